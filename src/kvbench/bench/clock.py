"""Wall-clock timing that is correct on CPU and CUDA, and the summary statistics of repeats.

On CUDA, kernels run asynchronously: :func:`now` synchronises the device
before reading ``time.perf_counter``, so an interval covers the work issued
inside it. On CPU it is ``perf_counter`` alone.
"""
from __future__ import annotations

import statistics
import time

import torch


def now(device: torch.device | str = "cpu") -> float:
    """Seconds (``perf_counter``), after synchronising ``device`` when it is a CUDA device."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def summarise(values_ms: list[float]) -> dict[str, float]:
    """``median``, ``q1``, ``q3`` (inclusive quartiles), ``min``, ``max`` and ``n`` of ``values_ms``.

    Raises:
        ValueError: no values.
    """
    if not values_ms:
        raise ValueError("summarise needs at least one value")
    v = sorted(float(x) for x in values_ms)
    q1, _, q3 = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else (v[0], v[0], v[0])
    return {"median": statistics.median(v), "q1": q1, "q3": q3, "min": v[0], "max": v[-1], "n": len(v)}
