"""Audit records of refresh runs, and the policy that re-executes one (``kvbench replay``).

Every prediction row of a refresh run carries ``plan`` (:func:`plan_audit`), enough to re-execute
the refresh without the policy or the scoring rule:

- ``selected``: visual sequence indices (positions in the assembled request, 0-based) of a
  single-set policy, else None;
- ``depth``: per visual token (order of ``visual_index``), the number of leading decoder layers at
  which it was recomputed. Per-layer sets are nested (executor contract), so layer ``l`` recomputed
  ``{t : depth[t] > l}``; ``layer_counts`` is that count per layer;
- ``image_spans``, ``per_image_refreshed`` (mean refreshed tokens per layer, per image),
  ``coefficients`` (c_j, or None), ``scores`` (summary of the final ranking scores, or None),
  ``text_rows`` (``"all"`` or the recomputed text indices), ``base_from_stage1``, ``full_prefill``,
  ``budget`` (⌈r·N_visual⌉), ``tokens`` (generated ids);
- ``degenerate``: the policy's layer schedule recomputed visual tokens at layer 0 only (the plan's
  ``info["degenerate"]``, set by CONDUIT's as-run CacheBlend/KVShare schedule; False for other policies);
- ``cost`` (when the decoder's shape is given): the request's analytic decoder FLOPs under the policy
  (:func:`kvbench.bench.cost.analytic_cost`: ``scoring`` pass, an oracle's full-prefill look included, and
  ``executor``) and of a full prefill of the same request (``full_prefill``), and the visual ``row_layers``
  recomputed (Σ ``layer_counts``) out of ``n_visual · n_layers``: what CONDUIT Table 1's cost columns sum.

:func:`kvbench.eval.refresh.replay` rebuilds the request, runs the recorded per-layer sets through the same executor and
decodes again; it reproduces the prediction exactly (same rows per layer, same arithmetic). Records made
before the CacheBlend check-layer fix carry a ``blend`` field (rows whose new K/V the executor then
replaced by the reused ones); a non-empty one cannot be replayed and must be rerun.
"""
from __future__ import annotations

import torch

from kvbench.bench.cost import analytic_cost
from kvbench.bench.flops import DecoderShape, full_prefill_flops
from kvbench.reuse.assemble import AssembledRequest
from kvbench.reuse.executor import LayerSchedule
from kvbench.reuse.policies import RefreshPlan, RefreshPolicy, RefreshResult
from kvbench.reuse.validate import budget_count


def _ints(t: torch.Tensor | None) -> list[int] | None:
    return None if t is None else [int(x) for x in t.tolist()]


def score_summary(scores: torch.Tensor | None, selected_pos: torch.Tensor | None) -> dict | None:
    """``{n, min, max, mean, threshold, top}`` of final scores ``[N_visual]`` (``threshold``: lowest
    selected score; ``top``: the 5 best as ``[visual token number, score]``), or None."""
    if scores is None or scores.numel() == 0:
        return None
    s = scores.float()
    order = torch.sort(-s, stable=True).indices[:5]
    thr = None if selected_pos is None or selected_pos.numel() == 0 else float(s[selected_pos].min())
    return {"n": int(s.numel()), "min": float(s.min()), "max": float(s.max()), "mean": float(s.mean()),
            "threshold": thr, "top": [[int(i), float(s[i])] for i in order]}


