"""Helpers shared by the workflow files: the config's workspace and plans, and the input functions over them.

The config has been validated against workflow/schemas/config.schema.yaml (defaults filled in) before this file is
included. Paths of models and splits come from one kvbench.plan.Workspace; what each config section asks to build
comes from its plan (kvbench.plan: one protocol, built and checked here while the DAG is built). One `eval` rule
serves the runs of every plan and one `table` rule the tables of every plan, by looping over the plans; no input
function below names a table or a plan type.
"""
import json
import os
import re
import shlex
import sys

from kvbench.plan import PLAN_TYPES, Workspace, build_plans
from kvbench.plan.codecs import DEFAULT_VARIANT, FIGURE_VARIANTS
from kvbench.plan.residualkv import FIGURES as RKV_FIGURES, RKVPlan
from kvbench.report.published import load_published
from kvbench.report.tables import TABLES

WS = Workspace(config, workflow.basedir)
PROFILE = WS.profile
SEED = WS.seed
MODELS = WS.models
DATASETS = WS.datasets
ZOO_MODELS = WS.zoo_models
# the zoo models the default target trains and the zoo report shows (an `on_demand` one is trained for its tables)
REPORT_ZOO_MODELS = [m for m in ZOO_MODELS if not MODELS[m]["zoo"].get("on_demand")]
SMOKE_DATASETS = [d for d, spec in DATASETS.items() if "smoke" in spec]
SCBENCH_DATASETS = [d for d, spec in DATASETS.items() if "scbench" in spec]   # SCBench's own files (scbench.smk)
TOKENIZER_HASH, ZOO_HASHES, DATA_HASHES = WS.tokenizer_hash, WS.zoo_hashes, WS.data_hashes
TOKENIZER_DIR = f"zoo/{PROFILE}/tokenizer-{TOKENIZER_HASH}"
model_seed, local_path, is_zoo, model_dir = WS.model_seed, WS.local_path, WS.is_zoo, WS.model_dir
split_file, scbench_split = WS.split_file, WS.scbench_split


def alternation(names):
    """Regex matching exactly one of ``names`` (a never-matching regex when empty)."""
    names = sorted(names, key=len, reverse=True)
    return "|".join(re.escape(n) for n in names) or "(?!)"


def check_recipe(kind, name, recipe):
    """Params function guard: a path's recipe hash must be the config's (an older one has no rule)."""
    expected = {"model": ZOO_HASHES, "data": DATA_HASHES}[kind].get(name) if kind != "tokenizer" else TOKENIZER_HASH
    if recipe != expected:
        raise ValueError(f"{kind} {name!r} with recipe hash {recipe!r}: this config builds recipe {expected!r}; "
                         "the older directory is kept but is not rebuilt")
    return recipe


def train_dir(model):
    """Resumable training work directory of a zoo model (curves, summary, timing, state/)."""
    return f"zoo/{PROFILE}/.train/{model}-{ZOO_HASHES[model]}"


def warm_start_input(model):
    """A seed replica that starts from its entry's warm-up state (kvbench.train.recipes.SHARED_WARMUP): the entry's
    training summary, written after the warm-up state it kept; [] for every other model."""
    entry = WS.warm_start_entry(model)
    return [] if entry is None else [f"{train_dir(entry)}/summary.json"]


def warm_start_args(model):
    """` --warm-start <entry workdir>/warmup` (quoted) for such a seed replica, else ""."""
    entry = WS.warm_start_entry(model)
    if entry is None:
        return ""
    warmup = shlex.quote(os.path.join(train_dir(entry), "warmup"))
    return f" --warm-start {warmup}"


def train_overrides(model):
    """JSON of `training.overrides` with the model's own `zoo.overrides` merged over it."""
    return json.dumps(WS.train_overrides(model), sort_keys=True)


