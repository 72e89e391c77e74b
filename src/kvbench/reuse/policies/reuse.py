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
    """Plain cache reuse: no visual token refreshed (r = 0), the text computed over the stale image caches.

    The image caches, each prefilled alone under a generic instruction, are stitched and re-rotated to
    their serving positions; only the text tokens are computed, over those stale visual K/V. This is what
    the scoring pass itself computes, with no scoring.

    Source: the "Cache reuse" row of CONDUIT ("CONDUIT: A Unified Residual-Stream Restoration Framework for
    KV Cache Reuse in Vision-Language Models", arXiv 2609.05821, §4.2, Table 1; r = 0 of Table 2).

    Parameters
    ----------
    None. The budget ``r`` of :meth:`plan` is ignored (the spec grammar fixes it at 0: no visual token).
    """

    name = "reuse"
    label = "Cache reuse (r=0)"
    uses_scoring = False

    def plan(self, req, scoring, r):
        empty = req.visual_index[:0]
        return RefreshPlan(schedule=LayerSchedule(empty), selected=empty)

    def visual_rows(self, req, r, n_layers):
        return [0] * n_layers
