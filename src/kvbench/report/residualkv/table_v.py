"""ResidualKV Table V, long generation (paper §V-B, Table V: AIME, Qwen3-4B-Thinking, up to 32,768 generated tokens).

The table's rows (config ``residualkv.tableV``, ``{label, method}``) run on the backbone and task of
``residualkv.long_generation`` (``model``, ``tasks``, and optionally ``n_test``, ``threads``, ``protocol``, ``codec``,
``train``, ``sampling``), not on the section's ``model``/``tasks``: :func:`generation_section` is that section as an
:class:`~kvbench.plan.residualkv.RKVPlan` reads it (the main section's codec and training keys as the base), so the
rows' runs and the backbone's own ResidualKV codec are named and built by the same plan machinery as Tables III-VIII
(``results/runs/<profile>/<model>/<task>/residualkv/<slug>/``, ``codecs/<profile>/<model>/main-<recipe>/``).

Every row compresses during decoding: ResidualKV codes each generated token as it leaves its raw window
(:mod:`kvbench.compress.residualkv.cache`); SnapKV in its decoding form (``snapkv_decoding``,
:mod:`kvbench.compress.presses.snapkv_decoding`, kvpress's ``DecodingPress``); OmniKV keeps every token and selects at
every decode step over all of them (KR 100% by construction, :mod:`kvbench.compress.presses.omnikv`).

Columns: Table III's (:func:`~kvbench.report.residualkv.tables.score_table`): one per task and ``avg`` (mean per-record
final-answer score x 100: :func:`kvbench.eval.metrics.final_answer`; with several sampled records per problem, pass@1
= their mean), ``KR_packed %`` / ``KR_resident %`` (bytes the cache holds at the end of a request over the full FP16
cache of the whole sequence, prompt and generated tokens), ``CR %`` (keys attention read / keys visible, over the
forwards after the prompt chunk: every decode step), the §V-A KR formula and the packed bytes by part; then
``generated tokens`` and ``sequence tokens`` (means per record). A cell is computed or empty with its reason in
``notes``.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pandas as pd

from kvbench.plan.base import Table, load_spec
from kvbench.report.residualkv.tables import (
    _mean,
    _read_run,
    attribution_header,
    codec_header,
    full_layer_header,
    paired_table,
    run_summary,
    score_table,
    selection_header,
    write_csv,
)
from kvbench.plan.generation import sampling
from kvbench.plan.residualkv import RKVPlan
from kvbench.utils.io import read_jsonl

def _samples_per_problem(split: Path) -> int | None:
    """Records per problem in a split (records sharing ``meta.problem``; None when no record names one)."""
    if not split.is_file():
        return None
    problems = [r.get("meta", {}).get("problem") for r in read_jsonl(split)]
    counts = Counter(p for p in problems if p is not None)
    return max(counts.values()) if counts else None


def table_v(plan: RKVPlan, root: str | Path = ".") -> pd.DataFrame:
    """Table III's columns (:func:`~kvbench.report.residualkv.tables.score_table`: scores, KR packed/resident, CR, KR formula,
    packed bytes by part, notes) per configured method, plus ``generated tokens`` and ``sequence tokens`` (means per
    record)."""
    df = score_table(plan, "tableV", root)
    generated, notes = [], list(df["notes"])
    for i, row in enumerate(plan.rows("tableV")):
        counts = [r["plan"].get("n_generated") for task in plan.tasks
                  for r in _read_run(Path(root) / plan.run_dir(task, row.spec))
                  if r.get("status") == "ok" and isinstance(r.get("plan"), dict)]
        generated.append(round(_mean(counts), 1) if counts and None not in counts else None)
        if generated[-1] is None:
            notes[i] = "; ".join(filter(None, [notes[i], "generated tokens: a run without the audit field n_generated"]))
    df.insert(df.columns.get_loc("notes"), "generated tokens", generated)
    df.insert(df.columns.get_loc("notes"), "sequence tokens",
              [round(_mean([run_summary(Path(root) / plan.run_dir(t, r.spec))["n_tokens"] for t in plan.tasks]), 1)
               for r in plan.rows("tableV")])
    df["notes"] = notes
    return df


def header(plan: RKVPlan, root: str | Path = ".", splits: dict[str, str] | None = None) -> list[str]:
    """The CSV header: what ran (tiny zoo or local checkpoint), how it decoded (and, from ``splits``, task -> split
    path under ``root``, how many records each problem has), the budgets, the codec."""
    s = sampling(plan.s)
    decoding = ("greedy decoding (the tiny zoo model's answer is deterministic)" if not s else
                "sampled decoding, " + ", ".join(f"{k} {v}" for k, v in s.items())
                + " (Qwen3-Thinking's recommended thinking-mode settings; the paper states none, §V-B, Table V), "
                  "each record seeded by the runner (kvbench.eval.runner.record_seed)")
    n = [_samples_per_problem(Path(root) / splits[t]) if t in (splits or {}) else None for t in plan.tasks]
    per_problem = ("; records per problem: " + ", ".join(f"{t} {k}" for t, k in zip(plan.tasks, n) if k)
                   + " (score = pass@1, their mean)") if any(n) else ""
    budgets = "; ".join(f"{r.label}: {r.spec}" for r in plan.rows("tableV"))
    return plan.header(TABLE.title, "tableV") + [
        f"# decoding: {decoding}; at most max_new_tokens per record (the split's){per_problem}",
        f"# budgets (each row's spec): {budgets}",
        "# every row compresses during decoding: ResidualKV codes generated tokens as they leave its raw window; "
        "SnapKV (decoding form, kvpress DecodingPress) evicts the whole cache to target_size every interval decode "
        "steps; OmniKV keeps every token (KR 100%) and selects at every decode step",
        "# score: final answer exact (kvbench.eval.metrics.final_answer) x 100; KR_packed/KR_resident %: bytes held at "
        "the end of a request / full FP16 cache of the whole sequence (prompt + generated); CR %: keys read / keys "
        "visible over the decode steps; generated/sequence tokens: means per record",
    ] + selection_header(plan, "tableV") + full_layer_header(plan.rows("tableV")) + attribution_header(
        plan.rows("tableV")) + codec_header(plan, "tableV", root)


def _write(key: str, spec: str | dict, out: str | Path, root: str | Path = ".") -> pd.DataFrame:
    """Table V from the workflow's JSON ``spec`` (``RKVPlan.from_spec``'s, plus ``splits``: task -> split path)."""
    spec = load_spec(spec, "residualkv")
    plan = RKVPlan.from_spec(spec)
    df, lines = paired_table(plan, "tableV", table_v(plan, root), root)
    write_csv(df, header(plan, root, spec.get("splits")) + lines, out)
    return df


TABLE = Table(
    "residualkv/tableV", "ResidualKV", "residualkv", "Table V (long generation: compression during decoding)",
    "**ResidualKV Table V** (paper §V-B, long generation: AIME with Qwen3-4B-Thinking, up to 32,768 generated "
    "tokens): full cache, SnapKV in its decoding form, OmniKV and ResidualKV, each compressing while the answer is "
    "generated, scored by the exact final answer (pass@1 where records are sampled). KR and CR are measured over the "
    "whole sequence (prompt and generated tokens). On the smoke profile the backbone is the tiny zoo model "
    "``tiny-qwen2-lm-chain`` and the task chain pairs (``chain_pairs_64``: two chains written in alternation, 128 "
    "generated tokens each read from the prompt, then a final question whose answer is only in the generated trace, "
    "about 100 tokens back), greedy: these are not the paper's numbers. The paper gives no KR/CR and no sampling settings for this "
    "table (§V-B, Table V).", _write, plan="residualkv_generation")
TABLES: dict[str, Table] = {TABLE.name: TABLE}
