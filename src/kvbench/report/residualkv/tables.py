"""ResidualKV's tables and figures from compression runs, codec training curves and profiling CSVs.

Tables (``results/residualkv/table{III,VI,VII,VIII}.csv``): one row per press spec, one column per task
(mean per-record score x 100), ``avg`` (unweighted mean over tasks, the paper's average), two measured KRs
never mixed (:mod:`kvbench.compress.accounting`; bytes at the end of each request / the full FP16 cache, mean
over requests and tasks): ``KR_packed %`` (the paper's accounting: codes at their bit width) and
``KR_resident %`` (every tensor the cache holds, as held); ``CR %`` (keys attention could read / keys visible,
mean over layers and over the steps that read the compressed cache); for ResidualKV rows ``KR formula %``
(§V-A: β q_full + (1−β)(ρ_ref/2 + q_b d_c/2d_k), with the measured reference density); and the packed bytes
by part in % of the full FP16 cache (:data:`BREAKDOWN`; they add up to ``KR_packed %`` up to rounding), which
show what the formula leaves out (indices, raw window and sinks). A cell is computed or empty with its reason
in ``notes``. Files start with ``#`` header lines (``pd.read_csv(path, comment="#")``).

Paired differences (:mod:`kvbench.report.paired`): below the score rows (``kind = "score"``), one row per pair of
rows (``kind = "paired difference"``, ``a − b`` in table order): the score per record pooled over the tasks, and the
per-record KR and CR, each with a 95% paired-bootstrap CI (the section's ``bootstrap``), so a published ordering is
judged against a CI rather than two means.

Figures: Fig. 5 (score vs number of references), Figs. 10-12 (codec training curves of the variants),
Fig. 8 (decode tokens/s vs context, from the profiling CSV), Fig. 6 (codec cost, from its CSV).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from kvbench.compress.presses.omnikv import OmniKVPress
from kvbench.compress.registry import PRESS
from kvbench.report import paired
from kvbench.compress.residualkv import references
from kvbench.compress.residualkv.cache import FULL_KV_FORMS, ResidualKVPress
from kvbench.plan.base import Table
from kvbench.plan.residualkv import RKVPlan, known_model_shape, press_spec
from kvbench.utils.io import atomic_path, read_jsonl


def _read_run(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "predictions.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"run {run_dir} has no predictions.jsonl (run it first)")
    return read_jsonl(path)


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else math.nan


#: Table columns of the packed bytes by part, in % of the full FP16 cache: column -> StoredBytes parts summed.
BREAKDOWN: dict[str, tuple[str, ...]] = {
    "full layers %": ("full_layer",), "codes+scales %": ("codes", "scales"), "references %": ("references",),
    "indices %": ("indices",), "window+sinks %": ("raw_window", "sinks"),
}


def _kr_packed(plan: dict) -> float | None:
    # An audit row written before the resident accounting (issue #13 item 6) has ``kr``: the same packed
    # accounting (codes at their bit width, indices at the held width, raw tokens at FP16), so it is that value.
    return plan.get("kr_packed", plan.get("kr"))


def _breakdown(plan: dict) -> dict[str, float | None]:
    """Fractions of the full FP16 cache per :data:`BREAKDOWN` column from one audit row's per-layer ``bytes``
    (``full_bytes`` its denominator; in an older row, Σ packed bytes / ``kr``)."""
    layers = plan.get("bytes")
    if not isinstance(layers, list) or not layers:
        return dict.fromkeys(BREAKDOWN)
    sums = {col: sum(b.get(k, 0) for b in layers for k in keys) for col, keys in BREAKDOWN.items()}
    full = plan.get("full_bytes")
    if not full:
        kr = _kr_packed(plan)
        full = sum(sums.values()) / kr if kr else None
    return {col: (v / full if full else None) for col, v in sums.items()}


def run_summary(run_dir: str | Path) -> dict:
    """Score x 100; KR packed and resident, CR, per-part fractions of the full cache (:data:`BREAKDOWN` keys)
    (fractions, mean over ok records; NaN where no record has one, e.g. ``kr_resident`` in runs written
    before it existed); mean tokens; error count of one run."""
    rows = _read_run(run_dir)
    ok = [r for r in rows if r.get("status") == "ok"]
    plans = [r["plan"] for r in ok if isinstance(r.get("plan"), dict)]
    parts = [_breakdown(p) for p in plans]
    resident = [p.get("kr_resident") for p in plans]
    return {
        "score": 100 * _mean([r["score"] for r in rows]),
        "kr_packed": _mean([_kr_packed(p) for p in plans]),
        # never a mean over some records: a run with a record lacking it has no resident KR
        "kr_resident": _mean(resident) if all(x is not None for x in resident) else math.nan,
        "cr": _mean([p.get("cr") for p in plans]),
        **{col: _mean([b[col] for b in parts]) for col in BREAKDOWN},
        "n_tokens": _mean([p.get("n_tokens") for p in plans]),
        "n": len(rows),
        "errors": len(rows) - len(ok),
    }


def record_values(run_dir: str | Path) -> dict[str, dict[str, float]]:
    """Per-record values of one run, keyed by record id: ``score`` (every record; a failed sample scores 0 as the
    runner wrote it), ``kr`` (packed KR) and ``cr`` (fractions; records with an audit row that has them).

    Raises:
        FileNotFoundError: the run has no predictions.
        ValueError: a record id appears twice (records could not be paired by id), or a record's score is missing,
            not a number or NaN.
    """
    rows = _read_run(run_dir)
    ids = [r["id"] for r in rows]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"run {run_dir}: record id(s) {dup[:3]} appear more than once; runs are paired by record id")
    bad = [r["id"] for r in rows if not isinstance(r.get("score"), (int, float)) or math.isnan(r["score"])]
    if bad:  # the runner writes 0.0 for a failed sample; a missing or NaN score would spoil every pair silently
        raise ValueError(f"run {run_dir}: record(s) {bad[:3]} have no numeric score (a number in [0, 1] expected)")
    plans = {r["id"]: r["plan"] for r in rows if r.get("status") == "ok" and isinstance(r.get("plan"), dict)}
    return {"score": {r["id"]: float(r["score"]) for r in rows},
            "kr": {i: float(_kr_packed(p)) for i, p in plans.items() if _kr_packed(p) is not None},
            "cr": {i: float(p["cr"]) for i, p in plans.items() if p.get("cr") is not None}}


#: Table column -> :func:`record_values` key of the per-record quantities paired besides the score.
PAIRED_METRICS = {"KR_packed %": "kr", "CR %": "cr"}


def bootstrap_settings(section: dict | None) -> dict:
    """``{"resamples", "seed"}`` of a section's ``bootstrap`` (schema defaults where unset: 2000, 0).

    Raises:
        ValueError: resamples below 100 or a negative seed.
    """
    boot = {**paired.DEFAULT_BOOTSTRAP, **((section or {}).get("bootstrap") or {})}
    if int(boot["resamples"]) < 100 or int(boot["seed"]) < 0:
        raise ValueError(f"residualkv.bootstrap: resamples must be >= 100 and seed >= 0, got {boot}")
    return {"resamples": int(boot["resamples"]), "seed": int(boot["seed"])}


def paired_rows(rows: list[tuple[str, str, list[Path]]], tasks: list[str], boot: dict) -> list[dict]:
    """Every pair of ``rows`` (``(label, spec, run dir per task)``, table order) as paired-difference rows
    (:func:`kvbench.report.paired.pair_rows`: score pooled over ``tasks``, plus :data:`PAIRED_METRICS`)."""
    per_row = []
    for label, spec, dirs in rows:
        vals = [record_values(d) for d in dirs]
        per_row.append({"method": label, "spec": spec, "values": {t: v["score"] for t, v in zip(tasks, vals)},
                        **{k: {t: v[k] for t, v in zip(tasks, vals)} for k in PAIRED_METRICS.values()}})
    return paired.pair_rows(per_row, tasks, boot["resamples"], boot["seed"], metrics=PAIRED_METRICS)


def with_paired(df: pd.DataFrame, pairs: list[dict]) -> pd.DataFrame:
    """``df`` (score rows) with a leading ``kind = "score"`` column and ``pairs`` below it; counts stay integers
    and ``notes`` stays last."""
    df = df.copy()
    df.insert(0, "kind", "score")
    out = pd.concat([df, pd.DataFrame(pairs)], ignore_index=True)
    for c in ("wins", "losses", "ties", "n"):
        if c in out:
            out[c] = out[c].astype("Int64")
    return out[[c for c in out.columns if c != "notes"] + ["notes"]]


def paired_table(plan: RKVPlan, target: str, df: pd.DataFrame, root: str | Path = ".") -> tuple[pd.DataFrame, list[str]]:
    """``target``'s score table ``df`` with every pair of its rows below it, and the header lines saying how."""
    tasks = plan.target_tasks(target)
    rows = [(r.label, r.spec, [Path(root) / plan.run_dir(t, r.spec) for t in tasks]) for r in plan.rows(target)]
    boot = bootstrap_settings(plan.s)
    pairs = paired_rows(rows, tasks, boot)
    return with_paired(df, pairs), paired.difference_header(pairs, "every pair of rows, a above b in table order",
                                                              **boot)


