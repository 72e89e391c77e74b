"""MPIC baselines: recompute all text plus leading image tokens, at every layer; no scoring pass.

- ``mpic`` (MPIC-k, arXiv 2502.01960): the first ``k`` tokens of *each* image; with ``k=None`` the first
  ⌈r·n_j⌉ of each image j (the authors' per-image form ``each=first:r%``).
- ``mpic-first`` (CONDUIT-as-run "first:r"): the first ⌈r·N_visual⌉ positions of the flattened image-token
  list of the whole request (``recompute.py``: ``parse_recompute_strategy``).
"""
from __future__ import annotations

import torch

from kvbench.reuse.executor import LayerSchedule
from kvbench.reuse.policies.base import RefreshPlan, RefreshPolicy, register
from kvbench.reuse.validate import budget_count


@register()
class MPIC(RefreshPolicy):
    name = "mpic"
    uses_scoring = False

    def __init__(self, k: int | None = None):
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(f"mpic k (leading tokens per image) must be None or an int >= 0, got {k!r}")
        self.k = k

    def plan(self, req, scoring, r):
        parts = []
        for s, e in req.image_spans:
            take = budget_count(r, e - s) if self.k is None else min(self.k, e - s)
            parts.append(torch.arange(s, s + take, device=req.visual_index.device))
        sel = torch.cat(parts)
        return RefreshPlan(schedule=LayerSchedule(sel), selected=sel, info={"variant": "per-image"})


@register()
class MPICFirst(RefreshPolicy):
    name = "mpic-first"
    uses_scoring = False

    def plan(self, req, scoring, r):
        sel = req.visual_index[:budget_count(r, req.n_visual)]
        return RefreshPlan(schedule=LayerSchedule(sel), selected=sel, info={"variant": "global first:r"})
