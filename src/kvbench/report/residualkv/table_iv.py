"""ResidualKV Table IV (paper §V-B, SCBench): compression methods on shared contexts with several queries each.

Rows: the config's ``residualkv.tableIV`` (``{label, method}``; ResidualKV at a fixed reference stride, ``alpha=0``,
as the paper's SCBench runs, §V-A), every row under the ``shared_context`` protocol. Columns: the tasks of
``residualkv.target_tasks.tableIV`` (multi-query splits: the smoke ``*_1k_mq`` tasks, or SCBench's SCDQ files
converted by ``kvbench scbench-convert`` on the paper profile), each the mean over records of the mean score of a
record's queries x 100 (= SCBench's mean over queries when records hold equal numbers of queries), ``avg`` the
unweighted mean over tasks, then KR and CR measured as in Table III (:func:`kvbench.report.residualkv.tables.score_table`):
KR from the bytes the cache holds after each query (mean over queries and records), CR over each query's own chunk
and decode steps.

Mode: SCBench's multi-request ("SCDQ", ``--same_context_different_query``): the context is prefilled once as its own
chunk and compressed, and each query reads the cache as it was after the context
(:mod:`kvbench.compress.multiquery`); SCBench's other mode, multi-turn, keeps earlier queries and answers in the
cache and is not what the paper's SCDQ subset runs.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvbench.plan.base import Table
from kvbench.report.residualkv.tables import (
    attribution_header,
    codec_header,
    full_layer_header,
    paired_table,
    score_table,
    selection_header,
    write_csv,
)
from kvbench.plan.residualkv import RKVPlan, check_table_iv

KEY = "tableIV"
#: Header line saying how every row met its queries.
MODE = ("# mode: SCBench multi-request (SCDQ): each record's context prefilled once as its own chunk and compressed, "
        "then every query answered from the cache as it was after the context (restored per query; earlier queries "
        "and answers are not in the cache: SCBench's multi-turn mode is not run); scores: per record the mean over "
        "its queries, per task the mean over records x 100 (kvbench.compress.multiquery)")


def write_table_iv(plan: RKVPlan, out: str | Path, root: str | Path = ".") -> pd.DataFrame:
    """Compute Table IV from its runs under ``root`` and write it to ``out`` (module doc).

    Raises:
        ValueError: a row not under ``shared_context`` (:func:`kvbench.plan.residualkv.check_table_iv`).
        FileNotFoundError: a run has no predictions.
    """
    check_table_iv(plan)
    df, lines = paired_table(plan, KEY, score_table(plan, KEY, root), root)
    what = ("multi-query smoke tasks (several '\\nQuery:'/'\\nChain:' questions about one context, the zoo LM's "
            "question forms) in place of SCBench's SCDQ files" if plan.zoo else
            "SCBench SCDQ files converted by kvbench scbench-convert")
    header = plan.header(TABLES[f"residualkv/{KEY}"].title, KEY) + [
        f"# Table IV tasks: {', '.join(plan.target_tasks(KEY))}: {what}", MODE,
        "# KR_packed %: packed bytes / full FP16 cache after each query (the paper's accounting, measured); "
        "KR_resident %: every tensor held, as held; CR %: keys read / keys visible over each query's chunk and "
        "decode steps; KR formula %: paper §V-A; the paper's Table IV has no full-cache row (§V-B): ours is "
        "the reference the others are read against",
    ] + lines + selection_header(plan, KEY) + full_layer_header(plan.rows(KEY)) + attribution_header(
        plan.rows(KEY)) + codec_header(plan, KEY, root)
    write_csv(df, header, out)
    return df


def _write(key: str, spec: str | dict, out: str | Path, root: str | Path = ".") -> pd.DataFrame:
    return write_table_iv(RKVPlan.from_spec(spec), out, root)


TABLES: dict[str, Table] = {t.name: t for t in (
    Table(f"residualkv/{KEY}", "ResidualKV", "residualkv", "Table IV (SCBench: shared context, several queries)",
          "**ResidualKV Table IV** (paper §V-B, SCBench's SCDQ subset): ResidualKV at a fixed reference stride "
          "(alpha = 0), KVzip, SnapKV, OmniKV and the full cache on contexts that several queries share. Each record's "
          "context is prefilled once as its own chunk and compressed; every query is answered from the cache as it "
          "was after the context (SCBench's multi-request mode). Scores are the mean over a record's queries, then "
          "over records, x 100; ``avg`` the unweighted mean over tasks; KR measured from the bytes held after each "
          "query (``KR_packed %`` the paper's accounting, ``KR_resident %`` every tensor as held), CR over each "
          "query's own forwards. On the smoke profile the model is the tiny zoo LM and the tasks are multi-query "
          "needle, key-value and variable-tracking tasks in place of SCBench: these are not the paper's numbers.",
          _write),
)}
