"""CONDUIT's premise diagnostics, Tables 11-13 (paper App. C-D): the tables read per-layer captures of
``kvbench conduit-diagnose`` (rule ``conduit_diag_capture``), one per backbone of ``conduit.models`` x dataset of
``conduit_diagnostics.datasets``, over the image caches of the CONDUIT runs."""
from __future__ import annotations

import json

from kvbench.data.smoke import TASKS
from kvbench.plan.base import Plan, Table


class DiagnosticsPlan(Plan):
    """The ``conduit_diagnostics`` section's captures and tables (module docstring).

    Args:
        section: the config's ``conduit_diagnostics`` mapping.
        conduit: the config's :class:`~kvbench.plan.conduit.ConduitPlan` (backbones, image caches, regimes).
    """

    name = "conduit_diagnostics"
    aggregate = "conduit"

    def __init__(self, section: dict, conduit):
        self.cfg = section
        self.conduit = conduit

    @classmethod
    def from_config(cls, ws, plans: dict) -> "DiagnosticsPlan | None":
        """The plan (None without a ``conduit_diagnostics:`` section), checked while the DAG is built.

        Raises:
            ValueError: no ``conduit:`` section, a dataset that is not a vlm dataset, a layer outside a backbone,
                or more records than the image caches hold; naming the key.
        """
        if "conduit_diagnostics" not in ws.config:
            return None
        if plans.get("conduit") is None:
            raise ValueError("this config has no `conduit:` section, which conduit_diagnostics needs (its backbones and "
                             "image caches); add one or drop conduit_diagnostics")
        section = ws.config["conduit_diagnostics"]
        for d in section["datasets"]:
            # the kind is optional: a smoke dataset's generator knows it, a JSONL's records are checked when captured
            kind = ws.datasets.get(d, {}).get("kind") or (TASKS[d].kind if d in TASKS else None)
            if d not in ws.datasets or kind not in (None, "vlm"):
                raise ValueError(f"config conduit_diagnostics.datasets: {d!r} must be a vlm dataset under `datasets`")
        for model in ws.config["conduit"]["models"]:
            depth = ws.model_depth(model)  # None: the capture checks the depth when it starts
            bad = [i for i in section["layers"] if depth is not None and not i < depth]
            if bad:
                raise ValueError(f"config conduit_diagnostics.layers: {bad} are not layers of {model!r}, which has "
                                 f"{depth} (0..{depth - 1}); the schema default [7, 14, 24] is the paper's for "
                                 "Qwen2.5-VL-3B")
        n_test = ws.config["conduit"].get("n_test")
        if n_test is not None and section["n_records"] > n_test:
            raise ValueError(f"config conduit_diagnostics.n_records ({section['n_records']}) exceeds conduit.n_test "
                             f"({n_test}): the image caches hold only the first {n_test} records")
        plan = cls(section, plans["conduit"])
        plan.ws = ws
        return plan

    def captures(self) -> list[str]:
        """Capture CSVs: one per backbone of ``conduit.models`` x dataset of ``conduit_diagnostics.datasets``."""
        return [f"results/conduit/diag/{self.ws.profile}/{m}/{d}.csv" for m in self.conduit.models
                for d in self.cfg["datasets"]]

    def capture_args(self) -> str:
        """``kvbench conduit-diagnose`` flags (``n_records``, ``m``, ``seed``), as one shell string of integers."""
        return f"--n {int(self.cfg['n_records'])} --m {int(self.cfg['m'])} --seed {int(self.cfg['seed'])}"

    def builds(self, table: Table) -> bool:
        return True

    def table_inputs(self, table: Table) -> list[str]:
        """The captures. Table 13 compares image types, so its datasets must have two.

        Raises:
            ValueError: Table 13 with one image type.
        """
        types = sorted(set(self.cfg["datasets"].values()))
        if table.key == "table13" and len(types) < 2:
            raise ValueError(f"config conduit_diagnostics.datasets: every dataset has the image type {types[0]!r}; "
                             "Table 13 compares image types, so it needs two datasets of different types "
                             "(Tables 11 and 12 do not)")
        return self.captures()

    def table_spec(self, table: Table) -> str:
        return json.dumps({"profile": self.ws.profile, "conduit_diagnostics": self.cfg, "captures": self.captures(),
                           "regimes": self.ws.config["conduit"].get("regimes", {}), "zoo_models": self.ws.zoo_models},
                          sort_keys=True)
