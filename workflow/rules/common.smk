"""Helpers shared by the workflow files: config lookups, paths, target lists.

The config has been validated against workflow/schemas/config.schema.yaml
(defaults filled in) before this file is included. Models are either zoo
models (`zoo:`, trained by models.smk) or local checkpoints (`checkpoint:`);
datasets are either smoke generators (`smoke:`, materialised by data.smk) or
JSONL files on disk (`jsonl:`). Relative local paths are under `paths.root`.
"""
import json
import os
import re
import shlex
import sys

PROFILE = config["profile"]
SEED = config["seed"]
ROOT = os.path.expanduser(config["paths"]["root"])
MODELS = config["models"]
DATASETS = config["datasets"]
ZOO_MODELS = [m for m, spec in MODELS.items() if "zoo" in spec]
# the zoo models the default target trains and the zoo report shows (an `on_demand` one is trained for its tables)
REPORT_ZOO_MODELS = [m for m in ZOO_MODELS if not MODELS[m]["zoo"].get("on_demand")]
SMOKE_DATASETS = [d for d, spec in DATASETS.items() if "smoke" in spec]
SCBENCH_DATASETS = [d for d, spec in DATASETS.items() if "scbench" in spec]   # SCBench's own files (scbench.smk)


def _check_matrix():
    """Fail early, naming the entry, if the eval matrix refers to an unknown model or dataset."""
    for model, tasks in config["eval"]["matrix"].items():
        if model not in MODELS:
            raise ValueError(f"config eval.matrix: model {model!r} is not defined under `models`")
        if MODELS[model].get("zoo", {}).get("on_demand"):   # the matrix is the default target's zoo report
            raise ValueError(f"config eval.matrix: model {model!r} is `zoo.on_demand` (trained only by the targets that "
                             "read it, not by the default target); remove it from the matrix or drop on_demand")
        for task in tasks:
            if task not in DATASETS:
                raise ValueError(f"config eval.matrix.{model}: dataset {task!r} is not defined under `datasets`")


_check_matrix()


def _check_names():
    """Fail before any job runs if a method, smoke generator or training override is unknown.

    The package's own registries are the single source of truth, so the dry run
    catches what would otherwise fail only after the models had trained.
    """
    from kvbench.data.smoke import TASKS
    from kvbench.eval.registry import check_method_spec
    from kvbench.train.recipes import RECIPES, apply_overrides

    from kvbench.eval.registry import parse_method_spec

    # refresh policies serve VLM records with cached images, presses serve text records: a method of the eval
    # matrix that cannot serve one of its datasets would fail only at run time, after the models had trained
    serves = {"refresh": "vlm"}  # presses serve both (VLM records: kvbench.compress.generate_vlm)
    for method in config["eval"]["methods"]:
        try:
            check_method_spec(method)  # a registry name (full), a refresh spec (reuse) or a press
        except ValueError as e:
            raise ValueError(f"config eval.methods: unknown method {method!r} or bad method spec: {e}") from e
        wanted = serves.get(parse_method_spec(method).family)
        for tasks in config["eval"]["matrix"].values():
            for task in tasks:
                if wanted and DATASETS[task]["kind"] != wanted:
                    raise ValueError(f"config eval.methods: {method!r} serves {wanted} datasets only, but the eval "
                                     f"matrix has {task!r} ({DATASETS[task]['kind']}); list it in the conduit or "
                                     f"residualkv section instead")
    for name in SMOKE_DATASETS:
        if name not in TASKS:
            raise ValueError(f"config datasets.{name}: no smoke generator named {name!r}; expected one of {sorted(TASKS)}")
    from kvbench.models.tiny import seed_replica, zoo_spec

    for name in ZOO_MODELS:
        try:
            zoo_spec(name)
        except KeyError as e:
            raise ValueError(f"config models.{name}: {e.args[0]}") from None
        replica = seed_replica(name)
        if replica is not None and model_seed(name) != replica[1]:
            raise ValueError(f"config models.{name}: a seed replica of {replica[0]!r} named -s{replica[1]} must set "
                             f"zoo.seed: {replica[1]} (it trains with seed {model_seed(name)})")
        for task in MODELS[name]["zoo"]["floors"]:
            if task not in TASKS:
                raise ValueError(f"config models.{name}.zoo.floors: {task!r} is not a smoke task; "
                                 f"expected one of {sorted(TASKS)}")
            wanted = {"lm": "text", "vlm": "vlm"}[MODELS[name]["kind"]]
            if TASKS[task].kind != wanted:
                raise ValueError(f"config models.{name}.zoo.floors: {task!r} is a {TASKS[task].kind} task, but "
                                 f"{name!r} is a {MODELS[name]['kind']} model; a floor needs a {wanted} task")
        overrides = {**config["training"]["overrides"], **MODELS[name]["zoo"]["overrides"]}
        try:
            apply_overrides(RECIPES[MODELS[name]["kind"]](), overrides)
        except ValueError as e:
            raise ValueError(f"config training overrides of model {name!r}: {e}") from e


def model_seed(model):
    """Training seed of a zoo model: its `zoo.seed` (seed replicas), else the config's `seed`."""
    seed = MODELS[model]["zoo"].get("seed")
    return SEED if seed is None else seed


_check_names()


