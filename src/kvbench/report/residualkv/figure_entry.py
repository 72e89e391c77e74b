"""Entry point of ``kvbench report residualkv-fig<N>``: a ResidualKV figure (:mod:`kvbench.report.residualkv.figures`) from
the workflow's JSON spec. Tables are ``kvbench report residualkv/table<N>`` (:mod:`kvbench.report.tables`)."""
from __future__ import annotations

from pathlib import Path

from kvbench.report.residualkv import figures as rkv_figures
from kvbench.report.residualkv.tables import TABLES
from kvbench.plan.residualkv import RKVPlan


def report(target: str, spec: str | dict, out: str | Path, root: str | Path = ".", out_csv: str | Path | None = None,
           raw: str | Path | None = None) -> None:
    """Entry point of ``kvbench report residualkv-<target>``.

    ``spec``: ``{profile, residualkv, zoo, seed, model_dir}`` (``common.smk``'s ``rkv_report_spec``); the codec
    figures need ``seed`` and ``model_dir`` to find the codec directories (:meth:`RKVPlan.codec_dir`).

    ``raw`` is Fig. 11's throughput CSV (``kvbench bench rkv-variants``); other targets take none.

    Raises:
        ValueError: ``spec`` is not the JSON the workflow passes, ``target`` is unknown, or ``raw`` is given
            to a target other than fig11.
    """
    if raw is not None and target != "fig11":
        raise ValueError(f"--raw is not read by residualkv-{target} (only fig11's throughput CSV, fig6, fig8)")
    plan = RKVPlan.from_spec(spec)
    if target == "fig11":
        rkv_figures.fig11(plan, out, out_csv, root, throughput=raw)
    elif target in rkv_figures.FIGURES:
        rkv_figures.FIGURES[target](plan, out, out_csv, root)
    else:
        hint = f" (tables are `kvbench report residualkv/{target} --spec ...`)" if f"residualkv/{target}" in TABLES else ""
        raise ValueError(f"unknown ResidualKV figure {target!r}{hint}; known: {sorted([*rkv_figures.FIGURES, 'fig11'])}")
