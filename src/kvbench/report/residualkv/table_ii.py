"""ResidualKV Table II (multimodal, §V-B): compression presses on VLMs; the writer.

The table (``results/residualkv/tableII.csv``) has one row per backbone x method: the score per task (mean per-record
score x 100), ``avg`` (unweighted mean over tasks, the paper's average), ``KR_packed %`` / ``KR_resident %`` (bytes the
cache holds at the end of each request over the full FP16 cache, from the audit rows, as Table III:
:func:`kvbench.report.residualkv.tables.run_summary`), ``CR %`` (keys attention read / keys visible after the context
chunk) and ``kept %`` (share of the prompt's tokens whose K/V the cache still holds). A cell is computed or empty with
its reason in ``notes``. What it reads (the ``residualkv.tableII`` mapping, its runs and codecs):
:mod:`kvbench.plan.multimodal`.
"""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from kvbench.plan.base import Table, load_spec
from kvbench.plan.multimodal import KEY, MMPlan
from kvbench.plan.residualkv import press_spec
from kvbench.report import paired
from kvbench.report.residualkv.tables import (
    _mean,
    _read_run,
    bootstrap_settings,
    full_layer_header,
    paired_rows,
    run_summary,
    with_paired,
)
from kvbench.utils.io import write_csv

def cr_bounds(plan: MMPlan, root: str | Path = ".") -> str:
    """The header line of the CR lower bound of each row that keeps whole layers (``full_layers``): by the paper's
    formula CR = beta + (1 - beta) r (§V-A), CR >= beta = full-attention layers / layers, here computed from
    the row's spec and the layer count of its runs' audit (bytes by layer), beside the paper's 7/36 on Qwen3-VL-8B
    (Table I). Empty when no row keeps full layers."""
    bounds = []
    for model in plan.models:
        for row in plan.rows_of(model):
            full = press_spec(row.spec).params.get("full_layers")
            if not full:
                continue
            layers = {len(r["plan"]["bytes"]) for t in plan.tasks
                      for r in _read_run(Path(root) / plan.run(model, t, row.spec).path(plan.profile))
                      if r.get("status") == "ok" and isinstance(r.get("plan"), dict) and r["plan"].get("bytes")}
            if len(layers) != 1:
                bounds.append(f"{model} {row.label}: no layer count in its runs' audit" if not layers else
                              f"{model} {row.label}: runs disagree on the layer count {sorted(layers)}")
                continue
            (n,) = layers
            bounds.append(f"{model} {row.label}: {len(full)}/{n} = {100 * len(full) / n:.1f}%")
    if not bounds:
        return ""
    return ("# CR lower bound of the rows that keep full-attention layers, beta = full layers / layers (from the row's "
            f"spec and its runs' layer count): {'; '.join(bounds)} (the paper's ResidualKV on Qwen3-VL-8B: 7/36 = 19.4%)")


def _kept(run_dir: Path) -> float:
    plans = [r["plan"] for r in _read_run(run_dir) if r.get("status") == "ok" and isinstance(r.get("plan"), dict)]
    return _mean([p.get("kept") for p in plans])


def score_table(plan: MMPlan, root: str | Path = ".") -> pd.DataFrame:
    """Backbone x method rows, task columns (module docstring)."""
    pct = lambda x: None if math.isnan(x) else round(100 * x, 1)  # noqa: E731
    out = []
    for model in plan.models:
        for row in plan.rows_of(model):
            cells, notes = {"model": model, "method": row.label, "spec": row.spec}, []
            dirs = [Path(root) / plan.run(model, t, row.spec).path(plan.profile) for t in plan.tasks]
            runs = [run_summary(d) for d in dirs]
            for task, s in zip(plan.tasks, runs):
                cells[task] = round(s["score"], 2)
                if s["errors"]:
                    notes.append(f"{task}: {s['errors']}/{s['n']} samples failed (scored 0)")
            cells["avg"] = round(_mean([cells[t] for t in plan.tasks]), 2)
            cells["KR_packed %"] = pct(_mean([s["kr_packed"] for s in runs]))
            resident = [s["kr_resident"] for s in runs]
            cells["KR_resident %"] = None if any(math.isnan(x) for x in resident) else pct(_mean(resident))
            cells["CR %"] = pct(_mean([s["cr"] for s in runs]))
            cells["kept %"] = pct(_mean([_kept(d) for d in dirs]))
            for col in ("KR_packed %", "CR %", "kept %"):
                if cells[col] is None:
                    notes.append(f"{col}: no audit row in the runs")
            cells["notes"] = "; ".join(notes)
            out.append(cells)
    return pd.DataFrame(out)


def paired_by_model(plan: MMPlan, df: pd.DataFrame, boot: dict, root: str | Path = ".") -> tuple[pd.DataFrame, list[str]]:
    """``df`` with every pair of each backbone's rows below it (:func:`kvbench.report.residualkv.tables.paired_rows`, a
    ``model`` column naming the backbone) and the header lines saying how."""
    pairs = []
    for model in plan.models:
        rows = [(r.label, r.spec, [Path(root) / plan.run(model, t, r.spec).path(plan.profile) for t in plan.tasks])
                for r in plan.rows_of(model)]
        pairs += [{"model": model, **p} for p in paired_rows(rows, plan.tasks, boot)]
    out = with_paired(df, pairs)
    # `model` leads, as in the score rows
    out = out[["model"] + [c for c in out.columns if c != "model"]]
    return out, paired.difference_header(pairs, "every pair of one backbone's rows, a above b in table order",
                                         **boot)


def _write(key: str, spec: str | dict, out: str | Path, root: str | Path = ".") -> pd.DataFrame:
    spec = load_spec(spec, KEY)
    plan = MMPlan.from_spec(spec)
    df, lines = paired_by_model(plan, score_table(plan, root), bootstrap_settings(spec), root)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    bound = cr_bounds(plan, root)
    write_csv(df, plan.header() + full_layer_header(plan.rows) + ([bound] if bound else []) + lines, str(out))
    return df


TABLES: dict[str, Table] = {t.name: t for t in (
    Table("residualkv/tableII", "ResidualKV", "residualkv", "Table II (multimodal: methods x image tasks, KR/CR)",
          "**ResidualKV Table II** (paper §V-B, multimodal): compression presses on VLMs against the full KV cache, per "
          "image task; visual-token pruning baselines (FastV, PACT, DivPrune) and cache compression read the same "
          "prompt (the context chunk with every image, then the question reading the compressed cache). KR is measured "
          "from the bytes the cache holds (packed: the paper's accounting; resident: every tensor held); CR from the "
          "keys attention read. On the smoke profile the model is the tiny zoo VLM and the tasks are smoke image tasks "
          "in place of the paper's seven benchmarks: these are not the paper's numbers. The paper's 'CR 10%' for "
          "ResidualKV on Qwen3-VL-8B is below its own lower bound beta = 7/36 (header).", _write,
          plan="residualkv_mm"),
)}
