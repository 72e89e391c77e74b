"""Beyond both papers: CONDUIT's Table 1 block over ResidualKV-compressed image caches; the writer.

The table (``results/beyond/conduit_rkv_cache.csv``) has per row the score on the raw caches (Table 1's own run), on
the compressed caches, their paired difference (compressed − raw, per record, with a 95% paired-bootstrap CI) and the
cache bytes per image raw vs compressed; below, CONDUIT minus ProphetKV and minus the strongest other budgeted row on
either cache form (does the ordering survive compression?). No paper reports this: no published number exists. What it
reads (``beyond.conduit_rkv_cache``, the runs, the compressed caches): :mod:`kvbench.plan.compressed_cache`.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from kvbench.eval.registry import parse_method_spec
from kvbench.plan.base import Table, load_spec
from kvbench.plan.compressed_cache import KEY, CompressedCachePlan
from kvbench.plan.conduit import Column, ConduitPlan
from kvbench.report.conduit.accuracy import Runs, _mean, note_errors
from kvbench.report.paired import paired_stats
from kvbench.utils.io import write_csv

def _paired(runs: Runs, a_dir: dict[str, str], b_dir: dict[str, str], cols: list[Column]) -> dict:
    """Run ``a`` minus run ``b`` (per dataset directories), paired by record id within each column on the records
    both hold: ``{"a", "b"}`` (avg over columns of the paired records' means, points), ``diff`` (pooled over all
    records), ``d`` (the per-record differences), ``n``, ``notes``. A missing run leaves them out with its reason."""
    notes, a_means, b_means, diffs = [], [], [], []
    for c in cols:
        sa, why_a = runs.column(a_dir[c.dataset], c)
        sb, why_b = runs.column(b_dir[c.dataset], c)
        if sa is None or sb is None:
            notes += [w for w in (why_a, why_b) if w]
            continue
        ids = sorted(set(sa) & set(sb))
        if set(sa) != set(sb):
            notes.append(f"{c.name}: paired on the {len(ids)} records both runs hold ({len(sa)} and {len(sb)})")
        if not ids:
            notes.append(f"{c.name}: no record in both runs")
            continue
        a_means.append(_mean(sa[i] for i in ids))
        b_means.append(_mean(sb[i] for i in ids))
        diffs.append(np.array([sa[i] - sb[i] for i in ids]))
    if len(diffs) < len(cols):
        return {"n": 0, "notes": notes + ["a column is empty"]}
    d = np.concatenate(diffs)
    return {"a": 100 * _mean(a_means), "b": 100 * _mean(b_means), "diff": 100 * float(d.mean()), "d": d,
            "n": len(d), "notes": notes}


def _ci(d: np.ndarray, boot: dict) -> dict:
    """95% paired-bootstrap CI of ``d`` (points) and whether it excludes 0 (:func:`kvbench.report.paired.paired_stats`)."""
    stats = paired_stats(d, boot["resamples"], boot["seed"])
    return {k: stats[k] for k in ("ci95_lo", "ci95_hi", "told_apart")}


def bytes_summary(indexes: dict[str, dict]) -> dict | None:
    """Bytes per image over the datasets' compressed caches (their ``kvbench cache --compressed`` indexes'
    ``summary``), weighted by images: raw, compressed, KR, parts, embeds, tokens per image; None without an index."""
    sums = [ix["summary"] for ix in indexes.values()]
    if not sums:
        return None
    n = sum(s["n_images"] for s in sums)
    w = lambda key: sum(s[key] * s["n_images"] for s in sums) / n   # noqa: E731
    raw, comp = w("raw_kv_bytes"), w("compressed_kv_bytes")
    return {"n_images": n, "tokens_per_image": w("tokens_per_image"), "raw": raw, "compressed": comp, "kr": comp / raw,
            "embeds": w("embeds_bytes"), "rel_err_k": w("rel_err_k_mean"), "rel_err_v": w("rel_err_v_mean"),
            "parts": {p: sum(s["parts"][p] * s["n_images"] for s in sums) / n for p in sums[0]["parts"]}}


def table(plan: CompressedCachePlan, runs: Runs, sizes: dict | None) -> pd.DataFrame:
    """Score rows (raw vs compressed per Table 1 row) and the ordering rows (CONDUIT minus ProphetKV and minus the
    strongest other budgeted row, on each cache form). Points = score x 100, 2 decimals; bytes per image (mean over
    images); a cell is computed or empty with its reason in ``notes``."""
    boot = plan.conduit.cfg["gap"]
    cols = plan.columns
    out, comp_avg = [], {}
    raw_dir = lambda spec: {d: plan.raw_run(d, spec).path(plan.conduit.profile) for d in plan.datasets}  # noqa: E731
    comp_dir = lambda spec: {d: plan.compressed_run(d, spec).path(plan.conduit.profile) for d in plan.datasets}  # noqa: E731
    for row in plan.rows():
        rec = {"backbone": plan.model, "regime": plan.conduit.regime(plan.model), "r": plan.r,
               "kind": "score", "method": row.label, "spec": row.spec}
        p = _paired(runs, comp_dir(row.spec), raw_dir(row.spec), cols)
        notes = list(p["notes"])
        for run in dict.fromkeys([*comp_dir(row.spec).values(), *raw_dir(row.spec).values()]):
            if runs.rows(run) is not None:  # a failed sample scores 0: say so, or it reads as compression's cost
                notes.append(note_errors(runs.rows(run), run) or "")
        notes = [n for n in notes if n]
        if p["n"]:
            rec.update({"raw": round(p["b"], 2), "compressed": round(p["a"], 2), "diff": round(p["diff"], 2),
                        **_ci(p["d"], boot), "n": p["n"]})
            comp_avg[row.label] = p["a"]
        if row.spec == plan.conduit.reference:
            notes.append("full prefill reads no image cache: one run on both sides, no cache bytes")
        elif sizes is None:
            notes.append("bytes: no compressed-cache index")
        else:
            rec.update({"raw bytes/image": round(sizes["raw"]), "compressed bytes/image": round(sizes["compressed"]),
                        "KR %": round(100 * sizes["kr"], 1)})
        rec["notes"] = "; ".join(dict.fromkeys(notes))
        out.append(rec)
    out += ordering_rows(plan, runs, comp_avg, raw_dir, comp_dir)
    cols_out = ["backbone", "regime", "r", "kind", "method", "spec", "raw", "compressed", "diff", "ci95_lo", "ci95_hi",
                "told_apart", "n", "raw bytes/image", "compressed bytes/image", "KR %", "notes"]
    df = pd.DataFrame(out).reindex(columns=cols_out)
    for c in ("n", "raw bytes/image", "compressed bytes/image"):   # counts stay integers beside empty cells
        df[c] = df[c].astype("Int64")
    return df


def ordering_rows(plan: CompressedCachePlan, runs: Runs, comp_avg: dict, raw_dir, comp_dir) -> list[dict]:
    """CONDUIT minus ProphetKV and minus the strongest other budgeted row (highest avg on the compressed caches;
    ties: the first in table order), paired by record id, on the compressed caches and on the raw ones."""
    rows = plan.rows()
    ours = [r for r in rows if parse_method_spec(r.spec).name == "conduit"]
    others = [r for r in rows if r not in ours and parse_method_spec(r.spec).r is not None]
    if len(ours) != 1 or not others:
        return []
    pk = [r for r in others if parse_method_spec(r.spec).name == "prophetkv"]
    scored = [r for r in others if r.label in comp_avg]
    best = max(scored, key=lambda r: comp_avg[r.label]) if scored else None   # max: the first on ties
    pairs = list(dict.fromkeys([*pk, *([best] if best else [])]))
    out = []
    for b in pairs:
        roles = (["ProphetKV"] if b in pk else []) + (["the strongest other budgeted row on the compressed caches"]
                                                      if b is best else [])
        for form, dirs in (("compressed", comp_dir), ("raw", raw_dir)):
            rec = {"backbone": plan.model, "regime": plan.conduit.regime(plan.model), "r": plan.r,
                   "kind": f"paired difference ({form} caches)", "method": f"{ours[0].label} − {b.label}",
                   "spec": f"{ours[0].spec} − {b.spec}"}
            p = _paired(runs, dirs(ours[0].spec), dirs(b.spec), plan.columns)
            if p["n"]:
                rec.update({"diff": round(p["diff"], 2), **_ci(p["d"], plan.conduit.cfg["gap"]), "n": p["n"]})
            rec["notes"] = "; ".join([f"b = {' and '.join(roles)}", *p["notes"]])
            out.append(rec)
    return out


#: relative L2 restore error from which the header calls the restored caches mostly lost
LOST_ERROR = 0.5


def restore_notes(st, sizes: dict | None) -> list[str]:
    """``#`` lines on what the compression does to the comparison (issue #33): a restore error of
    :data:`LOST_ERROR` or more (the restored K/V keep little of the raw ones), and a lossy layer 0 (coded, or a
    full layer below 16 bits), whose error a schedule that recomputes every visual token at layer 0 (as-run
    CacheBlend and KVShare) repairs for free, since layer-0 K/V do not depend on the prefix.

    Args:
        st: the storage spec (``full_layers``, ``full_kv_bits``).
        sizes: the compressed-cache index summary (``rel_err_k``, ``rel_err_v``), or None.
    """
    lines = []
    if sizes is not None and max(sizes["rel_err_k"], sizes["rel_err_v"]) >= LOST_ERROR:
        lines.append(
            f"# the restore error is near total (relative L2 error of K {sizes['rel_err_k']:.3f}, of V "
            f"{sizes['rel_err_v']:.3f}; >= {LOST_ERROR:g}: the restored K/V keep little of the raw ones), so "
            "'compressed' measures refresh over mostly lost caches, not over a mild compression")
    lossy0 = 0 not in st.full_layers or st.full_kv_bits < 16
    if lossy0:
        form = "coded as a residual layer" if 0 not in st.full_layers else f"stored at {st.full_kv_bits} bits"
        lines.append(
            f"# layer 0 is lossy here ({form}), while its fresh K/V equal the raw cached ones whatever the prefix: a "
            "schedule that recomputes every visual token at layer 0 (as-run CacheBlend and KVShare) repairs that "
            "error at no staleness cost, so on these caches layer-front-loaded schedules gain for a reason other "
            "than staleness")
    return lines


def header(plan: CompressedCachePlan, spec: dict, df: pd.DataFrame, sizes: dict | None) -> list[str]:
    """The CSV's ``#`` lines: who computed it (tiny zoo or checkpoint; not a published number), the codec and
    storage, the bytes by part, the restore error, what the cells are, and the orderings that survive or not."""
    zoo = plan.model in set(spec.get("zoo_models", ()))
    who = (f"kvbench {plan.conduit.profile} profile: tiny zoo ({plan.model}) on smoke datasets, not the paper's model"
           if zoo else f"kvbench {plan.conduit.profile} profile: {plan.model} computed by this pipeline")
    st = plan.storage_spec(spec["codec_dir"])
    full = ("FP16" if st.full_kv_bits == 16 else f"KIVI-style {st.full_kv_bits}-bit (keys per channel over 32 tokens, "
            "the last incomplete group FP16; values per token)")
    boot = plan.conduit.cfg["gap"]
    lines = [
        f"# Beyond both papers: CONDUIT Table 1's r = {plan.r:g} block over ResidualKV-compressed image caches. {who}. "
        "No published number exists: neither CONDUIT nor ResidualKV reports CONDUIT over compressed caches.",
        f"# codec: {spec['codec_dir']} (sha256 of its files {spec.get('codec_id', '?')[:12]}), the backbone's VLM "
        f"codec (rule rkv_mm_codec); storage per image, image-local positions: sparse layers = {st.n_sink} raw sink(s), "
        f"references on the codec's stride schedule stored FP8 e4m3, every other token a {st.bits}-bit residual code "
        f"against the mean of its k nearest earlier references (int16 indices; int32 from 32,768 references on), no raw window; full-attention layers "
        f"{list(st.full_layers)} stored {full}; vision embeds (a refresh's layer-0 input) kept at the model dtype in "
        "both forms. Restored: every token's K/V decoded (kv = f_d(z) + mean of its references) when a request reuses "
        "the image; the refresh policies then run on the restored caches as on the raw ones.",
    ]
    if sizes is None:
        lines.append("# bytes: no compressed-cache index was given")
    else:
        parts = ", ".join(f"{k} {v:,.0f}" for k, v in sizes["parts"].items() if v)
        lines.append(
            f"# bytes per image (mean over the {sizes['n_images']} distinct images of the records, "
            f"{sizes['tokens_per_image']:.1f} visual tokens each): raw FP16 K+V of all layers {sizes['raw']:,.0f} B, "
            f"compressed {sizes['compressed']:,.0f} B (KR {100 * sizes['kr']:.1f}%; by part: {parts}), measured from "
            f"the stored tensors; embeds {sizes['embeds']:,.0f} B per image in both forms. Restore error (diagnostic): "
            f"relative L2 error of K {sizes['rel_err_k']:.3f}, of V {sizes['rel_err_v']:.3f} (mean over images and "
            "layers)")
    lines += restore_notes(st, sizes)
    lines.append(
        "# cells: raw = score on the raw caches (Table 1's run), compressed = on the compressed caches, x 100, avg over "
        f"the columns {[c.name for c in plan.columns]} (records paired by id within each column); diff = compressed "
        "- raw per record, mean over all records pooled across the columns; 95% CI: paired bootstrap, percentile "
        f"method, {boot['resamples']} resamples, seed {boot['seed']}; told_apart = the CI excludes 0. Rows of kind "
        "'paired difference (<form> caches)' give CONDUIT minus a baseline, both on that cache form (in diff, with "
        "its CI)")
    for form in ("compressed", "raw"):
        d = df[df["kind"] == f"paired difference ({form} caches)"]
        text = "; ".join(f"{r.method} {r.diff:+.2f} [{r.ci95_lo:+.2f}, {r.ci95_hi:+.2f}]"
                         + (" told apart" if r.told_apart is True else " NOT told apart")
                         for r in d.itertuples() if not pd.isna(r.diff)) or "none computed"
        lines.append(f"# ordering on the {form} caches: {text}")
    return lines


def _write(key: str, spec: str | dict, out: str | Path, root: str | Path = ".") -> pd.DataFrame:
    """The table from the workflow's JSON ``spec``: ``{profile, conduit, beyond: {conduit_rkv_cache}, splits,
    zoo_models, codec_dir, codec_id, indexes: {dataset: compressed-cache index.json}}``."""
    spec = load_spec(spec, "beyond")
    conduit = ConduitPlan(spec["conduit"], spec["profile"], spec.get("zoo_models", ()))
    plan = CompressedCachePlan(spec["beyond"][KEY], conduit)
    runs = Runs(root, spec.get("splits", {}), allow_missing=True)
    indexes = {d: json.loads(Path(root, p).read_text()) for d, p in spec.get("indexes", {}).items() if Path(root, p).is_file()}
    if indexes:
        spec = {**spec, "codec_id": next(iter(indexes.values())).get("codec_id", "?")}
    sizes = bytes_summary(indexes)
    df = table(plan, runs, sizes)
    write_csv(df, header(plan, spec, df, sizes), str(out))
    return df


TABLES: dict[str, Table] = {t.name: t for t in (
    Table("beyond/conduit_rkv_cache", "Beyond both papers", "beyond",
          "CONDUIT over ResidualKV-compressed image caches (Table 1's r block, raw vs compressed)",
          "**Beyond both papers: CONDUIT over ResidualKV-compressed image caches** (no paper section: CONDUIT's "
          "Limitations name the storage of cached visual K/V as its remaining cost): each image's cached "
          "visual K/V stored in ResidualKV's form (FP8 references + quantised residual codes; full-attention layers "
          "as configured) and restored when a request reuses the image; Table 1's rows at one budget run on the "
          "restored caches. Per row the score on the raw and on the compressed caches, their paired difference with "
          "a 95% paired-bootstrap CI, and the cache bytes per image raw vs compressed (KR); below, CONDUIT minus "
          "ProphetKV and minus the strongest other budgeted row on each cache form. No published number exists: these are "
          "not the paper's numbers; on the smoke profile the backbone is the tiny zoo VLM.",
          _write, plan="conduit_rkv_cache"),
)}

