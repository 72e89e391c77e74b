"""ResidualKV Fig. 8 on a lent GPU in a fixed time budget (``scripts/gpu_fig8.sh`` runs it on a bare machine).

The paper's Fig. 8 (§V-B) is one H100 at 64K-900K tokens on Llama-3.1-8B. This entry point times the
Llama-3.1-8B-shaped random-weight timing LM (``timing-llama-3.1-8b``, bfloat16, Table I's full layers
0, 1, 2, 8, 18) at 32K-256K tokens with full attention through transformers' ``DynamicCache`` + SDPA, our
full cache, and ResidualKV+OmniKV (INT4): tokens/s with its 95% interval and the achieved bandwidth as a
share of the measured copy bandwidth and of the datasheet peak (:mod:`kvbench.bench.decode`,
:mod:`kvbench.bench.bandwidth`).

Contexts run in increasing order, each through :func:`kvbench.bench.decode.measure_decode_throughput` (a fresh
cache per method), and the CSV is rewritten after each, so a run cut short keeps what it measured. A context
is skipped (and the larger ones with it) when the previous one's wall time, scaled by the square of the
context ratio (the prefill's attention), would overrun ``--budget-s``; one that runs out of device memory is
recorded in the log and ends the sweep.

``--device cpu`` is a dry run on tiny shapes (``timing-qwen2-lm-test``, contexts 256 and 512): the same code
path in seconds, for a machine without a GPU.

Usage: ``python -m kvbench.bench.gpu_fig8 --out DIR [--device cuda|cpu] [--budget-s S] [--contexts N ...]``;
writes ``DIR/fig8_<device>.csv``.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvbench.bench import decode
from kvbench.bench.settings import DEVICE_PATTERN, check_contexts


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one device kind runs (every field a :func:`~kvbench.bench.decode.measure_decode_throughput`
    argument of that name; ``vocab_size`` None: the timing LM's own)."""

    model: str
    contexts: tuple[int, ...]
    methods: tuple[str, ...]
    dtype: str
    decode_steps: int
    repeats: int
    warmup_steps: int
    prefill_chunk: int
    copy_mib: int
    vocab_size: int | None = None


METHODS = ("dynamic-cache-sdpa", "full", "residualkv-omnikv", "residualkv-omnikv-latent-v")
PLANS = {
    # bf16 on an H200: 16 GB of weights, 128 KiB of KV per token (256K tokens: 32 GiB); prefill chunks of 1024
    # keep the press attention's boolean mask (32 heads x chunk x context) at 8 GiB at 256K tokens
    "cuda": Plan("timing-llama-3.1-8b", (32768, 65536, 131072, 262144), METHODS, "bfloat16", decode_steps=16,
                 repeats=3, warmup_steps=4, prefill_chunk=1024, copy_mib=1024),
    "cpu": Plan("timing-qwen2-lm-test", (256, 512), METHODS, "float32", decode_steps=4, repeats=2, warmup_steps=1,
                prefill_chunk=256, copy_mib=16, vocab_size=512),
}


def next_fits(spent_s: float, context: int, next_context: int, left_s: float) -> bool:
    """Whether ``next_context`` is expected to fit ``left_s`` seconds, the last context having taken ``spent_s``:
    its time scaled by ``(next / last)^2`` (the prefill's attention; decode and the linear layers grow slower)."""
    return spent_s * (next_context / context) ** 2 <= left_s


def run(device: str, out_dir: str | Path, budget_s: float, contexts: Sequence[int] | None = None,
        seed: int = 0) -> Path:
    """Measure ``PLANS[device kind]`` (``contexts`` overriding its own) within ``budget_s`` seconds of sweeping;
    returns the CSV written (``out_dir/fig8_<kind>.csv``, rewritten after each context).

    A CSV left in ``out_dir`` by an earlier run is removed first, so the file exists only if this run measured at
    least one context.

    Raises:
        ValueError: ``device`` not ``cpu``, ``cuda`` or ``cuda:<i>``; ``budget_s`` not a positive finite number;
            ``contexts`` not distinct positive integers; and what
            :func:`~kvbench.bench.decode.measure_decode_throughput` refuses.
    """
    import math
    import re

    import torch

    if device == "auto" or not re.fullmatch(DEVICE_PATTERN, device):   # `kvbench bench`'s pattern, less `auto`
        raise ValueError(f"device must be cpu, cuda or cuda:<index>, got {device!r}")
    kind = device.split(":")[0]
    if not (budget_s > 0 and math.isfinite(budget_s)):
        raise ValueError(f"budget_s must be a positive number of seconds, got {budget_s}")
    plan = PLANS[kind]
    todo = tuple(sorted(check_contexts("contexts", list(contexts)) if contexts else plan.contexts))
    out = Path(out_dir) / f"fig8_{kind}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)   # success must mean this run's rows
    rows: list[dict] = []
    done: list[int] = []
    spent, start = 0.0, time.monotonic()
    for i, context in enumerate(todo):
        if i and not next_fits(spent, todo[i - 1], context, budget_s - (time.monotonic() - start)):
            print(f"gpu_fig8: skipping contexts {list(todo[i:])}: context {todo[i - 1]} took {spent:.0f} s, "
                  f"{budget_s - (time.monotonic() - start):.0f} s of the budget left", flush=True)
            break
        t0 = time.monotonic()
        try:
            got, _ = decode.measure_decode_throughput(
                plan.model, [context], plan.methods, decode_steps=plan.decode_steps, warmup_steps=plan.warmup_steps,
                repeats=plan.repeats, threads=None, device=device, dtype=plan.dtype, seed=seed,
                vocab_size=plan.vocab_size, prefill_chunk=plan.prefill_chunk, copy_mib=plan.copy_mib,
                log=lambda m: print(m, flush=True))
        except decode.OutOfMemory as e:
            print(f"gpu_fig8: context {context} ran out of memory, sweep ended ({e})", flush=True)
            break
        spent = time.monotonic() - t0
        rows += got
        done.append(context)
        head = decode.header_line(plan.model, "random", "RANDOM", done, plan.decode_steps, plan.warmup_steps,
                                  plan.repeats, rows)
        decode.write_csv(rows, head, decode.COLUMNS, out)
        print(f"gpu_fig8: context {context} took {spent:.0f} s; {out} holds {len(rows)} rows", flush=True)
        decode.release(torch.device(device))
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line (module docstring); returns 0 once the CSV holds at least one context this run measured, 1 when
    none was, 2 (one line on stderr) for bad input."""
    p = argparse.ArgumentParser(prog="python -m kvbench.bench.gpu_fig8", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory of the CSV (the device machine's $OUT)")
    p.add_argument("--device", default="cuda", help="cuda[:i] (default) or cpu (dry run on tiny shapes)")
    p.add_argument("--budget-s", type=float, default=390.0, help="seconds the sweep may take (default 390)")
    p.add_argument("--contexts", type=int, nargs="+", default=None, help="override the plan's contexts (tokens)")
    a = p.parse_args(argv)
    try:
        out = run(a.device, a.out, a.budget_s, a.contexts)
    except ValueError as e:
        print(f"gpu_fig8: error: {e}", file=sys.stderr)
        return 2
    return 0 if out.is_file() else 1


if __name__ == "__main__":
    raise SystemExit(main())
