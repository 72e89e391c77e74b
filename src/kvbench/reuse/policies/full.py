"""``full``: full prefill with the model's own forward (vision tower and all tokens; r = 1 by definition).

The quality reference of every table ("% of full prefill"); ``r`` is ignored.
"""
from __future__ import annotations

from kvbench.reuse.policies.base import RefreshPlan, RefreshPolicy, register


@register()
class Full(RefreshPolicy):
    name = "full"
    uses_scoring = False

    def plan(self, req, scoring, r):
        return RefreshPlan(schedule=None, selected=req.visual_index)
