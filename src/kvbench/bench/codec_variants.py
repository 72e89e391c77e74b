"""ResidualKV Fig. 11's throughput panel: relative decode throughput of codec hyper-parameter settings.

The paper (§V-C, Fig. 11) plots, for each of d_c, k, d_ff and the stride s, the NTP loss and the decode
throughput relative to the default setting. The NTP loss comes from the trained variant codecs
(:func:`kvbench.report.residualkv.figures.fig11`); this module measures the throughput.

Why a timing model and random codecs: the zoo LM is so small that a decode step is Python overhead
(:mod:`kvbench.bench.timing_lm`), so its tokens/s cannot tell codec shapes apart. Each variant's codec
shape is read from its trained ``codec.json`` and carried to the wider random-weight timing LM **at the
same ratios**: ``d_c`` and ``d_ff`` are scaled by ``d_kv(timing LM) / d_kv(codec)`` (the zoo's 128 ->
the timing LM's 512: d_c 32 -> 128, d_ff 192 -> 768), while ``k``, ``stride``, ``alpha``, ``n_sink``,
``window`` and the codec form (joint, encoder/decoder kinds, references) are kept as trained. The codec
weights are random (:meth:`ResidualCodec.for_model`, one seed for all): restore time depends on shapes
and on how many references each restored token averages, not on the weights.

The paper measures at 128K tokens and batch 16; the compressed caches here run batch 1. Each variant runs
ResidualKV+OmniKV with 4-bit codes, 4-bit KIVI-style full layers and FP8 references (the ``residualkv-omnikv``
method of :mod:`kvbench.bench.decode`) at one context, timed with :func:`kvbench.bench.decode.time_decode`
(fresh cache, per-step times: median tokens/s and the 95% interval of :data:`kvbench.bench.clock.STEP_INTERVAL`);
``relative_throughput`` is its tokens/s over the ``default`` variant's. Each row carries Fig. 8's bandwidth
columns (:mod:`kvbench.bench.bandwidth`).
"""
from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from kvbench.bench import bandwidth, clock, decode
from kvbench.bench.latency import resolve_device
from kvbench.bench.settings import VariantThroughputConfig
from kvbench.bench.timing_lm import TIMING_LMS, ZOO_TOKENIZER, full_layers_for, full_layers_of
from kvbench.compress.residualkv.codec import CodecConfig, ResidualCodec, codec_config_for_shape, model_kv_shape

COLUMNS = ["variant", "default", "context", "codec_d_kv", "d_kv", "d_c", "d_ff", "k", "stride", "alpha",
           *decode.TIMING_COLUMNS[:4], "relative_throughput", *decode.TIMING_COLUMNS[4:], "model", "weights",
           "device", "dtype", "threads"]
#: Shape fields carried unchanged from the trained codec (widths are scaled, see the module docstring).
KEPT_FIELDS = ("k", "n_sink", "stride", "alpha", "grid", "window", "bias", "joint", "encoder", "decoder",
               "references")


def read_codec_configs(codec_dirs: Mapping[str, str | Path]) -> dict[str, CodecConfig]:
    """``{label: CodecConfig}`` from each directory's ``codec.json``.

    Raises:
        ValueError: an empty mapping, or a label whose directory holds no ``codec.json`` (naming both).
    """
    if not codec_dirs:
        raise ValueError("no codec variants given; expected LABEL=DIR pairs of trained codecs")
    out = {}
    for label, d in codec_dirs.items():
        path = Path(d) / "codec.json"
        if not path.is_file():
            raise ValueError(f"codec variant {label!r}: {str(d)!r} holds no trained codec (codec.json missing)")
        out[label] = CodecConfig.from_json(path.read_text())
    return out


def scaled_overrides(cfg: CodecConfig, d_kv: int) -> dict:
    """:meth:`ResidualCodec.for_model` overrides that carry ``cfg`` to a model with ``d_kv`` (``2 d_k``).

    ``d_c`` and ``d_ff`` keep their ratio to ``d_kv`` (rounded, at least 1); :data:`KEPT_FIELDS` are copied.
    """
    scale = d_kv / cfg.d_kv
    return {"d_c": max(1, round(cfg.d_c * scale)), "d_ff": max(1, round(cfg.d_ff * scale)),
            **{f: getattr(cfg, f) for f in KEPT_FIELDS}}


