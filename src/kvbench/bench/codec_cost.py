"""ResidualKV Fig. 6: the cost of putting the non-linear map on the write side (paper §IV-B).

Two one-layer codecs at matched parameter counts:

- ``residualkv``: SwiGLU encoder f_c + linear decoder f_d (the paper's design);
- ``reverse``: linear encoder + SwiGLU decoder (``CodecConfig(encoder="linear", decoder="swiglu")``),
  its intermediate width solved by :func:`reverse_d_ff` so that both hold the same number of
  parameters (within 1%; exactly for the Table I shapes).

Timed paths (device-synchronised clock, median of ``repeats`` after ``warmup`` untimed runs):

- prefill path: the residual codes of ``tokens`` tokens, ``z = f_c(kv) - f_c(mean_ref)``
  (:meth:`LayerCodec.residual_code`, as the cache codes a prefilled context: two encoder passes);
- per-step restore (``restore_ms``): the cache's own read of one sparse layer in a decode step,
  :meth:`ResidualKVLayer.history <kvbench.compress.residualkv.cache.ResidualKVLayer.history>` with
  ``restore_tokens`` of the coded context's candidates selected (default ``ceil(0.17 tokens)``, OmniKV's
  keep): selected references read, selected codes restored ``f_d(z) + mean_ref``, keys re-rotated, sinks
  and raw window joined. The layer is a one-layer random LM's (:func:`filled_layer`) that prefilled
  ``tokens`` tokens through the codec (unquantised codes and float32 references, as the codec pair), so
  what Fig. 8's CPU decode steps run is what is timed here (on CUDA those run the restore kernel instead);
- ``codec_restore_ms``: the decoder map alone, :meth:`LayerCodec.restore` of ``restore_tokens`` random codes
  (the part the two codec forms differ in; what the paper's 0.93 -> 0.47 ms isolates);
- total: prefill path + ``decode_steps`` x restore (the paper's 4,096-token prefill + 512 steps).

The paper (H100): 7.37M vs 7.34M parameters; prefill path 1.61 -> 3.67 ms, per-step restore
0.93 -> 0.47 ms, total 480 -> 243 ms. Its parameter counts fit the released Qwen2.5-7B-1M codec
(d_kv 1,024, d_c 256, d_ff 3,072: 7,340,032); the defaults here are Table I's Llama-3.1-8B shape
(d_kv 2,048, d_c 512, d_ff 3,072: 15,204,352). Weights are random (cost does not depend on them), inputs
random normal for the codec maps, the random LM's K/V for the cache's restore.
"""
from __future__ import annotations

import dataclasses
import math
import tempfile

import torch

from kvbench.bench import clock
from kvbench.bench.decode import last_logits
from kvbench.bench.latency import resolve_device
from kvbench.bench.settings import CodecCostConfig
from kvbench.compress.cache import PressCache, StepState, press_attention
from kvbench.compress.residualkv.cache import ResidualKVLayer, ResidualKVPress
from kvbench.compress.residualkv.codec import CodecConfig, LayerCodec, ResidualCodec

COLUMNS = ["codec", "encoder", "decoder", "params", "prefill_ms", "restore_ms", "codec_restore_ms", "total_ms",
           "tokens", "restore_tokens", "decode_steps", "d_kv", "d_c", "d_ff", "device", "dtype", "threads"]
#: Share of a context a sparse layer restores per step by default (OmniKV keep, authors' configs).
RESTORE_SHARE = 0.17


def reverse_d_ff(d_kv: int, d_c: int, d_ff: int) -> int:
    """Intermediate width of the reverse codec (linear f_c, SwiGLU f_d) with as many parameters as
    ResidualKV's (SwiGLU f_c of width ``d_ff``, linear f_d), no bias.

    ResidualKV: ``2 d_kv d_ff + d_ff d_c + d_c d_kv``; reverse: ``d_kv d_c + 2 d_c f + f d_kv``, so
    ``f = round(d_ff (2 d_kv + d_c) / (2 d_c + d_kv))`` (4,608 for d_kv 2,048, d_c 512, d_ff 3,072).

    Raises:
        ValueError: a size below 1.
    """
    if min(d_kv, d_c, d_ff) < 1:
        raise ValueError(f"d_kv, d_c, d_ff must be >= 1, got {d_kv}, {d_c}, {d_ff}")
    return max(1, round(d_ff * (2 * d_kv + d_c) / (2 * d_c + d_kv)))