def alternation(names):
    """Regex matching exactly one of ``names`` (a never-matching regex when empty)."""
    names = sorted(names, key=len, reverse=True)
    return "|".join(re.escape(n) for n in names) or "(?!)"


def local_path(path):
    """A config path: absolute as given, else under `paths.root` (`~` expanded)."""
    path = os.path.expanduser(path)
    return path if os.path.isabs(path) else os.path.join(ROOT, path)


def is_zoo(model):
    return "zoo" in MODELS[model]


# --- Trained and generated artefacts, keyed by profile and recipe hash -------------------------
# zoo/<profile>/<model>-<hash>/, data/<profile>/<task>-<hash>/: the hash covers everything that
# determines the bytes (kvbench.utils.recipe), so a config change writes a new directory instead
# of deleting a finished one, two configs coexist, and switching back costs nothing.

def _recipes():
    from kvbench.train.recipes import zoo_recipe
    from kvbench.utils.recipe import recipe_hash

    tok = recipe_hash({"vocab_size": config["zoo"]["tokenizer"]["vocab_size"]})
    models = {}
    for name in ZOO_MODELS:
        zoo = MODELS[name]["zoo"]
        overrides = {**config["training"]["overrides"], **zoo["overrides"]}
        # The floors are in the recipe: a changed floor is a new model directory, never a rerun (and
        # first a deletion) of a finished one.
        recipe = zoo_recipe(name, MODELS[name]["kind"], overrides, seed=model_seed(name), threads=zoo["threads"],
                            tokenizer=tok)
        models[name] = recipe_hash({**recipe, "floors": zoo["floors"], "val_n": zoo["val_n"]})
    data = {task: recipe_hash({"task": task, "seed": SEED, "tokenizer": tok, **DATASETS[task]["smoke"]})
            for task in SMOKE_DATASETS}
    return tok, models, data


TOKENIZER_HASH, ZOO_HASHES, DATA_HASHES = _recipes()
TOKENIZER_DIR = f"zoo/{PROFILE}/tokenizer-{TOKENIZER_HASH}"


def check_recipe(kind, name, recipe):
    """Params function guard: a path's recipe hash must be the config's (an older one has no rule)."""
    expected = {"model": ZOO_HASHES, "data": DATA_HASHES}[kind].get(name) if kind != "tokenizer" else TOKENIZER_HASH
    if recipe != expected:
        raise ValueError(f"{kind} {name!r} with recipe hash {recipe!r}: this config builds recipe {expected!r}; "
                         "the older directory is kept but is not rebuilt")
    return recipe


def model_dir(model):
    """Checkpoint directory of a model: zoo/<profile>/<model>-<hash> for zoo models, else the local checkpoint."""
    return f"zoo/{PROFILE}/{model}-{ZOO_HASHES[model]}" if is_zoo(model) else local_path(MODELS[model]["checkpoint"])


def split_file(task):
    """Evaluated JSONL split of a dataset (an SCBench file: its conversion, scbench.smk)."""
    if "smoke" in DATASETS[task]:
        return f"data/{PROFILE}/{task}-{DATA_HASHES[task]}/test.jsonl"
    if "scbench" in DATASETS[task]:
        return scbench_split(task)
    return local_path(DATASETS[task]["jsonl"])


def scbench_split(task):
    """The conversion of SCBench's own file of dataset ``task`` (`scbench:`; rule scbench_convert)."""
    return f"data/{PROFILE}/{task}-scbench/test.jsonl"


def train_dir(model):
    """Resumable training work directory of a zoo model (curves, summary, timing, state/)."""
    return f"zoo/{PROFILE}/.train/{model}-{ZOO_HASHES[model]}"


def train_overrides(model):
    """JSON of `training.overrides` with the model's own `zoo.overrides` merged over it."""
    return json.dumps({**config["training"]["overrides"], **MODELS[model]["zoo"]["overrides"]}, sort_keys=True)


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


def run_dir(model, task, method):
    """Directory of an eval-matrix run (:class:`kvbench.plan.base.Run`, group ``eval``)."""
    from kvbench.eval.registry import parse_method_spec
    from kvbench.plan.base import Run

    spec = parse_method_spec(method)
    return Run(model, task, spec.canonical, spec.slug).path(PROFILE)


def matrix_cells(methods=None):
    """(model, task, method) of every run of the eval matrix."""
    methods = config["eval"]["methods"] if methods is None else methods
    return [
        (model, task, method)
        for model, tasks in config["eval"]["matrix"].items()
        for task in tasks
        for method in methods
    ]


def matrix_metrics(methods=None, models=None):
    return [
        f"{run_dir(m, t, k)}/metrics.json"
        for m, t, k in matrix_cells(methods)
        if models is None or m in models
    ]


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


# Short target names (targets.smk).
# ResidualKV figures with a producing rule (its Fig. 9 is not built; `figures/fig9.pdf` then has no rule). CONDUIT has
# no Figure 13, so `figures/fig13.pdf` is ResidualKV's (rkv_fig13.smk; it needs `residualkv.fig13`).
RESIDUALKV_ONLY_FIGURES = ["5", "6", "8", "10", "11", "12", "13"]
AMBIGUOUS_FIGURES = ["3", "4"]


