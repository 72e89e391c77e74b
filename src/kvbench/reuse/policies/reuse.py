"""``reuse``: plain reuse, no visual token refreshed (r = 0 by definition; ``r`` is ignored).

Text tokens are computed over the stitched, re-rotated image caches; this is
the "Cache reuse" row of CONDUIT's tables and what the scoring pass itself
computes.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvbench.reuse.executor import LayerSchedule
from kvbench.reuse.policies.base import RefreshPlan, RefreshPolicy, register


@register()
@dataclass
class Reuse(RefreshPolicy):
    name = "reuse"
    label = "Cache reuse (r=0)"
    uses_scoring = False

    def plan(self, req, scoring, r):
        empty = req.visual_index[:0]
        return RefreshPlan(schedule=LayerSchedule(empty), selected=empty)

    def visual_rows(self, req, r, n_layers):
        return [0] * n_layers
