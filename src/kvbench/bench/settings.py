"""Settings of the ResidualKV profiling verbs, one frozen dataclass each, validated when built.

- :class:`DecodeThroughputConfig`: ``kvbench bench rkv-throughput`` (Fig. 8, :mod:`kvbench.bench.decode`);
- :class:`CodecCostConfig`: ``kvbench bench codec-cost`` (Fig. 6, :mod:`kvbench.bench.codec_cost`);
- :class:`VariantThroughputConfig`: ``kvbench bench rkv-variants`` (Fig. 11, :mod:`kvbench.bench.codec_variants`).

Each field is one flag of its verb and holds the verb's default, so the CLI (parsed flags), the measuring
functions' defaults and the workflow (the config's ``residualkv.fig8`` / ``fig6`` / ``fig11`` mappings,
:meth:`kvbench.plan.residualkv.RKVPlan.bench_args`) share one definition and one set of checks, and the
report never imports the CLI to check a config. The checks run before any model work, so a bad value fails
while Snakemake builds the DAG, not after it removed the old CSV.

Light on purpose (no torch at import, nor in the checks): the CLI and the report import it.
"""
from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from kvbench.bench import DTYPES
from kvbench.bench.timing_lm import TIMING_LMS, ZOO_TOKENIZER
from kvbench.utils.spec import is_int

#: Decode-throughput methods (:mod:`kvbench.bench.decode` describes each one's cache).
METHODS = ("full", "dynamic-cache-sdpa", "residualkv-omnikv", "residualkv-omnikv-unquantised",
           "residualkv-omnikv-latent-v")
#: Contexts (tokens) of the default CPU run of Fig. 8, out to 32K (cost: ``docs/decisions/benchmarks.md``, "Fig. 8 on the CPU: contexts and cost").
CPU_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
#: The paper's range (Fig. 8: 64K-900K tokens), for a GPU.
PAPER_CONTEXTS = (65536, 131072, 262144, 524288)
#: The random-weight LM the decode timings run on (:data:`kvbench.bench.timing_lm.TIMING_LMS`).
TIMING_LM = "timing-qwen2-lm-wide"
#: ``--device`` values of every ``kvbench bench`` verb (``auto``: CUDA when available, else CPU).
DEVICE_PATTERN = r"auto|cpu|cuda(:\d+)?"


def _int_at_least(lo: int, what: str, optional: bool = False) -> Callable[[str, Any], Any]:
    """Check of an integer field ``>= lo`` (None allowed when ``optional``: the verb's own default)."""
    def check(name: str, value: Any) -> Any:
        if optional and value is None:
            return None
        if not is_int(value) or value < lo:
            raise ValueError(f"{name} must be {what}, got {value!r}")
        return int(value)
    return check


def _text(optional: bool = False) -> Callable[[str, Any], Any]:
    """Check of a non-empty string field (a name or path; None allowed when ``optional``)."""
    def check(name: str, value: Any) -> Any:
        if optional and value is None:
            return None
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        return value
    return check