def residualkv_table_numerals():
    """Roman numerals of the ResidualKV tables (`results/table<ROMAN>.csv` short names)."""
    from kvbench.report.tables import TABLES

    return [t.key.removeprefix("table") for t in TABLES.values() if t.paper == "ResidualKV"]
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


# --- CONDUIT accuracy targets (conduit.smk) ---------------------------------------------------

def _conduit_plan():
    """The ConduitPlan of the config (None without a `conduit:` section); fails early on bad names or specs."""
    from kvbench.report.conduit import ConduitPlan
    from kvbench.plan.residualkv import known_model_shape

    if "conduit" not in config:
        return None
    section = config["conduit"]
    for model in section["models"]:
        if model not in MODELS:
            raise ValueError(f"config conduit.models: {model!r} is not defined under `models`")
        if MODELS[model]["kind"] != "vlm":
            raise ValueError(f"config conduit.models: {model!r} is a {MODELS[model]['kind']!r} model; refresh runs need a vlm")
    for group in ("multi_image", "single_image"):
        for name, col in section[group].items():
            if col["dataset"] not in DATASETS:
                raise ValueError(f"config conduit.{group}.{name}: dataset {col['dataset']!r} is not defined under `datasets`")
            if "k" in col and col["k"][0] > col["k"][1]:
                raise ValueError(f"config conduit.{group}.{name}: k range {col['k']} is empty (lo > hi)")
    try:
        plan = ConduitPlan(section, PROFILE, ZOO_MODELS)
        depth = {}
        for model in section["models"]:
            try:
                shape = known_model_shape(model, MODELS[model], None if is_zoo(model) else model_dir(model))
            except ValueError:  # a config.json without the head counts: the depth is checked when the run starts
                shape = None
            if shape is not None:
                depth[model] = shape[0]
        plan.check_layers(depth)
        return plan
    except ValueError as e:
        raise ValueError(f"config conduit: {e}") from e


CONDUIT = _conduit_plan()


def conduit_plan():
    """The config's ConduitPlan; raises (at DAG time) when the config has no `conduit:` section."""
    if CONDUIT is None:
        raise ValueError("this config has no `conduit:` section, so it has no CONDUIT accuracy targets "
                         "(config/config.yaml shows one)")
    return CONDUIT


def conduit_cache_dir(wc):
    """Image-cache root of one model x dataset (the conduit_cache rule's index.json lives there)."""
    return f"cache/conduit/{wc.profile}/{wc.model}/{wc.task}"


def conduit_limit():
    """`--limit N` arguments for `conduit.n_test` (none: every record), each quoted in the command (`{params.limit:q}`)."""
    n = config.get("conduit", {}).get("n_test")
    return [] if n is None else ["--limit", str(n)]


def conduit_run_inputs(target):
    """Input function: predictions of every run ``target`` (a ConduitPlan target: a table key or ``fig3``) reads,
    plus the splits (K lookup).

    Raises (at DAG time) when the target's column group is empty: a schema-valid config without
    `conduit.single_image` ended in a ZeroDivisionError inside the Table 2 job.
    """
    def inputs(wc):
        plan = conduit_plan()
        group = "multi_image" if target in ("fig3", "fig4") else table_of(f"conduit/{target}").columns
        if group != "all" and not config["conduit"].get(group):
            raise ValueError(f"config conduit.{group} is empty, so CONDUIT {target} has no column to average; "
                             f"name at least one dataset there (config/config.yaml shows how)")
        runs = [f"{plan.run_dir(m, d, s)}/predictions.jsonl" for m, d, s in plan.runs(target)]
        return runs + sorted({split_file(d) for _, d, _ in plan.runs(target)})
    return inputs


def conduit_report_spec(target):
    """The JSON the CONDUIT writers read: profile, the conduit section, split paths, zoo model names."""
    plan = conduit_plan()
    splits = {d: split_file(d) for _, d, _ in plan.runs(target)}
    return json.dumps({"profile": PROFILE, "conduit": config["conduit"], "splits": splits,
                       "zoo_models": ZOO_MODELS}, sort_keys=True)


def conduit_targets():
    """Every CONDUIT accuracy target this config can build, for the `conduit` aggregate. A table whose column group
    is empty (e.g. no `conduit.single_image` for Table 2) is left out; asked for by name, it fails naming the key."""
    tables = [t for t in TABLES.values() if t.section == "conduit"
              and (t.columns == "all" or config.get("conduit", {}).get(t.columns))]
    diagnostics = [t.path for t in TABLES.values() if t.section == "conduit_diagnostics" and "conduit_diagnostics" in config]
    return [t.path for t in tables] + diagnostics + ["figures/conduit/fig3.pdf", "figures/conduit/fig4.pdf"]


def model_resource(key, zoo_default, checkpoint_default):
    """Resource function: the model entry's `key` (mem_mb, gpus), else the zoo or checkpoint default."""
    return lambda wc: MODELS[wc.model].get(key, zoo_default if is_zoo(wc.model) else checkpoint_default)


# --- ResidualKV targets (residualkv.smk) ------------------------------------------------------

def _rkv_section():
    """The config's `residualkv` section with `codec.import` (an authors' checkpoint, imported as the main codec)
    resolved like every local path (absolute, else under `paths.root`)."""
    section = dict(config["residualkv"])
    codec = dict(section["codec"])
    if "import" in codec:
        codec["import"] = local_path(str(codec["import"]))
    section["codec"] = codec
    return section


