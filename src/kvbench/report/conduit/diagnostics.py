"""CONDUIT's premise diagnostics as tables (App. C-D; Tables 11-13), from the capture CSVs of
:func:`kvbench.reuse.diagnostics.capture` (``kvbench conduit-diagnose``, one per model x dataset).

- **Table 11** (selection rules vs random, §D.3): per decoder layer and budget r, the projected residual error
  R_l(S) = Σ_{t ∉ S} α_l(t)² ŝ_l(t) (diagonal form of §C.1; ŝ the Monte Carlo drift of §D.1) of each rule's
  refresh set of ⌈r·N⌉ tokens (per-layer signals, one image coefficient per image as CONDUIT's with λ = 1),
  as a reduction factor Σ R(random) / Σ R(rule) over records; random is its exact expectation
  (1 − k/N)·Σ_t α²ŝ. Rules: query attention (α), cached value norm (‖V‖), cached key norm (‖K‖), CONDUIT's
  throughput α·‖V‖ with the image coefficient, and the oracle top-k of α²ŝ (the best any rule can do under
  this objective). ``spearman`` is the mean over records of the Spearman correlation of CONDUIT's surrogate
  α·‖V_cached‖ with the true per-token term α·√ŝ.
- **Table 12** (cached value-norm stability and rank overlaps, §D.3): Spearman of ‖V_cached‖ vs ‖V_fresh‖ over
  each record's visual tokens, per layer and averaged over layers (paper: 0.996 / 0.990); and the overlap of
  the top decile by attention, the top decile by key norm and the bottom decile by value norm, as observed
  overlap / the independent-decile expectation k²/N (1 = no enrichment).
- **Table 13** (scale similarity across image types, §D.3): the Kolmogorov-Smirnov distance between the
  pooled within-image squared-throughput values (α·‖V‖)² of two image types, before and after dividing each
  image's values by g_j², g_j the image's mean throughput (paper: mean cross-type KS 0.66 -> 0.24).

Every table has one block per model (with its staleness regime) and states its record counts.
docs/decisions/conduit.md, "Diagnostics, Tables 11-13", records how the paper's protocol was read.
"""
from __future__ import annotations

import math
from itertools import combinations
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from kvbench.plan.base import Table, load_spec
from kvbench.utils.io import write_csv
from kvbench.reuse.diagnostics import COLUMNS
from kvbench.reuse.validate import budget_count

#: Selection rules of Table 11, in column order.
RULES = ("attention", "value_norm", "key_norm", "conduit", "oracle")


def read_captures(paths: list[str | Path]) -> pd.DataFrame:
    """Concatenate capture CSVs (each with ``model``, ``dataset`` and :data:`COLUMNS`).

    Raises:
        ValueError: no path, or a file missing a column.
    """
    if not paths:
        raise ValueError("no capture CSV given (kvbench conduit-diagnose writes them)")
    frames = []
    for p in paths:
        df = pd.read_csv(p)
        missing = {"model", "dataset", *COLUMNS} - set(df.columns)
        if missing:
            raise ValueError(f"{p}: not a diagnostics capture (missing columns {sorted(missing)})")
        frames.append(df)
    return pd.concat(frames, ignore_index=True)


def _top(scores: np.ndarray, k: int) -> np.ndarray:
    """Bool mask of the ``k`` largest ``scores``, ties to the earlier token (as :func:`kvbench.reuse.scoring.top_k`)."""
    order = np.argsort(-scores, kind="stable")
    mask = np.zeros(len(scores), dtype=bool)
    mask[order[:k]] = True
    return mask


def _conduit_scores(g: pd.DataFrame) -> np.ndarray:
    """α·‖V‖ times the image coefficient c_j = m_j / mean_k m_k (λ = 1; c = 1 for one image)."""
    s = (g["attn"] * g["vnorm_cached"]).to_numpy()
    images = g["image"].to_numpy()
    m = pd.Series(np.clip(s, 0, None)).groupby(images).mean()
    if len(m) <= 1 or m.mean() <= 0:
        return s
    return s * (m / m.mean()).reindex(images).to_numpy()