def _sequence(name: str, value: Any, what: str) -> tuple:
    """``value`` as a tuple; a list or tuple is required, since a lone string would be split into characters."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of {what}, got {value!r}")  # noqa: TRY004 (one type for bad settings)
    return tuple(value)


def check_contexts(name: str, value: Any) -> tuple[int, ...]:
    """``value`` as a tuple of context lengths (tokens).

    Raises:
        ValueError: not a list, empty, an entry that is not a positive integer, or a repeated length.
    """
    contexts = _sequence(name, value, "context lengths in tokens")
    if not contexts:
        raise ValueError(f"{name} is empty; expected context lengths in tokens, e.g. [1024, 2048]")
    bad = [c for c in contexts if not is_int(c) or c < 1]
    if bad:
        raise ValueError(f"{name} must be context lengths in tokens (positive integers), got {bad} in {list(contexts)}")
    if len(set(contexts)) != len(contexts):
        raise ValueError(f"{name} {list(contexts)} repeat a length; expected distinct lengths")
    return tuple(int(c) for c in contexts)


def check_methods(name: str, value: Any) -> tuple[str, ...]:
    """``value`` as a tuple of :data:`METHODS`.

    Raises:
        ValueError: not a list, empty, or an unknown method (naming it and :data:`METHODS`).
    """
    methods = _sequence(name, value, f"methods, some of {list(METHODS)}")
    if not methods:
        raise ValueError(f"{name} is empty; expected some of {list(METHODS)}")
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ValueError(f"{name}: unknown method(s) {bad}; expected some of {list(METHODS)}")
    return methods


def _check_model(name: str, value: Any) -> str:
    """A timing LM's name or a checkpoint directory with ``config.json``."""
    _text()(name, value)
    if Path(value, "config.json").is_file():
        return value
    if value not in TIMING_LMS:
        raise ValueError(f"{name} {value!r} is neither a timing LM {sorted(TIMING_LMS)} nor a checkpoint "
                         "directory with config.json")
    return value


def _check_device(name: str, value: Any) -> str:
    if not isinstance(value, str) or not re.fullmatch(DEVICE_PATTERN, value):
        raise ValueError(f"{name} must be auto, cpu, cuda or cuda:<index>, got {value!r}")
    return value


def _check_dtype(name: str, value: Any) -> str:
    if value not in DTYPES:
        raise ValueError(f"{name} must be one of {list(DTYPES)}, got {value!r}")
    return value


def _check_codec_shape(name: str, value: Any) -> tuple[int, int, int]:
    shape = _sequence(name, value, "three sizes (d_kv, d_c, d_ff)")
    if len(shape) != 3 or not all(is_int(v) and v >= 1 for v in shape):
        raise ValueError(f"{name} must be three positive integers (d_kv, d_c, d_ff), got {list(shape)}")
    return tuple(int(v) for v in shape)


_positive = _int_at_least(1, "a positive integer")
#: Field name -> check returning the normalised value (lists become tuples); a name means the same in every verb.
_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "model": _check_model,
    "tokenizer": _text(),
    "contexts": check_contexts,
    "methods": check_methods,
    "decode_steps": _positive,
    "repeats": _positive,
    "warmup": _int_at_least(0, "an integer >= 0"),
    "threads": _int_at_least(1, "a positive integer or None (torch's default)", optional=True),
    "device": _check_device,
    "dtype": _check_dtype,
    "seed": _int_at_least(-(2 ** 63), "an integer"),  # the lowest seed torch.manual_seed takes
    "codec_dir": _text(optional=True),
    "codec_shape": _check_codec_shape,
    "tokens": _positive,
    "prefill_chunk": _positive,
    "restore_tokens": _int_at_least(1, "a positive integer or None (ceil(0.17 tokens))", optional=True),
}


