"""``oracle-kv``: the refresh set a rule that knew the fresh K/V would pick, a bound for the testbed, not a method.

It runs the full prefill first and ranks visual tokens by their true deviation, so it costs more than full
prefill and never appears as a row of the papers' tables; the dial screen (issue #33, item 1) uses it to ask
whether refreshing ~r·N tokens *can* recover the reuse -> full gap of a regime, before any refresh method is run
on it. Parameters: :class:`OracleKV`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.reuse.executor import LayerSchedule
from kvbench.reuse.policies.base import RefreshPlan, RefreshPolicy, register
from kvbench.reuse.scoring import top_k
from kvbench.reuse.validate import budget_count


def true_deviation(req, fresh) -> torch.Tensor:
    """float32 ``[N_visual]``: Σ_l ‖[K‖V]_fresh,l(t) − [K‖V]_cached,l(t)‖₂ over decoder layers, per visual token.

    ``req.stale_k``/``stale_v`` hold the cached K (re-rotated to the serving positions) and V; ``fresh`` (an
    :class:`~kvbench.reuse.executor.ExecResult` of the full prefill) the K/V a refresh writes. Both keys are
    post-RoPE at the same positions, so their difference is the content's.
    """
    vis = req.visual_index
    total = torch.zeros(len(vis))
    for layer in range(len(fresh.keys)):
        dk = fresh.keys[layer][0][:, vis].float() - req.stale_k[layer][0][:, vis].float()
        dv = fresh.values[layer][0][:, vis].float() - req.stale_v[layer][0][:, vis].float()
        total += (dk.pow(2).sum(dim=(0, 2)) + dv.pow(2).sum(dim=(0, 2))).sqrt()
    return total


@register()
@dataclass
class OracleKV(RefreshPolicy):
    """Refresh the ⌈r·N_visual⌉ visual tokens whose cached K/V deviate most from the fresh ones, at every layer.

    The score of token t is :func:`true_deviation` (‖Δ[K‖V]‖₂ summed over layers), read from a full prefill of the
    same request; one global top-k (earliest index on ties), then Phase 2 as for every policy (every text token
    recomputed; r = 1 equals full prefill). The knowledge is the oracle's: it is a bound on what a token-sparse
    refresh can recover on a testbed (the staleness trial's "oracle by true KV deviation", 99.1% of the gap at
    11%), not a method of either paper, and its cost is a full prefill plus the refresh.

    Source: the ranking is CacheBlend's (arXiv 2405.16444, §4.2: tokens of highest KV deviation), with the true
    deviation at every layer in place of the one CacheBlend measures at its check layer; the bound plays the role
    of CONDUIT's oracle rule in its diagnostics (arXiv 2609.05821, App. D; :mod:`kvbench.reuse.diagnostics`).

    Parameters: none besides ``r``.
    """

    name = "oracle-kv"
    label = "Oracle (true KV deviation)"
    form = "a bound: ranks by the fresh K/V of a full prefill, which a method cannot read"
    uses_scoring = False
    reads_fresh: ClassVar[bool] = True

    def plan(self, req, scoring, r):
        assert scoring is not None, "oracle-kv plans from the full prefill's result (reads_fresh)"
        s = true_deviation(req, scoring)
        sel = req.visual_index[top_k(s, budget_count(r, req.n_visual))]
        return RefreshPlan(schedule=LayerSchedule(sel), selected=sel, scores=s)

    def visual_rows(self, req, r, n_layers):
        return [budget_count(r, req.n_visual)] * n_layers