def kr_formula(plan: RKVPlan, spec: str, n_tokens: float, shape: tuple[int, int]) -> float | None:
    """§V-A KR of a row's press at ``n_tokens`` on this plan's model of ``shape`` = ``(n_layers, d_kv)``: the press's
    own :meth:`~kvbench.compress.cache.Press.kr_formula` with its codec variant's config (None for presses
    without a closed form, or when no token count was measured)."""
    press = press_spec(spec).build()
    if not n_tokens or math.isnan(n_tokens):
        return None
    variant = plan.codec_of(spec)
    codec = None if variant is None else plan.codecs.config(variant, shape)
    return press.kr_formula(int(round(n_tokens)), *shape, codec=codec)


def score_table(plan: RKVPlan, target: str, root: str | Path = ".", shape: tuple[int, int] | None = None) -> pd.DataFrame:
    """Rows x tasks table of ``target`` (module docstring). ``shape``: ``(n_layers, d_kv)`` for the KR formula
    (None: :func:`model_shape`)."""
    n_layers, d_kv = shape or model_shape(plan, root)
    out = []
    pct = lambda x: None if math.isnan(x) else round(100 * x, 1)  # noqa: E731
    for row in plan.rows(target):
        cells, notes = {"method": row.label, "spec": row.spec}, []
        tasks = plan.target_tasks(target)
        runs = [run_summary(Path(root) / plan.run_dir(task, row.spec)) for task in tasks]
        for task, s in zip(tasks, runs):
            cells[task] = round(s["score"], 2)
            if s["errors"]:
                notes.append(f"{task}: {s['errors']}/{s['n']} samples failed (scored 0)")
        cells["avg"] = round(_mean([cells[t] for t in tasks]), 2)
        cells["KR_packed %"] = pct(_mean([s["kr_packed"] for s in runs]))
        resident = [s["kr_resident"] for s in runs]
        cells["KR_resident %"] = None if any(math.isnan(x) for x in resident) else pct(_mean(resident))
        if cells["KR_resident %"] is None:
            notes.append("KR_resident: a run predates the resident accounting (rerun it)")
        cells["CR %"] = pct(_mean([s["cr"] for s in runs]))
        f = kr_formula(plan, row.spec, _mean([s["n_tokens"] for s in runs]), (n_layers, d_kv))
        cells["KR formula %"] = None if f is None else round(100 * f, 1)
        if f is None:
            notes.append("KR formula: ResidualKV's §V-A formula applies to ResidualKV rows only")
        for col in BREAKDOWN:
            cells[col] = pct(_mean([s[col] for s in runs]))
        cells["notes"] = "; ".join(notes)
        out.append(cells)
    return pd.DataFrame(out)


