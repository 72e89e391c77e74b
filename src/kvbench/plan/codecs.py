"""Codec training logistics of a ResidualKV plan: which codec variants exist, where each lives, how it is trained
or imported, and what its training job asks the scheduler for.

Layout: ``codecs/<profile>/<model>/<variant>-<recipe>/`` (``codec/``, ``curves.csv``, ``summary.json``, their
``*.timing.*`` wall-clock, ``state/``), ``<recipe>`` the first 8 hex digits of the sha256 of everything that determines
the trained weights (:meth:`CodecPlan.recipe`), so a changed config trains into a new directory and never overwrites a
finished codec; ``main`` is the codec of the tables; the others feed Figs. 10-12 (and Table VIII).

The main codec may be imported instead of trained: ``codec: {import: <dir>}`` names the authors' compressor
checkpoint (:mod:`kvbench.compress.residualkv.deltakv_format`; the other ``codec`` keys are its inference-time
overrides and the variants' base); it lands in ``codecs/<profile>/<model>/main-import-<hash>/codec/`` (the hash of
the path, overrides and backbone directory), written by ``kvbench codec-import`` with a ``provenance.json``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shlex
from pathlib import Path

from kvbench.compress.residualkv.codec import CodecConfig, codec_config_for_shape
from kvbench.compress.residualkv.deltakv_format import CONFIG_FILE, PROVENANCE_FILE, WEIGHTS_FILE, plan_import
from kvbench.data.local_text import corpus_builder
from kvbench.utils.recipe import recipe_hash

#: The codec variants (config ``residualkv.variants``) each codec figure reads; Fig. 11's throughput is
#: relative to :data:`DEFAULT_VARIANT`.
FIG11_PANELS = {"d_c": ["dc_low", "base", "dc_high"], "d_ff": ["dff_low", "base", "dff_high"],
                "k": ["k_low", "base", "k_high"], "s": ["s_low", "base", "s_high"]}
FIGURE_VARIANTS = {"fig10": ["base", "separate"],
                   "fig11": list(dict.fromkeys(v for vs in FIG11_PANELS.values() for v in vs)),
                   "fig12": ["base", "ntp", "mse"]}
DEFAULT_VARIANT = "base"
#: Training keys of a codec recipe (config ``residualkv.train``, overridable per variant); ``slice_s`` is not one
#: of them: it only cuts invocations, never the work.
TRAIN_KEYS = ("objective", "steps", "seq_len", "lr", "data", "dtype", "batch", "data_files", "text_field")
#: Where codec training runs (``residualkv.train``): not in the recipe, since they do not change the weights
#: (``gpus`` splits the global ``batch`` over processes, with the same result; ``checkpointing`` recomputes).
PLACEMENT_KEYS = ("device", "gpus", "checkpointing")
#: The ``codec`` key naming an authors' checkpoint to import as the main codec (module doc).
IMPORT_KEY = "import"
#: Codec-training throughput on the zoo LM, tokens/s (main codec: 600 steps x 512 tokens in about 330 s on 2 idle
#: cores), and the slow-down allowed for a loaded machine: the runtime estimate of a run without a slice.
ZOO_CODEC_TOKENS_PER_S, LOAD_FACTOR = 930, 4


class CodecPlan:
    """The codec variants of one ResidualKV section (``residualkv.codec``, ``.train``, ``.variants``) on one backbone.

    Args:
        section: the ``residualkv`` mapping (or Table V's, :func:`kvbench.plan.generation.generation_section`).
        profile: the config's profile (path component).
        model: the backbone's config name (path component).
        shape: ``(n_layers, d_kv)`` of the backbone where known before anything runs, else None.
        zoo: the backbone is a zoo model (runtime estimates) rather than a local checkpoint.
        seed: the config's ``seed`` (codecs are trained with it); needed for codec directories.
        model_dir: the backbone's checkpoint directory as the workflow names it; part of each recipe.

    Raises:
        ValueError: a variant's settings are invalid (e.g. ``d_c`` not a multiple of the quantisation group, ``k``
            below 1, an unknown CodecConfig field), or an imported checkpoint is missing or refused.
    """

    def __init__(self, section: dict, profile: str, model: str, shape: tuple[int, int] | None = None,
                 zoo: bool = True, seed: int | None = None, model_dir: str | None = None):
        self.s = section
        self.profile = profile
        self.model = model
        self.variants: dict[str, dict] = {"main": {}, **(section.get("variants") or {})}
        self.shape = shape
        self.zoo = zoo
        self.seed = seed
        self.model_dir = model_dir
        self._imported: dict = {}  # (import dir, shape) -> CodecConfig read from the checkpoint
        self._check()

    def _check(self) -> None:
        """Every codec variant builds a valid CodecConfig (checked before any training). Without the model's
        shape, ``d_kv`` is taken as ``4 d_c`` (or 128), which checks everything but the default sizes."""

        fields = {f.name for f in dataclasses.fields(CodecConfig)} - {"n_layers", "d_kv"}
        for variant in self.variants:
            over = self.overrides(variant)
            if self.source(variant):
                self.config(variant, self.shape)  # reads the checkpoint's config.json and tensor header
                continue
            unknown = sorted(set(over) - fields)
            if unknown:
                raise ValueError(f"codec variant {variant!r}: unknown CodecConfig field(s) {unknown}; known: {sorted(fields)}")
            d_c = over.get("d_c")
            shape = self.shape or (1, 4 * d_c if isinstance(d_c, int) and d_c > 0 else 128)
            try:
                codec_config_for_shape(*shape, **over)
            except (ValueError, TypeError) as e:
                raise ValueError(f"codec variant {variant!r} ({over}): {e}") from None

    def variant(self, name: str) -> dict:
        """The config entry of codec variant ``name`` (``main``: ``{}``).

        Raises:
            ValueError: ``name`` is not configured under ``residualkv.variants`` (e.g. a figure's variant).
        """
        if name not in self.variants:
            raise ValueError(f"codec variant {name!r} is not configured under residualkv.variants "
                             f"(configured: {sorted(self.variants)}; Figs. 10-12 read {FIGURE_VARIANTS})")
        return self.variants[name]

    def dir(self, variant: str) -> str:
        """``codecs/<profile>/<model>/<variant>-<recipe hash>`` (module doc)."""
        self.variant(variant)
        return f"codecs/{self.profile}/{self.model}/{self.name(variant)}"

    def name(self, variant: str) -> str:
        """``<variant>-<recipe hash>`` (``<variant>-import-<hash>`` when imported): the last component of
        :meth:`dir`."""
        kind = "-import" if self.source(variant) else ""
        return f"{variant}{kind}-{recipe_hash(self.recipe(variant))}"

    def names(self, kind: str | None = None) -> dict[str, str]:
        """``{codec_name: variant}`` of every configured variant (the rules' wildcard values); ``kind``
        ``"trained"`` or ``"imported"`` keeps those only (``rkv_codec`` / ``rkv_codec_import``)."""
        if kind not in (None, "trained", "imported"):
            raise ValueError(f"kind must be None, 'trained' or 'imported', got {kind!r}")
        return {self.name(v): v for v in self.variants
                if kind is None or (kind == "imported") == bool(self.source(v))}

    def source(self, variant: str) -> str | None:
        """The authors' checkpoint directory ``variant`` is imported from (``codec.import``; main codec only),
        or None: trained here."""
        return self.s["codec"].get(IMPORT_KEY) if variant == "main" else None

    def import_files(self, variant: str) -> list[str]:
        """The files an imported codec is built from (``config.json``, ``model.safetensors``): the rule's inputs."""

        src = self.source(variant)
        return [f"{src}/{CONFIG_FILE}", f"{src}/{WEIGHTS_FILE}"] if src else []

    def recipe(self, variant: str) -> dict:
        """Everything that determines ``variant``'s weights: trained, its CodecConfig overrides, training keys
        (:data:`TRAIN_KEYS`), seed and backbone directory, not ``slice_s`` (where invocations are cut);
        imported, the checkpoint directory, the overrides and the backbone directory.

        Raises:
            ValueError: the plan was built without ``seed`` or ``model_dir``.
        """
        if self.seed is None or self.model_dir is None:
            raise ValueError("the codec plan needs seed= and model_dir= to name codec directories (their recipe includes both)")
        if self.source(variant):
            return {"import": self.source(variant), "codec": self.overrides(variant),
                    "model": str(self.model_dir)}
        return {"codec": self.overrides(variant), **self.training(variant), "seed": self.seed,
                "model": str(self.model_dir)}

    def origin(self, variant: str, root: str | Path = ".") -> str:
        """How ``variant``'s codec was made, for table headers: trained here (directory name, objective, steps x
        tokens, lr, data, seed) or imported from a directory (the weights' sha256 prefix from the codec's
        ``provenance.json`` under ``root``)."""
        src = self.source(variant)
        named = self.seed is not None and self.model_dir is not None  # else no directory name (codec_recipe)
        if not src:
            t = self.training(variant)
            return (f"trained here ({self.name(variant) if named else variant}: objective {t.get('objective', 'joint')}, "
                    f"{t['steps']} steps x {t.get('seq_len', 512)} tokens, lr {t.get('lr', 2e-4):g}, "
                    f"data {t.get('data', 'text')}, seed {self.seed})")

        if not named:
            return f"imported from {src} (kvbench codec-import)"
        path = Path(root) / self.dir(variant) / "codec" / PROVENANCE_FILE
        try:
            sha = json.loads(path.read_text())["weights_sha256"][:12]
        except (OSError, ValueError, KeyError):
            return f"imported from {src} (kvbench codec-import; {path} unreadable, so no weights hash)"
        return f"imported from {src} (kvbench codec-import; model.safetensors sha256 {sha}...)"

    def slice_s(self, variant: str) -> int | None:
        """``slice_s`` of ``variant`` (its own key, else ``train``'s): seconds one invocation of
        ``kvbench codec-train`` may run before it saves its state and fails, to be rerun; None: no slice."""
        v = self.variant(variant)
        return v["slice_s"] if "slice_s" in v else self.s["train"].get("slice_s")

    def runtime_min(self, variant: str) -> int:
        """Scheduler runtime (minutes) of one ``rkv_codec`` job: the slice plus 30 minutes to load the model,
        evaluate and save; without a slice, for a zoo model :data:`LOAD_FACTOR` x the measured time of its
        tokens at :data:`ZOO_CODEC_TOKENS_PER_S` plus 10, for a checkpoint one day (set ``slice_s`` there)."""
        slice_s = self.slice_s(variant)
        if slice_s is not None:
            return math.ceil(slice_s / 60) + 30
        if not self.zoo:
            return 24 * 60
        t = self.training(variant)
        return math.ceil(LOAD_FACTOR * t["steps"] * t["seq_len"] / ZOO_CODEC_TOKENS_PER_S / 60) + 10

    def config(self, variant: str, shape: tuple[int, int] | None):
        """The :class:`~kvbench.compress.residualkv.codec.CodecConfig` ``variant`` trains on a backbone of
        ``shape`` = ``(n_layers, d_kv)`` (the codec's own defaults where the config is silent); an imported
        codec's from its checkpoint (:func:`~kvbench.compress.residualkv.deltakv_format.plan_import`: config.json
        and the tensor header, checked against ``shape`` when it is known).

        Raises:
            ValueError: an imported checkpoint is missing or refused (naming ``residualkv.codec.import``).
        """

        src = self.source(variant)
        if not src:
            return codec_config_for_shape(*shape, **self.overrides(variant))

        key = (src, shape)
        if key not in self._imported:
            try:
                self._imported[key] = plan_import(src, shape, **self.overrides(variant)).config
            except (OSError, ValueError) as e:
                raise ValueError(f"residualkv.codec.import {src!r}: {e}") from None
        return self._imported[key]

    def overrides(self, variant: str) -> dict:
        """CodecConfig fields of ``variant``: the main codec's (without ``import``), updated by the variant's
        ``overrides``."""
        main = {k: v for k, v in self.s["codec"].items() if k != IMPORT_KEY}
        return {**main, **self.variant(variant).get("overrides", {})}

    def placement(self, variant: str) -> dict:
        """``{device, gpus, grad_accum, checkpointing, dtype}`` of ``variant``'s training job (``residualkv.train``):
        ``gpus`` processes (one per GPU, ``torchrun``) each accumulating ``grad_accum = batch / gpus`` sequences.

        Raises:
            ValueError: ``gpus`` > 1 off CUDA, ``batch`` not a multiple of ``gpus``, or a half ``dtype`` other
                than bfloat16 on the CPU; naming ``residualkv.train`` and the values.
        """
        t, recipe = self.s["train"], self.training(variant)
        device, gpus = t.get("device", "cpu"), t.get("gpus", 1)
        batch, dtype = recipe.get("batch", 1), recipe.get("dtype", "float32")
        if gpus > 1 and not device.startswith("cuda"):
            raise ValueError(f"config residualkv.train: gpus={gpus} needs device: cuda (got device: {device!r})")
        if batch % gpus:
            raise ValueError(f"config residualkv.train: batch={batch} must be a multiple of gpus={gpus} "
                             "(each GPU accumulates batch / gpus sequences per step)")
        if dtype == "float16" and not device.startswith("cuda"):
            raise ValueError(f"config residualkv.train: dtype float16 needs device: cuda (got {device!r})")
        return {"device": device, "gpus": gpus, "grad_accum": batch // gpus,
                "checkpointing": bool(t.get("checkpointing", False)), "dtype": dtype}

    def train_flags(self, variant: str, resolve=lambda path: path) -> str:
        """The placement and corpus flags of ``kvbench codec-train`` for ``variant``, shell-quoted, only those
        that differ from the verb's defaults (``resolve`` maps a configured corpus path to the file).

        Raises:
            ValueError: ``data_files`` with ``data: tasks``, a directory, mixed or unknown suffixes, or
                ``text_field`` without ``data_files`` (naming ``residualkv.train``).
        """

        place, recipe = self.placement(variant), self.training(variant)
        if recipe.get("data_files"):

            if recipe.get("data", "text") != "text":
                raise ValueError(f"config residualkv.train: data_files is a text corpus; it needs data: text, got "
                                 f"data: {recipe['data']}")
            try:
                corpus_builder([resolve(f) for f in recipe["data_files"]])
            except ValueError as e:
                raise ValueError(f"config residualkv.train.data_files: {e}") from None
        elif "text_field" in recipe:
            raise ValueError("config residualkv.train: text_field names a column of data_files, which are not set")
        flags = []
        if place["device"] != "cpu":
            flags += ["--device", place["device"]]
        if place["dtype"] != "float32":
            flags += ["--dtype", place["dtype"]]
        if place["grad_accum"] != 1:
            flags += ["--grad-accum", str(place["grad_accum"])]
        if place["checkpointing"]:
            flags += ["--checkpointing"]
        if recipe.get("data_files"):
            flags += ["--data-files", *(resolve(f) for f in recipe["data_files"])]
        if recipe.get("text_field", "text") != "text":
            flags += ["--text-field", recipe["text_field"]]
        return " ".join(shlex.quote(f) for f in flags)

    def gpus(self, variant: str) -> int:
        """GPUs ``variant``'s training job asks the scheduler for (0 on the CPU)."""
        place = self.placement(variant)
        return place["gpus"] if place["device"].startswith("cuda") else 0

    def launcher(self, variant: str) -> str:
        """``kvbench``, or for several GPUs ``torchrun --standalone --nproc_per_node N -m kvbench.cli`` (one
        process per GPU of one node; :mod:`kvbench.train.dist`)."""
        gpus = self.placement(variant)["gpus"]
        return "kvbench" if gpus == 1 else f"torchrun --standalone --nproc_per_node {gpus} -m kvbench.cli"

    def training(self, variant: str) -> dict:
        """``{objective, steps, seq_len, lr, data}`` of ``variant`` (its own keys, else the ``train`` section's)."""
        v = self.variant(variant)
        return {k: v[k] if k in v else self.s["train"][k] for k in TRAIN_KEYS if k in v or k in self.s["train"]}