def _rkv_plan():
    from kvbench.plan.residualkv import RKVPlan, check_table_i, known_model_shape

    if "residualkv" not in config:
        return None
    section = _rkv_section()
    if section["model"] not in MODELS or MODELS[section["model"]]["kind"] != "lm":
        raise ValueError(f"config residualkv.model: {section['model']!r} must be an `lm` model defined under `models`")
    for task in section["tasks"]:
        if task not in DATASETS:
            raise ValueError(f"config residualkv.tasks: {task!r} is not defined under `datasets`")
    for target, tasks in (section.get("target_tasks") or {}).items():
        for task in tasks:
            if task not in DATASETS:
                raise ValueError(f"config residualkv.target_tasks.{target}: {task!r} is not defined under `datasets`")
    try:
        shape = known_model_shape(section["model"], MODELS[section["model"]],
                                  None if is_zoo(section["model"]) else model_dir(section["model"]))
        check_table_i(section["model"], MODELS[section["model"]], shape)
        return RKVPlan(section, PROFILE, shape, zoo=is_zoo(section["model"]), seed=SEED,
                       model_dir=model_dir(section["model"]))
    except ValueError as e:
        raise ValueError(f"config residualkv: {e}") from e


def _rkv_gen_plan():
    """Table V's plan (kvbench.report.rkv_generation): `residualkv.tableV` on `residualkv.long_generation`'s backbone
    and tasks, with that backbone's own codec; None without Table V rows."""
    from kvbench.report.rkv_generation import generation_plan
    from kvbench.plan.residualkv import known_model_shape

    if not config.get("residualkv", {}).get("tableV"):
        return None
    gen = config["residualkv"].get("long_generation") or {}
    model = gen.get("model")
    if model not in MODELS or MODELS[model]["kind"] != "lm":
        raise ValueError(f"config residualkv.long_generation.model: {model!r} must be an `lm` model defined under "
                         "`models` (Table V's backbone)")
    for task in gen.get("tasks", []):
        if task not in DATASETS:
            raise ValueError(f"config residualkv.long_generation.tasks: {task!r} is not defined under `datasets`")
        if DATASETS[task].get("kind") == "vlm":   # the backbone is an LM (checked above)
            raise ValueError(f"config residualkv.long_generation.tasks: {task!r} is a `vlm` dataset; Table V's LM "
                             f"backbone {model!r} needs `text` tasks")
    try:
        shape = known_model_shape(model, MODELS[model], None if is_zoo(model) else model_dir(model))
        return generation_plan(_rkv_section(), PROFILE, shape, zoo=is_zoo(model), seed=SEED,
                               model_dir=model_dir(model))
    except ValueError as e:
        raise ValueError(f"config residualkv.tableV: {e}") from e


RKV = _rkv_plan()
if RKV is not None and RKV.configured("tableIV"):
    from kvbench.report.rkv_scbench import check_rows as _check_table_iv_rows

    _check_table_iv_rows(RKV)  # while the DAG is built, not after every run of the table finished
RKV_GEN = _rkv_gen_plan()
RKV_GEN_CODECS = RKV_GEN.codecs.names("trained") if RKV_GEN else {}  # Table V backbone's codecs
# "<variant>-<recipe hash>" -> variant (codecs/ directory names), both plans'
RKV_CODECS = {**(RKV.codecs.names("trained") if RKV else {}), **RKV_GEN_CODECS}
# "main-import-<hash>" -> variant (rkv_codec_import), both plans'
RKV_GEN_IMPORTS = RKV_GEN.codecs.names("imported") if RKV_GEN else {}  # Table V backbone's own imported codec
RKV_IMPORTS = {**(RKV.codecs.names("imported") if RKV else {}), **RKV_GEN_IMPORTS}


def _mm_plan():
    """ResidualKV Table II's plan (:class:`kvbench.report.rkv_multimodal.MMPlan`), None without `residualkv.tableII`."""
    from kvbench.data.smoke import TASKS
    from kvbench.report.rkv_multimodal import MMPlan
    from kvbench.plan.residualkv import known_model_shape

    section = config.get("residualkv", {}).get("tableII")
    if not section:
        return None
    for m in section["models"]:
        if m not in MODELS or MODELS[m].get("kind") != "vlm":
            raise ValueError(f"config residualkv.tableII.models: {m!r} must be a `vlm` model defined under `models`")
    for t in section["tasks"]:
        # a dataset's kind: its `kind:` or, for a smoke dataset without one, its generator's
        if t not in DATASETS or (DATASETS[t].get("kind") or (TASKS[t].kind if t in TASKS else None)) != "vlm":
            raise ValueError(f"config residualkv.tableII.tasks: {t!r} must be a `vlm` dataset defined under `datasets`")
    plan = MMPlan(section, PROFILE, {m: is_zoo(m) for m in section["models"]})
    # a zoo VLM's depth is known now; a checkpoint's is checked when its job loads it (a dry run's root may be a stand-in)
    plan.check_layers({m: known_model_shape(m, MODELS[m])[0] for m in plan.models if is_zoo(m)})
    return plan


MM = _mm_plan()


