"""ResidualKV Fig. 8: decode throughput (tokens/s) vs context length, batch 1.

The paper (§V-B, Fig. 8; one H100, batch 1, contexts 64K-900K) compares full attention with
ResidualKV+OmniKV, quantised and unquantised. Here, per (context, method), with a **fresh cache** each
(so no method carries codes or timings of another context, and each holds one cache at a time):

1. a context of ``context`` random token ids (the same ids for every method) is prefilled through the
   method's cache in chunks of ``prefill_chunk`` tokens (memory: the attention of a chunk is ``chunk x
   context``); the prefill is **not** timed (its wall time is the ``prefill_s`` column);
2. ``warmup_steps`` greedy decode steps run untimed, then ``repeats`` runs of ``decode_steps`` greedy steps,
   each step timed with the device-synchronised clock (:mod:`kvbench.bench.clock`);
3. ``tokens_per_s`` = 1000 / the median step time over all timed steps; ``tps_lo95`` / ``tps_hi95``: the
   95% interval :data:`kvbench.bench.clock.STEP_INTERVAL` (:func:`~kvbench.bench.clock.step_rate`);
4. the cache's measured keep ratio (packed bytes / full FP16 bytes, the paper's accounting:
   :func:`keep_ratio_measured` with ``kind="packed"``; ``kr_measured``), compute ratio (keys attended per
   layer / visible tokens, mean over the timed steps, :func:`compute_ratio_measured`; ``cr_measured``) and
   the bandwidth columns of :mod:`kvbench.bench.bandwidth` (bytes the last timed step read, achieved GB/s,
   share of the machine's copy bandwidth measured once per run) are recorded;
5. ``vs_full`` / ``vs_dynamic_cache``: tokens/s over ``full``'s / ``dynamic-cache-sdpa``'s at the same context
   (empty when that method was not run).

Methods (:data:`METHODS`):

- ``full``: :class:`~kvbench.compress.cache.Press`, our exact full cache read through the press attention;
- ``dynamic-cache-sdpa``: transformers' own ``DynamicCache`` with the model's ``sdpa`` attention, no kvbench
  code on the path: the outside reference for full attention (:class:`DynamicCacheSDPA`). The header notes
  the contexts where ``full`` is slower than it;
- ``residualkv-omnikv``: :class:`ResidualKVPress` (``residualkv+omnikv``, 4-bit residual codes, FP8
  references, ``keep`` 0.17, the authors' OmniKV config);
- ``residualkv-omnikv-unquantised``: the same with 16-bit codes and float32 references;
- ``residualkv-omnikv-latent-v``: ``residualkv-omnikv`` with ``latent_v``: at decode steps W_V is applied to the
  attention-weighted codes instead of decoding V per restored token (beyond the paper; same result up to
  rounding, :meth:`ResidualKVLayer.attend <kvbench.compress.residualkv.cache.ResidualKVLayer.attend>`).

As in the paper's quantised curve, ``residualkv-omnikv`` also stores its full-attention layers KIVI-style
in 4 bits (``ResidualKVPress.full_kv_bits = 4``); the unquantised one keeps them exact (16). The
``full_kv_bits`` column records it.

Timing models (:mod:`kvbench.bench.timing_lm`) have RANDOM weights and, unless ``codec_dir`` is given,
the codec is random too (:meth:`ResidualCodec.for_model`): decode time depends on shapes and on how many
tokens each layer reads and restores, not on trained weights. The numbers are this machine's, not the
paper's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import inspect
import resource
import statistics
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from kvbench import kernels
from kvbench.bench import bandwidth, clock
from kvbench.bench.latency import resolve_device
from kvbench.bench.settings import (
    METHODS,
    DecodeThroughputConfig,
    check_contexts,
    check_methods,
)
from kvbench.bench.timing_lm import (
    TIMING_LMS,
    ZOO_TOKENIZER,
    build_timing_lm,
    fixed_vocab_size,
    full_layers_for,
    full_layers_of,
    zoo_vocab_size,
)
from kvbench.compress import checks
from kvbench.compress.accounting import compute_ratio_measured, keep_ratio_measured
from kvbench.compress.cache import Press, press_attention
from kvbench.compress.presses.omnikv import OmniKVPress
from kvbench.compress.residualkv.cache import ResidualKVPress
from kvbench.compress.residualkv.codec import CodecConfig, ResidualCodec, model_kv_shape
from kvbench.models.loader import load_model
from kvbench.utils.io import atomic_path

#: Timing columns shared with Fig. 11 (:mod:`kvbench.bench.codec_variants`), then the bandwidth columns.
TIMING_COLUMNS = ["tokens_per_s", "tps_lo95", "tps_hi95", "ms_per_token", "kr_measured", "cr_measured",
                  *bandwidth.COLUMNS, "prefill_s", "peak_mem_gib"]
COLUMNS = ["model", "weights", "device", "dtype", "threads", "context", "method", "decode_steps", "repeats",
           *TIMING_COLUMNS[:4], "vs_full", "vs_dynamic_cache", *TIMING_COLUMNS[4:], "full_kv_bits", "kernels",
           "checks"]
#: Sink tokens of a codec built by ``ResidualCodec.for_model`` (the CodecConfig default).
_DEFAULT_N_SINK = {f.name: f.default for f in dataclasses.fields(CodecConfig)}["n_sink"]
#: OmniKV share of candidate tokens restored (ResidualKV authors' configs; docs/decisions/presses.md, "The authors' baseline settings").
OMNIKV_KEEP = 0.17


class OutOfMemory(ValueError):
    """A (context, method) ran out of memory (a ValueError, so the CLI prints one line): the message names them."""


@dataclasses.dataclass(frozen=True)
class DynamicCacheSDPA:
    """The ``dynamic-cache-sdpa`` method: transformers' ``DynamicCache`` read by the model's own ``sdpa``
    attention (every key and value, exact), the reference a kvbench cache is compared with. Not a
    :class:`Press`: no kvbench code runs on its path. ``full_kv_bits`` 16: its K/V are held in the model's
    dtype."""

    full_kv_bits: int = 16


def check_inputs(contexts: Sequence[int], methods: Sequence[str], decode_steps: int, warmup_steps: int,
                 repeats: int, n_sink: int) -> None:
    """Validate a run before any model work.

    Raises:
        ValueError: empty ``contexts`` or ``methods``, an unknown method (names :data:`METHODS`), a
            repeated context, a context below ``n_sink`` (the sparse layers' raw sink tokens), ``decode_steps`` or ``repeats``
            below 1, or negative ``warmup_steps``.
    """
    check_methods("methods", list(methods))
    check_contexts("contexts", list(contexts))
    short = [c for c in contexts if int(c) < n_sink]
    if short:
        raise ValueError(f"context(s) {short} shorter than n_sink = {n_sink} (the codec's sink tokens)")
    if decode_steps < 1 or repeats < 1 or warmup_steps < 0:
        raise ValueError(f"decode_steps and repeats must be >= 1 and warmup_steps >= 0, got "
                         f"decode_steps={decode_steps}, repeats={repeats}, warmup_steps={warmup_steps}")


def make_press(method: str, codec_dir: str | Path, full_layers: Sequence[int],
               keep: float = OMNIKV_KEEP) -> Press | DynamicCacheSDPA:
    """The press of ``method`` (:data:`METHODS`; the module docstring gives each one's settings), or
    :class:`DynamicCacheSDPA` for ``dynamic-cache-sdpa``.

    Raises:
        ValueError: unknown method, or the press rejects its settings.
    """
    if method == "full":
        return Press()
    if method == "dynamic-cache-sdpa":
        return DynamicCacheSDPA()
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {list(METHODS)}")
    quantised = method != "residualkv-omnikv-unquantised"
    return ResidualKVPress(codec_dir=str(codec_dir), selector=OmniKVPress(keep=keep), full_layers=tuple(full_layers),
                           bits=4 if quantised else 16, ref_fp8=quantised, full_kv_bits=4 if quantised else 16,
                           latent_v=method == "residualkv-omnikv-latent-v")


def slower_than_reference(rows: Sequence[dict]) -> list[int]:
    """Contexts where ``full`` (ours) decodes slower than ``dynamic-cache-sdpa`` (``vs_dynamic_cache < 1``)."""
    return [r["context"] for r in rows if r["method"] == "full" and (r.get("vs_dynamic_cache") or 1.0) < 1.0]


def header_line(model: str, weights: str, codec: str, contexts: Sequence[int], decode_steps: int,
                warmup_steps: int, repeats: int, rows: Sequence[dict] = ()) -> str:
    """The CSV's ``#`` first line: what was measured, how the interval is defined, why these are not the
    paper's numbers, and (from ``rows``) the contexts where our full cache is slower than transformers'."""
    slow = slower_than_reference(rows)
    note = (f"; NOTE: our full cache is slower than transformers' DynamicCache+SDPA at context(s) "
            f"{'/'.join(map(str, slow))} (vs_dynamic_cache < 1)") if slow else ""
    return (f"# kvbench ResidualKV Fig. 8: decode throughput at batch 1 on a timing model with "
            f"{weights.upper()} weights ({model}) and a {codec} codec (decode time depends on shapes and on how "
            f"many tokens each layer reads and restores, not on trained weights); contexts "
            f"{'/'.join(str(c) for c in contexts)} of random token ids, a fresh cache per (context, method), "
            f"prefill not timed; tokens/s = 1000 / median step time over {repeats} runs of {decode_steps} "
            f"greedy steps after {warmup_steps} warm-up steps; {clock.STEP_INTERVAL}; bytes per step = weights "
            f"+ KV read (kv_read_source audit: the packed form a fused kernel reads; the CPU torch path reads wider "
            f"rows, so its achieved GB/s is a lower bound), GB/s against a copy benchmark (read + written) in the "
            f"same process; peak_mem_gib on a CPU is the process's peak so far; OmniKV keep "
            f"{OMNIKV_KEEP}; full layers 4-bit KIVI-style when quantised, exact otherwise; not the paper's numbers "
            f"(one H100, 64K-900K tokens){note}")


def load_lm(model_name_or_dir: str, device: torch.device, dtype: torch.dtype, seed: int,
            vocab_size: int | None, tokenizer: str) -> tuple[Any, str]:
    """``(model, weights)``: a timing LM (random weights; vocabulary ``vocab_size``, else the LM's fixed one,
    else ``tokenizer``'s) or a checkpoint (:func:`kvbench.models.loader.load_model`, "trained")."""
    if model_name_or_dir in TIMING_LMS:
        vocab = vocab_size or fixed_vocab_size(model_name_or_dir) or zoo_vocab_size(tokenizer)
        return build_timing_lm(model_name_or_dir, vocab, device=device, dtype=dtype, seed=seed), "random"

    model, _ = load_model(model_name_or_dir, dtype=dtype, device=str(device))
    return model, "trained"


@functools.cache
def _cache_kwarg(model_cls: type) -> str:
    """The forward's name of the cache argument: ``cache`` (transformers >= 5.2x, the pin) or, in an older
    transformers (a GPU image's), ``past_key_values``; an unknown keyword would be swallowed by ``**kwargs``
    and the model would decode without its cache."""
    return "cache" if "cache" in inspect.signature(model_cls.forward).parameters else "past_key_values"


def last_logits(model: Any, cache: Any, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Last-position logits ``[vocab]`` of ``ids`` ``[1, t]`` (int64 token ids) at positions
    ``start..start+t-1``, reading and writing ``cache`` (a transformers ``Cache``: a kvbench ``PressCache`` inside
    :func:`~kvbench.compress.cache.press_attention`, or a ``DynamicCache``)."""
    pos = torch.arange(start, start + ids.shape[1], device=ids.device).view(1, -1)
    kw = {_cache_kwarg(type(model)): cache}
    return model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1, **kw).logits[0, -1]


@contextlib.contextmanager
def _open_cache(model: Any, press: Press | DynamicCacheSDPA) -> Iterator[Any]:
    """A fresh cache of ``press`` with the model's attention set to read it; restored on exit."""
    if isinstance(press, DynamicCacheSDPA):
        from transformers import DynamicCache

        old = model.config._attn_implementation
        model.set_attn_implementation("sdpa")
        try:
            yield DynamicCache(config=model.config)
        finally:
            model.set_attn_implementation(old)
        return
    cache = press.new_cache(model)
    with press_attention(model, cache):
        yield cache


def _peak_mem_gib(device: torch.device) -> float:
    """CUDA: peak bytes allocated since the last reset (GiB); CPU: the process's peak resident set so far
    (``ru_maxrss``, KiB on Linux; monotonic over the run, so the largest context's row bounds it)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


@torch.inference_mode()
def time_decode(model: Any, press: Press | DynamicCacheSDPA, context: int, decode_steps: int, warmup_steps: int,
                repeats: int, seed: int = 0, prefill_chunk: int = 2048) -> dict[str, Any]:
    """Time greedy decoding at ``context`` tokens through a fresh cache of ``press`` (module docstring, 1-3).

    Returns:
        ``tokens_per_s``, ``tps_lo95``, ``tps_hi95`` (tokens/s), ``ms_per_token`` (the median step, ms),
        ``kr_measured`` (after the last timed step), ``cr_measured`` (mean over the timed steps; 1.0 for
        :class:`DynamicCacheSDPA`, which reads every key), ``kv_read_bytes`` and ``kv_read_source`` (the last
        timed step, :mod:`kvbench.bench.bandwidth`), ``prefill_s`` (untimed prefill, s) and ``peak_mem_gib``.
    """
    device = model.device
    tc = model.config.get_text_config()
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    ids = torch.randint(tc.vocab_size, (1, context), generator=torch.Generator().manual_seed(seed)).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with _open_cache(model, press) as cache:
        t0 = clock.now(device)
        for start in range(0, context, prefill_chunk):
            logits = last_logits(model, cache, ids[:, start:start + prefill_chunk], start)
        prefill_s, pos = clock.now(device) - t0, context
        if cache.get_seq_length() != context:   # a cache the model never wrote would time attention over nothing
            raise RuntimeError(f"the model wrote {cache.get_seq_length()} of {context} prefilled tokens to its cache")
        for _ in range(warmup_steps):
            logits = last_logits(model, cache, logits.argmax().view(1, 1), pos)
            pos += 1
        first_timed, step_ms = pos, []
        for _ in range(repeats * decode_steps):
            t0 = clock.now(device)
            logits = last_logits(model, cache, logits.argmax().view(1, 1), pos)
            step_ms.append((clock.now(device) - t0) * 1000)
            pos += 1
        if isinstance(press, DynamicCacheSDPA):
            kr = cr = 1.0   # every key exact and attended: the full cache by definition
            kv, source = bandwidth.tensor_bytes(t for layer in cache.layers for t in (layer.keys, layer.values)), "tensors"
        else:
            # the step at position p sees p + 1 tokens (itself included), as the attention mask does
            cr = statistics.fmean(compute_ratio_measured(a, first_timed + i + 1)
                                  for i, a in enumerate(cache.attended[-len(step_ms):]))
            kr = keep_ratio_measured(cache.stored_bytes(), kind="packed", n_tokens=pos,
                                     n_layers=tc.num_hidden_layers, n_kv_heads=tc.num_key_value_heads,
                                     head_dim=head_dim)
            kv, source = bandwidth.press_read_bytes(cache, pos, 2 * tc.num_key_value_heads * head_dim,
                                                    model.dtype.itemsize)
    rate = clock.step_rate(step_ms)
    return {"tokens_per_s": rate["tokens_per_s"], "tps_lo95": rate["tps_lo95"], "tps_hi95": rate["tps_hi95"],
            "ms_per_token": rate["median_ms"], "kr_measured": kr, "cr_measured": cr, "kv_read_bytes": kv,
            "kv_read_source": source, "prefill_s": prefill_s, "peak_mem_gib": _peak_mem_gib(device)}


def release(device: torch.device) -> None:
    """Free what the last cache left (Python garbage, CUDA's cached blocks), so the next holds alone."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def add_ratios(rows: list[dict]) -> None:
    """Set ``vs_full`` and ``vs_dynamic_cache`` of every row in place: its tokens/s over that method's at the
    same context (None when that method has no row there)."""
    for col, ref in (("vs_full", "full"), ("vs_dynamic_cache", "dynamic-cache-sdpa")):
        base = {r["context"]: r["tokens_per_s"] for r in rows if r["method"] == ref}
        for r in rows:
            r[col] = r["tokens_per_s"] / base[r["context"]] if r["context"] in base else None


def measure_decode_throughput(model_name_or_dir: str, contexts: Sequence[int] = DecodeThroughputConfig.contexts,
                              methods: Sequence[str] = DecodeThroughputConfig.methods,
                              decode_steps: int = DecodeThroughputConfig.decode_steps,
                              warmup_steps: int = DecodeThroughputConfig.warmup,
                              repeats: int = DecodeThroughputConfig.repeats, threads: int | None = None,
                              device: str = "cpu", dtype: str = "auto", seed: int = 0, *, codec_dir: str | None = None,
                              vocab_size: int | None = None, tokenizer: str = ZOO_TOKENIZER,
                              full_layers: Sequence[int] | None = None, keep: float = OMNIKV_KEEP,
                              prefill_chunk: int = DecodeThroughputConfig.prefill_chunk, copy_mib: int = 256,
                              log: Callable[[str], None] | None = None,
                              on_context: Callable[[list[dict], str], None] | None = None) -> tuple[list[dict], str]:
    """Fig. 8's measurements: one row per (context, method) with :data:`COLUMNS`, and the header line.

    Each row records what its decode steps ran on (``kernels``: :func:`kvbench.kernels.describe`, e.g.
    ``triton-interpreter`` under ``TRITON_INTERPRET=1``) and whether ``KVBENCH_CHECKS`` was on (``checks``: host
    read-backs in every step), so measurements taken another way are told apart.

    Args:
        model_name_or_dir: a timing LM (:data:`~kvbench.bench.timing_lm.TIMING_LMS`, random weights) or a
            checkpoint directory / zoo name.
        contexts: context lengths in tokens (:data:`~kvbench.bench.settings.CPU_CONTEXTS` by default;
            :data:`~kvbench.bench.settings.PAPER_CONTEXTS` on a GPU), run in the order given.
        methods: some of :data:`METHODS`.
        decode_steps, warmup_steps, repeats: timed greedy steps per run, untimed steps first, timed runs.
        threads: torch intra-op threads (None: leave as is). device: ``cpu``, ``cuda[:i]`` or ``auto``.
        dtype: ``auto`` (bfloat16 on CUDA, float32 on CPU) or a torch dtype name.
        seed: timing-model weights, random codec and context ids.
        codec_dir: a trained codec for the model; None builds a random one (``ResidualCodec.for_model``).
        vocab_size: timing-LM vocabulary; None: the LM's fixed size, else that of ``tokenizer`` (the zoo's).
        full_layers: full-attention layers (None: :func:`~kvbench.bench.timing_lm.full_layers_of` a timing
            LM, :func:`~kvbench.bench.timing_lm.full_layers_for` a checkpoint's depth).
        keep: OmniKV share of candidates restored. prefill_chunk: tokens per untimed prefill forward.
        copy_mib: size of the copy benchmark's tensor (MiB), :func:`kvbench.bench.bandwidth.copy_gb_s`.
        on_context: called after each context with the rows so far and a header saying how many contexts are
            done (the CLI writes the CSV then, so a failure at a long context keeps the shorter ones).

    Raises:
        ValueError: see :func:`check_inputs`; ``prefill_chunk < 1``; a context (+ decoded tokens) beyond
            the model's ``max_position_embeddings``; a ``codec_dir`` whose (n_layers, d_kv) differ from the
            model's, a ``codec.json`` that is not JSON, a bad ``KVBENCH_KERNELS`` (all raised before any timing);
            memory running out at a (context, method), naming them (the rows before are passed to ``on_context``).
    """
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    codec_cfg = read_codec_config(codec_dir) if codec_dir else None
    check_inputs(contexts, methods, decode_steps, warmup_steps, repeats,
                 codec_cfg.n_sink if codec_cfg else _DEFAULT_N_SINK)
    if threads is not None:
        torch.set_num_threads(threads)
    dev, dt = resolve_device(device, dtype)

    kernel_mode = kernels.describe(dev)   # a bad KVBENCH_KERNELS fails here, before any measurement
    model, weights = load_lm(model_name_or_dir, dev, dt, seed, vocab_size, tokenizer)
    tc = model.config.get_text_config()
    extra = warmup_steps + decode_steps * repeats
    too_long = [c for c in contexts if c + extra > tc.max_position_embeddings]
    if too_long:
        raise ValueError(f"context(s) {too_long} + {extra} decoded tokens exceed the model's "
                         f"max_position_embeddings = {tc.max_position_embeddings}")
    if codec_cfg is not None and (codec_cfg.n_layers, codec_cfg.d_kv) != model_kv_shape(model):
        # checked before any timing, so a misfit codec cannot cost a full-attention run first
        raise ValueError(f"codec {codec_dir!r} does not fit the model: codec (n_layers, d_kv) = "
                         f"{(codec_cfg.n_layers, codec_cfg.d_kv)}, model {model_kv_shape(model)}")
    if full_layers is None:
        full_layers = (full_layers_of(model_name_or_dir) if model_name_or_dir in TIMING_LMS
                       else full_layers_for(tc.num_hidden_layers))
    codec_kind = "trained" if codec_dir else "RANDOM"
    machine = bandwidth.copy_gb_s(dev, mib=copy_mib)
    wbytes, peak = bandwidth.weight_bytes(model), bandwidth.peak_gb_s(dev)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvbench-codec-") as tmp:
        if codec_dir is None:
            ResidualCodec.for_model(model, seed=seed).save(tmp)
        presses = {m: make_press(m, codec_dir or tmp, tuple(full_layers), keep) for m in methods}
        for done, context in enumerate(contexts):
            for method, press in presses.items():
                try:
                    r = time_decode(model, press, int(context), decode_steps, warmup_steps, repeats, seed,
                                    prefill_chunk)
                except (torch.OutOfMemoryError, RuntimeError) as e:
                    if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
                        raise
                    release(dev)
                    kept = f"; the {done} shorter context(s) are written" if done and on_context else ""
                    raise OutOfMemory(f"context {context}, method {method}: out of memory on {dev} "
                                     f"({str(e).splitlines()[0][:200]}); lower the context, or --prefill-chunk for "
                                     f"the prefill{kept}") from None
                release(dev)
                r.update(bandwidth.step_columns(wbytes, r["kv_read_bytes"], r["kv_read_source"], r["ms_per_token"],
                                                machine, peak))
                rows.append({"model": model_name_or_dir, "weights": weights, "device": str(dev),
                             "dtype": str(dt).removeprefix("torch."), "threads": torch.get_num_threads(),
                             "context": int(context), "method": method, "decode_steps": decode_steps,
                             "repeats": repeats, **r, "full_kv_bits": getattr(press, "full_kv_bits", 16),
                             "kernels": kernel_mode, "checks": checks.ENABLED})
                if log:
                    log(f"{method:<30} context {context:>7} {r['tokens_per_s']:8.2f} tok/s "
                        f"[{r['tps_lo95']:.2f}, {r['tps_hi95']:.2f}]  KR {r['kr_measured']:.3f}  "
                        f"CR {r['cr_measured']:.3f}  {r['achieved_gb_s']:.2f} GB/s ({r['kv_read_source']})  "
                        f"prefill {r['prefill_s']:.1f} s")
            if on_context is not None and done + 1 < len(contexts):
                part = [dict(x) for x in rows]
                add_ratios(part)
                on_context(part, header_line(model_name_or_dir, weights, codec_kind, contexts, decode_steps,
                                             warmup_steps, repeats, part)
                           + f"; PARTIAL: {done + 1} of {len(contexts)} contexts measured so far")
    add_ratios(rows)
    head = header_line(model_name_or_dir, weights, codec_kind, contexts, decode_steps, warmup_steps, repeats, rows)
    return rows, head


def read_codec_config(codec_dir: str | Path) -> CodecConfig:
    """The :class:`CodecConfig` of ``codec_dir/codec.json``. Raises FileNotFoundError, or ValueError naming the file
    when it is not a valid codec config."""
    path = Path(codec_dir) / "codec.json"
    try:
        return CodecConfig.from_json(path.read_text())
    except ValueError as e:   # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path}: not a codec config ({e})") from None


def write_csv(rows: list[dict], header: str, columns: Sequence[str], out: str | Path) -> None:
    """Write ``header`` (one ``#`` line) and ``rows`` with ``columns`` to ``out``, atomically."""
    import pandas as pd

    with atomic_path(out) as tmp, open(tmp, "w") as f:
        f.write(header + "\n")
        pd.DataFrame(rows, columns=list(columns)).to_csv(f, index=False)
