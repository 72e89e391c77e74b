"""CONDUIT's evidence allocation, failure audit and case study (App. D.4: Tables 14, 15, Figure 4), from the
audit records of refresh runs (``plan`` of each prediction row, :mod:`kvbench.eval.audit`).

Every quantity is computed from what the runs recorded, per record:

- the **evidence page** is the image holding the answer: ``meta.page`` of the record (docpages pages are
  numbered from 1 in prompt order), so the allocation is counted, not guessed;
- a run's **budget share on the evidence page** is Σ depth over the evidence page's visual tokens / Σ depth over
  all visual tokens (``depth``: layers at which a token was recomputed; one set for all layers gives L per
  refreshed token), and its **coverage** is the share of the page's tokens refreshed at any layer;
- the **attention gap** is c_ev − max_{j ≠ ev} c_j with c the image coefficients of the query-attention-only run
  (``conduit@r:use_v_norm=false``, λ = 1: c_j = m_j / mean_k m_k with m_j image j's mean query attention), i.e.
  how far the evidence page's attention stands above the strongest distractor's, in units of the mean page;
  records are grouped into quartiles by its magnitude (:func:`gap_quartiles`);
- **raw-attention top-k** is ProphetKV as CONDUIT runs it (query attention, no ‖V‖, no image coefficient).

Failure audit (records where CONDUIT at r and full prefill answer differently), first matching class:
``low page coverage`` (CONDUIT refreshed at most ``coverage`` of the evidence page's tokens), ``near-tied``
(CONDUIT's own evidence and best distractor page scores, its coefficients, within ``tie`` of each other, relative),
``other`` (the paper's remaining cases were "consistent with unmodeled attention drift"; we do not test that);
``recovered`` counts those whose CONDUIT answer at ``recover_r`` equals full prefill's.

The case study (Table 15, Figure 4) is the first record of the configured column in split order (chosen before
any run is read, not by its outcome).

Which runs Tables 14 and 15 read is planned by :mod:`kvbench.plan.conduit`; this module writes them from a plan and
:class:`kvbench.report.conduit.accuracy.Runs` (taken as ``Any``: that module imports this one).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvbench.plan.conduit import EVIDENCE_DEFAULTS, case_column, case_rows, evidence_columns, evidence_specs

def evidence_image(record: dict) -> int | None:
    """0-based image index of the page holding the answer (``meta.page`` - 1), None when the record names none."""
    page = record.get("meta", {}).get("page")
    return None if page is None else int(page) - 1


def page_tokens(plan: dict) -> list[range]:
    """Per image, the positions of its visual tokens in ``plan["depth"]`` (visual-token order)."""
    out, start = [], 0
    for s, e in plan["image_spans"]:
        out.append(range(start, start + (e - s)))
        start += e - s
    if start != len(plan["depth"]):
        raise ValueError(f"audit record: image spans cover {start} visual tokens, depth has {len(plan['depth'])}")
    return out


def allocation(plan: dict, image: int) -> tuple[float, float]:
    """``(budget share, coverage)`` of image ``image`` in one run's audit record (module docstring); share NaN
    when nothing was refreshed."""
    depth = np.asarray(plan["depth"], dtype=float)
    toks = list(page_tokens(plan)[image])
    total = depth.sum()
    share = float(depth[toks].sum() / total) if total > 0 else math.nan
    return share, float((depth[toks] > 0).mean())


def gap(coefficients: list[float] | None, image: int) -> float:
    """c_ev − max over the other images (NaN with fewer than two images or no coefficients)."""
    if not coefficients or len(coefficients) < 2:
        return math.nan
    c = np.asarray(coefficients, dtype=float)
    return float(c[image] - np.delete(c, image).max())


def _row(runs: Any, plan: Any, model: str, dataset: str, spec: str) -> dict[str, dict]:
    rows = runs.rows(plan.run_dir(model, dataset, spec))
    if rows is None:
        raise FileNotFoundError(f"run {plan.run_dir(model, dataset, spec)} is missing")
    return rows


def records_of(plan: Any, runs: Any, model: str, column: Any, specs: dict[str, str]) -> pd.DataFrame:
    """One row per record of ``column`` present in every run of ``specs`` (name -> spec): the record's evidence
    image and K, each run's prediction, score and audit-derived allocation."""
    recs = runs.records(column.dataset)
    rows = {name: _row(runs, plan, model, column.dataset, spec) for name, spec in specs.items()}
    ids = [i for i in rows["full"] if i in recs and column.keeps(recs[i]) and all(i in r for r in rows.values())]
    out = []
    for i in ids:
        ev = evidence_image(recs[i])
        if ev is None:
            continue
        item = {"id": i, "K": int(recs[i]["meta"].get("K", 0)), "evidence": ev, "answer": recs[i].get("answer")}
        for name, r in rows.items():
            item[f"{name}_pred"], item[f"{name}_score"] = r[i].get("prediction"), float(r[i].get("score") or 0.0)
            p = r[i].get("plan")
            if p and not p.get("full_prefill"):
                item[f"{name}_share"], item[f"{name}_coverage"] = allocation(p, ev)
                item[f"{name}_coef"] = p.get("coefficients")
        out.append(item)
    return pd.DataFrame(out)


