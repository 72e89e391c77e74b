"""MPIC baselines: recompute all text plus leading image tokens, at every layer; no scoring pass.

- ``mpic`` (MPIC-k, arXiv 2502.01960): the first ``k`` tokens of *each* image; with ``k=None`` the first
  ⌈r·n_j⌉ of each image j (the authors' per-image form ``each=first:r%``).
- ``mpic-first`` (CONDUIT-as-run "first:r"): the first ⌈r·N_visual⌉ positions of the flattened image-token
  list of the whole request (``recompute.py``: ``parse_recompute_strategy``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.reuse.executor import LayerSchedule
from kvbench.reuse.policies.base import RefreshPlan, RefreshPolicy, register
from kvbench.reuse.validate import budget_count


@register()
@dataclass
class MPIC(RefreshPolicy):
    """MPIC-k: recompute all text plus the leading visual tokens of each image, at every layer; no scoring.

    Image j's first ``k`` visual tokens (or, with ``k=None``, its first ⌈r·n_j⌉) are recomputed at every
    layer with all text; the rest of each image keeps its stale K/V. Per-image rounding can select more
    than ⌈r·N_visual⌉ in all.

    Source: MPIC (arXiv 2502.01960), MPIC-k: all text plus the first k image tokens (k = 32 its headline);
    this is the paper's per-image form (the CONDUIT authors' ``each=first:r%``), not CONDUIT's as-run global
    form, which is ``mpic-first`` (docs/decisions/reuse.md, "Policies", "Baselines: sources").

    Parameters
    ----------
    k : int or None, default None — leading visual tokens recomputed per image (tokens, >= 0); None: the
        first ⌈r·n_j⌉ of each image j, with ``r`` the budget of :meth:`plan` (a fraction of the image's
        n_j visual tokens).
    """

    name = "mpic"
    label = "MPIC"
    form = "MPIC-k per image (the first ceil(r n_j) tokens of each image)"
    uses_scoring = False

    k: int | None = None

    def __post_init__(self):
        k = self.k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(f"mpic k (leading tokens per image) must be None or an int >= 0, got {k!r}")

    def _counts(self, spans, r) -> list[int]:
        return [budget_count(r, e - s) if self.k is None else min(self.k, e - s) for s, e in spans]

    def plan(self, req, scoring, r):
        parts = [torch.arange(s, s + take, device=req.visual_index.device)
                 for (s, _), take in zip(req.image_spans, self._counts(req.image_spans, r))]
        sel = torch.cat(parts)
        return RefreshPlan(schedule=LayerSchedule(sel), selected=sel, info={"variant": "per-image"})

    def visual_rows(self, req, r, n_layers):
        return [sum(self._counts(req.image_spans, r))] * n_layers


@register()
@dataclass
class MPICFirst(RefreshPolicy):
    """MPIC as CONDUIT runs it ("first:r"): recompute the first ⌈r·N_visual⌉ visual tokens of the request.

    The visual tokens of all images are flattened in prompt order and the first ⌈r·N_visual⌉ are
    recomputed at every layer with all text, so the leading images take the whole budget; no scoring pass.

    Source: MPIC (arXiv 2502.01960) in the form CONDUIT's code runs it (``cpa2001/CONDUIT`` @ 96c71d2,
    ``nanovllm/engine/recompute.py``, ``parse_recompute_strategy``), the MPIC row of CONDUIT
    (arXiv 2609.05821) §4.2, Table 1; the paper's per-image form is ``mpic``.

    Parameters
    ----------
    None. The budget ``r`` of :meth:`plan` is the fraction of the request's visual tokens recomputed.
    """

    name = "mpic-first"
    label = "MPIC (first:r)"
    form = "MPIC as CONDUIT runs it (the first ceil(r N) visual tokens of the request)"
    uses_scoring = False

    def plan(self, req, scoring, r):
        sel = req.visual_index[:budget_count(r, req.n_visual)]
        return RefreshPlan(schedule=LayerSchedule(sel), selected=sel, info={"variant": "global first:r"})

    def visual_rows(self, req, r, n_layers):
        return [budget_count(r, req.n_visual)] * n_layers