def plan_audit(req: AssembledRequest, result: RefreshResult, params: dict, tokens: list[int],
               shape: DecoderShape | None = None) -> dict:
    """The audit record of one refresh of ``req`` (module docstring); JSON-serialisable.

    Args:
        req: the assembled request the policy ran on.
        result: :func:`kvbench.reuse.refresh`'s output.
        params: the policy parameters of the spec (non-default ones).
        tokens: generated token ids.
        shape: the text decoder's shape; given, the record carries ``cost``.
    """
    plan, out = result.plan, result.output
    vis = req.visual_index.cpu()
    depth = torch.zeros(vis.numel(), dtype=torch.long)
    for kept in out.computed_visual:
        depth += torch.isin(vis, kept.cpu()).long()
    n_layers = len(out.computed_visual)
    per_image = torch.zeros(req.n_images).scatter_add_(0, req.image_of_visual.cpu(), depth.float()) / max(n_layers, 1)
    sel_pos = None if plan.selected is None else torch.isin(vis, plan.selected.cpu()).nonzero().flatten()
    return {
        "policy": result.policy, "r": result.r, "params": params,
        "n_visual": req.n_visual, "n_images": req.n_images, "n_layers": n_layers,
        "budget": budget_count(result.r, req.n_visual),
        "image_spans": [[int(s), int(e)] for s, e in req.image_spans],
        "full_prefill": plan.schedule is None,
        "selected": _ints(plan.selected),
        "depth": _ints(depth),
        "layer_counts": out.layer_counts,
        "degenerate": bool(plan.info.get("degenerate", False)),
        "per_image_refreshed": [round(float(x), 4) for x in per_image],
        "coefficients": None if plan.coefficients is None else [float(c) for c in plan.coefficients],
        "scores": score_summary(None if plan.scores is None else plan.scores.cpu(), sel_pos),
        "text_rows": "all" if plan.text_rows is None else _ints(plan.text_rows),
        "base_from_stage1": bool(plan.base_from_stage1),
        "tokens": [int(t) for t in tokens],
        **({} if shape is None else {"cost": request_cost(req, result, params, shape)}),
    }


def request_cost(req: AssembledRequest, result: RefreshResult, params: dict, shape: DecoderShape) -> dict:
    """``{scoring, executor, full_prefill, row_layers}`` of one refresh (module docstring, ``cost``): FLOPs as ints."""
    c = analytic_cost(result.policy, req, result.r, shape, **params)
    assert list(c.visual_rows) == list(result.output.layer_counts), (result.policy, c.visual_rows)
    return {"scoring": c.scoring, "executor": c.executor, "full_prefill": full_prefill_flops(shape, req.seq_len),
            "row_layers": int(sum(c.visual_rows))}


# --- replay ------------------------------------------------------------------------------------

class ReplayPolicy(RefreshPolicy):
    """Re-executes an audit record's plan (no selection rule of its own).

    Raises:
        ValueError: (at plan time) the request's visual tokens or image spans differ from the record's, or the
            record carries a non-empty ``blend`` (made with the pre-fix CacheBlend check-layer blend).
    """

    def __init__(self, audit: dict):
        if audit.get("blend"):
            # the executor no longer hands reused K/V back to computed rows, so these rows cannot be reproduced
            raise ValueError(f"this {audit.get('policy')!r} audit record was made with the pre-fix CacheBlend "
                             f"check-layer blend (layers {sorted(audit['blend'])} gave unselected tokens their "
                             "reused K/V back); the executor no longer does that, so it cannot be replayed: rerun "
                             "the run")
        self.audit = audit
        self.name = f"replay:{audit['policy']}"
        self.uses_scoring = bool(audit["base_from_stage1"])  # Phase 2 then starts from Stage I's K/V

    def visual_rows(self, req, r, n_layers):
        return list(self.audit["layer_counts"])

    def plan(self, req, scoring, r):
        a = self.audit
        if req.n_visual != a["n_visual"] or [list(s) for s in req.image_spans] != a["image_spans"]:
            raise ValueError(f"request has {req.n_visual} visual tokens in spans {req.image_spans}, the audit record "
                             f"{a['n_visual']} in {a['image_spans']}: not the recorded request")
        if a["full_prefill"]:
            return RefreshPlan(schedule=None, selected=req.visual_index)
        depth = torch.tensor(a["depth"], device=req.visual_index.device)
        computed = [req.visual_index[depth > layer] for layer in range(a["n_layers"])]
        text_rows = None if a["text_rows"] == "all" else torch.tensor(a["text_rows"], device=req.visual_index.device)
        return RefreshPlan(schedule=LayerSchedule(computed), text_rows=text_rows,
                           base_from_stage1=bool(a["base_from_stage1"]))