def gap_quartiles(gaps: pd.Series) -> pd.Categorical:
    """Quartile of each record by the attention gap's magnitude ``|gap|``, ranked ascending (ties by record order,
    so the quartiles have equal counts): ``Q1 (closest)`` holds the pages nearest a tie with the strongest distractor,
    ``Q4 (widest)`` the largest gaps either way, as the paper's "closest quartile ... as the page-level gap widens"
    (§D.4). Ranked by the signed gap, Q1 held the most negative gaps, the pages a distractor beat by most (issue
    #33). Fewer records than quartiles (a tiny config): one group per record."""
    q = min(4, len(gaps))
    labels = ["Q1 (closest)", "Q2", "Q3", "Q4 (widest)"] if q == 4 else [f"Q{i + 1}" for i in range(q)]
    if q > 1:
        labels[0] = "Q1 (closest)"
    return pd.qcut(gaps.abs().rank(method="first"), q, labels=labels)


def table14(plan: Any, runs: Any, cfg: dict) -> pd.DataFrame:
    """Table 14: allocation rows per attention-gap quartile and failure-audit rows, per backbone (module docstring).

    Args:
        cfg: the ``conduit.evidence`` mapping (:data:`EVIDENCE_DEFAULTS`).

    Raises:
        ValueError: a column without multi-image records naming their evidence page.
    """
    cfg = {**EVIDENCE_DEFAULTS, **cfg}
    specs = evidence_specs(plan, cfg)
    out = []
    for model in plan.models:
        frames = [records_of(plan, runs, model, c, specs) for c in evidence_columns(plan, cfg)]
        df = pd.concat([f for f in frames if len(f)], ignore_index=True) if any(len(f) for f in frames) else None
        if df is None or df.empty:
            raise ValueError(f"{model}: no multi-image record with meta.page in the columns "
                             f"{[c.name for c in evidence_columns(plan, cfg)]}")
        df["gap"] = [gap(c, e) for c, e in zip(df["attention_coef"], df["evidence"])]
        df = df[df["gap"].notna()].reset_index(drop=True)
        if df.empty:
            raise ValueError(f"{model}: no record with two or more pages and image coefficients for the attention gap")
        df["quartile"] = gap_quartiles(df["gap"])
        base = {"backbone": model, "regime": plan.regime(model)}
        for q, g in df.groupby("quartile", observed=True):
            out.append({**base, "part": "allocation", "group": str(q),
                        "gap": f"[{g['gap'].min():.3f}, {g['gap'].max():.3f}]",
                        "|gap|": f"[{g['gap'].abs().min():.3f}, {g['gap'].abs().max():.3f}]", "records": len(g),
                        "CONDUIT - full": round(100 * (g["conduit_score"] - g["full_score"]).mean(), 2),
                        "raw top-k - full": round(100 * (g["raw_score"] - g["full_score"]).mean(), 2),
                        "CONDUIT evidence share %": round(100 * g["conduit_share"].mean(), 1),
                        "raw top-k evidence share %": round(100 * g["raw_share"].mean(), 1),
                        "uniform share %": round(100 * (1 / g["K"]).mean(), 1)})
        differ = df[df["conduit_pred"] != df["full_pred"]].copy()
        low = differ["conduit_coverage"] <= cfg["coverage"]
        tie = np.array([_near_tie(c, e, cfg["tie"]) for c, e in zip(differ["conduit_coef"], differ["evidence"])],
                       dtype=bool)
        classes = np.where(low, "low page coverage", np.where(tie, "near-tied", "other"))
        recovered = differ["recover_pred"] == differ["full_pred"]
        out.append({**base, "part": "audit", "group": "differing answers", "records": len(differ),
                    "recovered": int(recovered.sum())})
        for name in ("low page coverage", "near-tied", "other"):
            sel = classes == name
            out.append({**base, "part": "audit", "group": name, "records": int(sel.sum()),
                        "recovered": int(recovered[sel].sum())})
    return pd.DataFrame(out)


