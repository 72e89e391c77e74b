"""CacheBlend, in two forms (docs/decisions.md, "Baselines: sources").

- ``cacheblend`` (arXiv 2405.16444, selective KV recompute; as coded in ``YaoJiayi/CacheBlend``,
  ``vllm_blend``): layer 0 recomputes every visual token; the check layer (1) computes every visual
  token again and keeps all of their new K/V (the original's check layer writes what it computed for
  every token), then ranks them by value deviation Σ(v_new − v_old)² at that layer; the top
  ⌈r·N_visual⌉ are the only visual rows computed from the next layer on (the original filters the
  query rows there and fuses ``old[imp] = new`` only in later layers). ``deviation="k"`` uses key
  deviation instead (LMCache's production variant). Text (the query suffix) is always computed.
- ``cacheblend-conduit`` (as CONDUIT runs it, ``nanovllm/engine/cacheblend.py``): layer 0 = 100 % of
  visual tokens, then counts decay linearly (non-increasing) so that their layer average equals
  ⌈r·N_visual⌉ where reachable (:func:`linear_layer_counts`); after each layer that must shrink, the
  active tokens are ranked by ‖k_new − k_old‖₂ + ‖v_new − v_old‖₂ at that layer and the top ones go on.

Layer 0 is always fully recomputed; that leaves visual K/V unchanged (layer-0 inputs are the vision
features), so the as-run form at r = 0 equals plain reuse, while the paper form at r = 0 still keeps every
visual token's new K/V at its check layer (docs/decisions.md, "Policies").
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvbench.reuse.executor import LayerSchedule, LayerState
from kvbench.reuse.policies._layers import n_layers_of
from kvbench.reuse.policies.base import RefreshPlan, RefreshPolicy, register
from kvbench.reuse.scoring import top_k
from kvbench.reuse.validate import budget_count


def linear_layer_counts(n_layers: int, n_visual: int, avg_count: int) -> list[int]:
    """Per-layer visual counts: layer 0 = ``n_visual``, non-increasing, linear decay, integer, summing to
    ``clip(avg_count·L, N, N·L)`` (layer average = ``avg_count`` where that is ≥ N/L).

    The continuous profile N·max(0, 1 − l/H) is solved for the horizon H by bisection, floored, and the
    remaining units go to the layers with the largest fractional parts that can take one without
    breaking monotonicity.
    """
    N, L = int(n_visual), int(n_layers)
    if L <= 0:
        return []
    if N <= 0:
        return [0] * L
    if L == 1:
        return [N]
    total = max(N, min(int(avg_count) * L, N * L))
    if total >= N * L:
        return [N] * L
    if total <= N:
        return [N] + [0] * (L - 1)

    def profile(h: float) -> list[float]:
        return [float(N)] + [N * max(0.0, 1.0 - i / h) for i in range(1, L)]

    lo, hi = 0.0, 1.0
    while sum(profile(hi)) < total:
        hi *= 2.0
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(profile(mid)) < total else (lo, mid)
    cont = profile(hi)
    counts = [min(N, math.floor(x + 1e-9)) for x in cont]
    counts[0] = N
    for i in range(1, L):
        counts[i] = min(counts[i], counts[i - 1])
    frac = [x - c for x, c in zip(cont, counts)]
    for _ in range(total - sum(counts)):
        cands = [i for i in range(1, L) if counts[i] < counts[i - 1]]
        best = max(cands, key=lambda i: (frac[i], -i))
        counts[best] += 1
        frac[best] = -1.0
    return counts


def flat_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """One row per token: keys or values ``[1, n_kv, T, hd]`` at int64 sequence indices ``idx`` ``[n]`` →
    float32 ``[n, n_kv·hd]`` (heads concatenated), the form the per-token deviation scores take norms of."""
    return x[0, :, idx].float().transpose(0, 1).reshape(idx.numel(), -1)


class ShrinkSchedule(LayerSchedule):
    """Start with every visual token; after layer l keep the top ``counts[l+1]`` active tokens by ``score_fn``."""

    def __init__(self, visual_index: torch.Tensor, counts: list[int],
                 score_fn: Callable[[LayerState], torch.Tensor], needs_queries: bool = False):
        super().__init__(visual_index)
        self.counts = counts
        self.score_fn = score_fn
        self.needs_queries = needs_queries
        self._active = visual_index.numel()

    def wants_queries(self, layer: int) -> bool:
        return (self.needs_queries and layer + 1 < len(self.counts)
                and 0 < min(self.counts[layer + 1], self._active) < self._active)

    def advance(self, state: LayerState) -> torch.Tensor:
        active = state.active_visual
        target = min(self.counts[state.layer + 1], active.numel())
        if target >= active.numel():
            nxt = active
        elif target <= 0:
            nxt = active[:0]
        else:
            nxt = active[top_k(self.score_fn(state), target)]
        self._active = nxt.numel()
        return nxt


def kv_deviation(state: LayerState) -> torch.Tensor:
    """‖k_new − k_old‖₂ + ‖v_new − v_old‖₂ per active visual token (CONDUIT's CacheBlend score)."""
    idx = state.active_visual
    dk = (flat_rows(state.keys, idx) - flat_rows(state.old_keys, idx)).norm(dim=-1)
    dv = (flat_rows(state.values, idx) - flat_rows(state.old_values, idx)).norm(dim=-1)
    return dk + dv


class CheckLayerSchedule(LayerSchedule):
    """CacheBlend's original schedule: every visual token up to and including the check layer (all keep their
    new K/V there), then the top ``k`` by deviation at the check layer, fixed for every later layer."""

    def __init__(self, visual_index: torch.Tensor, k: int, check_layer: int, deviation: str):
        super().__init__(visual_index)
        self.k, self.check_layer, self.deviation = k, check_layer, deviation
        self.selected: torch.Tensor | None = None

    def advance(self, state: LayerState) -> torch.Tensor:
        if state.layer != self.check_layer:
            return state.active_visual  # all before the check layer; the fixed set after it
        idx = state.active_visual
        new, old = (state.values, state.old_values) if self.deviation == "v" else (state.keys, state.old_keys)
        dev = ((flat_rows(new, idx) - flat_rows(old, idx)) ** 2).sum(dim=-1)
        self.selected = idx[top_k(dev, self.k)]
        return self.selected


@register()
@dataclass
class CacheBlend(RefreshPolicy):
    name = "cacheblend"
    label = "CacheBlend"
    form = "CacheBlend as in its paper (check layer 1, top-r by value deviation, fixed set after)"
    uses_scoring = False

    check_layer: int = 1
    deviation: str = "v"

    def __post_init__(self):
        check_layer = self.check_layer
        if isinstance(check_layer, bool) or not isinstance(check_layer, int) or check_layer < 1:
            raise ValueError(f"cacheblend check_layer must be an int >= 1, got {check_layer!r}")
        if self.deviation not in ("v", "k"):
            raise ValueError(f"cacheblend deviation must be 'v' or 'k', got {self.deviation!r}")

    def plan(self, req, scoring, r):
        sched = CheckLayerSchedule(req.visual_index, budget_count(r, req.n_visual), self.check_layer,
                                   self.deviation)
        return RefreshPlan(schedule=sched, info={"variant": "paper", "check_layer": self.check_layer})

    def visual_rows(self, req, r, n_layers):
        # every visual token up to and including the check layer, then the fixed top-k set
        k = budget_count(r, req.n_visual)
        return [req.n_visual if layer <= self.check_layer else k for layer in range(n_layers)]


@register()
@dataclass
class CacheBlendConduit(RefreshPolicy):
    name = "cacheblend-conduit"
    label = "CacheBlend (CONDUIT as-run)"
    form = ("CacheBlend as CONDUIT runs it (layer 0 all visual tokens, counts decaying linearly to a layer average "
            "of the budget, ranked by |dk|+|dv|)")
    uses_scoring = False

    def plan(self, req, scoring, r):
        counts = linear_layer_counts(n_layers_of(req), req.n_visual, budget_count(r, req.n_visual))
        return RefreshPlan(schedule=ShrinkSchedule(req.visual_index, counts, kv_deviation),
                           info={"variant": "conduit-as-run", "layer_counts": counts})

    def visual_rows(self, req, r, n_layers):
        return linear_layer_counts(n_layers, req.n_visual, budget_count(r, req.n_visual))
