"""Latency benchmarks (CONDUIT Table 3): prefill FLOPs and time to first token.

- :mod:`~kvbench.bench.timing_model`: a wider random-weight Qwen2.5-VL for timing only;
- :mod:`~kvbench.bench.requests`: docpages requests with scaled pages (context size);
- :mod:`~kvbench.bench.flops`: ``FlopCounterMode`` measurement and the analytic per-layer count;
- :mod:`~kvbench.bench.cost`: analytic cost of each refresh policy on a request;
- :mod:`~kvbench.bench.clock`: device-synchronised wall clock, repeat statistics;
- :mod:`~kvbench.bench.latency`: the benchmark (``kvbench bench conduit-latency``);
- :mod:`~kvbench.report.conduit.table3`: Table 3 from the raw measurements (``kvbench report conduit/table3``).
- :mod:`~kvbench.bench.settings`: settings of the ResidualKV profiling verbs (Figs. 6, 8 and 11), checked
  when built, shared by the CLI and the workflow's config check.

This module only holds defaults (no torch import), so the CLI can read them cheaply.
"""

#: Methods of CONDUIT's Table 3 in display order; ``full`` is the reference.
#: Both forms of CacheBlend and MPIC are timed, as Table 1 scores both (its ``CacheBlend`` and ``MPIC`` rows are
#: CONDUIT's as-run ``cacheblend-conduit`` and ``mpic-first``; issue #33).
TABLE3_METHODS = ["full", "reuse", "cacheblend-conduit", "cacheblend", "mpic-first", "mpic", "kvshare-conduit",
                  "prophetkv", "conduit"]

#: ``--dtype`` values of every ``kvbench bench`` verb (``auto``: bfloat16 on CUDA, float32 on CPU).
DTYPES = ("auto", "float32", "float16", "bfloat16")

#: Defaults of ``kvbench bench conduit-latency`` and :class:`~kvbench.bench.latency.LatencyConfig`
#: (4/8/16 pages of 448 px: about 1k/2k/4k tokens; about 8 minutes on 2 idle CPU cores).
BENCH_DEFAULTS = {
    "model": "timing-qwen2.5-vl-wide",
    "sizes": [4, 8, 16],
    "page_px": 448,
    "r": 0.10,
    "methods": TABLE3_METHODS,
    "repeats": 5,
    "warmup": 1,
}