def measure_variant_throughput(codec_dirs: Mapping[str, str | Path], default: str,
                               model_name: str = VariantThroughputConfig.model,
                               context: int = VariantThroughputConfig.contexts[0],
                               decode_steps: int = VariantThroughputConfig.decode_steps,
                               warmup_steps: int = VariantThroughputConfig.warmup,
                               repeats: int = VariantThroughputConfig.repeats,
                               threads: int | None = None, device: str = "cpu", dtype: str = "auto",
                               seed: int = 0, *, tokenizer: str = ZOO_TOKENIZER, vocab_size: int | None = None,
                               keep: float = decode.OMNIKV_KEEP,
                               full_layers: Sequence[int] | None = None,
                               copy_mib: int = 256,
                               log: Callable[[str], None] | None = None) -> tuple[list[dict], str]:
    """One row per variant (:data:`COLUMNS`) and the CSV header line.

    Args:
        codec_dirs: ``{label: trained codec directory}``; only ``codec.json`` (the shape) is read.
        default: the label whose tokens/s is 1.0 in ``relative_throughput`` (the default setting).
        model_name: a timing LM (:data:`~kvbench.bench.timing_lm.TIMING_LMS`) or a checkpoint directory.
        context: context length in tokens (random ids, prefill untimed).
        decode_steps, warmup_steps, repeats, threads, device, dtype, seed, tokenizer, vocab_size, keep,
            full_layers, copy_mib: as :func:`kvbench.bench.decode.measure_decode_throughput`.

    Raises:
        ValueError: ``default`` not among the labels; a variant whose scaled shape is invalid (checked for
            all before any timing, naming the variant and its trained d_c); see :func:`read_codec_configs`
            and :func:`kvbench.bench.decode.check_inputs`.
    """
    if default not in codec_dirs:
        raise ValueError(f"default variant {default!r} is not among the codec variants {sorted(codec_dirs)}")
    configs = read_codec_configs(codec_dirs)
    for cfg in configs.values():
        decode.check_inputs([context], ["residualkv-omnikv"], decode_steps, warmup_steps, repeats, cfg.n_sink)
    if threads is not None:
        torch.set_num_threads(threads)
    dev, dt = resolve_device(device, dtype)
    model, weights = decode.load_lm(model_name, dev, dt, seed, vocab_size, tokenizer)
    n_layers, d_kv = model_kv_shape(model)
    if full_layers is None:
        full_layers = full_layers_of(model_name) if model_name in TIMING_LMS else full_layers_for(n_layers)
    layers = tuple(full_layers)
    scaled = {}
    for label, cfg in configs.items():  # every shape first: a misfit must not cost the others' timings
        scaled[label] = scaled_overrides(cfg, d_kv)
        try:
            codec_config_for_shape(n_layers, d_kv, **scaled[label])
        except ValueError as e:
            raise ValueError(f"codec variant {label!r} (trained d_c {cfg.d_c}, d_ff {cfg.d_ff} at d_kv {cfg.d_kv}) "
                             f"scaled to {model_name}'s d_kv {d_kv} gives d_c {scaled[label]['d_c']}, d_ff "
                             f"{scaled[label]['d_ff']}: {e}") from None
    machine = bandwidth.copy_gb_s(dev, mib=copy_mib)
    wbytes, peak = bandwidth.weight_bytes(model), bandwidth.peak_gb_s(dev)
    rows = []
    for label, cfg in configs.items():
        over = scaled[label]
        with tempfile.TemporaryDirectory(prefix="kvbench-codec-") as tmp:
            ResidualCodec.for_model(model, seed=seed, **over).save(tmp)
            press = decode.make_press("residualkv-omnikv", tmp, layers, keep)
            r = decode.time_decode(model, press, context, decode_steps, warmup_steps, repeats, seed)
            decode.release(dev)
        r.update(bandwidth.step_columns(wbytes, r["kv_read_bytes"], r["kv_read_source"], r["ms_per_token"], machine,
                                        peak))
        rows.append({"variant": label, "default": label == default, "context": context, "codec_d_kv": cfg.d_kv,
                     "d_kv": d_kv, "d_c": over["d_c"], "d_ff": over["d_ff"], "k": cfg.k, "stride": cfg.stride,
                     "alpha": cfg.alpha, **r, "model": model_name, "weights": weights, "device": str(dev),
                     "dtype": str(dt).removeprefix("torch."), "threads": torch.get_num_threads()})
        if log:
            log(f"{label:<12} d_c {over['d_c']:>4} d_ff {over['d_ff']:>5} k {cfg.k} s {cfg.stride}: "
                f"{r['tokens_per_s']:.2f} tok/s")
    base = next(r["tokens_per_s"] for r in rows if r["default"])
    for r in rows:
        r["relative_throughput"] = r["tokens_per_s"] / base
    head = (f"# kvbench ResidualKV Fig. 11 throughput: decode tokens/s of ResidualKV+OmniKV (4-bit codes, 4-bit full layers, FP8 "
            f"references, keep {keep}) per codec setting, on a timing model with {weights.upper()} weights "
            f"({model_name}) and RANDOM codecs of each trained variant's shape scaled to d_kv {d_kv} (same d_c/d_kv, "
            f"d_ff/d_kv; k and stride as trained); context {context} random ids, a fresh cache per variant; tokens/s = "
            f"1000 / median step time over {repeats} runs of {decode_steps} steps after {warmup_steps} warm-up; "
            f"{clock.STEP_INTERVAL}; bytes per step and GB/s as Fig. 8; batch 1; relative to {default!r}; not the "
            f"paper's numbers (128K tokens, batch 16, H100)")
    return rows, head


def parse_codec_dirs(pairs: Sequence[str]) -> dict[str, str]:
    """``["label=dir", ...]`` -> ``{label: dir}``.

    Raises:
        ValueError: a pair without ``=``, an empty label or directory, or a repeated label.
    """
    out: dict[str, str] = {}
    for p in pairs:
        label, sep, d = p.partition("=")
        if not sep or not label or not d:
            raise ValueError(f"codec variant {p!r} is not LABEL=DIR")
        if label in out:
            raise ValueError(f"codec variant label {label!r} given twice")
        out[label] = d
    return out
