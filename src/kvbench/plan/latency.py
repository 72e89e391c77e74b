"""CONDUIT Table 3's plan: the table reads the raw measurements of ``kvbench bench conduit-latency``
(``results/bench/<profile>/conduit_latency.csv``, rule ``conduit_latency``), not runs."""
from __future__ import annotations

import json

from kvbench.plan.base import Plan, Table


class LatencyPlan(Plan):
    """The ``conduit_latency`` section's table (module docstring)."""

    name = "conduit_latency"

    def __init__(self, profile: str, labels: dict[str, str] | None = None):
        self.profile, self.labels = profile, labels or {}

    @classmethod
    def from_config(cls, ws, plans: dict) -> "LatencyPlan | None":
        """The plan (None without a ``conduit_latency:`` section; its settings are checked by
        :func:`kvbench.bench.workflow.latency_job`)."""
        if "conduit_latency" not in ws.config:
            return None
        # Table 1's row labels, so that a Table 3 row reads as the Table 1 row of the same method and form
        rows = (ws.config.get("conduit") or {}).get("methods") or []
        return cls(ws.profile, {r["method"]: r["label"] for r in rows if isinstance(r, dict) and "method" in r})

    @property
    def raw(self) -> str:
        """The measurements' CSV."""
        return f"results/bench/{self.profile}/conduit_latency.csv"

    def builds(self, table: Table) -> bool:
        return True

    def table_inputs(self, table: Table) -> list[str]:
        return [self.raw]

    def table_spec(self, table: Table) -> str:
        return json.dumps({"profile": self.profile, "raw": self.raw, "labels": self.labels}, sort_keys=True)
