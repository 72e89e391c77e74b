"""``prophetkv``: ProphetKV as CONDUIT runs it: the same scorer without ‖V‖ and without image coefficients
(λ = 0): per-layer query-to-stale-key attention mass, uniform mean over layers, global top-⌈r·N_visual⌉
(ProphetKV, arXiv 2602.02579; docs/decisions/reuse.md, "Baselines: sources"). The query is text, so it is always recomputed.

Parameters:
    layers: decoder layers averaged (None: all).
    phase2_text: ``"all"`` (default) or ``"query"`` (as the authors' code runs it, through the same Phase 2 as
        CONDUIT), from :class:`~kvbench.reuse.policies.base.Phase2TextPolicy`.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvbench.reuse.executor import LayerSchedule
from kvbench.reuse.policies.base import Phase2TextPolicy, RefreshPlan, register
from kvbench.reuse.validate import budget_count


@register()
@dataclass
class ProphetKV(Phase2TextPolicy):
    name = "prophetkv"
    label = "ProphetKV"
    form = "ProphetKV as CONDUIT runs it (query attention only, no image coefficient)"

    layers: list[int] | None = None

    def __post_init__(self):
        super().__post_init__()
        self.layers = None if self.layers is None else list(self.layers)

    def plan(self, req, scoring, r):
        s = scoring.token_scores(self.layers, use_v_norm=False)
        sel = scoring.select(s, r)
        return RefreshPlan(schedule=LayerSchedule(sel), selected=sel, scores=s, **self.text_plan(req))

    def visual_rows(self, req, r, n_layers):
        return [budget_count(r, req.n_visual)] * n_layers
