"""The plan layer: what each config section asks Snakemake to build, behind one protocol.

Every plan implements :class:`~kvbench.plan.base.Plan` (its runs and, per run, what it reads, its threads and record
limit; its tables, what each reads and the JSON its writer gets). :func:`build_plans` builds the config's plans in
:data:`PLAN_TYPES` order, each checked while the DAG is built; ``workflow/rules/common.smk`` loops over them, and
each :class:`~kvbench.plan.base.Table` names the plan that says what it reads. Adding a plan is one class and one
line in :data:`PLAN_TYPES`; adding a table to an existing plan is its writer's ``Table`` entry.
"""
from __future__ import annotations

from kvbench.plan.base import Plan, Run, Table
from kvbench.plan.compressed_cache import CompressedCachePlan
from kvbench.plan.conduit import ConduitPlan
from kvbench.plan.diagnostics import DiagnosticsPlan
from kvbench.plan.generation import GenerationPlan
from kvbench.plan.latency import LatencyPlan
from kvbench.plan.matrix import MatrixPlan
from kvbench.plan.multimodal import MMPlan
from kvbench.plan.residualkv import RKVPlan
from kvbench.plan.workspace import Workspace

#: Every plan type, in build order: a plan may read those built before it (the compressed-image-cache plan reads
#: CONDUIT's and Table II's); where two plans name one run, the later one serves it (Table V's backbone may be
#: ``residualkv.model``).
PLAN_TYPES: dict[str, type[Plan]] = {p.name: p for p in (
    MatrixPlan, ConduitPlan, RKVPlan, GenerationPlan, MMPlan, CompressedCachePlan, DiagnosticsPlan, LatencyPlan)}


def build_plans(ws: Workspace) -> dict[str, Plan]:
    """The config's plans, ``{name: plan}`` in :data:`PLAN_TYPES` order (a section the config lacks: no plan).

    Raises:
        ValueError: a section fails its plan's checks, naming the config key.
    """
    plans: dict[str, Plan] = {}
    for name, cls in PLAN_TYPES.items():
        plan = cls.from_config(ws, plans)
        if plan is not None:
            plans[name] = plan
    return plans


__all__ = ["PLAN_TYPES", "Plan", "Run", "Table", "Workspace", "build_plans"]
