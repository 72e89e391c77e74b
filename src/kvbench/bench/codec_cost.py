"""ResidualKV Fig. 6: the cost of putting the non-linear map on the write side (paper §IV-B).

Two one-layer codecs at matched parameter counts:

- ``residualkv``: SwiGLU encoder f_c + linear decoder f_d (the paper's design);
- ``reverse``: linear encoder + SwiGLU decoder (``CodecConfig(encoder="linear", decoder="swiglu")``),
  its intermediate width solved by :func:`reverse_d_ff` so that both hold the same number of
  parameters (within 1%; exactly for the Table I shapes).

Timed paths (device-synchronised clock, median of ``repeats`` after ``warmup`` untimed runs):

- prefill path: the residual codes of ``tokens`` tokens, ``z = f_c(kv) - f_c(mean_ref)``
  (:meth:`LayerCodec.residual_code`, as the cache codes a prefilled context: two encoder passes);
- per-step restore: ``kv_hat = f_d(z) + mean_ref`` (:meth:`LayerCodec.restore`) of the ``restore_tokens``
  tokens a sparse layer reads in one decode step (default ``ceil(0.17 tokens)``, OmniKV's keep);
- total: prefill path + ``decode_steps`` x restore (the paper's 4,096-token prefill + 512 steps).

The paper (H100): 7.37M vs 7.34M parameters; prefill path 1.61 -> 3.67 ms, per-step restore
0.93 -> 0.47 ms, total 480 -> 243 ms. Its parameter counts fit the released Qwen2.5-7B-1M codec
(d_kv 1,024, d_c 256, d_ff 3,072: 7,340,032); the defaults here are Table I's Llama-3.1-8B shape
(d_kv 2,048, d_c 512, d_ff 3,072: 15,204,352). Weights are random (cost does not depend on them), inputs
random normal; only the codec's own maps are timed (no quantisation, no reference gather).
"""
from __future__ import annotations

import math

import torch

from kvbench.bench import clock
from kvbench.bench.settings import CodecCostConfig
from kvbench.compress.residualkv.codec import CodecConfig, LayerCodec

COLUMNS = ["codec", "encoder", "decoder", "params", "prefill_ms", "restore_ms", "total_ms", "tokens",
           "restore_tokens", "decode_steps", "d_kv", "d_c", "d_ff", "device", "dtype", "threads"]
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
            ``warmup`` negative, or ``restore_tokens > tokens``.
    """
    from kvbench.bench.latency import resolve_device

    restore_tokens = math.ceil(RESTORE_SHARE * tokens) if restore_tokens is None else restore_tokens
    for name, v in (("d_kv", d_kv), ("d_c", d_c), ("d_ff", d_ff), ("tokens", tokens),
                    ("restore_tokens", restore_tokens), ("decode_steps", decode_steps), ("repeats", repeats)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if restore_tokens > tokens:
        raise ValueError(f"restore_tokens = {restore_tokens} exceeds tokens = {tokens} (a step restores coded tokens)")
    if threads is not None:
        torch.set_num_threads(threads)
    dev, dt = resolve_device(device, dtype)
    gen = torch.Generator().manual_seed(seed)
    kv, mean = (torch.randn(tokens, d_kv, generator=gen).to(dev, dt) for _ in range(2))
    z = torch.randn(restore_tokens, d_c, generator=gen).to(dev, dt)
    rows = []
    for name, codec in codec_pair(d_kv, d_c, d_ff, seed).items():
        codec = codec.to(dev, dt)
        pre = _median_ms(lambda c=codec: c.residual_code(kv, mean), dev, repeats, warmup)
        rest = _median_ms(lambda c=codec: c.restore(z, mean[:restore_tokens]), dev, repeats, warmup)
        cfg = codec.config
        rows.append({"codec": name, "encoder": cfg.encoder, "decoder": cfg.decoder,
                     "params": sum(p.numel() for p in codec.parameters()), "prefill_ms": pre, "restore_ms": rest,
                     "total_ms": pre + decode_steps * rest, "tokens": tokens, "restore_tokens": restore_tokens,
                     "decode_steps": decode_steps, "d_kv": d_kv, "d_c": d_c, "d_ff": cfg.d_ff, "device": str(dev),
                     "dtype": str(dt).removeprefix("torch."), "threads": torch.get_num_threads()})
    header = (f"# kvbench ResidualKV Fig. 6: codec cost at matched parameters (SwiGLU f_c + linear f_d vs the "
              f"reverse), one layer, RANDOM weights (cost does not depend on them); prefill path = residual codes "
              f"of {tokens} tokens, restore = {restore_tokens} tokens per step, total = prefill + {decode_steps} "
              f"restores; ms, median of {repeats} runs on {dev} ({rows[0]['dtype']}, {rows[0]['threads']} threads); "
              "not the paper's numbers (H100: 7.37M vs 7.34M params, total 480 -> 243 ms)")
    return rows, header
