"""``reuse``: plain reuse, no visual token refreshed (r = 0 by definition; ``r`` is ignored).

Text tokens are computed over the stitched, re-rotated image caches; this is
the "Cache reuse" row of CONDUIT's tables and what the scoring pass itself
computes.
"""
from __future__ import annotations

from kvbench.reuse.executor import LayerSchedule
from kvbench.reuse.policies.base import RefreshPlan, RefreshPolicy, register


@register()
class Reuse(RefreshPolicy):
    name = "reuse"
    uses_scoring = False

    def plan(self, req, scoring, r):
        empty = req.visual_index[:0]
        return RefreshPlan(schedule=LayerSchedule(empty), selected=empty)
