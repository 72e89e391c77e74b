"""Which codecs and runs each ResidualKV target needs, from the config's ``residualkv:`` section.

The Snakemake rules (workflow/rules/residualkv.smk) and the report (:mod:`kvbench.report.residualkv`) ask
the same :class:`RKVPlan`, so paths cannot drift apart.

Layout:

- codec variants: ``codecs/<profile>/<model>/<variant>-<recipe>/`` (``codec/``, ``curves.csv``, ``summary.json``,
  their ``*.timing.*`` wall-clock, ``state/``), ``<recipe>`` the first 8 hex digits of the sha256 of everything that
  determines the trained weights (:meth:`RKVPlan.codec_recipe`), so a changed config trains into a new directory
  and never overwrites a finished codec; ``main`` is the codec of the tables; the others feed Figs. 10-12 (and
  Table VIII);
- runs: ``results/runs/<profile>/<model>/<task>/residualkv/<slug>/`` (``kvbench eval`` of a press spec,
  :mod:`kvbench.eval.compress`).

A press spec that takes a codec names its variant with ``codec=<variant>`` (default ``main``).

The main codec may be imported instead of trained: ``codec: {import: <dir>}`` names the authors' compressor
checkpoint (:mod:`kvbench.compress.residualkv.deltakv_format`; the other ``codec`` keys are its inference-time
overrides and the variants' base); it lands in ``codecs/<profile>/<model>/main-import-<hash>/codec/`` (the hash of
the path, overrides and backbone directory), written by ``kvbench codec-import`` with a ``provenance.json``.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from kvbench.bench.settings import BY_FIGURE
from kvbench.compress.registry import PRESS
from kvbench.eval.registry import with_params
from kvbench.report.plan import Run, load_spec
from kvbench.utils.recipe import recipe_hash
from kvbench.utils.spec import MethodSpec, parse

#: Targets whose rows are the config's ``stride_sweep`` (Table VI: its α values; Fig. 5: α values and fixed
#: strides). Every other target ``tableX`` takes its rows from the config key of its own name, a list of
#: ``{label, method}``: a new table needs no line here.
SWEEP_TARGETS = ("tableVI", "fig5")
#: Targets run on the section's ``long_generation`` backbone and task, not on ``model``/``tasks`` (Table V: long
#: generation, :mod:`kvbench.report.rkv_generation` builds their plan); a section with ``long_generation`` leaves
#: them out of its own :meth:`RKVPlan.targets`.
GENERATION_TARGETS = ("tableV",)
#: Header wording of each evaluation protocol (:attr:`kvbench.compress.cache.Press.protocol`).
PROTOCOL_NOTES = {
    "one_pass": "one_pass: context + question prefilled as one chunk (exact), then greedy decoding reads the "
                "compressed cache; KVzip prefills the context alone, then the question",
    "shared_context": "shared_context: context prefilled as one chunk and compressed, then the question chunk and "
                      "greedy decoding read the compressed cache",
}
#: Fig. 11 panels: hyper-parameter -> codec variants in increasing order of its value (``base`` is the
#: default setting, trained as long as the others); each variant's value is in its config ``overrides``.
FIG11_PANELS = {"d_c": ["dc_low", "base", "dc_high"], "d_ff": ["dff_low", "base", "dff_high"],
                "k": ["k_low", "base", "k_high"], "s": ["s_low", "base", "s_high"]}
#: The codec variants (config ``residualkv.variants``) each codec figure reads; Fig. 11's throughput is
#: relative to :data:`DEFAULT_VARIANT`.
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


class RKVPlan:
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

    def __init__(self, section: dict, profile: str, shape: tuple[int, int] | None = None, zoo: bool = True, *,
                 seed: int | None = None, model_dir: str | None = None):
        missing = [k for k in ("model", "tasks", "codec", "train", "tableIII") if k not in section]
        if missing:
            raise ValueError(f"the residualkv section misses key(s) {missing}")
        self.s = section
        self.profile = profile
        self.model: str = section["model"]
        self.tasks: list[str] = list(section["tasks"])
        self.variants: dict[str, dict] = {"main": {}, **(section.get("variants") or {})}
        self.shape = shape
        self.zoo = zoo
        self.seed = seed
        self.model_dir = model_dir
        self._imported: dict = {}  # (import dir, shape) -> CodecConfig read from the checkpoint
        self._check_codecs()
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

    def _check_codecs(self) -> None:
        """Every codec variant builds a valid CodecConfig (checked before any training). Without the model's
        shape, ``d_kv`` is taken as ``4 d_c`` (or 128), which checks everything but the default sizes."""
        from kvbench.compress.residualkv.codec import CodecConfig, codec_config_for_shape

        fields = {f.name for f in dataclasses.fields(CodecConfig)} - {"n_layers", "d_kv"}
        for variant in self.variants:
            over = self.codec_overrides(variant)
            if self.codec_import(variant):
                self.codec_config(variant, self.shape)  # reads the checkpoint's config.json and tensor header
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

    def _check_figure_steps(self) -> None:
        """Figs. 10-12 compare codecs at matched steps (paper §V-C): their configured variants train equally long."""
        for fig, variants in FIGURE_VARIANTS.items():
            steps = {v: self.codec_training(v).get("steps") for v in variants if v in self.variants}
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

    # -- codecs -------------------------------------------------------------------------------------
    def variant(self, name: str) -> dict:
        """The config entry of codec variant ``name`` (``main``: ``{}``).

        Raises:
            ValueError: ``name`` is not configured under ``residualkv.variants`` (e.g. a figure's variant).
        """
        if name not in self.variants:
            raise ValueError(f"codec variant {name!r} is not configured under residualkv.variants "
                             f"(configured: {sorted(self.variants)}; Figs. 10-12 read {FIGURE_VARIANTS})")
        return self.variants[name]

    def codec_dir(self, variant: str) -> str:
        """``codecs/<profile>/<model>/<variant>-<recipe hash>`` (module doc)."""
        self.variant(variant)
        return f"codecs/{self.profile}/{self.model}/{self.codec_name(variant)}"

    def codec_name(self, variant: str) -> str:
        """``<variant>-<recipe hash>`` (``<variant>-import-<hash>`` when imported): the last component of
        :meth:`codec_dir`."""
        kind = "-import" if self.codec_import(variant) else ""
        return f"{variant}{kind}-{recipe_hash(self.codec_recipe(variant))}"

    def codec_names(self, kind: str | None = None) -> dict[str, str]:
        """``{codec_name: variant}`` of every configured variant (the rules' wildcard values); ``kind``
        ``"trained"`` or ``"imported"`` keeps those only (``rkv_codec`` / ``rkv_codec_import``)."""
        if kind not in (None, "trained", "imported"):
            raise ValueError(f"kind must be None, 'trained' or 'imported', got {kind!r}")
        return {self.codec_name(v): v for v in self.variants
                if kind is None or (kind == "imported") == bool(self.codec_import(v))}

    def codec_import(self, variant: str) -> str | None:
        """The authors' checkpoint directory ``variant`` is imported from (``codec.import``; main codec only),
        or None: trained here."""
        return self.s["codec"].get(IMPORT_KEY) if variant == "main" else None

    def import_files(self, variant: str) -> list[str]:
        """The files an imported codec is built from (``config.json``, ``model.safetensors``): the rule's inputs."""
        from kvbench.compress.residualkv.deltakv_format import CONFIG_FILE, WEIGHTS_FILE

        src = self.codec_import(variant)
        return [f"{src}/{CONFIG_FILE}", f"{src}/{WEIGHTS_FILE}"] if src else []

    def codec_recipe(self, variant: str) -> dict:
        """Everything that determines ``variant``'s weights: trained, its CodecConfig overrides, training keys
        (:data:`TRAIN_KEYS`), seed and backbone directory, not ``slice_s`` (where invocations are cut);
        imported, the checkpoint directory, the overrides and the backbone directory.

        Raises:
            ValueError: the plan was built without ``seed`` or ``model_dir``.
        """
        if self.seed is None or self.model_dir is None:
            raise ValueError("RKVPlan needs seed= and model_dir= to name codec directories (their recipe includes both)")
        if self.codec_import(variant):
            return {"import": self.codec_import(variant), "codec": self.codec_overrides(variant),
                    "model": str(self.model_dir)}
        return {"codec": self.codec_overrides(variant), **self.codec_training(variant), "seed": self.seed,
                "model": str(self.model_dir)}

    def codec_origin(self, variant: str, root: str | Path = ".") -> str:
        """How ``variant``'s codec was made, for table headers: trained here (directory name, objective, steps x
        tokens, lr, data, seed) or imported from a directory (the weights' sha256 prefix from the codec's
        ``provenance.json`` under ``root``)."""
        src = self.codec_import(variant)
        named = self.seed is not None and self.model_dir is not None  # else no directory name (codec_recipe)
        if not src:
            t = self.codec_training(variant)
            return (f"trained here ({self.codec_name(variant) if named else variant}: objective {t.get('objective', 'joint')}, "
                    f"{t['steps']} steps x {t.get('seq_len', 512)} tokens, lr {t.get('lr', 2e-4):g}, "
                    f"data {t.get('data', 'text')}, seed {self.seed})")
        from kvbench.compress.residualkv.deltakv_format import PROVENANCE_FILE

        if not named:
            return f"imported from {src} (kvbench codec-import)"
        path = Path(root) / self.codec_dir(variant) / "codec" / PROVENANCE_FILE
        try:
            sha = json.loads(path.read_text())["weights_sha256"][:12]
        except (OSError, ValueError, KeyError):
            return f"imported from {src} (kvbench codec-import; {path} unreadable, so no weights hash)"
        return f"imported from {src} (kvbench codec-import; model.safetensors sha256 {sha}...)"

    def codec_slice_s(self, variant: str) -> int | None:
        """``slice_s`` of ``variant`` (its own key, else ``train``'s): seconds one invocation of
        ``kvbench codec-train`` may run before it saves its state and fails, to be rerun; None: no slice."""
        v = self.variant(variant)
        return v["slice_s"] if "slice_s" in v else self.s["train"].get("slice_s")

    def codec_runtime_min(self, variant: str) -> int:
        """Scheduler runtime (minutes) of one ``rkv_codec`` job: the slice plus 30 minutes to load the model,
        evaluate and save; without a slice, for a zoo model :data:`LOAD_FACTOR` x the measured time of its
        tokens at :data:`ZOO_CODEC_TOKENS_PER_S` plus 10, for a checkpoint one day (set ``slice_s`` there)."""
        slice_s = self.codec_slice_s(variant)
        if slice_s is not None:
            return math.ceil(slice_s / 60) + 30
        if not self.zoo:
            return 24 * 60
        t = self.codec_training(variant)
        return math.ceil(LOAD_FACTOR * t["steps"] * t["seq_len"] / ZOO_CODEC_TOKENS_PER_S / 60) + 10

    def codec_config(self, variant: str, shape: tuple[int, int] | None):
        """The :class:`~kvbench.compress.residualkv.codec.CodecConfig` ``variant`` trains on a backbone of
        ``shape`` = ``(n_layers, d_kv)`` (the codec's own defaults where the config is silent); an imported
        codec's from its checkpoint (:func:`~kvbench.compress.residualkv.deltakv_format.plan_import`: config.json
        and the tensor header, checked against ``shape`` when it is known).

        Raises:
            ValueError: an imported checkpoint is missing or refused (naming ``residualkv.codec.import``).
        """
        from kvbench.compress.residualkv.codec import codec_config_for_shape

        src = self.codec_import(variant)
        if not src:
            return codec_config_for_shape(*shape, **self.codec_overrides(variant))
        from kvbench.compress.residualkv.deltakv_format import plan_import

        key = (src, shape)
        if key not in self._imported:
            try:
                self._imported[key] = plan_import(src, shape, **self.codec_overrides(variant)).config
            except (OSError, ValueError) as e:
                raise ValueError(f"residualkv.codec.import {src!r}: {e}") from None
        return self._imported[key]

    def codec_overrides(self, variant: str) -> dict:
        """CodecConfig fields of ``variant``: the main codec's (without ``import``), updated by the variant's
        ``overrides``."""
        main = {k: v for k, v in self.s["codec"].items() if k != IMPORT_KEY}
        return {**main, **self.variant(variant).get("overrides", {})}

    def codec_placement(self, variant: str) -> dict:
        """``{device, gpus, grad_accum, checkpointing, dtype}`` of ``variant``'s training job (``residualkv.train``):
        ``gpus`` processes (one per GPU, ``torchrun``) each accumulating ``grad_accum = batch / gpus`` sequences.

        Raises:
            ValueError: ``gpus`` > 1 off CUDA, ``batch`` not a multiple of ``gpus``, or a half ``dtype`` other
                than bfloat16 on the CPU; naming ``residualkv.train`` and the values.
        """
        t, recipe = self.s["train"], self.codec_training(variant)
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

    def codec_train_flags(self, variant: str, resolve=lambda path: path) -> str:
        """The placement and corpus flags of ``kvbench codec-train`` for ``variant``, shell-quoted, only those
        that differ from the verb's defaults (``resolve`` maps a configured corpus path to the file).

        Raises:
            ValueError: ``data_files`` with ``data: tasks``, a directory, mixed or unknown suffixes, or
                ``text_field`` without ``data_files`` (naming ``residualkv.train``).
        """
        import shlex

        place, recipe = self.codec_placement(variant), self.codec_training(variant)
        if recipe.get("data_files"):
            from kvbench.data.local_text import corpus_builder

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

    def codec_gpus(self, variant: str) -> int:
        """GPUs ``variant``'s training job asks the scheduler for (0 on the CPU)."""
        place = self.codec_placement(variant)
        return place["gpus"] if place["device"].startswith("cuda") else 0

    def codec_launcher(self, variant: str) -> str:
        """``kvbench``, or for several GPUs ``torchrun --standalone --nproc_per_node N -m kvbench.cli`` (one
        process per GPU of one node; :mod:`kvbench.train.dist`)."""
        gpus = self.codec_placement(variant)["gpus"]
        return "kvbench" if gpus == 1 else f"torchrun --standalone --nproc_per_node {gpus} -m kvbench.cli"

    def codec_training(self, variant: str) -> dict:
        """``{objective, steps, seq_len, lr, data}`` of ``variant`` (its own keys, else the ``train`` section's)."""
        v = self.variant(variant)
        return {k: v[k] if k in v else self.s["train"][k] for k in TRAIN_KEYS if k in v or k in self.s["train"]}

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
        """``spec`` with the section's ``protocol`` (default ``one_pass``) unless it spells its own, so every run
        name says how its prompt met the cache."""
        if "protocol" in press_spec(spec).params:
            return spec
        return with_params(spec, protocol=self.s.get("protocol", "one_pass"))

    def protocols(self, target: str) -> list[str]:
        """The protocols ``target``'s rows ran under (sorted)."""
        return sorted({press_spec(r.spec).params["protocol"] for r in self.rows(target)})

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
        """The :class:`~kvbench.report.plan.Run` of press ``spec`` on the plan's model x ``task``."""
        parsed = press_spec(spec)
        return Run(self.model, task, parsed.canonical, parsed.slug, "residualkv")

    def run_dir(self, task: str, spec: str) -> str:
        """``results/runs/<profile>/<model>/<task>/residualkv/<slug>``."""
        return self.run(task, spec).path(self.profile)

    def target_tasks(self, target: str | None) -> list[str]:
        """The task columns of ``target``: the section's ``target_tasks.<target>`` (Table IV's multi-query tasks),
        else ``tasks``."""
        return list((self.s.get("target_tasks") or {}).get(target) or self.tasks)

    def runs(self, target: str) -> list[tuple[str, str]]:
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
        with ``target``, the protocol its rows ran under (:meth:`protocols`)."""
        tasks = ", ".join(self.target_tasks(target))
        # the smoke stand-ins: Table V's chain task stands for AIME (long generation), the others for LongBench
        stand_in = ("a long-generation smoke task in place of AIME" if target in GENERATION_TARGETS else
                    "RULER/SCBench/LongBench-style smoke tasks in place of LongBench")
        what = (f"model {self.model} (tiny zoo LM trained here, not the paper's models); tasks {tasks} "
                f"({stand_in})" if self.zoo else
                f"model {self.model} (local checkpoint); tasks {tasks} (local benchmark files)")
        return [f"# kvbench ResidualKV {title}, profile {self.profile!r}: {what}; "
                + ("not the paper's numbers" if self.zoo else "computed by this pipeline, not copied from the paper"),
               ] + ([f"# protocol: {'; '.join(PROTOCOL_NOTES[p] for p in self.protocols(target))} "
                     "(kvbench.compress.generate)"] if target else [])