def _rule_scores(g: pd.DataFrame) -> dict[str, np.ndarray]:
    a, s_hat = g["attn"].to_numpy(), g["drift_mc"].to_numpy()
    return {"attention": a, "value_norm": g["vnorm_cached"].to_numpy(), "key_norm": g["knorm_cached"].to_numpy(),
            "conduit": _conduit_scores(g), "oracle": a ** 2 * s_hat}


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rho, NaN when either side is constant (no ranking to compare)."""
    if len(x) < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    return float(stats.spearmanr(x, y).statistic)


def table11(df: pd.DataFrame, layers: list[int], budgets: list[float]) -> pd.DataFrame:
    """Rows (model, dataset, layer, r): records, error reduction vs random per rule, surrogate Spearman.

    Raises:
        ValueError: a layer with no captured rows.
    """
    out = []
    for (model, dataset), d in df.groupby(["model", "dataset"], sort=False):
        for layer in layers:
            dl = d[d["layer"] == layer]
            if dl.empty:
                raise ValueError(f"{model}/{dataset}: no capture rows at layer {layer} "
                                 f"(captured: {sorted(d['layer'].unique())})")
            groups = [g for _, g in dl.groupby("record", sort=False)]
            rho = np.nanmean([_spearman((g["attn"] * g["vnorm_cached"]).to_numpy(),
                                        (g["attn"] * np.sqrt(g["drift_mc"])).to_numpy()) for g in groups])
            # per record: the residual terms attn^2 * drift and every rule's scores (independent of the budget)
            per_record = [((g["attn"] ** 2 * g["drift_mc"]).to_numpy(), _rule_scores(g)) for g in groups]
            for r in budgets:
                totals = dict.fromkeys(("random", *RULES), 0.0)
                for term, rule_scores in per_record:
                    n = len(term)
                    k = budget_count(r, n)  # the refresh runs' ⌈r·N⌉
                    totals["random"] += (1 - k / n) * term.sum()
                    for rule, scores in rule_scores.items():
                        totals[rule] += term[~_top(scores, k)].sum()
                row = {"model": model, "dataset": dataset, "layer": layer, "r": r, "records": len(groups)}
                for rule in RULES:
                    row[f"{rule}_x"] = totals["random"] / totals[rule] if totals[rule] > 0 else float("inf")
                row["spearman_surrogate"] = rho
                out.append(row)
    return pd.DataFrame(out)


def table12(df: pd.DataFrame, layers: list[int]) -> pd.DataFrame:
    """Rows (model, dataset, layer or ``mean``): value-norm stability Spearman and decile-overlap enrichments.

    The ``mean`` row averages the per-layer Spearman over the captured layers >= 1: at layer 0 a visual token's
    cached value equals the fresh one (its K/V do not depend on the prefix), so including it raised the mean by
    construction (issue #33)."""
    out = []
    pairs = (("attention", "key_norm"), ("attention", "low_value_norm"), ("key_norm", "low_value_norm"))
    for (model, dataset), d in df.groupby(["model", "dataset"], sort=False):
        per_layer = {}
        for layer, dl in d.groupby("layer"):
            rhos = [_spearman(g["vnorm_cached"].to_numpy(), g["vnorm_fresh"].to_numpy())
                    for _, g in dl.groupby("record", sort=False)]
            per_layer[int(layer)] = (np.nanmean(rhos) if not np.all(np.isnan(rhos)) else float("nan"), len(rhos))
        # layer 0's K/V do not depend on the prefix (cached = fresh, Spearman 1 by construction): not in the mean
        finite = [v for layer, (v, _) in per_layer.items() if layer >= 1 and not math.isnan(v)]
        out.append({"model": model, "dataset": dataset, "layer": "mean", "records": d["record"].nunique(),
                    "vnorm_spearman": float(np.mean(finite)) if finite else float("nan")})
        for layer in layers:
            dl = d[d["layer"] == layer]
            obs = dict.fromkeys(pairs, 0.0)
            exp = 0.0
            for _, g in dl.groupby("record", sort=False):
                n = len(g)
                k = math.ceil(n / 10)
                sets = {"attention": _top(g["attn"].to_numpy(), k),
                        "key_norm": _top(g["knorm_cached"].to_numpy(), k),
                        "low_value_norm": _top(-g["vnorm_cached"].to_numpy(), k)}
                for a, b in pairs:
                    obs[(a, b)] += float((sets[a] & sets[b]).sum())
                exp += k * k / n
            row = {"model": model, "dataset": dataset, "layer": layer, "records": dl["record"].nunique(),
                   "vnorm_spearman": per_layer.get(layer, (float("nan"), 0))[0]}
            for a, b in pairs:
                row[f"overlap_{a}_{b}"] = obs[(a, b)] / exp if exp else float("nan")
            out.append(row)
    return pd.DataFrame(out)


def table13(df: pd.DataFrame, layers: list[int], types: dict[str, str]) -> pd.DataFrame:
    """Rows (model, layer, type pair): KS distance of squared throughput before/after normalising by g_j.

    Args:
        types: dataset -> image type label (e.g. ``docpages: page``); datasets not named are left out.

    Raises:
        ValueError: fewer than two image types among the captures.
    """
    out = []
    for model, d in df.groupby("model", sort=False):
        d = d[d["dataset"].isin(types) & d["layer"].isin(layers)].copy()
        d["type"] = d["dataset"].map(types)
        present = list(dict.fromkeys(d["type"]))
        if len(present) < 2:
            raise ValueError(f"{model}: Table 13 compares image types and needs two; captured {present}")
        d["tau"] = (d["attn"] * d["vnorm_cached"]) ** 2
        g = (d["attn"] * d["vnorm_cached"]).groupby([d["dataset"], d["record"], d["layer"], d["image"]]).transform("mean")
        d["tau_norm"] = d["tau"] / (g ** 2).where(g > 0)
        for layer in [*layers, "all"]:
            dl = d if layer == "all" else d[d["layer"] == layer]
            for a, b in combinations(present, 2):
                x, y = dl[dl["type"] == a], dl[dl["type"] == b]
                row = {"model": model, "layer": layer, "types": f"{a} vs {b}",
                       "images": f"{x.groupby(['record', 'image']).ngroups} / {y.groupby(['record', 'image']).ngroups}"}
                for col, name in (("tau", "ks_raw"), ("tau_norm", "ks_normalised")):
                    row[name] = float(stats.ks_2samp(x[col].dropna(), y[col].dropna()).statistic)
                out.append(row)
    return pd.DataFrame(out)


def _header(spec: dict, title: str, df: pd.DataFrame) -> list[str]:
    zoo = [m for m in df["model"].unique() if m in spec.get("zoo_models", [])] if "model" in df else []
    who = (f"tiny zoo ({', '.join(zoo)}) on smoke datasets; NOT the paper's numbers" if zoo
           else "models computed by this pipeline")
    return [f"# CONDUIT {title}. kvbench {spec['profile']} profile: {who}."]


NOTES = {
    "table11": [
        "# <rule>_x = sum over records of R(random) / R(rule), R(S) = sum over tokens not refreshed of attn^2 * "
        "Monte Carlo drift (diagonal form, App. C.1; random = its exact expectation); > 1: the rule leaves less "
        "projected error than random. Per-layer signals; conduit = attn * cached |V| with the image coefficient "
        "(lambda = 1); oracle = top-k of attn^2 * drift (the best under this objective).",
        "# spearman_surrogate: mean over records of Spearman(attn * cached |V|, attn * sqrt(drift)). "
        "Paper (Qwen2.5-VL-3B, layers 7/14/24): rules cut error ~5x to >500x vs random, |V|-only ~ random, "
        "surrogate Spearman 0.79-0.89.",
    ],
    "table12": [
        "# vnorm_spearman: mean over records of Spearman(cached |V|, fresh |V|) over the visual tokens (row 'mean': "
        "averaged over layers >= 1, since layer 0's cached value is the fresh one whatever the prefix; paper: 0.996 Qwen2.5-VL-3B, 0.990 -7B over 64 shifted-prefix pairs).",
        "# overlap_a_b: tokens in both the top decile of a and of b (low_value_norm: the bottom decile of cached "
        "|V|) / the independent-decile expectation k^2/N; 1 = no enrichment (paper: no systematic positive "
        "enrichment).",
    ],
    "table13": [
        "# KS distance between the pooled within-image squared throughput (attn * cached |V|)^2 of two image types, "
        "raw and divided by g_j^2 (g_j: the image's mean throughput); paper: mean cross-type 0.66 -> 0.24.",
    ],
}


def write(key: str, spec: str | dict, out: str, root: str = ".") -> pd.DataFrame:
    """Build diagnostics table ``key`` (``table11``, ``table12``, ``table13``) from the workflow's spec
    (``profile``, ``conduit_diagnostics`` section, ``captures`` paths, ``regimes``, ``zoo_models``) into ``out``.

    Raises:
        ValueError: a bad spec or capture file, or too few image types for Table 13.
    """
    spec = load_spec(spec, "conduit_diagnostics")
    section = spec["conduit_diagnostics"]
    df = read_captures([Path(root) / p for p in spec["captures"]])
    if key == "table11":
        table = table11(df, section["layers"], section["budgets"])
    elif key == "table12":
        table = table12(df, section["layers"])
    elif key == "table13":
        table = table13(df, section["layers"], section["datasets"])
    else:
        raise ValueError(f"unknown diagnostics table {key!r}")
    regimes = spec.get("regimes", {})
    table.insert(table.columns.get_loc("model") + 1, "regime", table["model"].map(lambda m: regimes.get(m, "")))
    header = _header(spec, TABLES[f"conduit/{key}"].title, df) + NOTES[key]
    write_csv(table, header, out)
    return table


TABLES: dict[str, Table] = {t.name: t for t in (
    Table("conduit/table11", "CONDUIT", "conduit_diagnostics",
          "Table 11 (projected residual error of each selection rule vs random, surrogate ordering)",
          "**CONDUIT Table 11** (paper §D.3, estimator of §D.1): projected residual error reduction of each "
          "selection rule against random selection, per layer and budget, with the Monte Carlo staleness estimator, "
          "and the surrogate-ordering Spearman. On the smoke profile the backbones are the tiny zoo VLMs (strong and "
          "mild regime): these are not the paper's numbers.", write),
    Table("conduit/table12", "CONDUIT", "conduit_diagnostics",
          "Table 12 (cached value-norm stability across shifted prefixes, rank overlaps)",
          "**CONDUIT Table 12** (paper §D.3): Spearman of cached vs fresh value norms over shifted-prefix pairs, and "
          "decile overlaps of attention, key-norm and low-value-norm rankings against the independent baseline. On "
          "the smoke profile the backbones are the tiny zoo VLMs: these are not the paper's numbers.", write),
    Table("conduit/table13", "CONDUIT", "conduit_diagnostics",
          "Table 13 (scale similarity of squared throughput across image types)",
          "**CONDUIT Table 13** (paper §D.3): Kolmogorov-Smirnov distance between image types of within-image "
          "squared throughput, before and after normalising by the image scale g_j. On the smoke profile the types "
          "are docpages pages and digitgrid grids of the tiny zoo VLMs: these are not the paper's numbers.", write),
)}