def _near_tie(coefficients: list[float] | None, image: int, tie: float) -> bool:
    if not coefficients or len(coefficients) < 2:
        return False
    c = np.asarray(coefficients, dtype=float)
    other = np.delete(c, image).max()
    return abs(c[image] - other) <= tie * max(c[image], other)


# --- case study ---------------------------------------------------------------------------------

def case_record(plan: Any, runs: Any, cfg: dict) -> tuple[Any, str]:
    """``(column, record id)`` of the case study: the first record of ``cfg["column"]`` (default: the multi-image
    column with K = 4, else the last one) in split order that the reference run evaluated.

    Raises:
        ValueError: no such record.
    """
    col = case_column(plan, cfg)
    ref = _row(runs, plan, plan.models[0], col.dataset, plan.reference)
    for i, rec in runs.records(col.dataset).items():
        if i in ref and col.keeps(rec) and evidence_image(rec) is not None:
            return col, i
    raise ValueError(f"no record of column {col.name!r} with a named evidence page among the evaluated records")


def _case_rows_of(plan: Any, runs: Any):
    """Yield ``(backbone, label, spec, record, prediction row)`` of the case record under every case method.

    Raises:
        ValueError: a run without the case record.
    """
    col, rid = case_record(plan, runs, plan.cfg.get("case_study", {}))
    rec = runs.records(col.dataset)[rid]
    for model in plan.models:
        for label, spec in case_rows(plan):
            row = _row(runs, plan, model, col.dataset, spec).get(rid)
            if row is None:
                raise ValueError(f"run {plan.run_dir(model, col.dataset, spec)} has no record {rid!r}")
            yield model, label, spec, rec, row


def table15(plan: Any, runs: Any) -> pd.DataFrame:
    """Table 15: the case record's answer under every method at the case budget, per backbone, with where each
    method spent its refresh (share and coverage of the evidence page; per-page mean refreshed tokens per layer)."""
    out = []
    for model, label, spec, rec, row in _case_rows_of(plan, runs):
        ev = evidence_image(rec)
        p = row.get("plan") or {}
        share, cov = allocation(p, ev) if p and not p.get("full_prefill") else (math.nan, math.nan)
        out.append({"backbone": model, "regime": plan.regime(model), "record": rec["id"], "K": rec["meta"].get("K"),
                    "evidence page": ev + 1, "question": rec.get("question"), "gold": rec.get("answer"),
                    "method": label, "spec": spec, "answer": row.get("prediction"),
                    "correct": float(row.get("score") or 0.0) == 1.0,
                    "evidence share %": round(100 * share, 1) if not math.isnan(share) else math.nan,
                    "evidence coverage %": round(100 * cov, 1) if not math.isnan(cov) else math.nan,
                    "refreshed per page": "" if not p else str(p.get("per_image_refreshed"))})
    return pd.DataFrame(out)


