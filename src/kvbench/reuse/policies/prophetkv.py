"""``prophetkv``: ProphetKV as CONDUIT runs it: the same scorer without ‖V‖ and without image coefficients
(λ = 0): per-layer query-to-stale-key attention mass, uniform mean over layers, global top-⌈r·N_visual⌉
(ProphetKV, arXiv 2602.02579; docs/decisions/reuse.md, "Baselines: sources"). The query is text, so it is always recomputed.
Parameters: :class:`ProphetKV`.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvbench.reuse.executor import LayerSchedule
from kvbench.reuse.policies.base import Phase2TextPolicy, RefreshPlan, register
from kvbench.reuse.validate import budget_count


@register()
@dataclass
class ProphetKV(Phase2TextPolicy):
    """ProphetKV as CONDUIT runs it: refresh the visual tokens of highest query attention, no ‖V‖, no image scaling.

    CONDUIT's scoring pass with ``use_v_norm=False`` and λ = 0: s(t) = mean over ``layers`` of the query
    span's attention mass α_l(t) on stale key t, then one global top-⌈r·N_visual⌉, recomputed at every
    layer. The query is text, so it is always recomputed.

    Source: ProphetKV (arXiv 2602.02579: per-layer query-to-stale-key attention mass, uniform mean over
    layers, top-p of the context tokens plus the query), in the form CONDUIT's code runs it (``cpa2001/CONDUIT``
    @ 96c71d2, ``model_runner_kv_score.py``), the ProphetKV row of CONDUIT (arXiv 2609.05821) §4.2, Table 1.
    ProphetKV's own paper form is not implemented (docs/decisions/reuse.md, "Baselines: sources").

    Parameters
    ----------
    layers : list of int or None, default None — decoder layers (0-based) whose attention mass is
        averaged; None: all layers.
    phase2_text : str, default "all" — text rows of Phase 2: "all" text tokens, or "query": only the
        trailing query, as the authors' code runs it (:class:`~kvbench.reuse.policies.base.Phase2TextPolicy`).

    The budget ``r`` of :meth:`plan` is the fraction of the request's visual tokens recomputed
    (⌈r·N_visual⌉ tokens).
    """

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