def _crc_plan():
    """The compressed-image-cache plan (:class:`kvbench.report.conduit_rkv.CompressedCachePlan`; rules in
    conduit_rkv_cache.smk), None without `beyond.conduit_rkv_cache`. Its codec is rule rkv_mm_codec's for its model."""
    from kvbench.report.conduit_rkv import KEY, CompressedCachePlan
    from kvbench.plan.residualkv import known_model_shape

    section = (config.get("beyond") or {}).get(KEY)
    if not section:
        return None
    if CONDUIT is None:
        raise ValueError(f"config beyond.{KEY} reruns CONDUIT's Table 1 rows on compressed image caches, but the config "
                         "has no `conduit:` section")
    if not config.get("residualkv"):
        raise ValueError(f"config beyond.{KEY} stores the image caches with a VLM codec trained from "
                         "residualkv.tableII.codec, but the config has no `residualkv:` section")
    if MM is None or not MM.section.get("codec"):
        raise ValueError(f"config beyond.{KEY} stores the image caches with the backbone's VLM codec, trained by rule "
                         "rkv_mm_codec from residualkv.tableII.codec: configure that mapping (config/config.yaml shows one)")
    plan = CompressedCachePlan(section, CONDUIT)
    # a zoo model's depth is known now (a checkpoint's is checked by the cache job): fail before anything trains
    shape = known_model_shape(plan.model, MODELS[plan.model]) if is_zoo(plan.model) else None
    layers = plan.storage.get("full_layers", [])
    bad = [l for l in layers if shape and not 0 <= int(l) < shape[0]]
    if bad:
        raise ValueError(f"config beyond.{KEY}.storage.full_layers: {bad} outside {plan.model}'s {shape[0]} layers "
                         f"(0..{shape[0] - 1})")
    return plan


CRC = _crc_plan()


def mm_codec_models():
    """Backbones that rkv_mm_codec trains a VLM codec for (Table II's, and the compressed-image-cache table's)."""
    return list(dict.fromkeys((MM.models if MM else []) + ([CRC.model] if CRC else [])))


def mm_codec_files():
    """Training records of Table II's codecs: `residualkv.tableII.codec.data_files` (local JSONL, under `paths.root`),
    else the tasks' smoke train splits."""
    files = MM.section["codec"].get("data_files") or []
    if files:
        return [local_path(f) for f in files]
    not_smoke = [t for t in MM.tasks if "smoke" not in DATASETS[t]]
    if not_smoke:
        raise ValueError(f"config residualkv.tableII.codec: tasks {not_smoke} have no train split here; give the codec's "
                         "training records as codec.data_files (local JSONL of VLM records)")
    return [os.path.join(os.path.dirname(split_file(t)), "train.jsonl") for t in MM.tasks]


def mm_codec_dir(model):
    """`codecs/<profile>/<model>/mm-<recipe hash>`: Table II's codec of backbone `model`."""
    from kvbench.utils.recipe import recipe_hash

    return f"codecs/{PROFILE}/{model}/mm-{recipe_hash(MM.codec_recipe(model, model_dir(model), SEED, mm_codec_files()))}"


def mm_check_codec(wc):
    """Params guard: the codec directory's recipe hash must be the config's (an older one has no rule)."""
    want = os.path.basename(mm_codec_dir(wc.model))
    if wc.mmcodec != want:
        raise ValueError(f"codec {wc.mmcodec!r} of {wc.model!r}: this config trains Table II's codec as {want!r}; "
                         "the older directory is kept but is not rebuilt")
    return want


def mm_codec_placement():
    """`--device/--dtype/--checkpointing` flags of Table II's codec training (`tableII.codec.train`), when not defaults,
    each shell-quoted (the rule's `{params.args}`: config text never reaches the shell unquoted)."""
    t = MM.section["codec"]["train"]
    flags = []
    if t.get("device", "cpu") != "cpu":
        flags += ["--device", t["device"]]
    if t.get("dtype", "float32") != "float32":
        flags += ["--dtype", t["dtype"]]
    if t.get("checkpointing"):
        flags.append("--checkpointing")
    return " ".join(shlex.quote(f) for f in flags)


def mm_codec_gpus(wc):
    return 1 if str(MM.section["codec"]["train"].get("device", "cpu")).startswith("cuda") else 0


def mm_report_spec():
    """The JSON Table II's writer reads (:meth:`kvbench.report.rkv_multimodal.MMPlan.from_spec`)."""
    return json.dumps({"profile": PROFILE, "tableII": config["residualkv"]["tableII"], "zoo": MM.zoo,
                       "bootstrap": config["residualkv"]["bootstrap"]}, sort_keys=True)


def rkv_plan():
    if RKV is None:
        raise ValueError("this config has no `residualkv:` section, so it has no ResidualKV targets "
                         "(config/config.yaml shows one)")
    return RKV


def rkv_target_plan(target):
    """The plan of ResidualKV ``target``: Table V's (:data:`RKV_GEN`) for the long-generation targets, else the main one."""
    from kvbench.plan.residualkv import GENERATION_TARGETS

    if target in GENERATION_TARGETS and RKV_GEN is not None:
        return RKV_GEN
    return rkv_plan()


def rkv_import_plan(wc):
    """The plan whose codec `wc.codec` imports for backbone `wc.model`: Table V's when it is that plan's backbone and
    import (`residualkv.long_generation.codec.import`), else the main one."""
    if RKV_GEN is not None and wc.model == RKV_GEN.model and wc.codec in RKV_GEN_IMPORTS:
        return RKV_GEN
    return rkv_plan()


