"""Which runs each CONDUIT target reads, from the config's ``conduit:`` section (Tables 1, 2, 4, 5, 14, 15, the
staleness gap, Figures 3 and 4).

:class:`ConduitPlan` owns every target's rows (:data:`TARGETS`: the methods it compares) and the column group it
averages over; the Snakemake rules (through :mod:`kvbench.plan`'s protocol) and the writers
(:mod:`kvbench.report.conduit.accuracy`) ask the same object, so paths cannot drift apart. Runs are
``results/runs/<profile>/<model>/<dataset>/conduit/<slug>/`` (run group ``conduit``); each refresh run reads the
image cache ``cache/conduit/<profile>/<model>/<dataset>/`` (rule ``conduit_cache``).

Table 14's evidence runs and Table 15's case study (paper §D.4) are planned here too (:func:`evidence_specs`,
:func:`case_rows`); their writers are :mod:`kvbench.report.conduit.evidence`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from kvbench.eval.registry import canonical, parse_method_spec, run_slugs, slug, with_budget
from kvbench.models.tiny import seed_replica
from kvbench.plan.base import Plan, Run, Table

#: Defaults of ``conduit.evidence`` (Table 14): the budget, the recovery budget, the page-coverage and near-tie
#: thresholds of the failure audit, and the pooled column (None: every multi-image column).
EVIDENCE_DEFAULTS = {"r": 0.1, "recover_r": 0.2, "coverage": 0.2, "tie": 0.05, "column": None}


def targets() -> list[str]:
    """Every target a ConduitPlan reads runs for (:data:`TARGETS`, by key): its tables, then Figures 3 and 4."""
    return list(TARGETS)


@dataclass(frozen=True)
class Column:
    """One table column: a dataset, optionally only its records with ``k[0] <= meta.K <= k[1]``."""

    name: str
    dataset: str
    k: tuple[int, int] | None = None

    def keeps(self, record: dict) -> bool:
        if self.k is None:
            return True
        K = record.get("meta", {}).get("K")
        return K is not None and self.k[0] <= int(K) <= self.k[1]


@dataclass(frozen=True)
class Row:
    """One table row: ``label`` (the paper's name), ``spec`` (canonical method spec), ``r`` (block)."""

    label: str
    spec: str
    r: float | None = None


def _row(entry: dict) -> Row:
    """A row from a config entry ``{label, method}`` whose method is a full spec (r taken from it).

    Raises:
        ValueError: an invalid spec, naming the row's label (the config may list one spec in several rows).
    """
    try:
        spec = parse_method_spec(entry["method"])
    except ValueError as e:
        raise ValueError(f"conduit row {entry['label']!r}: {e}") from None
    return Row(entry["label"], spec.canonical, spec.r)


class ConduitPlan(Plan):
    """Which runs each CONDUIT target reads, from the config's ``conduit:`` section.

    Args:
        conduit: the ``conduit`` config section (schema: workflow/schemas/config.schema.yaml).
        profile: config profile (path component of runs).
        zoo_models: names of models trained here (their tables say "tiny zoo").

    Raises:
        ValueError: an invalid method spec, or two specs sharing a run directory.
    """

    name = "conduit"
    aggregate = "conduit"
    compare_figures = ("conduit/fig3",)

    def __init__(self, conduit: dict, profile: str, zoo_models: list[str] | tuple = ()):
        self.ws = None  # the workflow's Workspace (from_config), for split paths
        self.cfg = conduit
        self.profile = profile
        self.models = list(conduit["models"])
        self.zoo_models = set(zoo_models)
        self.regimes = dict(conduit.get("regimes") or {})
        unknown = sorted(set(self.regimes) - set(self.models))
        if unknown:
            raise ValueError(f"conduit.regimes names {unknown}, which are not in conduit.models {self.models}")
        for m in self.models:  # a seed replica is pooled with its regime's seeds: it must be its entry's regime
            entry = (seed_replica(m) or (None,))[0]
            if entry in self.models and self.regime(m) != self.regime(entry):
                raise ValueError(f"conduit.regimes: {m!r} is {self.regime(m)!r}, but it is a seed replica of {entry!r}, "
                                 f"which is {self.regime(entry)!r}; a replica's regime is its entry's")
        self.reference = canonical(conduit["reference"])
        self.multi = [Column(n, c["dataset"], tuple(c["k"]) if c.get("k") else None)
                      for n, c in conduit["multi_image"].items()]
        self.single = [Column(n, c["dataset"]) for n, c in conduit["single_image"].items()]
        self.run_slugs()  # validates every spec and the run-directory names
        for spec in self.all_specs():  # a compression press cannot serve cached images
            if parse_method_spec(spec).family not in ("refresh", "plain"):
                raise ValueError(f"method spec {spec!r} is a compression press; CONDUIT rows take refresh policies "
                                 f"(or full)")
        check_config(self)

    def regime(self, model: str) -> str:
        """The staleness regime a backbone stands for (``conduit.regimes``; "" when not given, e.g. a real
        checkpoint): on the smoke profile ``strong`` (the instruction is applied while the pages are read) or
        ``mild`` (the question side applies it; docs/decisions/zoo.md, "Two staleness regimes")."""
        return self.regimes.get(model, "")

    # --- rows of each target -----------------------------------------------------------------
    def fig3_rows(self) -> list[Row]:
        """Curve points (method label × r) and the two levels drawn as lines (r = None)."""
        labels = {m["label"]: m["method"] for m in self.cfg["methods"]}
        missing = [lab for lab in self.cfg["curve"]["methods"] if lab not in labels]
        if missing:
            raise ValueError(f"conduit.curve.methods {missing} are not labels of conduit.methods {list(labels)}")
        return [Row(lab, with_budget(labels[lab], r), r) for lab in self.cfg["curve"]["methods"]
                for r in self.cfg["curve"]["r"]] + [Row("Full prefill", self.reference),
                                                     Row("Cache reuse", canonical("reuse"))]

    def rows(self, target: str) -> list[Row]:
        """Rows of ``target`` (:data:`TARGETS`: a table key, ``fig3`` or ``fig4``).

        Raises:
            ValueError: an unknown target.
        """
        return TARGETS[self._target(target)][0](self)

    def column_group(self, target: str) -> str:
        """``multi_image``, ``single_image`` or ``all``: the config group ``target``'s columns come from."""
        return TARGETS[self._target(target)][1]

    def columns(self, target: str) -> list[Column]:
        """The columns a target averages over (its :meth:`column_group`)."""
        return {"multi_image": self.multi, "single_image": self.single,
                "all": self.multi + self.single}[self.column_group(target)]

    @staticmethod
    def _target(target: str) -> str:
        if target not in TARGETS:
            raise ValueError(f"unknown CONDUIT target {target!r}; expected one of {targets()}")
        return target

    # --- runs --------------------------------------------------------------------------------
    def run(self, model: str, dataset: str, spec: str) -> Run:
        """The :class:`~kvbench.plan.base.Run` of ``spec`` (canonical) on ``model`` x ``dataset``."""
        return Run(model, dataset, spec, slug(spec), "conduit")

    def run_dir(self, model: str, dataset: str, spec: str) -> str:
        """``results/runs/<profile>/<model>/<dataset>/conduit/<slug(spec)>``."""
        return self.run(model, dataset, spec).path(self.profile)

    def target_runs(self, target: str) -> list[tuple[str, str, str]]:
        """Distinct ``(model, dataset, canonical spec)`` a target reads (the reference run included)."""
        specs = [r.spec for r in self.rows(target)] + [self.reference]
        datasets = list(dict.fromkeys(c.dataset for c in self.columns(target)))
        return list(dict.fromkeys((m, d, s) for m in self.models for d in datasets for s in specs))

    def all_specs(self) -> list[str]:
        """Every canonical spec any target reads."""
        return list(dict.fromkeys([r.spec for t in targets() for r in self.rows(t)] + [self.reference]))

    def run_slugs(self) -> dict[str, str]:
        """``{run-directory name: canonical spec}`` of :meth:`all_specs` (checked injective)."""
        return run_slugs(self.all_specs())

    def check_layers(self, n_layers: dict[str, int]) -> None:
        """Every refresh spec's layer indices against each backbone's depth (``{model: n_layers}``, models whose
        depth is known before anything runs), so ``conduit@0.1:layers=99`` fails while the DAG is built.

        Raises:
            ValueError: naming the spec, the model and the bad indices.
        """
        for spec in self.all_specs():
            parsed = parse_method_spec(spec)
            if parsed.family != "refresh":
                continue
            for model in self.models:
                if model in n_layers:
                    try:
                        parsed.build().check_layers(n_layers[model])
                    except ValueError as e:
                        raise ValueError(f"method spec {spec!r} on {model!r}: {e}") from None

    def header(self, title: str) -> str:
        """First line of every output: which profile and models produced the numbers."""
        zoo = [m for m in self.models if m in self.zoo_models]
        if zoo:
            who = (f"kvbench {self.profile} profile: tiny zoo ({', '.join(zoo)}) on smoke datasets; "
                   "NOT the paper's numbers")
        else:
            who = f"kvbench {self.profile} profile: models {', '.join(self.models)} computed by this pipeline"
        return f"# CONDUIT {title}. {who}."

    # --- the workflow's protocol (kvbench.plan.base.Plan) -------------------------------------------
    @classmethod
    def from_config(cls, ws, plans: dict) -> "ConduitPlan | None":
        """The plan of the config's ``conduit:`` section (None without one), checked while the DAG is built: the
        backbones are VLMs of ``models``, the datasets exist, every spec parses and fits each known depth.

        Raises:
            ValueError: naming the ``conduit`` key and the bad value.
        """
        section = ws.config.get("conduit")
        if section is None:
            return None
        for model in section["models"]:
            if model not in ws.models:
                raise ValueError(f"config conduit.models: {model!r} is not defined under `models`")
            if ws.models[model]["kind"] != "vlm":
                raise ValueError(f"config conduit.models: {model!r} is a {ws.models[model]['kind']!r} model; refresh "
                                 "runs need a vlm")
        for group in ("multi_image", "single_image"):
            for name, col in section[group].items():
                if col["dataset"] not in ws.datasets:
                    raise ValueError(f"config conduit.{group}.{name}: dataset {col['dataset']!r} is not defined under "
                                     "`datasets`")
                if "k" in col and col["k"][0] > col["k"][1]:
                    raise ValueError(f"config conduit.{group}.{name}: k range {col['k']} is empty (lo > hi)")
        try:
            plan = cls(section, ws.profile, ws.zoo_models)
            depths = {m: ws.model_depth(m) for m in section["models"]}
            plan.check_layers({m: d for m, d in depths.items() if d is not None})
        except ValueError as e:
            raise ValueError(f"config conduit: {e}") from e
        plan.ws = ws
        return plan

    def cache_dir(self, model: str, dataset: str) -> str:
        """``cache/conduit/<profile>/<model>/<dataset>``: the per-image caches refresh runs read (rule ``conduit_cache``)."""
        return f"cache/conduit/{self.profile}/{model}/{dataset}"

    def runs(self) -> list[Run]:
        return list(dict.fromkeys(self.run(m, d, s) for t in targets() for m, d, s in self.target_runs(t)))

    def resources(self, run: Run) -> tuple[dict[str, str], dict]:
        """A refresh run reads its image cache (``full`` is plain prefill: no cache)."""
        if run.spec == "full":
            return {}, {}
        root = self.cache_dir(run.model, run.dataset)
        return {"cache": f"{root}/index.json"}, {"cache_dir": root, "build_missing": False}

    def threads(self, run: Run) -> int:
        return self.cfg.get("threads", 1)

    @property
    def n_test(self) -> int | None:
        """Records per split (``conduit.n_test``; None: every record): each run's and each image-cache build's."""
        return self.cfg.get("n_test")

    def n_test_of(self, model: str) -> int | None:
        """Records per split of ``model``'s runs and image caches: ``conduit.replica_n_test`` for a zoo seed replica
        (``<entry>-s<k>``, :func:`kvbench.models.tiny.seed_replica`) when it is set, else ``conduit.n_test``."""
        fewer = self.cfg.get("replica_n_test")
        return fewer if fewer is not None and seed_replica(model) is not None else self.n_test

    def limit(self, run: Run) -> int | None:
        return self.n_test_of(run.model)

    def builds(self, table: Table) -> bool:
        """A table whose column group is configured (asked for by name with an empty group, it fails naming the key)."""
        return table.key in self.built_targets()

    def report_figures(self) -> list[list[str]]:
        return [[f"figures/conduit/{f}.pdf", f"results/conduit/{f}.csv"] for f in ("fig3", "fig4")]

    def target_inputs(self, target: str) -> list[str]:
        """Predictions of every run ``target`` (a table key, ``fig3`` or ``fig4``) reads, then the splits (K lookup).

        Raises:
            ValueError: the target's column group is empty (a schema-valid config without ``conduit.single_image``
                once ended in a ZeroDivisionError inside the Table 2 job).
        """
        group = self.column_group(target)
        if group != "all" and not self.cfg.get(group):
            raise ValueError(f"config conduit.{group} is empty, so CONDUIT {target} has no column to average; "
                             f"name at least one dataset there (config/config.yaml shows how)")
        runs = [f"{self.run_dir(m, d, s)}/predictions.jsonl" for m, d, s in self.target_runs(target)]
        return runs + sorted({self.ws.split_file(d) for _, d, _ in self.target_runs(target)})

    def report_spec(self, target: str) -> str:
        """The JSON the CONDUIT writers read (:func:`kvbench.report.conduit.accuracy.plan_and_runs`): profile, the section,
        split paths, zoo model names."""
        splits = {d: self.ws.split_file(d) for _, d, _ in self.target_runs(target)}
        return json.dumps({"profile": self.profile, "conduit": self.cfg, "splits": splits,
                           "zoo_models": self.ws.zoo_models}, sort_keys=True)

    def table_inputs(self, table: Table) -> list[str]:
        return self.target_inputs(table.key)

    def table_spec(self, table: Table) -> str:
        return self.report_spec(table.key)

    def built_targets(self) -> list[str]:
        """The targets the ``conduit`` aggregate builds: those whose column group is configured (a table asked for by
        name with an empty group fails naming the key)."""
        return [t for t in targets() if self.column_group(t) == "all" or self.cfg.get(self.column_group(t))]

# --- rows of each target ------------------------------------------------------------------------

def _table1_rows(plan: ConduitPlan) -> list[Row]:
    return [Row(m["label"], with_budget(m["method"], r), r) for r in plan.cfg["budgets"] for m in plan.cfg["methods"]]


def _table4_rows(plan: ConduitPlan) -> list[Row]:
    lam = plan.cfg["lambda"]
    return [Row(f"λ = {v:g}", with_budget(f"{lam['method']}:lam={v!r}", lam["r"]), lam["r"]) for v in lam["values"]]


def _table14_rows(plan: ConduitPlan) -> list[Row]:
    names = {"conduit": "CONDUIT", "raw": "raw-attention top-k (ProphetKV)", "attention": "attention gap source",
             "recover": "CONDUIT at the recovery budget"}
    specs = evidence_specs(plan, plan.cfg.get("evidence", {}))
    return [Row(names[k], s, parse_method_spec(s).r) for k, s in specs.items() if k != "full"]


def _case_rows(plan: ConduitPlan) -> list[Row]:
    return [Row(label, spec, parse_method_spec(spec).r) for label, spec in case_rows(plan)]


def _gap_rows(plan: ConduitPlan) -> list[Row]:
    return [Row("Cache reuse", canonical("reuse")), Row("Full prefill", plan.reference)]


#: Every CONDUIT target (a table key, or ``fig3``/``fig4``) -> (its rows from the ``conduit`` section, the column group
#: it averages over: ``multi_image``, ``single_image`` or ``all``). A new CONDUIT table is one line here plus its
#: writer's :class:`~kvbench.plan.base.Table` entry.
TARGETS = {
    "table1": (_table1_rows, "multi_image"),
    "table2": (lambda plan: [_row(m) for m in plan.cfg["single_image_rows"]], "single_image"),
    "table4": (_table4_rows, "multi_image"),
    "table5": (lambda plan: [_row(m) for m in plan.cfg["ablation"]], "multi_image"),
    "table14": (_table14_rows, "multi_image"),
    "table15": (_case_rows, "multi_image"),
    "staleness_gap": (_gap_rows, "all"),
    "fig3": (lambda plan: plan.fig3_rows(), "multi_image"),
    "fig4": (_case_rows, "multi_image"),
}


# --- Table 14's evidence runs and Table 15's case study ----------------------------------------------

def evidence_columns(plan: ConduitPlan, cfg: dict) -> list:
    """The multi-image columns Table 14 pools (``cfg["column"]``: one named column; None: all)."""
    cols = plan.multi
    if cfg.get("column"):
        cols = [c for c in cols if c.name == cfg["column"]]
        if not cols:
            raise ValueError(f"conduit.evidence.column {cfg['column']!r} is not a conduit.multi_image column "
                             f"{[c.name for c in plan.multi]}")
    return cols


def evidence_specs(plan: ConduitPlan, cfg: dict) -> dict[str, str]:
    """``{name: canonical spec}`` of the runs Table 14 reads (``full`` = the plan's reference)."""

    cfg = {**EVIDENCE_DEFAULTS, **cfg}
    return {"full": plan.reference, "conduit": with_budget("conduit", cfg["r"]),
            "raw": with_budget("prophetkv", cfg["r"]),
            "attention": with_budget("conduit:use_v_norm=false", cfg["r"]),
            "recover": with_budget("conduit", cfg["recover_r"])}


def case_column(plan: ConduitPlan, cfg: dict) -> Column:
    """The case study's multi-image column: ``cfg["column"]``, or the one whose K range holds 4, else the last.

    Raises:
        ValueError: a named column that is not a ``conduit.multi_image`` column.
    """
    cols = plan.multi
    name = cfg.get("column")
    if name:
        col = next((c for c in cols if c.name == name), None)
        if col is None:
            raise ValueError(f"conduit.case_study.column {name!r} is not a conduit.multi_image column "
                             f"{[c.name for c in cols]}")
        return col
    return next((c for c in cols if c.k and c.k[0] <= 4 <= c.k[1]), cols[-1])


def check_config(plan: ConduitPlan) -> None:
    """Check ``conduit.evidence`` and ``conduit.case_study`` against the plan's columns while the DAG is built
    (not after every run finished).

    Raises:
        ValueError: a column that is not a multi-image column, ``evidence.recover_r`` not above ``evidence.r``, or
            ``replica_n_test`` above ``n_test``.
    """
    fewer, n = plan.cfg.get("replica_n_test"), plan.cfg.get("n_test")
    if fewer is not None and n is not None and fewer > n:
        raise ValueError(f"conduit.replica_n_test ({fewer}) must be at most conduit.n_test ({n}): a seed replica "
                         "evaluates fewer records per split than its entry, not more")
    cfg = {**EVIDENCE_DEFAULTS, **plan.cfg.get("evidence", {})}
    evidence_columns(plan, cfg)
    if cfg["recover_r"] <= cfg["r"]:
        raise ValueError(f"conduit.evidence.recover_r ({cfg['recover_r']}) must be above conduit.evidence.r "
                         f"({cfg['r']}): it is the larger budget at which a differing record may recover")
    if plan.multi:
        case_column(plan, plan.cfg.get("case_study", {}))


def case_rows(plan: ConduitPlan) -> list[tuple[str, str]]:
    """``(label, spec)`` of the case study: every Table 1 row at the case budget (budgeted ones get @r), then
    full prefill once."""

    r = plan.cfg.get("case_study", {}).get("r", 0.1)
    out = []
    for m in plan.cfg["methods"]:
        spec = with_budget(m["method"], r)  # canonical; reuse and full unchanged
        if spec != plan.reference:
            out.append((m["label"], spec))
    return out + [("Full prefill", plan.reference)]
