"""Analytic prefill cost of each refresh policy on an assembled request (the check on the measured FLOPs).

Each policy states the visual rows it computes per layer
(:meth:`~kvbench.reuse.policies.RefreshPolicy.visual_rows`, from its definition; docs/decisions/benchmarks.md,
"FLOPs"); text rows are computed at every layer by every policy. Policies with a scoring pass add
:func:`~kvbench.bench.flops.scoring_flops`; a policy that recomputes queries and attention mass after
some layers (KVShare, :meth:`~kvbench.reuse.policies.RefreshPolicy.mass_layers`) adds those. A policy
that runs the model's own forward (``full``) costs :func:`~kvbench.bench.flops.full_prefill_flops` for
the decoder (the vision tower is measured only).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvbench.bench import flops
from kvbench.reuse.assemble import AssembledRequest
from kvbench.reuse.policies import RefreshPolicy, get_policy


@dataclass(frozen=True)
class AnalyticCost:
    """Analytic FLOPs of one request under one policy (ints).

    Attributes:
        scoring: the scoring pass (0 for policies without one; an oracle's full prefill, ``reads_fresh``).
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
    """Visual rows computed at each layer by ``policy`` (with ``params``) at ratio ``r``.

    Raises:
        ValueError: unknown policy or bad parameter.
    """
    return get_policy(policy, **params).visual_rows(req, r, n_layers)


def analytic_cost(policy: str | RefreshPolicy, req: AssembledRequest, r: float, shape: flops.DecoderShape,
                  **params) -> AnalyticCost:
    """Analytic FLOPs of ``policy`` (a name with ``params``, or a policy instance) on ``req`` (decoder only;
    see the module docstring)."""
    pol = get_policy(policy, **params) if isinstance(policy, str) else policy
    T, n_text = req.seq_len, int(req.text_index.numel())
    vis = pol.visual_rows(req, r, shape.n_layers)
    if pol.model_forward:
        return AnalyticCost(scoring=0, executor=flops.full_prefill_flops(shape, T), visual_rows=tuple(vis))
    rows = [pol.phase2_text_rows(req) + v for v in vis]
    executor = flops.executor_flops(shape, T, rows)
    executor += sum(flops.query_flops(shape, rows[layer]) + flops.mass_flops(shape, rows[layer], T)
                    for layer in pol.mass_layers(vis))
    scoring = flops.scoring_flops(shape, T, n_text, int(req.query_index.numel())) if pol.uses_scoring else 0
    if pol.reads_fresh:  # an oracle's look at the fresh K/V is a full prefill
        scoring = flops.full_prefill_flops(shape, T)
    return AnalyticCost(scoring=scoring, executor=executor, visual_rows=tuple(vis))