def rkv_codec_plan(codec):
    """The plan that owns codec directory name ``codec`` (`<variant>-<recipe hash>`)."""
    return RKV_GEN if codec in RKV_GEN_CODECS else rkv_plan()


def rkv_run_inputs(target):
    """Input function: predictions of every run ResidualKV ``target`` (a table key or ``fig5``) reads."""
    def inputs(wc):
        plan = rkv_target_plan(target)
        return [f"{plan.run_dir(t, s)}/predictions.jsonl" for t, s in plan.runs(target)]
    return inputs


def rkv_report_spec(target=None):
    """The JSON the ResidualKV writers read (:meth:`kvbench.plan.residualkv.RKVPlan.from_spec`); for Table V its
    plan's section and backbone, and the evaluated splits (records per problem)."""
    plan = rkv_target_plan(target)
    if plan is RKV_GEN:
        return json.dumps({"profile": PROFILE, "residualkv": plan.s, "zoo": is_zoo(plan.model), "seed": SEED,
                           "model_dir": model_dir(plan.model), "splits": {t: split_file(t) for t in plan.tasks}},
                          sort_keys=True)
    model = config["residualkv"]["model"]
    return json.dumps({"profile": PROFILE, "residualkv": _rkv_section(), "zoo": is_zoo(model), "seed": SEED,
                       "model_dir": model_dir(model)}, sort_keys=True)


def rkv_variant_summaries(variants):
    return lambda wc: [f"{rkv_plan().codecs.dir(v)}/summary.json" for v in variants]


def rkv_bench_gpus(fig):
    """GPUs a profiling job asks the scheduler for: 1 when the config's `residualkv.<fig>.device` is CUDA."""
    device = str(config.get("residualkv", {}).get(fig, {}).get("device", "auto"))
    return 1 if device.startswith("cuda") else 0


def rkv_bench_args(fig):
    """``kvbench bench`` flags from the config's ``residualkv.<fig>`` mapping (checked by RKVPlan.bench_args)."""
    return rkv_plan().bench_args(fig)


def rkv_figure_variants(fig):
    """The codec variants figure ``fig`` (fig10/fig11/fig12) reads (:data:`kvbench.plan.codecs.FIGURE_VARIANTS`)."""
    from kvbench.plan.codecs import FIGURE_VARIANTS

    return FIGURE_VARIANTS[fig]


def rkv_default_variant():
    """The variant Fig. 11's relative throughput divides by (:data:`kvbench.plan.codecs.DEFAULT_VARIANT`)."""
    from kvbench.plan.codecs import DEFAULT_VARIANT

    return DEFAULT_VARIANT


# --- Runs and tables: the plan layer (kvbench.plan.base) -------------------------------------
# One dict of runs (the `eval` rule, eval.smk) and one of tables (the `table` rule, tables.smk).

def _runs():
    """``{(model, task, run name): Run}`` of the eval matrix, the CONDUIT plan and the ResidualKV plan."""
    from kvbench.eval.registry import parse_method_spec
    from kvbench.report.conduit import targets as conduit_plan_targets
    from kvbench.plan.base import Run

    runs = {}
    for model, task, method in matrix_cells():
        spec = parse_method_spec(method)
        runs[(model, task, spec.slug)] = Run(model, task, spec.canonical, spec.slug)
    if CONDUIT:
        for target in conduit_plan_targets():
            for m, d, s in CONDUIT.runs(target):
                run = CONDUIT.run(m, d, s)
                runs[(m, d, run.name)] = run
    if MM:
        for run in MM.runs():
            runs[(run.model, run.dataset, run.name)] = run
    if CRC:
        for run in CRC.new_runs():
            runs[(run.model, run.dataset, run.name)] = run
    for plan in (RKV, RKV_GEN):
        for target in plan.targets() if plan else []:
            for task, s in plan.runs(target):
                run = plan.run(task, s)
                runs[(plan.model, task, run.name)] = run
    return runs


RUNS = _runs()
RUN_NAMES = sorted({name for _, _, name in RUNS})


def run_of(wc):
    """The :class:`~kvbench.plan.base.Run` of an `eval` job (model, task, run wildcards)."""
    return RUNS[(wc.model, wc.task, wc.run)]


def _rkv_run_plan(wc):
    """The ResidualKV plan a `residualkv` run belongs to: Table V's when it is one of its runs, else the main one."""
    if RKV_GEN is not None and (wc.model, wc.task, run_of(wc).spec) in {(RKV_GEN.model, t, s) for t, s in RKV_GEN.runs("tableV")}:
        return RKV_GEN
    return rkv_plan()


#: Per run group: the config section's threads and record limit (`eval`, `conduit`, `residualkv`; Table V's runs:
#: its plan's section, `residualkv.long_generation` over `residualkv`).
def run_threads(wc):
    if run_of(wc).group == "residualkv":
        return _rkv_run_plan(wc).s.get("threads", 1)
    section = {"eval": config["eval"], "conduit": config.get("conduit", {}), "conduit_rkv": config.get("conduit", {}),
               "residualkv_mm": config.get("residualkv", {}).get("tableII", {})}
    return section[run_of(wc).group].get("threads", 1)