def model_shape(plan: RKVPlan, root: str | Path) -> tuple[int, int]:
    """``(n_layers, d_kv)`` of the plan's backbone: the plan's, else its ``config.json`` under ``root``, else a zoo
    model's by name, else the main codec's.

    Raises:
        FileNotFoundError: neither file exists.
    """
    if plan.shape is not None:
        return plan.shape
    path = Path(root) / (plan.model_dir or Path("zoo", plan.model)) / "config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else None
    if cfg is None and plan.zoo:
        return known_model_shape(plan.model, {"zoo": {}})  # a zoo model's shape is known by its name
    if cfg is None:
        codec = json.loads((Path(root) / plan.codecs.dir("main") / "codec" / "codec.json").read_text())
        return codec["n_layers"], codec["d_kv"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"], 2 * cfg["num_key_value_heads"] * head_dim


def table_vi(plan: RKVPlan, root: str | Path = ".") -> pd.DataFrame:
    """Table VI: per α, reference count and share at the longest evaluated context and at the paper's
    context (schedule of the main codec), then the scores."""
    df = score_table(plan, "tableVI", root)
    sweep, codec = plan.s["stride_sweep"], plan.codecs.config("main", model_shape(plan, root))
    longest = int(max(run_summary(Path(root) / plan.run_dir(t, plan.rows("tableVI")[0].spec))["n_tokens"]
                      for t in plan.tasks))
    paper_t = int(sweep.get("paper_context", 262144))
    cols = []
    for alpha in sweep["alpha"]:
        kw = dict(n_sink=codec.n_sink, stride=codec.stride, alpha=float(alpha))
        n_long, n_paper = references.reference_count(longest, **kw), references.reference_count(paper_t, **kw)
        cols.append({"alpha": alpha, f"refs @ {longest}": n_long, f"share @ {longest} %": round(100 * n_long / longest, 2),
                     f"refs @ {paper_t}": n_paper, f"share @ {paper_t} %": round(100 * n_paper / paper_t, 2)})
    return pd.concat([pd.DataFrame(cols), df.drop(columns=["method"])], axis=1)


def write_csv(df: pd.DataFrame, header: list[str], out: str | Path) -> None:
    """``header`` lines then the CSV, written atomically."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        with open(tmp, "w") as f:
            f.write("\n".join(header) + "\n")
            df.to_csv(f, index=False)


def selection_header(plan: RKVPlan, target: str) -> list[str]:
    """``#`` lines naming how the OmniKV rows of ``target`` select (standalone ``omnikv`` and ``+omnikv``
    selectors; :meth:`OmniKVPress.selection_form`), one per distinct form, with the rows' labels."""
    forms: dict[str, list[str]] = {}
    for row in plan.rows(target):
        press = press_spec(row.spec).build()
        selector = press if isinstance(press, OmniKVPress) else getattr(press, "selector", None)
        if isinstance(selector, OmniKVPress):
            forms.setdefault(selector.selection_form(), []).append(row.label)
    return [f"# OmniKV selection ({', '.join(labels)}): {form}" for form, labels in forms.items()]