def model_feeds(model):
    """The targets a zoo model of this kind feeds, named when its skill floor fails (kvbench.train.floors).

    From the model's own entry only (its kind, `zoo.on_demand`): a param that followed the conduit/residualkv sections
    would rerun (and first delete) a finished model whenever those sections change.
    """
    if MODELS[model]["zoo"].get("on_demand"):   # not in the zoo report; Table V's chain model is the configured one
        return ("the targets that name it (ResidualKV Table V when it is residualkv.long_generation.model)"
                if MODELS[model]["kind"] == "lm" else "the targets that name it")
    kind = {"lm": "ResidualKV Tables III, VI-VIII and Figs. 5, 10-12 (when it is residualkv.model)",
            "vlm": "CONDUIT Tables 1, 2, 4, 5, the staleness gap and Fig. 3 (when it is in conduit.models)"}
    return f"results/{PROFILE}/zoo.csv and {kind[MODELS[model]['kind']]}"




# --- Plans, runs and tables (kvbench.plan) ------------------------------------------------------------
# PLANS: the config's plans, each checked while the DAG is built. RUNS: every plan's runs (the `eval` rule); where two
# plans name one run, the later plan serves it. TABLE_PLANS: the tables the config builds in its aggregates.

PLANS = build_plans(WS)
MATRIX = PLANS["eval"]
RUNS = {(run.model, run.dataset, run.name): (plan, run) for plan in PLANS.values() for run in plan.runs()}
RUN_NAMES = sorted({name for _, _, name in RUNS})
TABLE_PLANS = {t.name: PLANS[t.plan_name] for t in TABLES.values()
               if t.plan_name in PLANS and PLANS[t.plan_name].builds(t)}


def run_dir(model, task, method):
    """Directory of an eval-matrix run (group ``eval``)."""
    return MATRIX.run(model, task, method).path(PROFILE)


def matrix_cells(methods=None):
    """(model, task, method) of every run of the eval matrix."""
    return MATRIX.cells(methods)


def matrix_metrics(methods=None, models=None):
    return [f"{run_dir(m, t, k)}/metrics.json" for m, t, k in matrix_cells(methods) if models is None or m in models]


def zoo_report_targets():
    return [f"results/{PROFILE}/zoo.csv", f"figures/{PROFILE}/zoo_training.pdf"]


def default_targets():
    """Inputs of the default target: the zoo report when the config has zoo models (not `on_demand` ones), plus every
    checkpoint model's runs."""
    targets = zoo_report_targets() if REPORT_ZOO_MODELS else []
    checkpoint_models = [m for m in MODELS if not is_zoo(m)]
    return targets + matrix_metrics(models=checkpoint_models)


def eval_inputs(wc):
    """Inputs of one eval run: the model's config.json and the evaluated split."""
    return {
        "model": os.path.join(model_dir(wc.model), "config.json"),
        "split": split_file(wc.task),
    }


def run_of(wc):
    """``(plan, Run)`` of an `eval` job (model, task, run wildcards)."""
    return RUNS[(wc.model, wc.task, wc.run)]


def run_threads(wc):
    plan, run = run_of(wc)
    return plan.threads(run)


def limit_args(n):
    """`--limit N` arguments for a record limit ``n`` (None: every record, no argument), each quoted in the command
    (`{params.limit:q}`)."""
    return [] if n is None else ["--limit", str(n)]


def run_limit(wc):
    """`--limit` arguments of one run (its plan's limit)."""
    plan, run = run_of(wc)
    return limit_args(plan.limit(run))


def run_runtime(wc):
    """Scheduler minutes (the run's plan: on the zoo an hour)."""
    plan, run = run_of(wc)
    return plan.runtime(run, is_zoo(wc.model))


def run_inputs(wc):
    """Inputs of one run: the model's config.json, the evaluated split, and what its plan says it reads."""
    plan, run = run_of(wc)
    return {**eval_inputs(wc), **plan.resources(run)[0]}


def run_method_params(wc):
    """`--method-params` JSON of one run (its plan's)."""
    plan, run = run_of(wc)
    return json.dumps(plan.resources(run)[1])