def run_limit(wc):
    """`--limit N` arguments (none: every record), each quoted in the command (`{params.limit:q}`)."""
    group = run_of(wc).group
    if group == "residualkv":
        n = _rkv_run_plan(wc).s.get("n_test")
    elif group == "residualkv_mm":
        n = MM.n_test
    else:
        key = {"eval": ("eval", "limit"), "conduit": ("conduit", "n_test"), "conduit_rkv": ("conduit", "n_test")}
        section, name = key[group]
        n = config.get(section, {}).get(name)
    return [] if n is None else ["--limit", str(n)]


def run_runtime(wc):
    """Scheduler minutes: an hour on the zoo; a checkpoint's ResidualKV runs (long contexts) 12 h, others 6 h."""
    if is_zoo(wc.model):
        return 60
    return 720 if run_of(wc).group == "residualkv" else 360


def _run_resource(wc):
    """What a run reads besides model and split: CONDUIT refresh runs their image cache, ResidualKV runs their codec."""
    run = run_of(wc)
    if run.group == "conduit" and run.spec != "full":  # `full` is FullCache (model.generate): no image cache
        root = f"cache/conduit/{wc.profile}/{wc.model}/{wc.task}"
        return {"cache": f"{root}/index.json"}, {"cache_dir": root, "build_missing": False}
    if run.group == "conduit_rkv":  # Table 1's specs on the compressed image caches (conduit_rkv_cache.smk)
        root = crc_cache_dir(wc.task)
        return {"cache": f"{root}/index.json"}, {"cache_dir": root, "build_missing": False,
                                                  "compressed": CRC.storage_spec(crc_codec_dir()).to_spec()}
    if run.group == "residualkv_mm" and MM.takes_codec(run.spec):
        codec = f"{mm_codec_dir(run.model)}/codec"
        return {"codec": f"{codec}/codec.json"}, {"codec_dir": codec}
    if run.group == "residualkv":
        from kvbench.report.rkv_generation import sampling

        plan = _rkv_run_plan(wc)
        variant = plan.codec_of(run.spec)
        params = sampling(plan.s)   # Table V's sampled decoding (greedy: none)
        if variant is not None:
            codec = f"{plan.codecs.dir(variant)}/codec"
            return {"codec": f"{codec}/codec.json"}, {"codec_dir": codec, **params}
        return {}, params
    return {}, {}


def run_inputs(wc):
    """Inputs of one run: the model's config.json, the evaluated split, and its resource (:func:`_run_resource`)."""
    return {**eval_inputs(wc), **_run_resource(wc)[0]}


def run_method_params(wc):
    """`--method-params` JSON of one run (:func:`_run_resource`)."""
    return json.dumps(_run_resource(wc)[1])


def _tables():
    from kvbench.report.tables import TABLES

    return TABLES


TABLES = _tables()


def table_of(name):
    """The :class:`~kvbench.plan.base.Table` of a target name, e.g. `conduit/table1`."""
    return TABLES[name]


def configured_tables():
    """Names of the tables this config has: its section is there (and, ResidualKV, its rows)."""
    names = []
    for t in TABLES.values():
        if t.section not in config:
            continue
        if t.name == "residualkv/tableII" and not MM:
            continue
        if t.section == "residualkv" and t.name != "residualkv/tableII" and not (RKV.configured(t.key) or t.key in RKV_MODEL_TABLES):
            continue
        names.append(t.name)
    return names


def diag_captures():
    """Capture CSVs of Tables 11-13: one per backbone of `conduit.models` x dataset of `conduit_diagnostics.datasets`."""
    section = config["conduit_diagnostics"]
    return [f"results/conduit/diag/{PROFILE}/{m}/{d}.csv" for m in conduit_plan().models for d in section["datasets"]]


def diag_capture_args():
    """`kvbench conduit-diagnose` flags from `conduit_diagnostics` (n_records, m, seed), as one shell string."""
    s = config["conduit_diagnostics"]
    return f"--n {int(s['n_records'])} --m {int(s['m'])} --seed {int(s['seed'])}"


def _check_diagnostics():
    """Fail at DAG time on a `conduit_diagnostics` section the captures could not serve."""
    from kvbench.data.smoke import TASKS
    from kvbench.plan.residualkv import known_model_shape

    if "conduit_diagnostics" not in config:
        return
    if "conduit" not in config:
        raise ValueError("this config has no `conduit:` section, which conduit_diagnostics needs (its backbones and "
                         "image caches); add one or drop conduit_diagnostics")
    section = config["conduit_diagnostics"]
    for d in section["datasets"]:
        # the kind is optional: a smoke dataset's generator knows it, a JSONL's records are checked when captured
        kind = DATASETS.get(d, {}).get("kind") or (TASKS[d].kind if d in TASKS else None)
        if d not in DATASETS or kind not in (None, "vlm"):
            raise ValueError(f"config conduit_diagnostics.datasets: {d!r} must be a vlm dataset under `datasets`")
    for model in config["conduit"]["models"]:
        try:
            shape = known_model_shape(model, MODELS[model], None if is_zoo(model) else model_dir(model))
        except ValueError:  # a config.json without the head counts: the capture checks the depth when it starts
            shape = None
        bad = [i for i in section["layers"] if shape is not None and not i < shape[0]]
        if bad:
            raise ValueError(f"config conduit_diagnostics.layers: {bad} are not layers of {model!r}, which has "
                             f"{shape[0]} (0..{shape[0] - 1}); the schema default [7, 14, 24] is the paper's for "
                             "Qwen2.5-VL-3B")
    n_test = config["conduit"].get("n_test")
    if n_test is not None and section["n_records"] > n_test:
        raise ValueError(f"config conduit_diagnostics.n_records ({section['n_records']}) exceeds conduit.n_test "
                         f"({n_test}): the image caches hold only the first {n_test} records")