@dataclass(frozen=True)
class BenchConfig:
    """What every ResidualKV profiling verb takes; subclasses add their own fields.

    Parameters:
        device : str, default ``"auto"`` — ``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or
            ``cuda:<i>``.
        dtype : str, default ``"auto"`` — ``auto`` (bfloat16 on CUDA, float32 on CPU) or one of :data:`DTYPES`.
        seed : int, default 0 — random weights and inputs.
        threads : int or None, default None — torch intra-op threads (None: torch's own; set by the rule).

    Raises:
        ValueError: a field of the wrong type or range (naming the field, the value and what is expected),
            or a rule across fields of the subclass.
    """

    #: The ``kvbench bench`` verb and the paper figure it measures.
    VERB: ClassVar[str] = ""
    FIGURE: ClassVar[str] = ""
    #: Flags the Snakemake rule sets itself, so a config may not (fields among them are left out of
    #: :meth:`config_keys`).
    RULE_FLAGS: ClassVar[tuple[str, ...]] = ("out", "threads")

    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    threads: int | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            # frozen: the normalised value (a list as a tuple) is stored past the generated __setattr__
            object.__setattr__(self, f.name, _CHECKS[f.name](f.name, getattr(self, f.name)))
        self._check_together()

    def _check_together(self) -> None:
        """Rules across fields (none here)."""

    @classmethod
    def config_keys(cls) -> list[str]:
        """Field names a config mapping may set: every field but the :data:`RULE_FLAGS`."""
        return [f.name for f in dataclasses.fields(cls) if f.name not in cls.RULE_FLAGS]

    @classmethod
    def from_config(cls, mapping: Any) -> BenchConfig:
        """The settings of a config mapping (``{contexts: [512, 1024], repeats: 3}``); fields it leaves out
        keep their defaults.

        Raises:
            ValueError: ``mapping`` is not a mapping, has a key outside :meth:`config_keys` (listing them),
                or a value the fields refuse.
        """
        if not isinstance(mapping, Mapping):
            raise ValueError(f"expected a mapping of `kvbench bench {cls.VERB}` flags, got {mapping!r}")  # noqa: TRY004
        keys = cls.config_keys()
        unknown = sorted(str(k) for k in mapping if k not in keys)
        if unknown:
            raise ValueError(f"unknown key(s) {unknown}; `kvbench bench {cls.VERB}` takes {keys} here (the rule sets "
                             + ", ".join(f"--{k}" for k in cls.RULE_FLAGS) + " itself)")
        return cls(**mapping)

    def flags(self, keys: Iterable[str]) -> str:
        """The ``kvbench bench`` flags of the fields ``keys``, in that order, shell-quoted, lists space-separated:
        ``("contexts", "repeats")`` -> ``--contexts 512 1024 --repeats 3``. A field that is None (the verb's
        default) gives no flag.

        Raises:
            AttributeError: a key that is not a field.
        """
        argv = []
        for key in keys:
            value = getattr(self, key)
            if value is not None:
                argv += [f"--{key.replace('_', '-')}", *map(str, value if isinstance(value, tuple) else [value])]
        return " ".join(shlex.quote(a) for a in argv)


@dataclass(frozen=True)
class DecodeThroughputConfig(BenchConfig):
    """``kvbench bench rkv-throughput``: ResidualKV Fig. 8, decode tokens/s vs context length at batch 1
    (:func:`kvbench.bench.decode.measure_decode_throughput`).

    Parameters (besides :class:`BenchConfig`'s):
        model : str, default :data:`TIMING_LM` — a timing LM (random weights) or a checkpoint directory
            with ``config.json``.
        tokenizer : str, default :data:`ZOO_TOKENIZER` — tokenizer whose vocabulary size a timing LM takes
            (set by the rule).
        contexts : tuple of int, default :data:`CPU_CONTEXTS` — distinct context lengths, tokens
            (:data:`PAPER_CONTEXTS` on a GPU).
        methods : tuple of str, default :data:`METHODS` — some of :data:`METHODS`.
        decode_steps : int, default 32 — timed greedy steps per run.
        repeats : int, default 3 — timed runs per (context, method).
        warmup : int, default 4 — untimed greedy steps first.
        codec_dir : str or None, default None — a trained codec for the model (None: a random one).
        prefill_chunk : int, default 2048 — tokens per untimed prefill forward (memory: a chunk's attention
            holds ``chunk x context`` scores per head).

    Raises:
        ValueError: see :class:`BenchConfig`; a context shorter than the codec's sink tokens is refused only
            by the run (the codec is not read here).
    """

    VERB: ClassVar[str] = "rkv-throughput"
    FIGURE: ClassVar[str] = "fig8"
    RULE_FLAGS: ClassVar[tuple[str, ...]] = ("out", "tokenizer", "threads")

    model: str = TIMING_LM
    tokenizer: str = ZOO_TOKENIZER
    contexts: tuple[int, ...] = CPU_CONTEXTS
    methods: tuple[str, ...] = METHODS
    decode_steps: int = 32
    repeats: int = 3
    warmup: int = 4
    codec_dir: str | None = None
    prefill_chunk: int = 2048


