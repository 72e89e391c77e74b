"""Wall-clock timing that is correct on CPU and CUDA, and the summary statistics of repeats.

On CUDA, kernels run asynchronously: :func:`now` synchronises the device
before reading ``time.perf_counter``, so an interval covers the work issued
inside it. On CPU it is ``perf_counter`` alone.

:func:`summarise` gives quartiles of a few repeats (CONDUIT Table 3, Fig. 6); :func:`step_rate` gives the
decode benchmarks' median rate and 95% interval from per-step times (ResidualKV Figs. 8 and 11).
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


#: The 95% interval of :func:`step_rate`, as the CSV headers name it.
STEP_INTERVAL = ("95% interval = the 2.5th/97.5th percentiles of the per-step times of all timed steps "
                 "(the spread of single steps, not a confidence interval of the median)")


def step_rate(step_ms: list[float]) -> dict[str, float]:
    """Median rate and a 95% interval of one decode benchmark cell from its per-step times.

    ``step_ms``: the time of every timed step (ms; all repeats pooled). Returns ``tokens_per_s`` =
    1000 / median step time, ``tps_lo95`` / ``tps_hi95`` = 1000 / the 97.5th / 2.5th percentile step time
    (inclusive interpolation, as :func:`statistics.quantiles`; one step gives its own rate thrice) and
    ``median_ms``. The interval is :data:`STEP_INTERVAL`: a range of single steps, so it stays meaningful with
    few repeats (a bootstrap of three per-run medians could only return their min and max).

    Raises:
        ValueError: no times, or a time that is not positive (naming it).
    """
    if not step_ms:
        raise ValueError("step_rate needs at least one step time")
    bad = [t for t in step_ms if not t > 0]
    if bad:
        raise ValueError(f"step times must be positive ms, got {bad[:3]}")
    v = sorted(float(t) for t in step_ms)
    if len(v) > 1:
        cuts = statistics.quantiles(v, n=40, method="inclusive")   # 2.5%, 5%, ..., 97.5%
        lo_ms, hi_ms = cuts[0], cuts[-1]
    else:
        lo_ms = hi_ms = v[0]
    med = statistics.median(v)
    return {"tokens_per_s": 1000 / med, "tps_lo95": 1000 / hi_ms, "tps_hi95": 1000 / lo_ms, "median_ms": med}
