"""ResidualKV Fig. 8: decode throughput (tokens/s) vs context length, batch 1.

The paper (§V-B, Fig. 8; one H100, batch 1, contexts 64K-900K) compares full attention with
ResidualKV+OmniKV, quantised and unquantised. Here, per (context, method):

1. a context of ``context`` random token ids is prefilled through the method's cache
   (:class:`~kvbench.compress.cache.PressCache`), in chunks of ``prefill_chunk`` tokens to bound the
   attention mask's memory; the prefill is **not** timed;
2. ``warmup_steps`` greedy decode steps run untimed, then ``repeats`` runs of ``decode_steps`` greedy
   steps are timed with the device-synchronised clock (:mod:`kvbench.bench.clock`). The repeats
   continue one sequence (the cache is not rebuilt), so the last repeat reads
   ``(warmup_steps + (repeats - 1) decode_steps)`` more tokens than the first: negligible next to the
   context;
3. the cache's measured keep ratio (packed bytes / full FP16 bytes, the paper's accounting:
   :func:`keep_ratio_measured` with ``kind="packed"``; the ``kr_measured`` column) and
   compute ratio (keys attended per layer / visible tokens, mean over the timed steps,
   :func:`compute_ratio_measured`) are recorded.

Methods (:data:`METHODS`):

- ``full``: :class:`~kvbench.compress.cache.Press`, the exact full cache;
- ``residualkv-omnikv``: :class:`ResidualKVPress` (``residualkv+omnikv``, 4-bit residual codes, FP8
  references, ``keep`` 0.17, the authors' OmniKV config);
- ``residualkv-omnikv-unquantised``: the same with 16-bit codes and float32 references.

As in the paper's quantised curve, ``residualkv-omnikv`` also stores its full-attention layers KIVI-style
in 4 bits (``ResidualKVPress.full_kv_bits = 4``); the unquantised one keeps them exact (16). The
``full_kv_bits`` column records it.

Timing models (:mod:`kvbench.bench.timing_lm`) have RANDOM weights and, unless ``codec_dir`` is given,
the codec is random too (:meth:`ResidualCodec.for_model`): decode time depends on shapes and on how many
tokens each layer reads and restores, not on trained weights. The numbers are this machine's, not the
paper's.
"""
from __future__ import annotations

import dataclasses
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvbench.bench import clock
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
    full_layers_for,
    zoo_vocab_size,
)
from kvbench.compress.accounting import compute_ratio_measured, keep_ratio_measured
from kvbench.compress.cache import Press, PressCache, press_attention
from kvbench.compress.presses.omnikv import OmniKVPress
from kvbench.compress.residualkv.cache import ResidualKVPress
from kvbench.compress.residualkv.codec import CodecConfig, ResidualCodec, model_kv_shape

COLUMNS = ["model", "weights", "device", "dtype", "threads", "context", "method", "decode_steps",
           "tokens_per_s", "q1", "q3", "ms_per_token", "kr_measured", "cr_measured", "full_kv_bits"]
#: Sink tokens of a codec built by ``ResidualCodec.for_model`` (the CodecConfig default).
_DEFAULT_N_SINK = {f.name: f.default for f in dataclasses.fields(CodecConfig)}["n_sink"]
#: OmniKV share of candidate tokens restored (ResidualKV authors' configs, sources.md).
OMNIKV_KEEP = 0.17


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


def make_press(method: str, codec_dir: str | Path, full_layers: Sequence[int], keep: float = OMNIKV_KEEP) -> Press:
    """The press of ``method`` (:data:`METHODS`; the module docstring gives each one's settings).

    Raises:
        ValueError: unknown method, or the press rejects its settings.
    """
    if method == "full":
        return Press()
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {list(METHODS)}")
    quantised = method == "residualkv-omnikv"
    return ResidualKVPress(codec_dir=str(codec_dir), selector=OmniKVPress(keep=keep), full_layers=tuple(full_layers),
                           bits=4 if quantised else 16, ref_fp8=quantised, full_kv_bits=4 if quantised else 16)


def header_line(model: str, weights: str, codec: str, contexts: Sequence[int], decode_steps: int,
                warmup_steps: int, repeats: int) -> str:
    """The CSV's ``#`` first line: what was measured and why these are not the paper's numbers."""
    return (f"# kvbench ResidualKV Fig. 8: decode throughput at batch 1 on a timing model with "
            f"{weights.upper()} weights ({model}) and a {codec} codec (decode time depends on shapes and on how "
            f"many tokens each layer reads and restores, not on trained weights); contexts "
            f"{'/'.join(str(c) for c in contexts)} of random token ids, prefill not timed; tokens/s median "
            f"(q1, q3) of {repeats} runs of {decode_steps} greedy steps after {warmup_steps} warm-up steps; "
            f"OmniKV keep {OMNIKV_KEEP}; full layers 4-bit KIVI-style when quantised, exact otherwise; not the paper's numbers (one H100, 64K-900K tokens)")


