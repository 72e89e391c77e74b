"""CONDUIT Table 3 from the raw latency measurements (:mod:`kvbench.bench.latency`).

One row per (method, context size) and one ``mean`` row per method, as the
paper averages over contexts (§4.3: 90.36 → 12.24 TFLOPs, TTFT 0.519 → 0.174 s,
2.99x). Columns (units in the names):

- ``prefill_tflops``: measured FLOPs of the request (``FlopCounterMode``), TFLOPs;
  full prefill includes the vision tower (``vision_tflops``), the cached paths
  never run it; ``pct_of_full_flops``: share of full prefill's;
- ``scoring_tflops``: the scoring pass's part; ``analytic_tflops`` and
  ``flops_rel_err``: the analytic count (decoder; vision tower added from the
  measurement) and the relative difference of the measured count from it;
- ``ttft_ms_median``, ``_q1``, ``_q3``, ``_min``, ``_max`` over the repeats;
  ``speedup``: full prefill's median TTFT / the method's (mean rows: ratio of
  the means of the medians, as the paper's 0.519 / 0.174); ``flop_bound_share``:
  speedup ÷ (1 / FLOP fraction) = speedup × pct_of_full_flops / 100, the share of
  the speedup its FLOP saving would allow that the method realises (1 = TTFT
  scales with FLOPs; the paper's mean: 2.99 × 13.5 % = 0.40);
- ``scoring_ms_median`` and ``scoring_pct_of_ttft``: the scoring pass timed on its own.

The first line of the CSV is a ``#`` header naming the profile, device,
threads and model, and saying these are not the paper's numbers.
"""
from __future__ import annotations

import json
import os

import pandas as pd

from kvbench.bench import TABLE3_METHODS
from kvbench.bench.clock import summarise
from kvbench.bench.latency import table3_policy
from kvbench.bench.timing_model import TIMING_MODELS
from kvbench.plan.base import Table
from kvbench.reuse.policies import REFRESH
from kvbench.utils.io import atomic_path

TABLE3_COLUMNS = [
    "method", "label", "pages", "context_tokens", "n_visual", "r", "refreshed_visual", "prefill_tflops",
    "pct_of_full_flops", "scoring_tflops", "vision_tflops", "analytic_tflops", "flops_rel_err",
    "ttft_ms_median", "ttft_ms_q1", "ttft_ms_q3", "ttft_ms_min", "ttft_ms_max", "speedup", "flop_bound_share",
    "scoring_ms_median", "scoring_pct_of_ttft", "repeats",
]


def header(raw: pd.DataFrame, profile: str) -> str:
    """The table's ``#`` first line, from the run's metadata columns."""
    first = raw.iloc[0]
    model = first["model"]
    kind = ("Qwen2_5_VLForConditionalGeneration with RANDOM weights built in memory for timing only"
            if model in TIMING_MODELS else "checkpoint")
    sizes = "/".join(str(p) for p in sorted(raw["pages"].unique()))
    return (f"# kvbench {profile} profile: CONDUIT Table 3 (prefill FLOPs and TTFT at r={first['r']:g}; batch 1) "
            f"on {first['device']} with {first['threads']} threads ({first['dtype']}; torch {first['torch']}); "
            f"timing model {model} ({kind}); docpages requests of {sizes} pages at {first['page_px']} px; "
            "mean rows: ratios of the means over contexts; not the paper's numbers")


def _cell(g: pd.DataFrame) -> dict:
    t = summarise(g["ttft_ms"].tolist())
    s = g["scoring_ms"].dropna()
    first = g.iloc[0]
    vision = first["flops_vision"]
    return {
        "context_tokens": int(first["seq_len"]), "n_visual": int(first["n_visual"]),
        "r": REFRESH.fixed_r.get(first["method"], first["r"]),   # reuse and full at their own r, not the run's
        "refreshed_visual": first["refreshed_visual"], "prefill_tflops": first["flops"] / 1e12,
        "scoring_tflops": first["flops_scoring"] / 1e12, "vision_tflops": vision / 1e12,
        "analytic_tflops": (first["flops_analytic"] + vision) / 1e12,
        "flops_rel_err": first["flops"] / (first["flops_analytic"] + vision) - 1.0,
        **{f"ttft_ms_{k}": t[k] for k in ("median", "q1", "q3", "min", "max")},
        "scoring_ms_median": summarise(s.tolist())["median"] if len(s) else None, "repeats": t["n"],
    }


