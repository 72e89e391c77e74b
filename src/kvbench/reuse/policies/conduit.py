"""``conduit``: CONDUIT's refresh rule (§3.3-3.5, App. A.1-A.2; ``recompute.py`` / ``model_runner_kv_score.py``).

Score s(t) = mean over layers of α_l(t)·‖V_l(t)‖ (all layers unless
``layers`` is given, e.g. the single-image subsets 14,16,18,20,22 of
Qwen2.5-VL-3B), times the image coefficient c_j = 1 + λ(m_j/mean m − 1)
(λ = 1 default; c = 1 when K = 1), then one global top-⌈r·N_visual⌉. Parameters: :class:`Conduit`.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvbench.reuse.executor import LayerSchedule
from kvbench.reuse.policies.base import Phase2TextPolicy, RefreshPlan, register
from kvbench.reuse.validate import budget_count, check_strength


@register()
@dataclass
class Conduit(Phase2TextPolicy):
    """CONDUIT: refresh the visual tokens of highest query attention × value norm, scaled per image.

    One scoring pass over the stale caches gives s(t) = mean over ``layers`` of α_l(t)·‖V_l(t)‖ (α: the
    query span's softmax attention on cached key t, ‖V‖: its cached value norm); each image's coefficient
    c_j = 1 + λ(m_j / m̄ − 1) scales its tokens' scores, then one global top-⌈r·N_visual⌉ over all images is
    recomputed at every layer (Phase 2). With one image c = 1 (intra-image selection).

    Source: "CONDUIT: A Unified Residual-Stream Restoration Framework for KV Cache Reuse in Vision-Language
    Models" (arXiv 2609.05821): §3.3 (token score), §3.4 (image coefficient), §3.5 (global top-k), App.
    A.1-A.2 (refresh mask, scoring pass). The defaults take the image coefficient from the fused score as the
    authors' code does (``coef_source="score"``) and recompute all text in Phase 2 (``phase2_text="all"``, so
    r = 1 is full prefill); ``phase2_text="query"`` is the authors' as-run Phase 2 (docs/decisions/reuse.md,
    "Image coefficient", "Phase 2 executor").

    Parameters
    ----------
    lam : float, default 1.0 — image-coefficient strength λ in [0, 1] (dimensionless): 0 gives c = 1 for
        every image (the "intra-image throughput only" row of Table 5); 1 is the paper's setting (§A.2),
        Table 4 sweeps it.
    layers : list of int or None, default None — decoder layers (0-based) whose scores are averaged; None:
        all layers (the main results); the single-image runs use a subset, e.g. 14, 16, 18, 20, 22 on
        Qwen2.5-VL-3B.
    use_v_norm : bool, default True — weight attention by ‖V‖; False is the "query attention only" row of
        Table 5.
    coef_source : str, default "score" — m_j, the mean per image of max(s, 0) (the authors' code), or
        "attention": the mean of α alone (the paper text's wording, §3.4).
    phase2_text : str, default "all" — text rows of Phase 2: "all" text tokens, or "query": only the
        trailing query (other text keeps its Stage I K/V) (:class:`~kvbench.reuse.policies.base.Phase2TextPolicy`).

    The budget ``r`` of :meth:`plan` is the refresh ratio: the fraction of the request's visual tokens
    recomputed (⌈r·N_visual⌉ tokens).
    """

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
