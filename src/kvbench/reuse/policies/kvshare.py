"""``kvshare-conduit`` (alias ``kvshare``): KVShare **as reimplemented in CONDUIT's code**
(``nanovllm/engine/cacheblend.py``), not the KVShare paper's own method (whose "dual-stage high
deviation" details are not public; docs/decisions/reuse.md, "Baselines: sources").

Same layer schedule as ``cacheblend-conduit`` (layer 0 = 100 %, linear decay to a layer average of
⌈r·N_visual⌉). After each layer that must shrink, each active visual token is scored by
attention mass × ‖v_new − v_old‖₁, where the mass is the causal softmax weight on that key from *all*
rows computed at that layer (text and active visual), averaged over those rows and the query heads.
Prefill only (no decode-stage reselection).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.reuse.executor import LayerState
from kvbench.reuse.policies.base import RefreshPolicy, register
from kvbench.reuse.policies.cacheblend import check_ties, flat_rows, linear_layer_counts, linear_plan
from kvbench.reuse.scoring import attention_mass
from kvbench.reuse.validate import budget_count


def kvshare_score(state: LayerState) -> torch.Tensor:
    """attention mass(all computed rows → key) × ‖v_new − v_old‖₁ per active visual token."""
    idx = state.active_visual
    mass = attention_mass(state.queries, state.keys, state.rows, state.scale)[idx]
    dv = (flat_rows(state.values, idx) - flat_rows(state.old_at(idx)[1])).abs().sum(dim=-1)
    return mass * dv


@register("kvshare")
@dataclass
class KVShareConduit(RefreshPolicy):
    """KVShare as reimplemented in CONDUIT's code: CacheBlend's decaying schedule, ranked by attention × ‖Δv‖₁.

    Layer 0 recomputes every visual token; the per-layer counts decay linearly to a layer average of
    ⌈r·N_visual⌉ (:func:`~kvbench.reuse.policies.cacheblend.linear_layer_counts`), and after each layer that
    must shrink the active visual tokens are ranked by the attention mass all computed rows put on them
    times ‖v_new − v_old‖₁ at that layer. Prefill only.

    Source: KVShare (arXiv 2503.16525) as CONDUIT's code reimplements it (``cpa2001/CONDUIT`` @ 96c71d2,
    ``nanovllm/engine/cacheblend.py``), the KVShare row of CONDUIT (arXiv 2609.05821) §4.2, Table 1.
    KVShare's own "dual-stage high deviation" method is not implemented (not public in readable form;
    docs/decisions/reuse.md, "Baselines: sources").

    Parameters
    ----------
    ties : str, default "first" — how equal scores are ranked, as in ``cacheblend-conduit`` (layer 0's ‖Δv‖₁ is 0
        for every visual token, so its first shrink is all ties).

    The budget ``r`` of :meth:`plan` sets the layer average ⌈r·N_visual⌉ of recomputed visual tokens.
    """

    name = "kvshare-conduit"
    label = "KVShare (CONDUIT reimpl.)"
    form = "KVShare as reimplemented in CONDUIT's code (CacheBlend schedule, attention x |dv|_1)"
    uses_scoring = False

    ties: str = "first"

    def __post_init__(self):
        check_ties(self.name, self.ties)

    def plan(self, req, scoring, r):
        return linear_plan(req, r, kvshare_score, "conduit-reimplementation", needs_queries=True, ties=self.ties)

    def visual_rows(self, req, r, n_layers):
        return linear_layer_counts(n_layers, req.n_visual, budget_count(r, req.n_visual))

    def mass_layers(self, rows):
        # the set shrinks after these layers: queries and attention mass of every computed row are needed there
        return [layer for layer in range(len(rows) - 1) if 0 < rows[layer + 1] < rows[layer]]