def full_layer_header(rows) -> list[str]:
    """``#`` lines naming how the ResidualKV rows among ``rows`` (:class:`~kvbench.plan.residualkv.Row`) with
    quantised full-attention layers store them (bits and :data:`~kvbench.compress.residualkv.cache.FULL_KV_FORMS`),
    one per distinct setting, with the rows' labels; none when no row quantises them."""
    forms: dict[tuple[int, str], list[str]] = {}
    for row in rows:
        press = press_spec(row.spec).build()
        if isinstance(press, ResidualKVPress) and press.full_kv_bits < 16:
            forms.setdefault((press.full_kv_bits, press.full_kv_form), []).append(row.label)
    return [f"# full-attention layers ({', '.join(labels)}): KIVI-style {bits}-bit, {FULL_KV_FORMS[form]}"
            for (bits, form), labels in forms.items()]


def attribution_header(rows, reference: str = "ResidualKV") -> list[str]:
    """``#`` lines saying what each ResidualKV-family row among ``rows`` changes against the row labelled
    ``reference`` (the spec parameters that differ, the reference's value in brackets; the protocol excluded), so a
    reader knows what a difference between the two isolates; none without such a row."""
    ref = next((r for r in rows if r.label == reference), None)
    if ref is None:
        return []
    base = press_spec(ref.spec)
    out = []
    for row in rows:
        spec = press_spec(row.spec)
        if row is ref or spec.cls is not base.cls:
            continue
        # a parameter only one side's press family has (a selector's, where the other has none) is the method's change
        keys = sorted(((set(spec.params) | set(base.params)) & set(_fields(spec)) & set(_fields(base)))
                      - {"protocol", "decode_tail"})
        value = lambda sp, k: sp.params.get(k, _fields(sp)[k].default if k in _fields(sp) else None)  # noqa: E731
        diff = [f"{k}={value(spec, k)} ({reference}: {value(base, k)})" for k in keys if value(spec, k) != value(base, k)]
        if spec.name != base.name:
            diff.insert(0, f"method {spec.name} ({reference}: {base.name})")
        if diff:
            out.append(f"# {row.label} vs {reference}: changes only {'; '.join(diff)}")
    return out