def load_lm(model_name_or_dir: str, device: torch.device, dtype: torch.dtype, seed: int,
            vocab_size: int | None, tokenizer: str) -> tuple[Any, str]:
    """``(model, weights)``: a timing LM (random weights, vocabulary of ``tokenizer`` unless
    ``vocab_size`` is given) or a checkpoint (:func:`kvbench.models.loader.load_model`, "trained")."""
    if model_name_or_dir in TIMING_LMS:
        vocab = vocab_size if vocab_size is not None else zoo_vocab_size(tokenizer)
        return build_timing_lm(model_name_or_dir, vocab, device=device, dtype=dtype, seed=seed), "random"
    from kvbench.models.loader import load_model

    model, _ = load_model(model_name_or_dir, dtype=dtype, device=str(device))
    return model, "trained"


def _forward(model: Any, cache: PressCache, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Last-position logits ``[vocab]`` of ``ids`` ``[1, t]`` at positions ``start..start+t-1``."""
    pos = torch.arange(start, start + ids.shape[1], device=ids.device).view(1, -1)
    return model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]


@torch.inference_mode()
def time_decode(model: Any, press: Press, contexts: Sequence[int], decode_steps: int, warmup_steps: int,
                repeats: int, seed: int = 0, prefill_chunk: int = 2048) -> dict[int, dict[str, float]]:
    """Time greedy decoding through ``press`` at each of ``contexts`` (tokens), growing one cache.

    The contexts are visited in increasing order: random token ids are prefilled (untimed, in chunks of
    ``prefill_chunk``) up to the first context, the decode steps run and are timed, and the same cache is
    then prefilled further up to the next context (the decoded tokens count as context); a fresh cache
    is started only when a context is shorter than what the cache already holds. Each context's prefix
    is therefore prefilled once per method, as in a fresh run, at about half the untimed work. The
    methods here have no ``after_context`` step (it is a no-op for ``Press`` and ``residualkv+omnikv``).

    Returns:
        Per context: ``tokens_per_s`` (median over repeats), ``q1``, ``q3`` (tokens/s), ``ms_per_token``
        (``1000 / tokens_per_s``), ``kr_measured`` (after the context's last timed step) and ``cr_measured`` (mean over
        the timed steps).
    """
    device = model.device
    gen = torch.Generator().manual_seed(seed)
    tc = model.config.get_text_config()
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    out: dict[int, dict[str, float]] = {}
    cache, pos = None, 0
    for context in sorted({int(c) for c in contexts}):
        if cache is None or pos > context:
            cache, pos = press.new_cache(model), 0
        with press_attention(model, cache):
            ids = torch.randint(tc.vocab_size, (1, context - pos), generator=gen).to(device)
            for start in range(0, ids.shape[1], prefill_chunk):
                logits = _forward(model, cache, ids[:, start:start + prefill_chunk], pos)
                pos += ids[:, start:start + prefill_chunk].shape[1]

            for _ in range(warmup_steps):
                logits = _forward(model, cache, logits.argmax().view(1, 1), pos)
                pos += 1
            ms, first_timed = [], pos
            for _ in range(repeats):
                t0 = clock.now(device)
                for _ in range(decode_steps):
                    logits = _forward(model, cache, logits.argmax().view(1, 1), pos)
                    pos += 1
                ms.append((clock.now(device) - t0) * 1000 / decode_steps)
        timed = cache.attended[-decode_steps * repeats:]
        # the step at position p sees p + 1 tokens (itself included), as the attention mask does
        cr = statistics.fmean(compute_ratio_measured(a, first_timed + i + 1) for i, a in enumerate(timed))
        kr = keep_ratio_measured(cache.stored_bytes(), kind="packed", n_tokens=pos, n_layers=tc.num_hidden_layers,
                                 n_kv_heads=tc.num_key_value_heads, head_dim=head_dim)
        tps = clock.summarise([1000 / m for m in ms])
        out[context] = {"tokens_per_s": tps["median"], "q1": tps["q1"], "q3": tps["q3"],
                        "ms_per_token": 1000 / tps["median"], "kr_measured": kr, "cr_measured": cr}
    return out


def measure_decode_throughput(model_name_or_dir: str, contexts: Sequence[int] = DecodeThroughputConfig.contexts,
                              methods: Sequence[str] = DecodeThroughputConfig.methods,
                              decode_steps: int = DecodeThroughputConfig.decode_steps,
                              warmup_steps: int = DecodeThroughputConfig.warmup,
                              repeats: int = DecodeThroughputConfig.repeats, threads: int | None = None,
                              device: str = "cpu", dtype: str = "auto", seed: int = 0, *, codec_dir: str | None = None,
                              vocab_size: int | None = None, tokenizer: str = ZOO_TOKENIZER,
                              full_layers: Sequence[int] | None = None, keep: float = OMNIKV_KEEP,
                              prefill_chunk: int = 2048,
                              log: Callable[[str], None] | None = None) -> tuple[list[dict], str]:
    """Fig. 8's measurements: one row per (context, method) with :data:`COLUMNS`, and the header line.

    Args:
        model_name_or_dir: a timing LM (:data:`~kvbench.bench.timing_lm.TIMING_LMS`, random weights) or a
            checkpoint directory / zoo name.
        contexts: context lengths in tokens (:data:`~kvbench.bench.settings.CPU_CONTEXTS` by default;
            :data:`~kvbench.bench.settings.PAPER_CONTEXTS` on a GPU).
        methods: some of :data:`METHODS`.
        decode_steps, warmup_steps, repeats: timed greedy steps per run, untimed steps first, timed runs.
        threads: torch intra-op threads (None: leave as is). device: ``cpu``, ``cuda[:i]`` or ``auto``.
        dtype: ``auto`` (bfloat16 on CUDA, float32 on CPU) or a torch dtype name.
        seed: timing-model weights, random codec and context ids.
        codec_dir: a trained codec for the model; None builds a random one (``ResidualCodec.for_model``).
        vocab_size: timing-LM vocabulary; None reads the size of ``tokenizer`` (the zoo tokenizer).
        full_layers: full-attention layers (None: :func:`~kvbench.bench.timing_lm.full_layers_for`).
        keep: OmniKV share of candidates restored. prefill_chunk: tokens per untimed prefill forward.

    Raises:
        ValueError: see :func:`check_inputs`; ``prefill_chunk < 1``; a context (+ decoded tokens) beyond
            the model's ``max_position_embeddings``; a ``codec_dir`` whose (n_layers, d_kv) differ from the
            model's (raised before any timing).
    """
    from kvbench.bench.latency import resolve_device

    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    codec_cfg = CodecConfig.from_json((Path(codec_dir) / "codec.json").read_text()) if codec_dir else None
    check_inputs(contexts, methods, decode_steps, warmup_steps, repeats,
                 codec_cfg.n_sink if codec_cfg else _DEFAULT_N_SINK)
    if threads is not None:
        torch.set_num_threads(threads)
    dev, dt = resolve_device(device, dtype)
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
    layers = tuple(full_layers) if full_layers is not None else full_layers_for(tc.num_hidden_layers)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvbench-codec-") as tmp:
        if codec_dir is None:
            ResidualCodec.for_model(model, seed=seed).save(tmp)
        cdir = codec_dir or tmp
        results, full_bits = {}, {}
        for method in methods:
            press = make_press(method, cdir, layers, keep)
            full_bits[method] = getattr(press, "full_kv_bits", 16)
            results[method] = time_decode(model, press, contexts, decode_steps, warmup_steps, repeats, seed,
                                          prefill_chunk)
            if log:
                for context, r in results[method].items():
                    log(f"{method:<30} context {context:>7} {r['tokens_per_s']:8.2f} tok/s  "
                        f"KR {r['kr_measured']:.3f}  CR {r['cr_measured']:.3f}")
    for context in contexts:
        for method in methods:
            rows.append({"model": model_name_or_dir, "weights": weights, "device": str(dev),
                         "dtype": str(dt).removeprefix("torch."), "threads": torch.get_num_threads(),
                         "context": int(context), "method": method, "decode_steps": decode_steps,
                         **results[method][int(context)], "full_kv_bits": full_bits[method]})
    head = header_line(model_name_or_dir, weights, "trained" if codec_dir else "RANDOM", contexts, decode_steps,
                       warmup_steps, repeats)
    return rows, head


def write_csv(rows: list[dict], header: str, columns: Sequence[str], out: str | Path) -> None:
    """Write ``header`` (one ``#`` line) and ``rows`` with ``columns`` to ``out``, atomically."""
    import pandas as pd

    from kvbench.utils.io import atomic_path

    with atomic_path(out) as tmp, open(tmp, "w") as f:
        f.write(header + "\n")
        pd.DataFrame(rows, columns=list(columns)).to_csv(f, index=False)