def table_of(name):
    """The :class:`~kvbench.plan.base.Table` of a target name, e.g. `conduit/table1`."""
    return TABLES[name]


def configured_tables():
    """Names of the tables this config builds in its aggregates (registry order)."""
    return [name for name in TABLES if name in TABLE_PLANS]


def _table_plan(table):
    """The plan of ``table``; raises (at DAG time) naming what the config lacks when it has none."""
    plan = PLANS.get(table.plan_name)
    if plan is None:
        raise ValueError(PLAN_TYPES[table.plan_name].absent(table, config))
    return plan


def table_inputs(wc):
    """Input function of the `table` rule: what table `wc.table` reads (its plan's answer)."""
    table = table_of(wc.table)
    return _table_plan(table).table_inputs(table)


def table_spec(wc):
    """The JSON `kvbench report <table>` reads (its plan's answer)."""
    table = table_of(wc.table)
    return _table_plan(table).table_spec(table)


def plan_of(name, targets):
    """The config's plan ``name`` for a rule of its ``targets``; raises (at DAG time) naming the missing section."""
    if name not in PLANS:
        raise ValueError(f"this config has no `{name}:` section, so it has no {targets} (config/config.yaml shows one)")
    return PLANS[name]


def model_resource(key, zoo_default, checkpoint_default):
    """Resource function: the model entry's `key` (mem_mb, gpus), else the zoo or checkpoint default."""
    return lambda wc: MODELS[wc.model].get(key, zoo_default if is_zoo(wc.model) else checkpoint_default)


# --- CONDUIT (conduit.smk, conduit_diag.smk) ----------------------------------------------------------
CONDUIT = PLANS.get("conduit")


def conduit_plan():
    """The config's ConduitPlan; raises (at DAG time) when the config has no `conduit:` section."""
    return plan_of("conduit", "CONDUIT accuracy targets")


def conduit_cache_dir(wc):
    """Image-cache root of one model x dataset (the conduit_cache rule's index.json lives there)."""
    return conduit_plan().cache_dir(wc.model, wc.task)


def conduit_limit(model):
    """`--limit` arguments of a backbone's image-cache builds: the CONDUIT plan's records per split for it
    (`conduit.n_test`, or `conduit.replica_n_test` for a seed replica)."""
    return limit_args(conduit_plan().n_test_of(model))


def aggregate_targets(name):
    """Every target of aggregate ``name`` (``conduit``) this config can build: the configured tables and the report
    figures of each plan whose :attr:`~kvbench.plan.base.Plan.aggregate` it is. A table whose column group is empty
    (e.g. no `conduit.single_image` for Table 2) is left out; asked for by name, it fails naming the key."""
    tables = [TABLES[t].path for t in configured_tables() if TABLE_PLANS[t].aggregate == name]
    figures = [f for p in PLANS.values() if p.aggregate == name for item in p.report_figures() for f in item
               if f.endswith(".pdf")]
    return tables + figures


def diag_capture_args():
    """`kvbench conduit-diagnose` flags from `conduit_diagnostics` (n_records, m, seed), as one shell string."""
    return PLANS["conduit_diagnostics"].capture_args()


# --- ResidualKV (residualkv.smk, rkv_multimodal.smk, conduit_rkv_cache.smk) -------------------------------------
RKV = PLANS.get("residualkv")
MM = PLANS.get("residualkv_mm")
CRC = PLANS.get("conduit_rkv_cache")
# codec directory name "<variant>-<recipe hash>" (imported: "main-import-<hash>") -> (its plan, variant), over the
# ResidualKV plans (the main one and Table V's backbone)
RKV_PLANS = [p for p in PLANS.values() if isinstance(p, RKVPlan)]
RKV_CODECS = {name: (p, v) for p in RKV_PLANS for name, v in p.codecs.names("trained").items()}
RKV_IMPORTS = {name: (p, v) for p in RKV_PLANS for name, v in p.codecs.names("imported").items()}