def _fields(spec) -> dict:
    """The parameters a parsed press spec may set (storage and selector fields, as the press family lists them)."""
    return PRESS.parameters(spec.cls) | (PRESS.parameters(spec.selector_cls) if spec.selector_cls else {})


def codec_header(plan: RKVPlan, target: str, root: str | Path = ".") -> list[str]:
    """``#`` lines naming the codec each row of ``target`` read (:meth:`RKVPlan.codec_origin`: trained here with its
    recipe, or imported from the authors' checkpoint with its weights' sha256 prefix), one per codec variant."""
    rows: dict[str, list[str]] = {}
    for row in plan.rows(target):
        variant = plan.codec_of(row.spec)
        if variant is not None:
            rows.setdefault(variant, []).append(row.label)
    return [f"# codec {v} ({', '.join(labels)}): {plan.codecs.origin(v, root)}" for v, labels in rows.items()]


def write_table(plan: RKVPlan, target: str, out: str | Path, root: str | Path = ".") -> pd.DataFrame:
    """Compute and write ``target`` (a key of :data:`TABLES`: tableIII, tableVI, tableVII, tableVIII,
    table_full_layer_form, table_layer_flow)."""
    if target == "tableVI":  # one row per alpha of one method: no pair of methods to tell apart
        df, lines = table_vi(plan, root), []
    else:
        df, lines = paired_table(plan, target, score_table(plan, target, root), root)
    header = plan.header(TABLES[f"residualkv/{target}"].title, target) + [
        "# scores: mean per-record score x 100; KR_packed %: packed bytes / full FP16 cache (the paper's accounting, "
        "measured, incl. sinks, raw window, indices); KR_resident %: bytes of every tensor held, as held (unpacked "
        "codes, masks, positions, dequantised copies, model dtype); CR %: keys read / keys visible after the first "
        "chunk; KR formula %: paper §V-A; full layers/codes+scales/references/indices/window+sinks %: KR_packed by part"
    ] + lines + selection_header(plan, target) + full_layer_header(plan.rows(target)) + attribution_header(
        plan.rows(target)) + codec_header(plan, target, root)
    write_csv(df, header, out)
    return df


def _write(key: str, spec: str | dict, out: str | Path, root: str | Path = ".") -> pd.DataFrame:
    return write_table(RKVPlan.from_spec(spec), key, out, root)


_CELLS = ("Scores are mean per-record score x 100 (``avg``: unweighted mean over tasks). KR is the keep ratio against "
          "the full FP16 cache, measured two ways never mixed: ``KR_packed %`` the paper's accounting (codes at their "
          "bit width, fp16 group scales, FP8 references, int16 reference indices, raw window, sinks and uncompressed "
          "K/V at FP16) and ``KR_resident %`` every tensor the cache really holds (unpacked uint8 codes, bool masks, "
          "int64 positions, KIVI's dequantised rows in the model's dtype, raw K/V in the model's dtype). ``KR formula %`` is the "
          "§V-A formula for ResidualKV rows; it omits the reference indices, the raw window and sinks, which the "
          "columns ``full layers %``, ``codes+scales %``, ``references %``, ``indices %`` and ``window+sinks %`` "
          "(``KR_packed %`` by part; an eviction press's kept tokens count as full-precision K/V under ``full "
          "layers %``) show. CR is the compute ratio (keys attention reads / keys visible). On the smoke profile the model is the "
          "tiny zoo LM (codec trained here) and the tasks are smoke needle, key-value and code-completion tasks in "
          "place of LongBench: these are not the paper's numbers. OmniKV selection (standalone and ``+omnikv``) is "
          "the authors' unless a row's spec says otherwise, and the CSV header names it: only decode steps select, "
          "so the question chunk reads every (restored) token; a decode step keeps int(keep·n) of the candidates "
          "(min(keep_tokens, n) where a row sets keep_tokens) by raw q·k, max over query heads (``sparse_prefill=true`` selects in multi-token chunks too, their "
          "query rows averaged or, with ``row_agg=max``, maxed).")

