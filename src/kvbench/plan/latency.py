"""CONDUIT Table 3's plan: the table reads the raw measurements of ``kvbench bench conduit-latency``
(``results/bench/<profile>/conduit_latency.csv``, rule ``conduit_latency``), not runs."""
from __future__ import annotations

import json

from kvbench.plan.base import Plan, Table


class LatencyPlan(Plan):
    """The ``conduit_latency`` section's table (module docstring)."""

    name = "conduit_latency"

    def __init__(self, profile: str):
        self.profile = profile

    @classmethod
    def from_config(cls, ws, plans: dict) -> "LatencyPlan | None":
        """The plan (None without a ``conduit_latency:`` section; its settings are checked by
        :func:`kvbench.bench.workflow.latency_job`)."""
        return cls(ws.profile) if "conduit_latency" in ws.config else None

    @property
    def raw(self) -> str:
        """The measurements' CSV."""
        return f"results/bench/{self.profile}/conduit_latency.csv"

    def builds(self, table: Table) -> bool:
        return True

    def table_inputs(self, table: Table) -> list[str]:
        return [self.raw]

    def table_spec(self, table: Table) -> str:
        return json.dumps({"profile": self.profile, "raw": self.raw}, sort_keys=True)
