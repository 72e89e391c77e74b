"""``full``: full prefill with the model's own forward (vision tower and all tokens; r = 1 by definition).

The quality reference of every table ("% of full prefill"); ``r`` is ignored.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvbench.reuse.policies.base import RefreshPlan, RefreshPolicy, register


@register()
@dataclass
class Full(RefreshPolicy):
    """Full prefill: the model's own forward over the whole request, vision tower included (r = 1).

    Nothing is reused: every visual and text token is computed from the pixels and the prompt, with the
    model's own forward rather than the Phase 2 executor. The quality reference of every table ("% of full
    prefill") and the FLOPs/TTFT reference of Table 3.

    Source: the full-prefill reference of CONDUIT ("CONDUIT: A Unified Residual-Stream Restoration Framework
    for KV Cache Reuse in Vision-Language Models", arXiv 2609.05821, §4.2-4.3, Tables 1-3).

    Parameters
    ----------
    None. The budget ``r`` of :meth:`plan` is ignored (the spec grammar fixes it at 1: every visual token).
    """

    name = "full"
    label = "Full prefill"
    uses_scoring = False
    model_forward = True

    def plan(self, req, scoring, r):
        return RefreshPlan(schedule=None, selected=req.visual_index)

    def visual_rows(self, req, r, n_layers):
        return [req.n_visual] * n_layers
