"""``conduit``: CONDUIT's refresh rule (§3.3-3.5, App. A.1-A.2; ``recompute.py`` / ``model_runner_kv_score.py``).

Score s(t) = mean over layers of α_l(t)·‖V_l(t)‖ (all layers unless
``layers`` is given, e.g. the single-image subsets 14,16,18,20,22 of
Qwen2.5-VL-3B), times the image coefficient c_j = 1 + λ(m_j/mean m − 1)
(λ = 1 default; c = 1 when K = 1), then one global top-⌈r·N_visual⌉.

Parameters:
    lam: λ in [0, 1].
    layers: decoder layers averaged (None: all).
    use_v_norm: multiply by ‖V‖ (False reproduces the "query attention only" ablation, Table 5).
    coef_source: ``"score"`` (m_j from the fused score s, as the authors' code does) or ``"attention"``
        (m_j from mean attention α only, the paper text's wording; docs/decisions/reuse.md, "Image coefficient").
    phase2_text: ``"all"`` (default) or ``"query"`` (as the authors' code runs), from
        :class:`~kvbench.reuse.policies.base.Phase2TextPolicy`.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvbench.reuse.executor import LayerSchedule
from kvbench.reuse.policies.base import Phase2TextPolicy, RefreshPlan, register
from kvbench.reuse.validate import budget_count, check_strength


@register()
@dataclass
class Conduit(Phase2TextPolicy):
    name = "conduit"
    label = "CONDUIT"

    lam: float = 1.0
    layers: list[int] | None = None
    use_v_norm: bool = True
    coef_source: str = "score"

    def __post_init__(self):
        super().__post_init__()
        self.lam = check_strength(self.lam)
        if self.coef_source not in ("score", "attention"):
            raise ValueError(f"coef_source must be 'score' or 'attention', got {self.coef_source!r}")
        layers = self.layers
        if layers is not None and (not list(layers) or any(not isinstance(i, int) or i < 0 for i in layers)):
            raise ValueError(f"layers must be None or a non-empty list of layer indices >= 0, got {layers!r}")
        self.layers = None if layers is None else list(layers)
        self.use_v_norm = bool(self.use_v_norm)

    def plan(self, req, scoring, r):
        s = scoring.token_scores(self.layers, self.use_v_norm)
        src = s if self.coef_source == "score" else scoring.token_scores(self.layers, use_v_norm=False)
        c = scoring.coefficients(src, self.lam)
        final = s * c[req.image_of_visual]
        sel = scoring.select(final, r)
        return RefreshPlan(schedule=LayerSchedule(sel), selected=sel, scores=final, coefficients=c,
                           **self.text_plan(req))

    def visual_rows(self, req, r, n_layers):
        return [budget_count(r, req.n_visual)] * n_layers