_check_diagnostics()


def table_inputs(wc):
    """Input function of the `table` rule: what table `wc.table` reads (runs and splits, or a raw CSV)."""
    table = table_of(wc.table)
    if table.section not in config:
        raise ValueError(f"this config has no `{table.section}:` section, so it has no {table.paper} target "
                         f"{table.path} (config/config.yaml shows one)")
    if table.section == "conduit":
        return conduit_run_inputs(table.key)(wc)
    if table.section == "beyond":
        return crc_table_inputs()
    if table.name == "residualkv/tableII":
        if not MM:
            raise ValueError("this config has no `residualkv.tableII:` mapping, so it has no ResidualKV Table II "
                             "(config/config.yaml shows one)")
        return [f"{run.path(PROFILE)}/predictions.jsonl" for run in MM.runs()]
    if table.section == "residualkv":
        return rkv_table_i_inputs(wc) if table.key in RKV_MODEL_TABLES else rkv_run_inputs(table.key)(wc)
    if table.section == "conduit_diagnostics":
        types = sorted(set(config["conduit_diagnostics"]["datasets"].values()))
        if table.key == "table13" and len(types) < 2:
            raise ValueError(f"config conduit_diagnostics.datasets: every dataset has the image type {types[0]!r}; "
                             "Table 13 compares image types, so it needs two datasets of different types "
                             "(Tables 11 and 12 do not)")
        return diag_captures()
    return [f"results/bench/{PROFILE}/conduit_latency.csv"]


def table_spec(wc):
    """The JSON `kvbench report <table>` reads (`--spec`)."""
    table = table_of(wc.table)
    if table.section == "conduit":
        return conduit_report_spec(table.key)
    if table.section == "beyond":
        return crc_report_spec()
    if table.name == "residualkv/tableII":
        return mm_report_spec()
    if table.section == "residualkv":
        return rkv_table_i_spec() if table.key in RKV_MODEL_TABLES else rkv_report_spec(table.key)
    if table.section == "conduit_diagnostics":
        return json.dumps({"profile": PROFILE, "conduit_diagnostics": config["conduit_diagnostics"],
                           "captures": diag_captures(), "regimes": config["conduit"].get("regimes", {}),
                           "zoo_models": ZOO_MODELS}, sort_keys=True)
    return json.dumps({"profile": PROFILE, "raw": f"results/bench/{PROFILE}/conduit_latency.csv"}, sort_keys=True)


# --- Ours beside the published figures (compare.smk) -----------------------------------------

def _published_tables():
    """Table targets (`conduit/table1`, ..., `conduit/fig3`) whose paper's published file has entries for them."""
    from kvbench.report.published import load_published

    names = []
    for paper in ("conduit", "residualkv"):
        pub = load_published(os.path.join(workflow.basedir, "config", "published", f"{paper}.yaml"))
        keys = {e.table for e in pub.entries}
        names += [t for t in [*TABLES, "conduit/fig3"] if t.startswith(f"{paper}/") and t.split("/", 1)[1] in keys]
    return names


COMPARE_TABLES = _published_tables()


def profile_compare_tables():
    """The compare tables this config builds: its tables with published figures, and Figure 3 with CONDUIT."""
    own = set(configured_tables()) | ({"conduit/fig3"} if CONDUIT else set())
    return [t for t in COMPARE_TABLES if t in own]


def published_file(wc):
    """config/published/<paper>.yaml of a compare target (anchored at the Snakefile, so `--directory` works)."""
    return os.path.join(workflow.basedir, "config", "published", f"{wc.table.split('/')[0]}.yaml")


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
    items += [[f] for f in (conduit_targets() if CONDUIT else []) if f.endswith(".csv")]
    items += [[table_of(t).path] for t in configured_tables() if table_of(t).section != "conduit"]
    if CONDUIT:
        items.append(["figures/conduit/fig3.pdf", "results/conduit/fig3.csv"])
        items.append(["figures/conduit/fig4.pdf", "results/conduit/fig4.csv"])
    if RKV:
        items += [["results/residualkv/fig11_throughput.csv"], ["results/residualkv/fig3.csv"]]
        items.append(["figures/residualkv/fig3.pdf", "results/residualkv/fig3_summary.csv", "results/residualkv/fig3.csv"])
        for n in RESIDUALKV_ONLY_FIGURES:
            item = [f"figures/residualkv/fig{n}.pdf", f"results/residualkv/fig{n}.csv"]
            item += {"11": ["results/residualkv/fig11_throughput.csv"],
                     "13": ["results/residualkv/fig13_summary.csv"]}.get(n, [])   # Fig. 13's shares per layer
            items += [item]
            if n in ("6", "8"):
                items.append([f"results/residualkv/fig{n}.csv"])
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
