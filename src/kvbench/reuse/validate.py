"""Argument checks shared by the reuse engine: fail before any model work.

Every public entry point calls these first, so a bad budget or strength is
reported with the offending value and the accepted range instead of surfacing
later as an empty selection or a NaN coefficient.
"""
from __future__ import annotations

import math
from numbers import Real


def check_ratio(r: object, name: str = "r") -> float:
    """Return ``r`` as float if it is a real number in [0, 1].

    Raises:
        ValueError: ``r`` is not a real number, is NaN, or lies outside [0, 1]
            (the message names the value and the expected range).
    """
    if isinstance(r, bool) or not isinstance(r, Real) or math.isnan(float(r)) or not 0.0 <= float(r) <= 1.0:
        raise ValueError(f"{name} must be a refresh ratio in [0, 1] (fraction of visual tokens), got {r!r}")
    return float(r)


def check_strength(lam: object, name: str = "lam") -> float:
    """Return the image-coefficient strength λ as float if it lies in [0, 1] (CONDUIT §3.4, λ=1 default).

    Raises:
        ValueError: ``lam`` is not a real number in [0, 1].
    """
    if isinstance(lam, bool) or not isinstance(lam, Real) or math.isnan(float(lam)) or not 0.0 <= float(lam) <= 1.0:
        raise ValueError(f"{name} (image-coefficient strength λ) must be in [0, 1], got {lam!r}")
    return float(lam)


def budget_count(r: float, n_visual: int) -> int:
    """Number of visual tokens refreshed at ratio ``r``: ⌈r·N_visual⌉, clipped to [0, N_visual].

    The authors' code rounds up (``math.ceil`` in ``nanovllm/engine/recompute.py``);
    the paper's §4.1 writes ⌊r·N⌋ (docs/decisions/reuse.md, "Budget and ties"). The product is
    rounded to 9 decimals first so that binary floating point does not turn an
    exact budget into one token more (0.1 * 30 = 3.0000000000000004 → 3, not 4).

    Raises:
        ValueError: ``r`` outside [0, 1] or ``n_visual`` negative.
    """
    r = check_ratio(r)
    if n_visual < 0:
        raise ValueError(f"n_visual must be >= 0, got {n_visual}")
    return min(n_visual, max(0, math.ceil(round(r * n_visual, 9))))