def codec_plan(wc):
    """The :class:`~kvbench.plan.codecs.CodecPlan` that trains codec directory `wc.codec`."""
    return RKV_CODECS[wc.codec][0].codecs


def codec_variant(wc):
    return RKV_CODECS[wc.codec][1]


def import_plan(wc):
    """The :class:`~kvbench.plan.codecs.CodecPlan` that imports codec directory `wc.codec` (`codec.import`)."""
    return RKV_IMPORTS[wc.codec][0].codecs


def import_variant(wc):
    return RKV_IMPORTS[wc.codec][1]


def rkv_plan():
    """The config's main RKVPlan; raises (at DAG time) when the config has no `residualkv:` section."""
    return plan_of("residualkv", "ResidualKV targets")


def rkv_run_inputs(target):
    """Input function: predictions of every run ResidualKV ``target`` (a figure of the main plan) reads."""
    return lambda wc: rkv_plan().target_inputs(target)


def rkv_report_spec():
    """The JSON the ResidualKV figure writers read (:meth:`kvbench.plan.residualkv.RKVPlan.from_spec`)."""
    return rkv_plan().report_spec()


def mm_codec_models():
    """Backbones that rkv_mm_codec trains a VLM codec for, over every plan (:meth:`Plan.vlm_codec_models`)."""
    return list(dict.fromkeys(m for p in PLANS.values() for m in p.vlm_codec_models()))


def mm_check_codec(wc):
    """Params guard: the codec directory's recipe hash must be the config's (an older one has no rule)."""
    want = os.path.basename(MM.codec_dir(wc.model))
    if wc.mmcodec != want:
        raise ValueError(f"codec {wc.mmcodec!r} of {wc.model!r}: this config trains Table II's codec as {want!r}; "
                         "the older directory is kept but is not rebuilt")
    return want


# Short target names (targets.smk).
# ResidualKV figures with a producing rule (its Fig. 9 is not built; `figures/fig9.pdf` then has no rule). CONDUIT has
# no Figure 13, so `figures/fig13.pdf` is ResidualKV's (rkv_fig13.smk; it needs `residualkv.fig13`).
RESIDUALKV_ONLY_FIGURES = list(RKV_FIGURES)
AMBIGUOUS_FIGURES = ["3", "4"]


def residualkv_table_numerals():
    """Roman numerals of the paper's ResidualKV tables (`results/table<ROMAN>.csv` short names); the tables beyond the
    paper (`table_full_layer_form`, ...) have only their canonical names."""
    return [m.group(1) for t in TABLES.values() if t.paper == "ResidualKV" and (m := re.fullmatch(r"table([IVX]+)", t.key))]


CONDUIT_FIGURES = ["3", "4"]
RESIDUALKV_AMBIGUOUS_FIGURES = ["3"]  # built, but only under its canonical name (rkv_observations.smk)


def ambiguous_figure(wc):
    """Input function of figures/fig3.pdf and fig4.pdf: always raises, naming the canonical targets that exist."""
    if wc.n in CONDUIT_FIGURES and wc.n in RESIDUALKV_AMBIGUOUS_FIGURES:
        built = (f"this pipeline builds both, CONDUIT's as figures/conduit/fig{wc.n}.pdf and ResidualKV's as "
                 f"figures/residualkv/fig{wc.n}.pdf: ask for one of them")
    elif wc.n in CONDUIT_FIGURES:
        built = f"this pipeline builds CONDUIT's as figures/conduit/fig{wc.n}.pdf; ResidualKV's Figure {wc.n} is not a target"
    else:
        built = f"neither CONDUIT's nor ResidualKV's Figure {wc.n} is a target of this pipeline"
    raise ValueError(f"figures/fig{wc.n}.pdf is ambiguous: both papers have a Figure {wc.n}; {built}.")


