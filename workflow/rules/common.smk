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

PROFILE = config["profile"]
SEED = config["seed"]
ROOT = os.path.expanduser(config["paths"]["root"])
MODELS = config["models"]
DATASETS = config["datasets"]
ZOO_MODELS = [m for m, spec in MODELS.items() if "zoo" in spec]
SMOKE_DATASETS = [d for d, spec in DATASETS.items() if "smoke" in spec]
TOKENIZER_DIR = "zoo/tokenizer"


def _check_matrix():
    """Fail early, naming the entry, if the eval matrix refers to an unknown model or dataset."""
    for model, tasks in config["eval"]["matrix"].items():
        if model not in MODELS:
            raise ValueError(f"config eval.matrix: model {model!r} is not defined under `models`")
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
    from kvbench.eval.methods import METHODS
    from kvbench.train.recipes import RECIPES, apply_overrides

    for method in config["eval"]["methods"]:
        if method not in METHODS:
            raise ValueError(f"config eval.methods: unknown method {method!r}; expected one of {sorted(METHODS)}")
    for name in SMOKE_DATASETS:
        if name not in TASKS:
            raise ValueError(f"config datasets.{name}: no smoke generator named {name!r}; expected one of {sorted(TASKS)}")
    for name in ZOO_MODELS:
        overrides = {**config["training"]["overrides"], **MODELS[name]["zoo"]["overrides"]}
        try:
            apply_overrides(RECIPES[MODELS[name]["kind"]](), overrides)
        except ValueError as e:
            raise ValueError(f"config training overrides of model {name!r}: {e}") from e


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


def model_dir(model):
    """Checkpoint directory of a model: zoo/<model> for zoo models, else the local checkpoint."""
    return f"zoo/{model}" if is_zoo(model) else local_path(MODELS[model]["checkpoint"])


def split_file(task):
    """Evaluated JSONL split of a dataset."""
    if "smoke" in DATASETS[task]:
        return f"data/smoke/{task}/test.jsonl"
    return local_path(DATASETS[task]["jsonl"])


def train_dir(model):
    """Resumable training work directory of a zoo model (curves, summary, state/)."""
    return f"zoo/.train/{model}"


def train_overrides(model):
    """JSON of `training.overrides` with the model's own `zoo.overrides` merged over it."""
    return json.dumps({**config["training"]["overrides"], **MODELS[model]["zoo"]["overrides"]}, sort_keys=True)


def run_dir(model, task, method):
    return f"results/runs/{PROFILE}/{model}/{task}/{method}"


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
    return ["results/smoke/zoo.csv", "figures/smoke/zoo_training.pdf"]


def default_targets():
    """Inputs of the default target: the zoo report when the config has zoo models, plus every checkpoint model's runs."""
    targets = zoo_report_targets() if ZOO_MODELS else []
    checkpoint_models = [m for m in MODELS if not is_zoo(m)]
    return targets + matrix_metrics(models=checkpoint_models)



def eval_inputs(wc):
    """Inputs of one eval run: the model's config.json and the evaluated split."""
    return {
        "model": os.path.join(model_dir(wc.model), "config.json"),
        "split": split_file(wc.task),
    }


# Short target names (targets.smk).
RESIDUALKV_ONLY_FIGURES = ["5", "6", "8", "9", "10", "11", "12", "13"]
AMBIGUOUS_FIGURES = ["3", "4"]


def ambiguous_figure(wc):
    """Input function of figures/fig3.pdf and fig4.pdf: always raises, naming both canonical targets."""
    raise ValueError(
        f"figures/fig{wc.n}.pdf is ambiguous: both papers have a Figure {wc.n}. "
        f"Ask for figures/conduit/fig{wc.n}.pdf (CONDUIT) or figures/residualkv/fig{wc.n}.pdf (ResidualKV)."
    )
