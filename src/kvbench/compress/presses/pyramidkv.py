"""PyramidKV: SnapKV's scores with per-layer budgets that shrink arithmetically from the bottom layer to the
top ("pyramidal information funnelling"), mean budget = SnapKV's.

Based on PyramidKV (Cai et al. 2024, https://arxiv.org/abs/2406.02069, §3.3 eq. 5-6); original repo
``Zefan-Cai/KVCache-Factory`` (``pyramidkv/pyramidkv_utils.py``, ``PyramidKVCluster``, beta = 20).
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

    Raises ValueError for ``beta < 1`` or ``layer_idx`` outside ``[0, n_layers)``.
    """
    if beta < 1:
        raise ValueError(f"beta must be >= 1, got {beta}")
    if not 0 <= layer_idx < n_layers:
        raise ValueError(f"layer_idx must be in [0, {n_layers}), got {layer_idx}")
    if n_layers == 1 or n_prefix + window < 2 * mean:
        return min(n_prefix, max(1, round(mean)))
    top = mean / beta
    bottom = 2 * mean - top
    if bottom >= n_prefix:
        bottom = n_prefix
        top = 2 * mean - bottom
    size = bottom - layer_idx * (bottom - top) / (n_layers - 1)
    return min(n_prefix, max(1, round(size)))


@dataclass
class PyramidKVPress(SnapKVPress):
    """PyramidKV (https://arxiv.org/abs/2406.02069): SnapKV with a pyramid of per-layer budgets whose mean
    is ``keep`` of the prefix.

    Parameters
    ----------
    keep, window, kernel, pooling : as :class:`~kvbench.compress.presses.snapkv.SnapKVPress`.
    beta : float, default 20 — bottom/top steepness: the top layer keeps ``mean / beta`` tokens (original).

    Raises ValueError as SnapKVPress, or for ``beta < 1``.
    """

    name = "pyramidkv"
    exact = {"keep": 1.0}
    beta: float = 20.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta < 1:
            raise ValueError(f"beta must be >= 1, got {self.beta}")

    def layer_budget(self, layer_idx: int, n_layers: int, n_prefix: int) -> int:
        """:func:`pyramid_budget` with mean ``keep · n_prefix`` (SnapKV's uniform budget if that is all)."""
        return pyramid_budget(self.keep * n_prefix, n_prefix, self.window, layer_idx, n_layers, self.beta)
