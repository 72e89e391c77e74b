"""Every table target of both papers, by name (``kvbench report <name>``, the workflow's one ``table`` rule).

Each paper's module holds its :class:`~kvbench.plan.base.Table` entries; this module only joins them.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvbench.plan.base import Table
from kvbench.report.beyond import conduit_rkv_cache
from kvbench.report.conduit import accuracy, diagnostics, table3
from kvbench.report.residualkv import table_i, table_ii, table_iv, table_v, tables

TABLES: dict[str, Table] = {**accuracy.TABLES, **diagnostics.TABLES, **table3.TABLES, **tables.TABLES,
                           **table_i.TABLES, **table_ii.TABLES, **table_iv.TABLES, **table_v.TABLES,
                           **conduit_rkv_cache.TABLES}


def write(name: str, spec: str | dict, out: str | Path, root: str | Path = ".") -> pd.DataFrame:
    """Build table ``name`` from the workflow's JSON ``spec`` and write it to ``out``.

    Raises:
        ValueError: an unknown table (naming the known ones), or a bad spec.
    """
    if name not in TABLES:
        raise ValueError(f"unknown table {name!r}; expected one of {sorted(TABLES)}")
    table = TABLES[name]
    if isinstance(spec, dict) and spec.get("allow_missing") and table.section != "conduit":
        raise ValueError(f"--allow-missing applies to CONDUIT's accuracy tables only, not {name}")
    try:
        return table.build(spec, str(out), str(root))
    except KeyError as e:  # most often a spec written by hand that lacks a key the workflow always gives
        raise ValueError(f"building {name}: missing key {e.args[0]!r}. If the --spec was written by hand, it may "
                         f"lack that key (the workflow's spec: `snakemake -n -p {table.path}` prints it); otherwise "
                         "the input lacks it (traceback above)") from e
