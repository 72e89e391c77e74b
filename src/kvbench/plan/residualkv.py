"""Which codecs and runs each ResidualKV target needs, from the config's ``residualkv:`` section.

The Snakemake rules (workflow/rules/residualkv.smk) and the report (:mod:`kvbench.report.residualkv.tables`) ask
the same :class:`RKVPlan`, so paths cannot drift apart.

Layout: codec variants under ``codecs/<profile>/<model>/`` (:mod:`kvbench.plan.codecs`, the plan's :attr:`RKVPlan.codecs`);
runs ``results/runs/<profile>/<model>/<task>/residualkv/<slug>/`` (``kvbench eval`` of a press spec,
:mod:`kvbench.eval.compress`). A press spec that takes a codec names its variant with ``codec=<variant>``
(default ``main``).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from kvbench.bench.settings import BY_FIGURE
from kvbench.compress.registry import PRESS
from kvbench.eval.registry import with_params
from kvbench.plan.base import Plan, Run, Table, load_spec
from kvbench.plan.codecs import FIGURE_VARIANTS, CodecPlan
from kvbench.utils.spec import MethodSpec, parse

#: Targets whose rows are the config's ``stride_sweep`` (Table VI: its α values; Fig. 5: α values and fixed
#: strides). Every other target ``tableX`` takes its rows from the config key of its own name, a list of
#: ``{label, method}``: a new table needs no line here.
SWEEP_TARGETS = ("tableVI", "fig5")
#: Targets run on the section's ``long_generation`` backbone and task, not on ``model``/``tasks`` (Table V: long
#: generation, :mod:`kvbench.report.residualkv.table_v` builds their plan); a section with ``long_generation`` leaves
#: them out of its own :meth:`RKVPlan.targets`.
GENERATION_TARGETS = ("tableV",)
#: Header wording of each evaluation protocol (:attr:`kvbench.compress.cache.Press.protocol`).
PROTOCOL_NOTES = {
    "one_pass": "one_pass: context + question prefilled as one chunk (exact), then greedy decoding reads the "
                "compressed cache; KVzip prefills the context alone, then the question",
    "shared_context": "shared_context: context prefilled as one chunk and compressed, then the question chunk and "
                      "greedy decoding read the compressed cache",
}


def protocol_note(specs: list[str]) -> str:
    """A table header's protocol wording of the press ``specs`` its rows ran: each protocol's
    :data:`PROTOCOL_NOTES`, then their ``decode_tail`` values when any is set."""
    parsed = [press_spec(s).params for s in specs]
    note = "; ".join(PROTOCOL_NOTES[p] for p in sorted({p["protocol"] for p in parsed}))
    tails = sorted({int(p.get("decode_tail", 0)) for p in parsed})
    if tails != [0]:
        note += (f"; decode_tail={'/'.join(map(str, tails))}: the question's last token(s) (the key) are fed as "
                 "decode steps after the prefill, so a one-token answer reads the compressed cache (decode-time "
                 "selection, quantised full layers and restoration act on it; the full cache is unchanged)")
    return note


def known_model_shape(model: str, entry: dict, checkpoint_dir: str | None = None) -> tuple[int, int] | None:
    """``(n_layers, d_kv)`` of a config's model before anything is built: a zoo model's from its
    :data:`~kvbench.models.tiny.ZOO` entry, a checkpoint's from its ``config.json`` when the file exists
    (else None: a dry run over a root that is not there yet).

    Raises:
        ValueError: ``config.json`` exists but is not JSON or lacks the layer/head fields.
    """
    if "zoo" in entry:
        from kvbench.models.tiny import zoo_spec

        cfg = zoo_spec(model).text
    else:
        path = Path(checkpoint_dir or "", "config.json")
        if not checkpoint_dir or not path.is_file():
            return None
        try:
            cfg = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"{path}: not a JSON file ({e})") from None
    from kvbench.compress.residualkv.codec import config_kv_shape

    return config_kv_shape(cfg, f"model {model!r}")


def check_table_i(model: str, entry: dict, shape: tuple[int, int] | None) -> None:
    """A model entry's Table I settings (``codec: {two_d_k, full_attention_layers, ...}``) against the
    checkpoint's ``(n_layers, d_kv)``, when both are known: a wrong checkpoint under the name is caught here.

    Raises:
        ValueError: ``two_d_k`` differs from the checkpoint's d_kv, or a full-attention layer is outside it.
    """
    table = entry.get("codec")
    if not table or shape is None:
        return
    n_layers, d_kv = shape
    if table.get("two_d_k", d_kv) != d_kv:
        raise ValueError(f"model {model!r}: codec.two_d_k = {table['two_d_k']} (Table I) but its checkpoint has "
                         f"2 d_k = {d_kv} ({n_layers} layers); is it the right checkpoint?")
    bad = [i for i in table.get("full_attention_layers", []) if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"model {model!r}: codec.full_attention_layers {bad} outside its checkpoint's {n_layers} layers")


def press_spec(spec: str) -> MethodSpec:
    """A ResidualKV-side row's spec, parsed as a compression press (a refresh policy is refused).

    Raises:
        ValueError: not a valid press spec.
    """
    return parse(spec, PRESS)


@dataclass(frozen=True)
class Row:
    """One table row: the paper's label and a canonical press spec."""

    label: str
    spec: str