def fig4_data(plan: Any, runs: Any) -> pd.DataFrame:
    """Per backbone, method and visual token of the case record: page, token, refresh depth and layers."""
    out = []
    for model, label, spec, rec, row in _case_rows_of(plan, runs):
        p, ev = row.get("plan"), evidence_image(rec)
        if not p:  # full prefill: every token at every layer, no audit record
            continue
        for page, toks in enumerate(page_tokens(p)):
            for j, t in enumerate(toks):
                out.append({"backbone": model, "record": rec["id"], "method": label, "page": page + 1, "token": j,
                            "depth": p["depth"][t], "n_layers": p["n_layers"], "evidence": page == ev})
    return pd.DataFrame(out)


def draw_fig4(df: pd.DataFrame, record: dict, base_dir: str | Path, out_pdf: str | Path) -> None:
    """Figure 4: one row of page panels per method; each page's image with its visual tokens shaded by the share
    of layers at which they were refreshed; the evidence page framed in red, the queried cell marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    from PIL import Image

    from kvbench.utils.io import atomic_path

    images = [p["image"] for p in record["content"] if p["type"] == "image"]
    meta = record.get("meta", {})
    backbones = list(dict.fromkeys(df["backbone"]))
    methods = list(dict.fromkeys(df["method"]))
    K = len(images)
    fig, axes = plt.subplots(len(backbones) * len(methods), K, figsize=(1.6 * K + 1.5, 1.5 * len(methods) * len(backbones)),
                             squeeze=False)
    for b, model in enumerate(backbones):
        for m, method in enumerate(methods):
            d = df[(df["backbone"] == model) & (df["method"] == method)]
            for k in range(K):
                ax = axes[b * len(methods) + m, k]
                img = Image.open(Path(base_dir) / images[k]).convert("RGB")
                ax.imshow(img)
                toks = d[d["page"] == k + 1].sort_values("token")
                n = len(toks)
                W, H = img.size
                cols = max(1, W // 28) if n == (W // 28) * (H // 28) else max(1, int(round(math.sqrt(n))))
                rows_n = max(1, math.ceil(n / cols))
                cw, ch = W / cols, H / rows_n
                for _, t in toks.iterrows():
                    y, x = divmod(int(t["token"]), cols)
                    share = t["depth"] / max(int(t["n_layers"]), 1)
                    if share > 0:
                        ax.add_patch(Rectangle((x * cw, y * ch), cw, ch, color="tab:blue", alpha=0.2 + 0.6 * share))
                if k + 1 == meta.get("page") and "row" in meta and "col" in meta:
                    ax.plot((meta["col"] - 0.5) * cw, (meta["row"] - 0.5) * ch, "x", color="tab:red", ms=8, mew=2)
                if k + 1 == meta.get("page"):
                    for s in ax.spines.values():
                        s.set_edgecolor("tab:red")
                        s.set_linewidth(2.5)
                ax.set_xticks([])
                ax.set_yticks([])
                if m == 0 and b == 0:
                    ax.set_title(f"page {k + 1}" + (" (evidence)" if k + 1 == meta.get("page") else ""), fontsize=8)
                if k == 0:
                    ax.set_ylabel(f"{method}" + (f"\n{model}" if len(backbones) > 1 else ""), fontsize=7)
    fig.suptitle(f"CONDUIT Fig. 4: record {record.get('id')}\nrefreshed visual tokens (shade: share of layers)",
                 fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.96))  # room for the two-line title above the page titles
    with atomic_path(out_pdf) as tmp:
        fig.savefig(tmp, format="pdf", metadata={"CreationDate": None})
    plt.close(fig)