def rkv_bench_gpus(fig):
    """Resource function: GPUs a profiling job asks the scheduler for (:meth:`RKVPlan.bench_gpus`)."""
    return lambda wc: rkv_plan().bench_gpus(fig)


def rkv_bench_args(fig):
    """``kvbench bench`` flags from the config's ``residualkv.<fig>`` mapping (checked by RKVPlan.bench_args)."""
    return rkv_plan().bench_args(fig)


# --- Ours beside the published figures (compare.smk) -----------------------------------------

def _published_tables():
    """Table targets (`conduit/table1`, ...) and the plans' compare figures (`conduit/fig3`) whose paper's published
    file has entries for them."""
    names = []
    for paper in ("conduit", "residualkv"):
        pub = load_published(WS.published(paper))
        keys = {e.table for e in pub.entries}
        names += [t for t in [*TABLES, *COMPARE_FIGURES] if t.startswith(f"{paper}/") and t.split("/", 1)[1] in keys]
    return names


COMPARE_FIGURES = sorted({f for cls in PLAN_TYPES.values() for f in cls.compare_figures})
COMPARE_TABLES = _published_tables()


def profile_compare_tables():
    """The compare tables this config builds: its tables with published figures, and its plans' compare figures."""
    own = set(configured_tables()) | {f for plan in PLANS.values() for f in plan.compare_figures}
    return [t for t in COMPARE_TABLES if t in own]


def published_file(wc):
    """config/published/<paper>.yaml of a compare target (anchored at the Snakefile, so `--directory` works)."""
    return WS.published(wc.table.split("/")[0])


def compare_page_inputs(wc):
    """Compare CSVs of `results/compare.md` (config `compare.tables`)."""
    tables = config["compare"]["tables"]
    if tables == "built":
        return [f"results/{t}.compare.csv" for t in profile_compare_tables() if os.path.exists(f"results/{t}.csv")]
    bad = [t for t in tables if t not in profile_compare_tables()]
    if bad:
        raise ValueError(f"config compare.tables: {bad} are not tables of this config with published figures; "
                         f"expected some of {profile_compare_tables()}")
    return [f"results/{t}.compare.csv" for t in tables]


# --- The report (`snakemake --report report.html`) ----------------------------------------------

def report_only():
    """Whether this invocation only writes the report (`--report [FILE]` without `--report-after-run`).

    Snakemake refuses a report whose DAG holds a report-marked file that does not exist, and the DAG
    of `--report` is that of the targets (`all` by default). So `all` then asks for what has been
    built (:func:`built_report_files`) instead of what a run builds. Snakemake does not tell a
    Snakefile its mode, so the command line is read (the Python API is not seen here).
    """
    args = sys.argv[1:]
    return "--report-after-run" not in args and any(a == "--report" or a.startswith("--report=") for a in args)


def report_items():
    """Every table and figure this config can build, each with the report-marked files its DAG also holds.

    A figure and the CSV of its numbers come from one job; Figs. 6 and 8 read their measurement CSV,
    Fig. 11 its throughput CSV; the kvpress parity table (parity.smk) in every config. Short-name copies
    (targets.smk) are not listed: they repeat these.
    """
    items = [[f] for f in zoo_report_targets()] if REPORT_ZOO_MODELS else []
    items += [[table_of(t).path] for t in configured_tables()]
    items += [item for plan in PLANS.values() for item in plan.report_figures()]
    items.append(["results/parity/kvpress.csv"])  # any config: the parity target needs no config section
    # ours beside the published figures (compare.smk): each table's compare CSV, and the page over them
    items += [[f"results/{t}.compare.csv"] for t in profile_compare_tables()] + [["results/compare.md"]]
    return items


def built_report_files():
    """The files of every :func:`report_items` entry whose files all exist (input of `all` under `--report`)."""
    files = []
    for item in report_items():
        if all(os.path.exists(f) for f in item):
            files += [f for f in item if f not in files]
    return files
