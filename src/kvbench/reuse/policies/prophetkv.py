"""``prophetkv``: ProphetKV as CONDUIT runs it: the same scorer without ‖V‖ and without image coefficients
(λ = 0): per-layer query-to-stale-key attention mass, uniform mean over layers, global top-⌈r·N_visual⌉
(shared/notes/sources.md; ProphetKV, arXiv 2602.02579). The query is text, so it is always recomputed."""
from __future__ import annotations

from kvbench.reuse.executor import LayerSchedule
from kvbench.reuse.policies.base import RefreshPlan, RefreshPolicy, register


@register()
class ProphetKV(RefreshPolicy):
    name = "prophetkv"

    def __init__(self, layers: list[int] | None = None):
        self.layers = None if layers is None else list(layers)

    def plan(self, req, scoring, r):
        s = scoring.token_scores(self.layers, use_v_norm=False)
        sel = scoring.select(s, r)
        return RefreshPlan(schedule=LayerSchedule(sel), selected=sel, scores=s)
