"""CacheBlend, in two forms (docs/decisions/reuse.md, "Baselines: sources").

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
visual token's new K/V at its check layer (docs/decisions/reuse.md, "CacheBlend, paper form").
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvbench.reuse.assemble import AssembledRequest
from kvbench.reuse.executor import LayerSchedule, LayerState
from kvbench.reuse.policies._layers import n_layers_of
from kvbench.reuse.policies.base import RefreshPlan, RefreshPolicy, register
from kvbench.reuse.scoring import TIE_RULES, top_k
from kvbench.reuse.validate import budget_count


def linear_layer_counts(n_layers: int, n_visual: int, avg_count: int) -> list[int]:
    """Per-layer visual counts of CONDUIT's as-run CacheBlend/KVShare schedule, exactly as
    ``build_cacheblend_layer_counts`` (``cpa2001/CONDUIT`` @ 96c71d2, ``nanovllm/engine/recompute.py``) makes them.

    Layer 0 = N (``n_visual``), then a non-increasing linear decay whose integer counts add up to the target
    ``clip(min(avg_count, N)·L, N, N·L)``, so the layer average is ``avg_count`` where that is ≥ N/L; below
    that the schedule is degenerate, ``[N, 0, ..., 0]`` (:func:`degenerate`).

    The continuous profile (N at layer 0, N·(1 − l/H) clipped to [0, N] after) is solved for the horizon H
    by 64 bisection steps on the target total, then floored (with a 1e-12 nudge). Each leftover unit goes to
    the layer of largest fractional part among those still below their predecessor, the earliest one when
    parts agree within 1e-12; parts are not used up, so one layer may take several units (as the authors'
    loop does). Float steps follow theirs, so the counts are theirs bit for bit (tested against a
    re-derivation of their rule).

    Args:
        n_layers: L decoder layers; n_visual: N visual tokens; avg_count: the budget ⌈r·N⌉.

    Returns:
        ``L`` ints in [0, N].
    """
    N, L = int(n_visual), int(n_layers)
    if L <= 0:
        return []
    if N <= 0:
        return [0] * L
    if L == 1:
        return [N]
    total = max(N, min(max(0, min(int(avg_count), N)) * L, N * L))
    if total >= N * L:
        return [N] * L
    if total <= N:
        return [N] + [0] * (L - 1)

    def profile(h: float) -> list[float]:
        return [float(N)] + [max(0.0, min(float(N), N * (1.0 - i / h))) for i in range(1, L)]

    lo, hi = 0.0, 1.0
    while sum(profile(hi)) < total:
        hi *= 2.0
    for _ in range(64):  # the authors' step count: more steps can move hi by an ulp and change a floor
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if sum(profile(mid)) < total else (lo, mid)
    cont = profile(hi)
    floors = [math.floor(x + 1e-12) for x in cont]
    frac = [x - f for x, f in zip(cont, floors)]  # of the unclipped floor, before the monotone pass (as theirs)
    counts = [max(0, min(N, f)) for f in floors]
    counts[0] = N
    for i in range(1, L):
        counts[i] = min(counts[i], counts[i - 1])
    for _ in range(total - sum(counts)):
        best = None
        for i in range(1, L):
            if counts[i] < counts[i - 1] and (best is None or frac[i] > frac[best] + 1e-12):
                best = i
        assert best is not None, "a schedule below N·L always has a layer below its predecessor"
        counts[best] += 1
    return counts


def degenerate(counts: list[int]) -> bool:
    """Whether a per-layer schedule recomputes visual tokens at layer 0 only (``[N, 0, ..., 0]`` with L ≥ 2).

    Layer-0 K/V of visual tokens do not depend on the prefix (docs/decisions/reuse.md, "CacheBlend and KVShare as
    CONDUIT runs them"), so such a run
    equals plain reuse except for the cost of layer 0: what the as-run CacheBlend/KVShare schedule does when
    ⌈r·N⌉·L ≤ N, i.e. on a model with about ≤ 1/r layers.
    """
    return len(counts) >= 2 and counts[0] > 0 and not any(counts[1:])


def flat_rows(x: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
    """One row per token: keys or values ``[1, n_kv, T, hd]`` at int64 sequence indices ``idx`` ``[n]`` (None: every
    token of ``x``) → float32 ``[n, n_kv·hd]`` (heads concatenated), the form the per-token deviation scores take
    norms of."""
    x = x[0] if idx is None else x[0, :, idx]
    return x.float().transpose(0, 1).reshape(x.shape[1], -1)


class ShrinkSchedule(LayerSchedule):
    """Start with every visual token; after layer l keep the top ``counts[l+1]`` active tokens by ``score_fn``."""

    def __init__(self, visual_index: torch.Tensor, counts: list[int],
                 score_fn: Callable[[LayerState], torch.Tensor], needs_queries: bool = False, ties: str = "first"):
        super().__init__(visual_index)
        self.counts = counts
        self.score_fn = score_fn
        self.needs_queries = needs_queries
        self.ties = ties
        self._active = visual_index.numel()

    def _shrinks_after(self, layer: int) -> bool:
        return layer + 1 < len(self.counts) and 0 < min(self.counts[layer + 1], self._active) < self._active

    def wants_queries(self, layer: int) -> bool:
        return self.needs_queries and self._shrinks_after(layer)

    def reads_old_kv(self, layer: int) -> bool:
        return self._shrinks_after(layer)

    def advance(self, state: LayerState) -> torch.Tensor:
        active = state.active_visual
        target = min(self.counts[state.layer + 1], active.numel())
        if target >= active.numel():
            nxt = active
        elif target <= 0:
            nxt = active[:0]
        else:
            nxt = active[top_k(self.score_fn(state), target, self.ties)]
        self._active = nxt.numel()
        return nxt


def kv_deviation(state: LayerState) -> torch.Tensor:
    """‖k_new − k_old‖₂ + ‖v_new − v_old‖₂ per active visual token (CONDUIT's CacheBlend score)."""
    idx = state.active_visual
    old_k, old_v = state.old_at(idx)
    dk = (flat_rows(state.keys, idx) - flat_rows(old_k)).norm(dim=-1)
    dv = (flat_rows(state.values, idx) - flat_rows(old_v)).norm(dim=-1)
    return dk + dv


def linear_plan(req: AssembledRequest, r: float, score_fn: Callable[[LayerState], torch.Tensor], variant: str,
                needs_queries: bool = False, ties: str = "first") -> RefreshPlan:
    """The plan of CONDUIT's as-run CacheBlend/KVShare schedule: :func:`linear_layer_counts` for budget
    ⌈r·N_visual⌉, shrunk by ``score_fn`` (:class:`ShrinkSchedule`) with the tie rule ``ties``
    (:func:`~kvbench.reuse.scoring.top_k`). ``info`` records the counts, whether they are :func:`degenerate` (the
    tables name such runs) and a tie rule other than the default."""
    counts = linear_layer_counts(n_layers_of(req), req.n_visual, budget_count(r, req.n_visual))
    info = {"variant": variant, "layer_counts": counts, "degenerate": degenerate(counts)}
    if ties != "first":   # default runs keep the plan record they always had
        info["ties"] = ties
    return RefreshPlan(schedule=ShrinkSchedule(req.visual_index, counts, score_fn, needs_queries=needs_queries,
                                               ties=ties), info=info)


def check_ties(policy: str, ties: str) -> None:
    """Raise ValueError naming ``policy`` unless ``ties`` is one of :data:`~kvbench.reuse.scoring.TIE_RULES`."""
    if ties not in TIE_RULES:
        raise ValueError(f"{policy} ties must be one of {TIE_RULES}, got {ties!r}")


class CheckLayerSchedule(LayerSchedule):
    """CacheBlend's original schedule: every visual token up to and including the check layer (all keep their
    new K/V there), then the top ``k`` by deviation at the check layer, fixed for every later layer."""

    def __init__(self, visual_index: torch.Tensor, k: int, check_layer: int, deviation: str):
        super().__init__(visual_index)
        self.k, self.check_layer, self.deviation = k, check_layer, deviation
        self.selected: torch.Tensor | None = None

    def reads_old_kv(self, layer: int) -> bool:
        return layer == self.check_layer

    def advance(self, state: LayerState) -> torch.Tensor:
        if state.layer != self.check_layer:
            return state.active_visual  # all before the check layer; the fixed set after it
        idx = state.active_visual
        old_k, old_v = state.old_at(idx)
        new, old = (state.values, old_v) if self.deviation == "v" else (state.keys, old_k)
        dev = ((flat_rows(new, idx) - flat_rows(old)) ** 2).sum(dim=-1)
        self.selected = idx[top_k(dev, self.k)]
        return self.selected


@register()
@dataclass
class CacheBlend(RefreshPolicy):
    """CacheBlend in its paper form: every visual token through the check layer, then the top ⌈r·N_visual⌉.

    Every visual token is recomputed at layers 0..``check_layer`` and keeps its new K/V there; at the check
    layer they are ranked by deviation Σ(v_new − v_old)² (or of keys) and the top ⌈r·N_visual⌉ are the only
    visual rows computed from the next layer on (a fixed set). Text is always computed.

    Source: CacheBlend (arXiv 2405.16444), selective KV recompute, as its paper and original code
    (``YaoJiayi/CacheBlend``, ``vllm_blend``) run it: the paper form; CONDUIT's as-run form is
    ``cacheblend-conduit`` (docs/decisions/reuse.md, "Policies", "Baselines: sources").

    Parameters
    ----------
    check_layer : int, default 1 — decoder layer (0-based, >= 1) where the deviations are measured (the
        original's check layer 1).
    deviation : str, default "v" — "v": value deviation Σ(v_new − v_old)² (the original); "k": key deviation
        (LMCache's production variant).

    The budget ``r`` of :meth:`plan` is the fraction of the request's visual tokens computed after the check
    layer (⌈r·N_visual⌉ tokens).
    """

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
    """CacheBlend as CONDUIT runs it: decaying per-layer counts, ranked by ‖Δk‖₂ + ‖Δv‖₂ after each layer.

    Layer 0 recomputes every visual token; the counts then decay linearly (never increasing) to a layer
    average of ⌈r·N_visual⌉ where reachable (:func:`linear_layer_counts`), and after each layer that must
    shrink the active tokens are ranked by ‖k_new − k_old‖₂ + ‖v_new − v_old‖₂ there. On a model with about
    ≤ 1/r layers the schedule is degenerate (layer 0 only, :func:`degenerate`).

    Source: CacheBlend (arXiv 2405.16444) as CONDUIT's code runs it (``cpa2001/CONDUIT`` @ 96c71d2,
    ``nanovllm/engine/cacheblend.py``; counts of ``recompute.py``'s ``build_cacheblend_layer_counts``), the
    CacheBlend row of CONDUIT (arXiv 2609.05821) §4.2, Table 1; the paper form is ``cacheblend``.

    Parameters
    ----------
    ties : str, default "first" — how equal deviations are ranked (:func:`~kvbench.reuse.scoring.top_k`): "first"
        keeps the earlier token, "random" a random one (seeded per record). Every layer-0 deviation of a visual token
        is 0 (its layer-0 K/V do not depend on the prefix), so the first shrink is all ties: "first" keeps the first
        pages' tokens in every record; the authors' ``torch.topk`` leaves the order unspecified
        (docs/decisions/reuse.md, "The first shrink's ties").

    The budget ``r`` of :meth:`plan` sets the layer average ⌈r·N_visual⌉ of recomputed visual tokens.
    """

    name = "cacheblend-conduit"
    label = "CacheBlend (CONDUIT as-run)"
    form = ("CacheBlend as CONDUIT runs it (layer 0 all visual tokens, counts decaying linearly to a layer average "
            "of the budget, ranked by |dk|+|dv|)")
    uses_scoring = False

    ties: str = "first"

    def __post_init__(self):
        check_ties(self.name, self.ties)

    def plan(self, req, scoring, r):
        return linear_plan(req, r, kv_deviation, "conduit-as-run", ties=self.ties)

    def visual_rows(self, req, r, n_layers):
        return linear_layer_counts(n_layers, req.n_visual, budget_count(r, req.n_visual))