@dataclass(frozen=True)
class CodecCostConfig(BenchConfig):
    """``kvbench bench codec-cost``: ResidualKV Fig. 6, the cost of the codec's non-linear map on the write
    side vs the read side at matched parameters (:func:`kvbench.bench.codec_cost.measure_codec_cost`).

    Parameters (besides :class:`BenchConfig`'s):
        codec_shape : (int, int, int), default (2048, 512, 3072) — ``(d_kv, d_c, d_ff)`` of the codec
            (Table I, Llama-3.1-8B).
        tokens : int, default 4096 — tokens coded on the prefill path.
        restore_tokens : int or None, default None — tokens restored per decode step, at most ``tokens``
            (None: ``ceil(0.17 tokens)``, OmniKV's keep).
        decode_steps : int, default 512 — restores in the total time.
        repeats : int, default 5 — timed runs of each path.
        warmup : int, default 1 — untimed runs of each path first.

    Raises:
        ValueError: see :class:`BenchConfig`; ``restore_tokens > tokens``.
    """

    VERB: ClassVar[str] = "codec-cost"
    FIGURE: ClassVar[str] = "fig6"

    codec_shape: tuple[int, int, int] = (2048, 512, 3072)
    tokens: int = 4096
    restore_tokens: int | None = None
    decode_steps: int = 512
    repeats: int = 5
    warmup: int = 1

    def _check_together(self) -> None:
        if self.restore_tokens is not None and self.restore_tokens > self.tokens:
            raise ValueError(f"restore_tokens = {self.restore_tokens} exceeds tokens = {self.tokens} "
                             "(a step restores coded tokens)")


@dataclass(frozen=True)
class VariantThroughputConfig(BenchConfig):
    """``kvbench bench rkv-variants``: ResidualKV Fig. 11's throughput panel, decode tokens/s of each codec
    variant's shape relative to the default one (:func:`kvbench.bench.codec_variants.measure_variant_throughput`).
    The codec directories (``--codecs``) and the default label (``--default``) are inputs of the rule, not
    settings.

    Parameters (besides :class:`BenchConfig`'s):
        model : str, default :data:`TIMING_LM` — a timing LM (random weights) or a checkpoint directory
            with ``config.json``.
        tokenizer : str, default :data:`ZOO_TOKENIZER` — as :class:`DecodeThroughputConfig` (set by the rule).
        contexts : tuple of one int, default (4096,) — the context length, tokens (Fig. 11 times one).
        decode_steps : int, default 16 — timed greedy steps per run.
        repeats : int, default 3 — timed runs per variant.
        warmup : int, default 2 — untimed greedy steps first.

    Raises:
        ValueError: see :class:`BenchConfig`; more than one context.
    """

    VERB: ClassVar[str] = "rkv-variants"
    FIGURE: ClassVar[str] = "fig11"
    RULE_FLAGS: ClassVar[tuple[str, ...]] = ("out", "codecs", "default", "tokenizer", "threads")

    model: str = TIMING_LM
    tokenizer: str = ZOO_TOKENIZER
    contexts: tuple[int, ...] = (4096,)
    decode_steps: int = 16
    repeats: int = 3
    warmup: int = 2

    def _check_together(self) -> None:
        if len(self.contexts) != 1:
            raise ValueError(f"contexts must be one context length (Fig. 11 times one), got {list(self.contexts)}")


#: Config key (``residualkv.<fig>``) -> settings of the verb that profiles that figure.
BY_FIGURE: dict[str, type[BenchConfig]] = {c.FIGURE: c for c in (DecodeThroughputConfig, CodecCostConfig,
                                                                  VariantThroughputConfig)}
#: ``kvbench bench`` verb -> its settings.
BY_VERB: dict[str, type[BenchConfig]] = {c.VERB: c for c in BY_FIGURE.values()}
