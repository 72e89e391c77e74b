"""The eval matrix's plan: every configured method on every model x dataset of ``eval.matrix`` (the zoo report's runs,
and a checkpoint's runs of the default target).

Runs are ``results/runs/<profile>/<model>/<dataset>/<slug>/`` (run group ``eval``: no sub-directory), with
``eval.threads`` and ``eval.limit``.
"""
from __future__ import annotations

from kvbench.eval.registry import check_method_spec, parse_method_spec
from kvbench.plan.base import Plan, Run


class MatrixPlan(Plan):
    """The ``eval`` section's runs (module docstring).

    Args:
        section: the config's ``eval`` mapping (``methods``, ``matrix``, ``threads``, ``limit``).
    """

    name = "eval"

    def __init__(self, section: dict):
        self.cfg = section

    @classmethod
    def from_config(cls, ws, plans: dict) -> "MatrixPlan":
        """The plan of ``eval``, checked while the DAG is built: models and datasets of the matrix exist (and no
        ``zoo.on_demand`` model is in it), every method parses and serves its datasets.

        Raises:
            ValueError: naming the ``eval`` key and the bad value.
        """
        section = ws.config["eval"]
        for model, tasks in section["matrix"].items():
            if model not in ws.models:
                raise ValueError(f"config eval.matrix: model {model!r} is not defined under `models`")
            if ws.models[model].get("zoo", {}).get("on_demand"):   # the matrix is the default target's zoo report
                raise ValueError(f"config eval.matrix: model {model!r} is `zoo.on_demand` (trained only by the targets "
                                 "that read it, not by the default target); remove it from the matrix or drop on_demand")
            for task in tasks:
                if task not in ws.datasets:
                    raise ValueError(f"config eval.matrix.{model}: dataset {task!r} is not defined under `datasets`")
        # refresh policies serve VLM records with cached images, presses serve text records: a method of the eval
        # matrix that cannot serve one of its datasets would fail only at run time, after the models had trained
        serves = {"refresh": "vlm"}  # presses serve both (VLM records: kvbench.compress.generate_vlm)
        for method in section["methods"]:
            try:
                check_method_spec(method)  # a registry name (full), a refresh spec (reuse) or a press
            except ValueError as e:
                raise ValueError(f"config eval.methods: unknown method {method!r} or bad method spec: {e}") from e
            wanted = serves.get(parse_method_spec(method).family)
            for tasks in section["matrix"].values():
                for task in tasks:
                    if wanted and ws.datasets[task]["kind"] != wanted:
                        raise ValueError(f"config eval.methods: {method!r} serves {wanted} datasets only, but the eval "
                                         f"matrix has {task!r} ({ws.datasets[task]['kind']}); list it in the conduit or "
                                         f"residualkv section instead")
        return cls(section)

    def cells(self, methods: list[str] | None = None) -> list[tuple[str, str, str]]:
        """``(model, task, method)`` of every run of the matrix (``methods``: instead of ``eval.methods``)."""
        methods = self.cfg["methods"] if methods is None else methods
        return [(model, task, method) for model, tasks in self.cfg["matrix"].items() for task in tasks
                for method in methods]

    @staticmethod
    def run(model: str, task: str, method: str) -> Run:
        spec = parse_method_spec(method)
        return Run(model, task, spec.canonical, spec.slug)

    def runs(self) -> list[Run]:
        return list(dict.fromkeys(self.run(*cell) for cell in self.cells()))

    def threads(self, run: Run) -> int:
        return self.cfg.get("threads", 1)

    def limit(self, run: Run) -> int | None:
        return self.cfg.get("limit")
