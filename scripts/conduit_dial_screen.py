#!/usr/bin/env python
"""CONDUIT's staleness-dial screen (issue #33, item 1; docs/decisions/zoo.md, "The staleness dial").

For each setting of the dial (``--stale-pages``; both task phases with ``cell_target: content`` and
``hide_prompt: text``), trains ``tiny-qwen2.5-vl``'s full recipe (1,950 steps; a screen that stopped after the grid
phase left full prefill at 0.31 on digitgrid for ``stale_pages`` 0.1: the lookup is not learned by then, so the
screen could not tell a setting's staleness from an untrained model), then on the first ``--n`` digitgrid test
records evaluates cache
reuse, full prefill and the ``oracle-kv`` bound at each ``--oracle-r``, and captures ``--n-diag`` records for the
value-norm rank stability (Spearman of cached vs fresh ‖V‖, layers >= 1). Writes one CSV row per setting. Every
step is a ``kvbench`` command (quoted argument lists); finished steps are skipped on a rerun. No refresh method of
either paper runs here: the screen decides which setting qualifies before any method is run on it.

    .venv/bin/python scripts/conduit_dial_screen.py --tokenizer zoo/smoke/tokenizer-<hash> --work screen \
        --out results/conduit/dial_screen.csv
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from kvbench.report.conduit.diagnostics import read_captures, table12
from kvbench.train.recipes import dial_fields
from kvbench.utils.io import write_csv

KV = [str(Path(sys.executable).parent / "kvbench")]  # the console script of the running environment


def run(cmd: list[str], done: Path, log: Path) -> None:
    """Run ``cmd`` unless ``done`` exists; its output goes to ``log``; a failure names the log."""
    if done.exists():
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"failed: {' '.join(cmd)} (see {log})")


def overrides(stale_pages: float) -> dict:
    """The dial's training overrides: the strong recipe's task phases with content targets and ``stale_pages``."""
    return {"phases": {"grid": dial_fields(stale_pages), "tasks": dial_fields(stale_pages)}}


def screen(x: float, a: argparse.Namespace, split: Path) -> dict:
    root = Path(a.work) / f"sp{x:g}"
    model = root / "model"
    run([*KV, "train", "--model", "tiny-qwen2.5-vl", "--tokenizer", a.tokenizer, "--out", str(model),
         "--workdir", str(root / "work"), "--seed", str(a.seed), "--threads", str(a.threads),
         "--overrides", json.dumps(overrides(x))], model / "model.safetensors", root / "train.log")
    cache = root / "cache"
    run([*KV, "cache", "--model", str(model), "--split", str(split), "--cache-dir", str(cache),
         "--out", str(cache / "index.json"), "--limit", str(a.n), "--threads", str(a.threads)],
        cache / "index.json", root / "cache.log")
    params = json.dumps({"cache_dir": str(cache), "build_missing": False})
    scores = {}
    for method in ["reuse", "full", *(f"oracle-kv@{r:g}" for r in a.oracle_r)]:
        out = root / "runs" / method
        run([*KV, "eval", "--model", str(model), "--split", str(split), "--method", method, "--out", str(out),
             "--limit", str(a.n), "--threads", str(a.threads),
             *([] if method == "full" else ["--method-params", params])],  # full prefill reads no cache
            out / "metrics.json", root / "logs" / f"{method}.log")
        scores[method] = json.loads((out / "metrics.json").read_text())["score"]
    cap = root / "diag.csv"
    run([*KV, "conduit-diagnose", "--model", str(model), "--model-name", f"stale_pages-{x:g}",
         "--dataset", "digitgrid", "--split", str(split), "--cache-dir", str(cache), "--out", str(cap),
         "--n", str(a.n_diag), "--threads", str(a.threads)], cap, root / "diag.log")
    df = read_captures([cap])
    layers = sorted(int(v) for v in df["layer"].unique() if int(v) >= 1)
    t12 = table12(df, layers)
    rho = float(np.nanmean(t12[t12["layer"] != "mean"]["vnorm_spearman"].astype(float)))
    full, reuse = scores["full"], scores["reuse"]
    row = {"stale_pages": x, "cell_target": "content", "hide_prompt": "text", "records": a.n,
           "full": full, "reuse": reuse, "reuse_pct_of_full": 100 * reuse / full if full else float("nan"),
           "vnorm_spearman_layers_ge_1": rho, "diag_records": a.n_diag}
    for r in a.oracle_r:
        o = scores[f"oracle-kv@{r:g}"]
        row[f"oracle_{r:g}"] = o
        row[f"oracle_{r:g}_recovery"] = (o - reuse) / (full - reuse) if full != reuse else float("nan")
    row["qualifies"] = bool(full >= a.floor and 0.60 <= reuse / full <= 0.85 and rho >= 0.9
                            and all(row[f"oracle_{r:g}_recovery"] >= 0.5 for r in a.oracle_r))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--work", required=True, help="directory of the screen's models, caches and runs")
    p.add_argument("--out", required=True, help="CSV, one row per setting (written atomically)")
    p.add_argument("--split", help="digitgrid test JSONL (default: generated under --work)")
    p.add_argument("--stale-pages", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    p.add_argument("--oracle-r", type=float, nargs="+", default=[0.1, 0.25])
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--n-diag", type=int, default=16)
    p.add_argument("--floor", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    for x in a.stale_pages:
        if not 0 <= x <= 1:
            p.error(f"--stale-pages takes shares in [0, 1], got {x}")
    split = Path(a.split) if a.split else Path(a.work) / "digitgrid" / "test.jsonl"
    if not a.split:
        run([*KV, "data", "--task", "digitgrid", "--out", str(split.parent), "--tokenizer", a.tokenizer,
             "--seed", str(a.seed), "--n-train", "0", "--n-test", str(a.n)], split, Path(a.work) / "data.log")
    rows = [screen(x, a, split) for x in a.stale_pages]
    df = pd.DataFrame(rows)
    write_csv(df, [f"# CONDUIT staleness-dial screen on the tiny zoo, not the paper's numbers: tiny-qwen2.5-vl's full recipe "
                   f"per setting; digitgrid, first {a.n} test records; Spearman of "
                   f"cached vs fresh value norms over layers >= 1 on {a.n_diag} records; oracle-kv is a bound, not "
                   "a method"], a.out)
    print(df.to_string(index=False))


if __name__ == "__main__":
    main()