#: ResidualKV's tables (:class:`~kvbench.plan.base.Table`); rows from the config key of the table's name
#: (``residualkv.tableIII``, ...) or, for Table VI, the ``stride_sweep`` (:meth:`RKVPlan.rows`).
TABLES: dict[str, Table] = {t.name: t for t in (
    Table("residualkv/tableIII", "ResidualKV", "residualkv", "Table III (methods x tasks, KR/CR)",
          "**ResidualKV Table III** (paper §V-B, main long-context results): every compression method (SnapKV, "
          "PyramidKV, KVzip, Quest, OmniKV, KIVI, Palu, ResidualKV with and without its codec) against the full KV "
          "cache, per task. ResidualKV stores its full-attention layers KIVI-style 4-bit (`full_kv_bits=4`), the "
          "paper's deployment (§V-A), in the authors' engine form (sinks and 32-63 tokens raw; the header names the "
          "form); a row labelled `(full layers FP16)`, where the config has one, keeps them FP16, "
          f"and so does the ResidualKV† row (as config/paper.yaml runs it). {_CELLS}", _write),
    Table("residualkv/tableVI", "ResidualKV", "residualkv", "Table VI (dynamic stride alpha: references and score)",
          "**ResidualKV Table VI** (paper §V-C, dynamic reference stride): per α, the number and share of reference "
          "tokens at the longest evaluated context and at the paper's 262K context, then the score with the main "
          f"codec. {_CELLS}", _write),
    Table("residualkv/tableVII", "ResidualKV", "residualkv", "Table VII (standalone vs combined)",
          "**ResidualKV Table VII** (paper §V-C, standalone vs combined): ResidualKV alone (every coded token "
          "restored, CR 100%) and combined with OmniKV or SnapKV selection, against the full KV cache; full-attention "
          "layers KIVI-style 4-bit (`full_kv_bits=4`, the paper's deployment, §V-A); a row labelled `(full layers "
          f"FP16)`, where the config has one, keeps them FP16. {_CELLS}", _write),
    Table("residualkv/tableVIII", "ResidualKV", "residualkv",
          "Table VIII (ablation: without f_c, f_d; without references; codes unquantised)",
          "**ResidualKV Table VIII** (paper §V-D, ablation of the core modules, codes not quantised, its own codec "
          "with d_c 1.5x the main one): ResidualKV, without the codec f_c/f_d as the authors ran it (a zero code "
          "of width d_c held, so KR is unchanged, and only the reference mean restored: `mean_only=true`; "
          "`use_codec=false` is the other form, the raw residual stored at full width) and without references. "
          f"{_CELLS}",
          _write),
    Table("residualkv/table_layer_flow", "ResidualKV", "residualkv",
          "Layer flow (score with one layer's coded tokens restored as their reference mean, the others exact)",
          "**Where the task flows** (issue #32; not a paper table): one row per decoder layer, in which every coded "
          "token (not the codec's sinks or raw window) is restored as the mean of its references only (`mean_only`, "
          "Table VIII's \"without f_c, f_d\"; references float32, no codes) while every other layer is kept exact "
          "(`full_layers` = all the others). The drop from the full cache measures how much of the task reads that "
          "layer's K/V beyond what its references carry: the layers ResidualKV compresses must carry the task for "
          f"its codec to be tested (Table VIII). {_CELLS}", _write),
    Table("residualkv/table_full_layer_form", "ResidualKV", "residualkv",
          "Full-layer form (4-bit full layers: KIVI's rule vs the authors' two forms; raw sinks for KIVI-2)",
          "**The full-layer form** (issue #32; not a paper table): what the storage form of ResidualKV's 4-bit "
          "full-attention layers (§V-A deployment) costs on its own. Layers 0-1 KIVI-4 in three forms with every other "
          "layer exact (`residualkv` standalone with `use_codec=false,bits=32,ref_fp8=false`: the raw residual and "
          "references stored in float32): jy-yuan/KIVI's rule (`full_kv_form=kivi`, this project's form before), the "
          "authors' engine (`after`: the codec's sinks raw, 32-63 raw tokens, quantised after the chunk's attention) "
          "and their HF reference (`before`: quantised before it); and KIVI-2 on every layer with and without 8 raw "
          f"sinks (`kivi:bits=2,sinks=8`). Each under both protocols. {_CELLS}", _write),
)}