class RKVPlan(Plan):
    """The ResidualKV side of a config (see ``config/config.yaml``, ``residualkv:``).

    Args:
        section: the config's ``residualkv`` mapping.
        profile: the config's profile name (path component).
        shape: ``(n_layers, d_kv)`` of the backbone where it is known before anything runs
            (:func:`known_model_shape`); then codec sizes and layer indices are checked against it.
        zoo: the model is a zoo model (the headers say so) rather than a local checkpoint.
        seed: the config's ``seed`` (codecs are trained with it); needed for codec directories.
        model_dir: the backbone's checkpoint directory as the workflow names it (``common.smk``'s
            ``model_dir``); part of each codec's recipe, needed for codec directories.

    Raises:
        ValueError: a row's spec is invalid, names a codec variant that is not configured or a layer
            the model does not have; a codec variant's settings are invalid (e.g. ``d_c`` not a
            multiple of the quantisation group, ``k`` or ``stride`` below 1); the variants of one codec
            figure train different numbers of steps.
    """

    name = "residualkv"

    def __init__(self, section: dict, profile: str, shape: tuple[int, int] | None = None, zoo: bool = True, *,
                 seed: int | None = None, model_dir: str | None = None):
        missing = [k for k in ("model", "tasks", "codec", "train", "tableIII") if k not in section]
        if missing:
            raise ValueError(f"the residualkv section misses key(s) {missing}")
        self.ws = None  # the workflow's Workspace (from_config)
        self.s = section
        self.profile = profile
        self.model: str = section["model"]
        self.tasks: list[str] = list(section["tasks"])
        self.shape = shape
        self.zoo = zoo
        self.seed = seed
        self.model_dir = model_dir
        #: the section's codec variants: directories, recipes, training jobs (:class:`~kvbench.plan.codecs.CodecPlan`)
        self.codecs = CodecPlan(section, profile, self.model, shape, zoo, seed, model_dir)
        self._check_figure_steps()
        for fig in BY_FIGURE:
            self.bench_args(fig)
        for target in self.targets():
            rows = self.rows(target)
            labels = [row.label for row in rows]
            dup = sorted({x for x in labels if labels.count(x) > 1})
            if dup:
                raise ValueError(f"{target}: row label(s) {dup} given twice (each row is one line of the table)")
            for row in rows:
                try:
                    self._check_spec(row.spec)  # fail while the DAG is built
                except ValueError as e:
                    raise ValueError(f"{self.rows_key(target)}, row {row.label!r}: {e}") from None

    @classmethod
    def from_spec(cls, spec: str | dict) -> "RKVPlan":
        """The plan of the workflow's JSON ``spec``: ``{profile, residualkv: section, zoo, seed, model_dir}``
        (``common.smk``'s ``report_spec``); ``seed`` and ``model_dir`` name the codec directories.

        Raises:
            ValueError: ``spec`` is not that JSON, or the section is invalid.
        """
        spec = load_spec(spec, "residualkv")
        return cls(spec["residualkv"], spec["profile"], zoo=spec.get("zoo", True), seed=spec.get("seed"),
                   model_dir=spec.get("model_dir"))

    def _check_figure_steps(self) -> None:
        """Figs. 10-12 compare codecs at matched steps (paper §V-C): their configured variants train equally long."""
        for fig, variants in FIGURE_VARIANTS.items():
            steps = {v: self.codecs.training(v).get("steps") for v in variants if v in self.variants}
            if len(set(steps.values())) > 1:
                raise ValueError(f"{fig} compares its codec variants at equal training steps, but they train "
                                 + ", ".join(f"{v} {n}" for v, n in steps.items()) + " steps")

    def _check_spec(self, spec: str) -> None:
        """A row's spec is valid (its press constructed: the press's own checks) and fits the model's layers."""
        self.codec_of(spec)
        press = press_spec(spec).build()
        if self.shape is not None:
            try:
                press.check_layers(self.shape[0])
            except ValueError as e:
                raise ValueError(f"press spec {spec!r}: {e}") from None

    def bench_gpus(self, fig: str) -> int:
        """GPUs the profiling job of ``fig`` asks the scheduler for: 1 when ``residualkv.<fig>.device`` is CUDA."""
        return 1 if str((self.s.get(fig) or {}).get("device", "auto")).startswith("cuda") else 0

    def bench_args(self, fig: str) -> str:
        """``kvbench bench`` flags (shell-quoted) from the config's ``residualkv.<fig>`` mapping, in its order,
        lists space-separated: ``{contexts: [512, 1024], repeats: 3}`` -> ``--contexts 512 1024 --repeats 3``
        (the verb's settings: :data:`kvbench.bench.settings.BY_FIGURE`).

        Raises:
            ValueError: a key the verb does not take (or the rule sets), a value its settings refuse, or
                Fig. 11 with more than one context; naming ``residualkv.<fig>``, the key and the value.
        """
        mapping = self.s.get(fig) or {}
        try:
            return BY_FIGURE[fig].from_config(mapping).flags(mapping)
        except ValueError as e:
            raise ValueError(f"residualkv.{fig}: {e}") from None

    @property
    def variants(self) -> dict[str, dict]:
        """``{variant: config entry}`` of the section's codecs (``main``: ``{}``)."""
        return self.codecs.variants

    def codec_of(self, spec: str) -> str | None:
        """The codec variant a press spec reads (None for presses without a codec)."""
        parsed = press_spec(spec)
        if "codec_dir" not in {f.name for f in dataclasses.fields(parsed.cls)}:
            return None
        variant = parsed.build().codec
        if variant not in self.variants:
            raise ValueError(f"press spec {spec!r} names codec variant {variant!r}, which residualkv.variants "
                             f"does not configure (configured: {sorted(self.variants)})")
        return variant

    # -- rows ----------------------------------------------------------------------------------------
    def rows_key(self, target: str) -> str:
        """The ``residualkv`` config key ``target``'s rows come from (:data:`SWEEP_TARGETS`, else its own name)."""
        return "stride_sweep" if target in SWEEP_TARGETS else target

    def configured(self, target: str) -> bool:
        """Whether the config has ``target``'s rows (:meth:`rows_key`; only Table III's is required)."""
        return bool(self.s.get(self.rows_key(target)))

    def targets(self) -> list[str]:
        """Every target this config has rows for: each ``table*`` list of rows, then the sweep targets."""
        own = [k for k, v in self.s.items() if k.startswith("table") and isinstance(v, list) and v
               and not (k in GENERATION_TARGETS and "long_generation" in self.s)]
        return own + [t for t in SWEEP_TARGETS if t not in own and self.configured(t)]

    def rows(self, target: str) -> list[Row]:
        """Rows of ``target``: its config list of ``{label, method}``, or (Table VI, Fig. 5) the ``stride_sweep``.

        Raises:
            ValueError: the config lacks ``target``'s key (:meth:`rows_key`), naming it.
        """
        if not self.configured(target):
            raise ValueError(f"config residualkv.{self.rows_key(target)} is not set, so {target} has no rows "
                             "(config/config.yaml shows one)")
        if target not in SWEEP_TARGETS:
            return [Row(e["label"], self._row_spec(target, e)) for e in self.s[target]]
        sweep = self.s["stride_sweep"]
        try:
            method = self.with_protocol(sweep["method"])
            rows = [Row(f"alpha = {a:g}", with_params(method, alpha=float(a))) for a in sweep["alpha"]]
            if target == "fig5":
                rows += [Row(f"stride = {s}", with_params(method, stride=int(s))) for s in sweep.get("stride", [])]
        except ValueError as e:
            raise ValueError(f"stride_sweep.method: {e}") from None
        return rows

    def with_protocol(self, spec: str) -> str:
        """``spec`` with the section's ``protocol`` (default ``one_pass``) and a non-zero ``decode_tail``, each unless
        it spells its own, so every run name says how its prompt met the cache."""
        params = press_spec(spec).params
        if "protocol" not in params:
            spec = with_params(spec, protocol=self.s.get("protocol", "one_pass"))
        if "decode_tail" not in params and self.s.get("decode_tail", 0):
            spec = with_params(spec, decode_tail=int(self.s["decode_tail"]))
        return spec

    def protocol_note(self, target: str) -> str:
        """The header's protocol wording of ``target``'s rows (:func:`protocol_note`)."""
        return protocol_note([r.spec for r in self.rows(target)])

    def _row_spec(self, target: str, row: dict) -> str:
        """The canonical press spec of one configured row (with :meth:`with_protocol`); errors name the table
        and the row's label."""
        try:
            parsed = press_spec(self.with_protocol(row["method"]))
        except ValueError as e:
            raise ValueError(f"{target}, row {row['label']!r}: {e}") from None
        if "text" not in parsed.cls.serves:   # the plan's backbone is an LM: its records are text
            raise ValueError(f"{target}, row {row['label']!r}: {parsed.name!r} answers {' and '.join(parsed.cls.serves)} "
                             f"records only, and this table runs the LM {self.model!r} on text tasks (Table II runs "
                             "the visual-token presses on VLMs)")
        return parsed.canonical

    def run(self, task: str, spec: str) -> Run:
        """The :class:`~kvbench.plan.base.Run` of press ``spec`` on the plan's model x ``task``."""
        parsed = press_spec(spec)
        return Run(self.model, task, parsed.canonical, parsed.slug, "residualkv")

    def run_dir(self, task: str, spec: str) -> str:
        """``results/runs/<profile>/<model>/<task>/residualkv/<slug>``."""
        return self.run(task, spec).path(self.profile)

    def target_tasks(self, target: str | None) -> list[str]:
        """The task columns of ``target``: the section's ``target_tasks.<target>`` (Table IV's multi-query tasks),
        else ``tasks``."""
        return list((self.s.get("target_tasks") or {}).get(target) or self.tasks)

    def target_runs(self, target: str) -> list[tuple[str, str]]:
        """``(task, spec)`` of every run ``target`` reads."""
        return [(t, r.spec) for r in self.rows(target) for t in self.target_tasks(target)]

    def run_slugs(self) -> dict[str, str]:
        """``{slug: canonical spec}`` over every target.

        Raises:
            ValueError: two specs map to one directory.
        """
        out: dict[str, str] = {}
        for target in self.targets():
            for row in self.rows(target):
                k = press_spec(row.spec).slug
                if out.get(k, row.spec) != row.spec:
                    raise ValueError(f"press specs {out[k]!r} and {row.spec!r} map to one run directory {k!r}")
                out[k] = row.spec
        return out

    def header(self, title: str, target: str | None = None) -> list[str]:
        """The CSV header lines of a table or figure: what was run, and that it is not the paper's numbers;
        with ``target``, the protocol its rows ran under (:func:`protocol_note`)."""
        tasks = ", ".join(self.target_tasks(target))
        # the smoke stand-ins: Table V's chain task stands for AIME (long generation), the others for LongBench
        stand_in = ("a long-generation smoke task in place of AIME" if target in GENERATION_TARGETS else
                    "RULER/SCBench/LongBench-style smoke tasks in place of LongBench")
        what = (f"model {self.model} (tiny zoo LM trained here, not the paper's models); tasks {tasks} "
                f"({stand_in})" if self.zoo else
                f"model {self.model} (local checkpoint); tasks {tasks} (local benchmark files)")
        return [f"# kvbench ResidualKV {title}, profile {self.profile!r}: {what}; "
                + ("not the paper's numbers" if self.zoo else "computed by this pipeline, not copied from the paper"),
               ] + ([f"# protocol: {self.protocol_note(target)} (kvbench.compress.generate)"] if target else [])

    # --- the workflow's protocol (kvbench.plan.base.Plan) -------------------------------------------
    @classmethod
    def _workflow_section(cls, ws) -> dict:
        """The config's ``residualkv`` section with ``codec.import`` (an authors' checkpoint, imported as the main codec)
        resolved like every local path (absolute, else under ``paths.root``)."""
        section = dict(ws.config["residualkv"])
        codec = dict(section["codec"])
        if "import" in codec:
            codec["import"] = ws.local_path(str(codec["import"]))
        section["codec"] = codec
        return section

    @classmethod
    def from_config(cls, ws, plans: dict) -> "RKVPlan | None":
        """The plan of the config's ``residualkv:`` section (None without one), checked while the DAG is built.

        Raises:
            ValueError: naming the ``residualkv`` key and the bad value (backbone, tasks, rows, codecs, Table IV's
                protocol).
        """
        if "residualkv" not in ws.config:
            return None
        section = cls._workflow_section(ws)
        model = section["model"]
        if model not in ws.models or ws.models[model]["kind"] != "lm":
            raise ValueError(f"config residualkv.model: {model!r} must be an `lm` model defined under `models`")
        # keys and repeated tasks: the schema's (propertyNames, uniqueItems)
        keyed = [("tasks", section["tasks"])] + [(f"target_tasks.{t}", ts)
                                                 for t, ts in (section.get("target_tasks") or {}).items()]
        for key, tasks in keyed:
            for task in tasks:
                if task not in ws.datasets:
                    raise ValueError(f"config residualkv.{key}: {task!r} is not defined under `datasets`")
                if ws.dataset_kind(task) == "vlm":   # the backbone is an LM (checked above)
                    raise ValueError(f"config residualkv.{key}: {task!r} is a `vlm` dataset; the LM backbone {model!r} "
                                     "needs `text` tasks (residualkv.tableII runs presses on VLMs)")
        try:
            shape = ws.model_shape(model)
            check_table_i(model, ws.models[model], shape)
            plan = cls(section, ws.profile, shape, zoo=ws.is_zoo(model), seed=ws.seed, model_dir=ws.model_dir(model))
        except ValueError as e:
            raise ValueError(f"config residualkv: {e}") from e
        if plan.configured("tableIV"):
            check_table_iv(plan)  # while the DAG is built, not after every run of the table finished
        plan.ws = ws
        return plan

    def runs(self) -> list[Run]:
        return list(dict.fromkeys(self.run(t, s) for target in self.targets() for t, s in self.target_runs(target)))

    def resources(self, run: Run) -> tuple[dict[str, str], dict]:
        """A ResidualKV run reads its codec variant (``codec_dir``); Table V's runs also take their sampling."""
        params = dict(self.s.get("sampling") or {})
        variant = self.codec_of(run.spec)
        if variant is None:
            return {}, params
        codec = f"{self.codecs.dir(variant)}/codec"
        return {"codec": f"{codec}/codec.json"}, {"codec_dir": codec, **params}

    def threads(self, run: Run) -> int:
        return self.s.get("threads", 1)

    def limit(self, run: Run) -> int | None:
        return self.s.get("n_test")

    def runtime(self, run: Run, zoo: bool) -> int:
        """An hour on the zoo; a checkpoint's long-context runs 12 hours."""
        return 60 if zoo else 720

    def builds(self, table: Table) -> bool:
        return self.configured(table.key) or table.key in MODEL_TABLES

    def report_figures(self) -> list[list[str]]:
        """Fig. 3 (with its summary), then :data:`FIGURES` (each with its CSV; Fig. 11 with its throughput CSV, Fig. 13
        with its per-layer shares), and the measurement CSVs of Figs. 6, 8 and 11."""
        out = [["results/residualkv/fig11_throughput.csv"], ["results/residualkv/fig3.csv"],
               ["figures/residualkv/fig3.pdf", "results/residualkv/fig3_summary.csv", "results/residualkv/fig3.csv"]]
        for n in FIGURES:
            out.append([f"figures/residualkv/fig{n}.pdf", f"results/residualkv/fig{n}.csv"]
                       + {"11": ["results/residualkv/fig11_throughput.csv"],
                          "13": ["results/residualkv/fig13_summary.csv"]}.get(n, []))
            if n in ("6", "8"):
                out.append([f"results/residualkv/fig{n}.csv"])
        return out

    def report_spec(self) -> str:
        """The JSON the ResidualKV writers read (:meth:`from_spec`)."""
        return json.dumps({"profile": self.profile, "residualkv": self.s, "zoo": self.zoo, "seed": self.seed,
                           "model_dir": self.model_dir}, sort_keys=True)

    def target_inputs(self, target: str) -> list[str]:
        """Predictions of every run ``target`` (a table key or ``fig5``) reads."""
        return [f"{self.run_dir(t, s)}/predictions.jsonl" for t, s in self.target_runs(target)]

    def table_i_models(self) -> list[str]:
        """Table I's rows: ``residualkv.model``, then every other model with a Table I entry (``models.<m>.codec``)."""
        return [self.model] + [m for m, spec in self.ws.models.items() if spec.get("codec") and m != self.model]

    def table_inputs(self, table: Table) -> list[str]:
        """Table I (:data:`MODEL_TABLES`): each row's config.json, the main codec (the table depends on the codec
        job) and the published file; the others: their runs' predictions."""
        if table.key not in MODEL_TABLES:
            return self.target_inputs(table.key)
        codec = f"{self.codecs.dir('main')}/codec/codec.json"
        return ([os.path.join(self.ws.model_dir(m), "config.json") for m in self.table_i_models()]
                + [codec, self.ws.published("residualkv")])

    def table_spec(self, table: Table) -> str:
        if table.key not in MODEL_TABLES:
            return self.report_spec()
        spec = json.loads(self.report_spec())
        spec["models"] = [{"name": m, "dir": self.ws.model_dir(m), "codec": self.ws.models[m].get("codec")}
                          for m in self.table_i_models()]
        spec["published"] = self.ws.published("residualkv")
        return json.dumps(spec, sort_keys=True)


#: ResidualKV tables built from checkpoints and codecs, not from runs (no config list of rows).
MODEL_TABLES = ("tableI",)
#: ResidualKV figures with a producing rule besides Fig. 3 (its Fig. 9 is not built). CONDUIT has no Figure 5-13, so
#: their short names ``figures/fig<N>.pdf`` are unambiguous (targets.smk); Fig. 13 needs ``residualkv.fig13``.
FIGURES = ("5", "6", "8", "10", "11", "12", "13")


def check_table_iv(plan: RKVPlan) -> None:
    """Every Table IV row runs under ``shared_context`` (the context its own chunk, compressed before the queries).

    Raises:
        ValueError: a row whose spec sets another protocol, naming it.
    """
    for row in plan.rows("tableIV"):
        protocol = press_spec(row.spec).params.get("protocol")
        if protocol != "shared_context":
            raise ValueError(f"residualkv.tableIV, row {row.label!r}: SCBench's rows run under protocol=shared_context "
                             f"(the context compressed before its queries), got {protocol!r}; spell "
                             "protocol=shared_context in its method")
