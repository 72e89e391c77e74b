"""Where a config's artefacts live: model and split paths, keyed by profile and recipe hash.

``zoo/<profile>/<model>-<hash>/`` and ``data/<profile>/<task>-<hash>/``: the hash covers everything that determines
the bytes (:mod:`kvbench.utils.recipe`), the code that makes them included, so a config change writes a new
directory instead of deleting a finished one, two configs coexist, and switching back costs nothing. Local checkpoints and JSONL files are under
``paths.root`` unless absolute. Every plan (:mod:`kvbench.plan`) and the workflow's rules ask one
:class:`Workspace`, so a path is named once.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvbench.data.smoke import TASKS
from kvbench.models.tiny import seed_replica, zoo_spec
from kvbench.plan.residualkv import known_model_shape
from kvbench.train.recipes import RECIPES, SHARED_WARMUP, apply_overrides, warmup_steps, zoo_recipe
from kvbench.utils.recipe import code_version, recipe_hash

#: the modules that write the tokenizer (``kvbench tokenizer``) and a smoke split (``kvbench data``): where the code
#: digests of their recipes start (:func:`kvbench.utils.recipe.code_version`)
TOKENIZER_ENTRY = "kvbench.data.tokenizer"
SPLIT_ENTRY = "kvbench.data.smoke"


@dataclass
class Workspace:
    """The validated config's models, datasets and their paths.

    Args:
        config: the validated config (schema defaults filled in).
        basedir: the workflow's directory (the Snakefile's; ``config/published/`` lives there).

    Attributes:
        tokenizer_hash, zoo_hashes, data_hashes: recipe hashes of the tokenizer, each zoo model and each smoke dataset.
    """

    config: dict
    basedir: str = "."
    tokenizer_hash: str = field(init=False)
    zoo_hashes: dict[str, str] = field(init=False)
    data_hashes: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        cfg = self.config
        self.profile: str = cfg["profile"]
        self.seed: int = cfg["seed"]
        self.root = os.path.expanduser(cfg["paths"]["root"])
        self.models: dict = cfg["models"]
        self.datasets: dict = cfg["datasets"]
        self.zoo_models = [m for m, spec in self.models.items() if "zoo" in spec]
        self.check_names()
        self.tokenizer_hash = recipe_hash({"vocab_size": cfg["zoo"]["tokenizer"]["vocab_size"],
                                           "code": code_version(TOKENIZER_ENTRY)})
        self.zoo_hashes = {}
        # entries first: a seed replica that starts from its entry's warm-up state has the entry's hash in its recipe
        for name in sorted(self.zoo_models, key=lambda m: self.warm_start_entry(m) is not None):
            zoo = self.models[name]["zoo"]
            entry = self.warm_start_entry(name)
            recipe = zoo_recipe(name, self.models[name]["kind"], self.train_overrides(name), seed=self.model_seed(name),
                                threads=zoo["threads"], tokenizer=self.tokenizer_hash,
                                warm_start=None if entry is None else self.zoo_hashes[entry])
            # the floors are in the recipe: a changed floor is a new model directory, never a rerun (and first a
            # deletion) of a finished one
            self.zoo_hashes[name] = recipe_hash({**recipe, "floors": zoo["floors"], "val_n": zoo["val_n"]})
        split_code = code_version(SPLIT_ENTRY)
        self.data_hashes = {task: recipe_hash({"task": task, "seed": self.seed, "tokenizer": self.tokenizer_hash,
                                               "code": split_code, **spec["smoke"]})
                            for task, spec in self.datasets.items() if "smoke" in spec}

    def check_names(self) -> None:
        """Fail before any job runs if a smoke generator, zoo model, skill floor or training override is unknown: the
        package's own registries are the single source of truth, so the dry run catches what would otherwise fail
        only after the models had trained.

        Raises:
            ValueError: naming the config key and the bad value.
        """
        for name, spec in self.datasets.items():
            if "smoke" in spec and name not in TASKS:
                raise ValueError(f"config datasets.{name}: no smoke generator named {name!r}; expected one of "
                                 f"{sorted(TASKS)}")
        for name in self.zoo_models:
            try:
                zoo_spec(name)
            except KeyError as e:
                raise ValueError(f"config models.{name}: {e.args[0]}") from None
            replica = seed_replica(name)
            if replica is not None and self.model_seed(name) != replica[1]:
                raise ValueError(f"config models.{name}: a seed replica of {replica[0]!r} named -s{replica[1]} must "
                                 f"set zoo.seed: {replica[1]} (it trains with seed {self.model_seed(name)})")
            kind = self.models[name]["kind"]
            for task in self.models[name]["zoo"]["floors"]:
                if task not in TASKS:
                    raise ValueError(f"config models.{name}.zoo.floors: {task!r} is not a smoke task; "
                                     f"expected one of {sorted(TASKS)}")
                wanted = {"lm": "text", "vlm": "vlm"}[kind]
                if TASKS[task].kind != wanted:
                    raise ValueError(f"config models.{name}.zoo.floors: {task!r} is a {TASKS[task].kind} task, but "
                                     f"{name!r} is a {kind} model; a floor needs a {wanted} task")
            try:
                apply_overrides(RECIPES[kind](), self.train_overrides(name))
            except ValueError as e:
                raise ValueError(f"config training overrides of model {name!r}: {e}") from e
        self.check_replicas()
        self.check_distinct_seeds()

    def check_replicas(self) -> None:
        """A seed replica that starts from its entry's warm-up state needs the entry in the config, trained with the
        same overrides and threads.

        Raises:
            ValueError: naming the replica's config key and what it must be.
        """
        for name in self.zoo_models:
            entry = self.warm_start_entry(name)
            if entry is not None and "zoo" not in self.models.get(entry, {}):
                raise ValueError(f"config models.{name}: a seed replica starts from its entry's warm-up state "
                                 f"(the phases through {SHARED_WARMUP[zoo_spec(name).recipe_name]!r}), so the config must "
                                 f"also train the entry {entry!r} (add it under `models` with a `zoo:` section)")
            if entry is not None and self.train_overrides(name) != self.train_overrides(entry):
                raise ValueError(f"config models.{name}: a seed replica starts from its entry's warm-up state, so its "
                                 f"training overrides {self.train_overrides(name)} must be {entry!r}'s "
                                 f"{self.train_overrides(entry)}")
            threads = [self.models[m]["zoo"]["threads"] for m in (name, entry or name)]
            if threads[0] != threads[1]:
                raise ValueError(f"config models.{name}.zoo.threads: {threads[0]}, but a seed replica starts from its "
                                 f"entry's warm-up state, so it must be {entry!r}'s ({threads[1]})")

    def check_distinct_seeds(self) -> None:
        """Each zoo entry and its seed replicas in the config train from distinct seeds: two with one seed are one
        model trained twice (a replica forked with its entry's seed ends on the entry's bytes), which would count
        as two seeds in the seed-pooled CI.

        Raises:
            ValueError: naming the two models and their seed.
        """
        seen: dict[tuple[str, int], str] = {}
        for name in self.zoo_models:
            replica = seed_replica(name)
            key = (replica[0] if replica else name, self.model_seed(name))
            if key in seen:
                raise ValueError(f"config models.{name}: trains {key[0]!r} from seed {key[1]}, as {seen[key]!r} does; "
                                 "each seed replica needs a seed of its own (the entry trains from its zoo.seed, else "
                                 "the top-level seed)")
            seen[key] = name

    def warm_start_entry(self, model: str) -> str | None:
        """The entry a zoo seed replica starts from (its warm-up state, :data:`kvbench.train.recipes.SHARED_WARMUP`),
        or None: not a replica, or its recipe shares no phases."""
        replica = seed_replica(model)
        if replica is None:
            return None
        recipe = zoo_spec(model).recipe_name
        shared = warmup_steps(recipe, apply_overrides(RECIPES[recipe](), self.train_overrides(model)))
        return None if shared is None else replica[0]

    # --- models ------------------------------------------------------------------------------------------
    def is_zoo(self, model: str) -> bool:
        return "zoo" in self.models[model]

    def model_seed(self, model: str) -> int:
        """Training seed of a zoo model: its ``zoo.seed`` (seed replicas), else the config's ``seed``."""
        seed = self.models[model]["zoo"].get("seed")
        return self.seed if seed is None else seed

    def train_overrides(self, model: str) -> dict:
        """``training.overrides`` with the model's own ``zoo.overrides`` merged over it."""
        return {**self.config["training"]["overrides"], **self.models[model]["zoo"]["overrides"]}

    def model_dir(self, model: str) -> str:
        """Checkpoint directory: ``zoo/<profile>/<model>-<hash>`` for zoo models, else the local checkpoint."""
        if self.is_zoo(model):
            return f"zoo/{self.profile}/{model}-{self.zoo_hashes[model]}"
        return self.local_path(self.models[model]["checkpoint"])

    def model_shape(self, model: str) -> tuple[int, int] | None:
        """``(n_layers, d_kv)`` of ``model`` where known before anything runs (:func:`known_model_shape`)."""
        return known_model_shape(model, self.models[model], None if self.is_zoo(model) else self.model_dir(model))

    def model_depth(self, model: str) -> int | None:
        """Decoder layers of ``model`` where known before anything runs; None also for a checkpoint whose
        ``config.json`` lacks the head counts (its depth is checked when its job starts)."""
        try:
            shape = self.model_shape(model)
        except ValueError:
            return None
        return None if shape is None else shape[0]

    # --- data ------------------------------------------------------------------------------------------
    def local_path(self, path: str) -> str:
        """A config path: absolute as given, else under ``paths.root`` (``~`` expanded)."""
        path = os.path.expanduser(path)
        return path if os.path.isabs(path) else os.path.join(self.root, path)

    def split_file(self, task: str) -> str:
        """Evaluated JSONL split of a dataset (an SCBench file: its conversion, ``scbench.smk``)."""
        spec = self.datasets[task]
        if "smoke" in spec:
            return f"data/{self.profile}/{task}-{self.data_hashes[task]}/test.jsonl"
        if "scbench" in spec:
            return self.scbench_split(task)
        return self.local_path(spec["jsonl"])

    def scbench_split(self, task: str) -> str:
        """The conversion of SCBench's own file of dataset ``task`` (``scbench:``; rule ``scbench_convert``)."""
        return f"data/{self.profile}/{task}-scbench/test.jsonl"

    def dataset_kind(self, task: str) -> str | None:
        """``text`` or ``vlm``: the dataset's ``kind``, else its smoke generator's (None: a JSONL file that names none)."""
        kind = self.datasets[task].get("kind")
        return kind or (TASKS[task].kind if "smoke" in self.datasets[task] and task in TASKS else None)

    def published(self, paper: str) -> str:
        """``config/published/<paper>.yaml`` (anchored at the workflow, so ``--directory`` works)."""
        return os.path.join(self.basedir, "config", "published", f"{paper}.yaml")