def build_table3(raw: pd.DataFrame, labels: dict[str, str] | None = None) -> pd.DataFrame:
    """Table 3 rows (see the module docstring) from the raw rows.

    ``labels`` maps a method (``cacheblend-conduit``) to its Table 1 row label (``CacheBlend``), so that the two
    tables name a method and its form alike; a method without one is labelled by its policy's ``label``, with the
    method's name added when Table 1 gives that label to another method.

    Raises:
        ValueError: no ``full`` measurements (every ratio is relative to full prefill).
    """
    if "full" not in set(raw["method"]):
        raise ValueError("raw measurements lack the 'full' reference method")
    order = {m: i for i, m in enumerate(TABLE3_METHODS)}
    cells = []
    for (method, pages), g in raw.groupby(["method", "pages"], sort=False):
        params = method.partition(":")[2]
        label = (labels or {}).get(method)
        if label is None:
            label = table3_policy(method, g.iloc[0]["r"]).label + (f" ({params})" if params else "")
            if label in (labels or {}).values():  # 'MPIC' is Table 1's mpic-first: the per-image form says its name
                label = f"{label} [{method}]"
        cells.append({"method": method, "label": label, "pages": str(pages), **_cell(g)})
    df = pd.DataFrame(cells)
    full = df[df["method"] == "full"].set_index("pages")
    df["pct_of_full_flops"] = 100 * df["prefill_tflops"] / df["pages"].map(full["prefill_tflops"])
    df["speedup"] = df["pages"].map(full["ttft_ms_median"]) / df["ttft_ms_median"]
    df["scoring_pct_of_ttft"] = 100 * df["scoring_ms_median"] / df["ttft_ms_median"]
    means = []
    full_ttft = full["ttft_ms_median"].mean()
    full_flops = full["prefill_tflops"].mean()
    for method, g in df.groupby("method", sort=False):
        m = g.mean(numeric_only=True)
        scoring = m.get("scoring_ms_median")   # absent when no timed method has a scoring pass (all None)
        means.append({**m.to_dict(), "method": method, "label": g["label"].iloc[0], "pages": "mean",
                      "pct_of_full_flops": 100 * m["prefill_tflops"] / full_flops,
                      "speedup": full_ttft / m["ttft_ms_median"], "scoring_ms_median": scoring,
                      "scoring_pct_of_ttft": (100 * scoring / m["ttft_ms_median"] if pd.notna(scoring) else None),
                      "repeats": int(g["repeats"].min())})
    df = pd.concat([df, pd.DataFrame(means)], ignore_index=True)
    df["flop_bound_share"] = df["speedup"] * df["pct_of_full_flops"] / 100
    df["_m"] = df["method"].map(lambda m: (order.get(m.partition(":")[0], len(order)), m))
    df["_p"] = df["pages"].map(lambda p: float("inf") if p == "mean" else int(p))
    return df.sort_values(["_m", "_p"]).drop(columns=["_m", "_p"])[TABLE3_COLUMNS].reset_index(drop=True)


def write_table3(raw_csv: str | os.PathLike, out: str | os.PathLike, profile: str,
                 labels: dict[str, str] | None = None) -> pd.DataFrame:
    """Read the raw CSV, build Table 3 (``labels``: :func:`build_table3`) and write it to ``out`` with its ``#``
    header line (atomically)."""
    raw = pd.read_csv(raw_csv)
    table = build_table3(raw, labels)
    with atomic_path(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(header(raw, profile) + "\n")
        table.to_csv(f, index=False, float_format="%.6g")
    return table


def _write(key: str, spec: str | dict, out: str | os.PathLike, root: str | os.PathLike = ".") -> pd.DataFrame:
    """:func:`write_table3` from the workflow's JSON ``spec``: ``{"profile", "raw": raw CSV path, "labels"}``."""
    spec = json.loads(spec) if isinstance(spec, str) else spec
    return write_table3(os.path.join(root, spec["raw"]), out, spec["profile"], spec.get("labels"))


#: CONDUIT Table 3 as a :class:`~kvbench.plan.base.Table` (built from ``kvbench bench conduit-latency``'s CSV).
TABLES = {"conduit/table3": Table(
    "conduit/table3", "CONDUIT", "conduit_latency", "Table 3 (prefill FLOPs and TTFT)",
    "**CONDUIT Table 3** (paper §4.3, serving latency; per-setting breakdown as in §B.2): prefill FLOPs and time to "
    "first token (TTFT) of full prefill and each refresh method at r = 0.10, per context size and averaged. FLOPs "
    "are counted with ``torch.utils.flop_counter`` over the computation each method really does and checked "
    "against an analytic count (``flops_rel_err``). TTFT is the median (with quartiles and min/max) over repeats "
    "after warm-up. On the smoke profile it is timed on a wider Qwen2.5-VL with random weights built for timing "
    "only, on this machine: these are not the paper's numbers.", _write)}
