"""Analytic prefill cost of each refresh policy on an assembled request (the check on the measured FLOPs).

Each policy's visual rows per layer follow from its definition
(docs/decisions.md, "Policies"), with ``k = ⌈r·N_visual⌉``:

- ``reuse``: none; ``conduit``, ``prophetkv``, ``mpic-first``: ``k`` at every layer;
  ``mpic``: ``Σ_j ⌈r·n_j⌉`` at every layer;
- ``cacheblend``: all ``N`` up to and including the check layer, then ``k``;
- ``kvshare-conduit``, ``cacheblend-conduit``: :func:`~kvbench.reuse.policies.cacheblend.linear_layer_counts`;
  KVShare also recomputes the queries of every computed row and their attention mass at each
  layer after which the set shrinks.

Text rows are computed at every layer by every policy. Policies with a scoring
pass add :func:`~kvbench.bench.flops.scoring_flops`. ``full`` is the model's own
forward: :func:`~kvbench.bench.flops.full_prefill_flops` for the decoder (the
vision tower is measured only).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvbench.bench import flops
from kvbench.reuse.assemble import AssembledRequest
from kvbench.reuse.policies import get_policy
from kvbench.reuse.policies.cacheblend import linear_layer_counts
from kvbench.reuse.validate import budget_count


@dataclass(frozen=True)
class AnalyticCost:
    """Analytic FLOPs of one request under one policy (ints).

    Attributes:
        scoring: the scoring pass (0 for policies without one).
        executor: Phase 2 (or the full forward's decoder for ``full``), LM head included.
        visual_rows: visual rows computed at each layer.
    """

    scoring: int
    executor: int
    visual_rows: tuple[int, ...]

    @property
    def total(self) -> int:
        return self.scoring + self.executor

    @property
    def mean_visual_rows(self) -> float:
        """Visual rows per layer, averaged over layers (the effective refresh count)."""
        return sum(self.visual_rows) / len(self.visual_rows)


def visual_rows(policy: str, req: AssembledRequest, r: float, n_layers: int, **params) -> list[int]:
    """Visual rows computed at each layer by ``policy`` at ratio ``r`` (see the module docstring).

    Raises:
        KeyError: a policy without a cost model here.
    """
    N = req.n_visual
    k = budget_count(r, N)
    if policy == "full":
        return [N] * n_layers
    if policy == "reuse":
        return [0] * n_layers
    if policy in ("conduit", "prophetkv", "mpic-first"):
        return [k] * n_layers
    if policy == "mpic":
        per_image = params.get("k")
        sizes = [e - s for s, e in req.image_spans]
        n = sum(budget_count(r, m) if per_image is None else min(per_image, m) for m in sizes)
        return [n] * n_layers
    if policy == "cacheblend":
        check = get_policy("cacheblend", **params).check_layer
        return [N if layer <= check else k for layer in range(n_layers)]
    if policy in ("kvshare-conduit", "kvshare", "cacheblend-conduit"):
        return linear_layer_counts(n_layers, N, k)
    raise KeyError(f"no analytic cost model for policy {policy!r}")


def analytic_cost(policy: str, req: AssembledRequest, r: float, shape: flops.DecoderShape,
                  **params) -> AnalyticCost:
    """Analytic FLOPs of ``policy`` on ``req`` (decoder only; see the module docstring)."""
    T, n_text = req.seq_len, int(req.text_index.numel())
    vis = visual_rows(policy, req, r, shape.n_layers, **params)
    if policy == "full":
        return AnalyticCost(scoring=0, executor=flops.full_prefill_flops(shape, T), visual_rows=tuple(vis))
    rows = [n_text + v for v in vis]
    executor = flops.executor_flops(shape, T, rows)
    if policy in ("kvshare-conduit", "kvshare"):
        shrink = [layer for layer in range(shape.n_layers - 1) if 0 < vis[layer + 1] < vis[layer]]
        executor += sum(flops.query_flops(shape, rows[layer]) + flops.mass_flops(shape, rows[layer], T)
                        for layer in shrink)
    scoring = 0
    if get_policy(policy, **params).uses_scoring:
        scoring = flops.scoring_flops(shape, T, n_text, int(req.query_index.numel()))
    return AnalyticCost(scoring=scoring, executor=executor, visual_rows=tuple(vis))