def codec_pair(d_kv: int, d_c: int, d_ff: int, seed: int = 0) -> dict[str, LayerCodec]:
    """``{"residualkv": SwiGLU f_c + linear f_d, "reverse": linear f_c + SwiGLU f_d}``, one layer each,
    random weights (seeded, the global RNG untouched), unquantised config (bits 16)."""
    shapes = {"residualkv": ("swiglu", "linear", d_ff), "reverse": ("linear", "swiglu", reverse_d_ff(d_kv, d_c, d_ff))}
    out = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, (enc, dec, width) in shapes.items():
            cfg = CodecConfig(n_layers=1, d_kv=d_kv, d_c=d_c, d_ff=width, bits=16, encoder=enc, decoder=dec)
            out[name] = LayerCodec(cfg).eval()
    return out


def one_layer_lm(d_kv: int, device: torch.device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A one-layer random ``Qwen2ForCausalLM`` whose K‖V width is ``d_kv``: heads of 128 (``d_kv / 256`` of
    them) when 256 divides ``d_kv``, else one head of ``d_kv / 2``; hidden size, MLP and vocabulary 64 (only
    its K/V matter here).

    Raises:
        ValueError: ``d_kv`` not a positive multiple of 4 (K and V halves with an even RoPE head).
    """
    import transformers

    if d_kv < 4 or d_kv % 4:
        raise ValueError(f"d_kv must be a positive multiple of 4 (two halves, even RoPE heads), got {d_kv}")
    heads, head_dim = (d_kv // 256, 128) if d_kv % 256 == 0 else (1, d_kv // 2)
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=64, num_hidden_layers=1, vocab_size=64,
                                   num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim,
                                   max_position_embeddings=1 << 20, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(cfg)
    return model.to(device=device, dtype=dtype).eval()


@torch.inference_mode()
def filled_layer(codec: LayerCodec, tokens: int, codec_dir: str, device: torch.device, dtype: torch.dtype,
                 seed: int = 0) -> tuple[ResidualKVLayer, PressCache]:
    """The sparse layer of a ResidualKV cache (standalone, unquantised codes, float32 references) on
    :func:`one_layer_lm` after a one-chunk prefill of ``tokens`` random ids, with ``codec`` saved to
    ``codec_dir`` as its one-layer codec; and its cache (whose :attr:`PressCache.step` a caller sets)."""
    model = one_layer_lm(codec.config.d_kv, device, dtype, seed)
    full = ResidualCodec(dataclasses.replace(codec.config, n_layers=1))
    full.layers[0].load_state_dict(codec.state_dict())
    full.save(codec_dir)
    press = ResidualKVPress(codec_dir=codec_dir, bits=16, ref_fp8=False)
    cache = press.new_cache(model)
    ids = torch.randint(64, (1, tokens), generator=torch.Generator().manual_seed(seed)).to(device)
    with press_attention(model, cache):
        last_logits(model, cache, ids, 0)
    return cache.layers[0], cache


def _median_ms(fn, device: torch.device, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    ms = []
    for _ in range(repeats):
        t0 = clock.now(device)
        fn()
        ms.append((clock.now(device) - t0) * 1000)
    return clock.summarise(ms)["median"]


@torch.inference_mode()
def measure_codec_cost(d_kv: int = CodecCostConfig.codec_shape[0], d_c: int = CodecCostConfig.codec_shape[1],
                       d_ff: int = CodecCostConfig.codec_shape[2], tokens: int = CodecCostConfig.tokens,
                       restore_tokens: int | None = None, decode_steps: int = CodecCostConfig.decode_steps,
                       repeats: int = CodecCostConfig.repeats, warmup: int = CodecCostConfig.warmup,
                       threads: int | None = None, device: str = "cpu", dtype: str = "auto",
                       seed: int = 0) -> tuple[list[dict], str]:
    """Fig. 6's measurements: one row per codec with :data:`COLUMNS` (times in ms), and the header line.

    Args:
        d_kv, d_c, d_ff: codec shape (defaults: Table I, Llama-3.1-8B).
        tokens: tokens coded on the prefill path; restore_tokens: tokens restored per decode step
            (None: ``ceil(0.17 tokens)``); decode_steps: restores in the total.
        repeats, warmup: timed and untimed runs of each path.
        threads: torch intra-op threads (None: leave as is); device ``cpu``/``cuda[:i]``/``auto``;
        dtype ``auto`` (bfloat16 on CUDA, float32 on CPU) or a torch dtype name; seed: weights and inputs.

    Raises:
        ValueError: a size, ``tokens``, ``restore_tokens``, ``decode_steps`` or ``repeats`` below 1,
            ``warmup`` negative, ``restore_tokens > tokens``, more ``restore_tokens`` than the coded context's
            candidates (the whole blocks of ``window`` tokens the cache codes after its sinks), or a ``d_kv`` :func:`one_layer_lm`
            refuses.
    """
    restore_tokens = math.ceil(RESTORE_SHARE * tokens) if restore_tokens is None else restore_tokens
    for name, v in (("d_kv", d_kv), ("d_c", d_c), ("d_ff", d_ff), ("tokens", tokens),
                    ("restore_tokens", restore_tokens), ("decode_steps", decode_steps), ("repeats", repeats)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if restore_tokens > tokens:
        raise ValueError(f"restore_tokens = {restore_tokens} exceeds tokens = {tokens} (a step restores coded tokens)")
    pair = codec_pair(d_kv, d_c, d_ff, seed)
    cfg0 = pair["residualkv"].config
    # the cache codes in blocks of `window` tokens (its default block) once `window + block` are raw, so the
    # candidates are the sinks' successors up to the last whole block
    n_cand = max(0, tokens - cfg0.n_sink - cfg0.window) // cfg0.window * cfg0.window
    if restore_tokens > n_cand:
        raise ValueError(f"restore_tokens = {restore_tokens} exceeds the {n_cand} candidates of a {tokens}-token "
                         f"context (the codec keeps {cfg0.n_sink} sinks raw and codes whole blocks of "
                         f"{cfg0.window} tokens once {2 * cfg0.window} are raw); raise tokens")
    if threads is not None:
        torch.set_num_threads(threads)
    dev, dt = resolve_device(device, dtype)
    gen = torch.Generator().manual_seed(seed)
    kv, mean = (torch.randn(tokens, d_kv, generator=gen).to(dev, dt) for _ in range(2))
    z = torch.randn(restore_tokens, d_c, generator=gen).to(dev, dt)
    candidates = torch.arange(cfg0.n_sink, cfg0.n_sink + n_cand)
    pick = torch.randperm(len(candidates), generator=gen)[:restore_tokens]
    selected = candidates[pick].sort().values.to(dev)
    rows = []
    for name, codec in pair.items():
        with tempfile.TemporaryDirectory(prefix="kvbench-codec-") as tmp:
            layer, cache = filled_layer(codec, tokens, tmp, dev, dt, seed)
            if layer.flushed != n_cand:
                raise RuntimeError(f"the cache coded {layer.flushed} tokens, the bench expected {n_cand}")
            cache.step = StepState(selected=selected)   # what an OmniKV filter layer sets for a decode step
            rest = _median_ms(layer.history, dev, repeats, warmup)
        codec = codec.to(dev, dt)
        pre = _median_ms(lambda c=codec: c.residual_code(kv, mean), dev, repeats, warmup)
        alone = _median_ms(lambda c=codec: c.restore(z, mean[:restore_tokens]), dev, repeats, warmup)
        cfg = codec.config
        rows.append({"codec": name, "encoder": cfg.encoder, "decoder": cfg.decoder,
                     "params": sum(p.numel() for p in codec.parameters()), "prefill_ms": pre, "restore_ms": rest,
                     "codec_restore_ms": alone, "total_ms": pre + decode_steps * rest, "tokens": tokens,
                     "restore_tokens": restore_tokens,
                     "decode_steps": decode_steps, "d_kv": d_kv, "d_c": d_c, "d_ff": cfg.d_ff, "device": str(dev),
                     "dtype": str(dt).removeprefix("torch."), "threads": torch.get_num_threads()})
    header = (f"# kvbench ResidualKV Fig. 6: codec cost at matched parameters (SwiGLU f_c + linear f_d vs the "
              f"reverse), one layer, RANDOM weights (cost does not depend on them); prefill path = residual codes "
              f"of {tokens} tokens, restore = the cache's per-step read of one sparse layer (ResidualKVLayer.history) "
              f"with {restore_tokens} of its candidates selected, codec_restore = the decoder map alone on "
              f"{restore_tokens} codes, total = prefill + {decode_steps} restores; ms, median of {repeats} runs on {dev} ({rows[0]['dtype']}, {rows[0]['threads']} threads); "
              "not the paper's numbers (H100: 7.37M vs 7.34M params, total 480 -> 243 ms)")
    return rows, header
