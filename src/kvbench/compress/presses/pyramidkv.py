"""PyramidKV: SnapKV's scores with per-layer budgets that shrink arithmetically from the bottom layer to the
top ("pyramidal information funnelling"), mean budget = SnapKV's.

Based on PyramidKV (Cai et al. 2024, https://arxiv.org/abs/2406.02069, §3.3 eq. 5-6); original repo
``Zefan-Cai/KVCache-Factory`` (``pyramidkv/pyramidkv_utils.py``, ``PyramidKVCluster``, beta = 20).

Two schedules: the original's (``beta``, :func:`pyramid_budget`) and, with ``least_ratio`` set, the ResidualKV
authors' (``CURRENTF/Sparse-vLLM`` ``src/deltakv/modeling/llama/llama_pyramidkv.py``): a per-layer share of
the candidates falling linearly from ``start`` at layer 0 to ``least_ratio`` at the last layer
(:func:`linear_ratio`); their regression config (``benchmark/sparsevllm_regression/manifest.json``) runs
0.5 → 0.1, i.e. ``keep=0.3,least_ratio=0.1`` here (docs/decisions/presses.md, "The authors' baseline settings").
"""
from __future__ import annotations

from dataclasses import dataclass

from kvbench.compress.presses.snapkv import SnapKVPress


def pyramid_budget(mean: float, n_prefix: int, window: int, layer_idx: int, n_layers: int,
                   beta: float = 20.0) -> int:
    """Prefix tokens kept in layer ``layer_idx`` (of ``n_layers``) for a mean budget ``mean`` (tokens) over
    ``n_prefix`` prefix tokens followed by a ``window``-token observation window.

    The original rule (KVCache-Factory ``PyramidKVCluster.update_kv``): top = ``mean / beta``,
    bottom = ``2·mean − top``; if bottom exceeds ``n_prefix`` it is clamped there and top = ``2·mean −
    bottom``; layer l gets ``bottom − l·(bottom − top)/(L − 1)``. When the prompt (``n_prefix + window``)
    is shorter than ``2·mean`` tokens the original falls back to SnapKV's uniform budget, as here.

    Differences, chosen so the mean over layers equals ``mean`` up to rounding: the step is a float (the
    original floors it, shrinking the mean), and each budget is rounded and clamped to [1, n_prefix].

    Raises ValueError for ``beta < 1``; ``layer_idx`` (the engine's) is asserted in ``[0, n_layers)``.
    """
    if beta < 1:
        raise ValueError(f"beta must be >= 1, got {beta}")
    assert 0 <= layer_idx < n_layers, f"layer_idx must be in [0, {n_layers}), got {layer_idx}"
    if n_layers == 1 or n_prefix + window < 2 * mean:
        return min(n_prefix, max(1, round(mean)))
    top = mean / beta
    bottom = 2 * mean - top
    if bottom >= n_prefix:
        bottom = n_prefix
        top = 2 * mean - bottom
    size = bottom - layer_idx * (bottom - top) / (n_layers - 1)
    return min(n_prefix, max(1, round(size)))


def linear_ratio(keep: float, least: float, layer_idx: int, n_layers: int) -> float:
    """Share of the prefix kept in layer ``layer_idx`` under the ResidualKV authors' linear schedule: from
    ``start = 2·keep − least`` at layer 0 to ``least`` at layer ``n_layers − 1``, so the mean over layers is
    ``keep`` (their ``pyramidkv_start_ratio`` / ``pyramidkv_least_ratio`` with start layer 0 and least layer
    the last; one layer keeps ``keep``)."""
    if n_layers == 1:
        return keep
    start = 2 * keep - least
    return start - (start - least) * layer_idx / (n_layers - 1)


@dataclass
class PyramidKVPress(SnapKVPress):
    """PyramidKV (https://arxiv.org/abs/2406.02069): SnapKV with a pyramid of per-layer budgets whose mean
    is ``keep`` of the prefix.

    Parameters
    ----------
    keep, window, kernel, pooling : as :class:`~kvbench.compress.presses.snapkv.SnapKVPress`.
    beta : float, default 20 — bottom/top steepness: the top layer keeps ``mean / beta`` tokens (original).
    least_ratio : float or None, default None — None: the original schedule (``beta``). A share: the
        ResidualKV authors' linear schedule (:func:`linear_ratio`), layer l keeping ``round(r_l · n_prefix)``
        prefix tokens (at least 1), r_l falling from ``2·keep − least_ratio`` at the first layer to
        ``least_ratio`` at the last, mean ``keep``; ``beta`` is then unused. Their config: ``keep=0.3,
        least_ratio=0.1`` (0.5 → 0.1), window 32, pooling kernel 7.

    Raises ValueError as SnapKVPress, for ``beta < 1``, or for a ``least_ratio`` outside (0, keep] or one
    that puts the first layer's share ``2·keep − least_ratio`` above 1.
    """

    name = "pyramidkv"
    exact = {"keep": 1.0}
    beta: float = 20.0
    least_ratio: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta < 1:
            raise ValueError(f"beta must be >= 1, got {self.beta}")
        least = self.least_ratio
        if least is not None:
            if not 0 < least <= self.keep:
                raise ValueError(f"least_ratio (the last layer's share) must be in (0, keep={self.keep}], got {least}")
            if 2 * self.keep - least > 1:
                raise ValueError(f"least_ratio={least} with keep={self.keep} puts the first layer's share at "
                                 f"{2 * self.keep - least:g} > 1; raise least_ratio or lower keep")

    def layer_budget(self, layer_idx: int, n_layers: int, n_prefix: int) -> int:
        """:func:`pyramid_budget` with mean ``keep · n_prefix`` (SnapKV's uniform budget if that is all), or,
        with ``least_ratio``, ``round(linear_ratio · n_prefix)`` clamped to [1, n_prefix]."""
        if self.least_ratio is not None:
            ratio = linear_ratio(self.keep, self.least_ratio, layer_idx, n_layers)
            return min(n_prefix, max(1, round(ratio * n_prefix)))
        return pyramid_budget(self.keep * n_prefix, n_prefix, self.window, layer_idx, n_layers, self.beta)
