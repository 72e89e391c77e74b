"""``full``: full prefill with the model's own forward (vision tower and all tokens; r = 1 by definition).

The quality reference of every table ("% of full prefill"); ``r`` is ignored.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvbench.reuse.policies.base import RefreshPlan, RefreshPolicy, register


@register()
@dataclass
class Full(RefreshPolicy):
    name = "full"
    label = "Full prefill"
    uses_scoring = False
    model_forward = True

    def plan(self, req, scoring, r):
        return RefreshPlan(schedule=None, selected=req.visual_index)

    def visual_rows(self, req, r, n_layers):
        return [req.n_visual] * n_layers
