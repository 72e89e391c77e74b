"""Every table target of both papers, by name (``kvbench report <name>``, the workflow's one ``table`` rule).

Each paper's module holds its :class:`~kvbench.report.plan.Table` entries; this module only joins them.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvbench.bench import table3
from kvbench.report import conduit, residualkv
from kvbench.report.plan import Table

TABLES: dict[str, Table] = {**conduit.TABLES, **table3.TABLES, **residualkv.TABLES}


def write(name: str, spec: str | dict, out: str | Path, root: str | Path = ".") -> pd.DataFrame:
    """Build table ``name`` from the workflow's JSON ``spec`` and write it to ``out``.

    Raises:
        ValueError: an unknown table (naming the known ones), or a bad spec.
    """
    if name not in TABLES:
        raise ValueError(f"unknown table {name!r}; expected one of {sorted(TABLES)}")
    return TABLES[name].write(spec, str(out), str(root))
