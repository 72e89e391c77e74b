"""CONDUIT's accuracy tables and budget-quality figure from refresh runs (Tables 1, 2, 4, 5; Figure 3).

Inputs are run directories of ``kvbench eval`` (``predictions.jsonl``: one row per record with ``id``
and ``score`` in [0, 1]); which runs a table needs is decided here, by :class:`ConduitPlan`, and the
Snakemake rules (workflow/rules/conduit.smk) ask the same object, so paths cannot drift apart.

Cells: mean per-record score × 100 over the records of a column (a dataset, or the records of a
multi-image dataset whose ``meta.K`` lies in a range: the smoke profile's "datasets" are docpages K
buckets); ``<col> %full`` = 100 × cell / the full-prefill cell of the same backbone and column (the
papers' "% of full prefill"); ``avg`` = unweighted mean over columns (the paper's "five-dataset
average") and ``avg %full`` = 100 × avg / full-prefill avg. A cell is computed or empty, and every
empty cell has its reason in the row's ``notes``; a missing run is an error unless the caller asks
for empty cells (then the note names the missing run). Each file starts with ``#`` header lines
(read back with ``pd.read_csv(path, comment="#")``) saying which profile produced it.

Staleness gap (:func:`staleness_gap`): reuse − full prefill, per record, paired; 95% CI by a paired
bootstrap (percentile method) of the mean difference. Tables 1 and 5 carry the same paired statistic below
their scores (:func:`paired_difference`: CONDUIT minus each other budgeted row of each block, strongest first; the
composite minus each ablation), so a reader sees when two rows cannot be told apart; Figure 3's points carry
a bootstrap CI of their average (:func:`mean_ci`).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from kvbench.plan.base import Table, load_spec
from kvbench.eval.registry import canonical, parse_method_spec
from kvbench.models.tiny import seed_replica, zoo_spec
from kvbench.plan.conduit import Column, ConduitPlan, Row, targets
from kvbench.report.conduit import evidence
from kvbench.report.paired import SEED_KIND, paired_bootstrap, paired_stats, seed_pooled_stats
from kvbench.train.recipes import SHARED_WARMUP
from kvbench.utils.io import atomic_path, read_jsonl, write_csv



# --- reading runs ------------------------------------------------------------------------------

class Runs:
    """Per-record scores of run directories under ``root``, and the records of each dataset split.

    Args:
        root: directory the run paths are relative to.
        splits: dataset name -> split JSONL (for ``meta.K`` of K-bucket columns).
        allow_missing: a missing run gives an empty cell with a note instead of an error.
    """

    def __init__(self, root: str | Path, splits: dict[str, str], allow_missing: bool = False):
        self.root, self.splits, self.allow_missing = Path(root), splits, allow_missing
        self._rows: dict[str, dict[str, dict] | None] = {}
        self._records: dict[str, dict[str, dict]] = {}

    def rows(self, run_dir: str) -> dict[str, dict] | None:
        """``{id: prediction row}`` of a run, or None when it is missing and missing runs are allowed.

        Raises:
            FileNotFoundError: the run has no ``predictions.jsonl`` (names the path).
        """
        if run_dir not in self._rows:
            path = self.root / run_dir / "predictions.jsonl"
            if not path.is_file():
                if not self.allow_missing:
                    raise FileNotFoundError(f"run {run_dir} is missing ({path} not found)")
                self._rows[run_dir] = None
            else:
                rows = read_jsonl(path)
                by_id = {r["id"]: r for r in rows}
                if len(by_id) != len(rows):  # the last row of an id would win silently
                    ids = [r["id"] for r in rows]
                    dup = sorted({i for i in ids if ids.count(i) > 1})
                    raise ValueError(f"run {run_dir}: record id(s) {dup[:3]} appear more than once; runs are paired "
                                     "by record id")
                self._rows[run_dir] = by_id
        return self._rows[run_dir]

    def records(self, dataset: str) -> dict[str, dict]:
        if dataset not in self._records:
            if dataset not in self.splits:
                raise KeyError(f"no split file given for dataset {dataset!r}")
            self._records[dataset] = {r["id"]: r for r in read_jsonl(self.splits[dataset])}
        return self._records[dataset]

    def column(self, run_dir: str, col: Column) -> tuple[dict[str, float] | None, str | None]:
        """``({id: score}, None)`` for the column's records in a run, or ``(None, reason)``."""
        rows = self.rows(run_dir)
        if rows is None:
            return None, f"{col.name}: missing run {run_dir}"
        recs = self.records(col.dataset) if col.k is not None else None
        unknown = [i for i in rows if recs is not None and i not in recs]
        if unknown:
            raise ValueError(f"run {run_dir}: ids {unknown[:3]} are not in the split of {col.dataset!r}")
        kept = {i: float(r["score"] or 0.0) for i, r in rows.items() if recs is None or col.keeps(recs[i])}
        if not kept:
            return None, f"{col.name}: no record with K in {list(col.k)} among the run's {len(rows)}"
        return kept, None


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def note_errors(rows: dict[str, dict] | None, run_dir: str) -> str | None:
    """``"<n> of <m> samples of <run> failed (scored 0)"`` when a run (``{id: row}``) has failed samples, else None."""
    if not rows:
        return None
    bad = sum(1 for r in rows.values() if r.get("status") == "error")
    return f"{bad} of {len(rows)} samples of {run_dir} failed (scored 0)" if bad else None


def score_table(plan: ConduitPlan, runs: Runs, rows: list[Row], cols: list[Column]) -> pd.DataFrame:
    """A score table: one row per (backbone, ``rows`` entry); per column score and % of full; averages.

    Returns:
        DataFrame with columns ``backbone, regime, r, method, spec, <col>, <col> %full, ..., avg, avg %full, notes``
        (scores in points = mean score × 100, rounded to 2 decimals; percentages to 1 decimal; empty
        cells are NaN with the reason in ``notes``).
    """
    out = []
    for model in plan.models:
        ref = {}
        for c in cols:
            scores, why = runs.column(plan.run_dir(model, c.dataset, plan.reference), c)
            ref[c.name] = (None if scores is None else _mean(scores.values()), why)
        for row in rows:
            rec = {"backbone": model, "regime": plan.regime(model), "r": row.r, "method": row.label,
                   "spec": row.spec}
            notes, vals, refs = [], {}, {}
            for c in cols:
                run = plan.run_dir(model, c.dataset, row.spec)
                scores, why = runs.column(run, c)
                note = note_errors(runs.rows(run), run)
                if note and note not in notes:
                    notes.append(note)
                val = None if scores is None else _mean(scores.values())
                rmean, rwhy = ref[c.name]
                rec[c.name] = math.nan if val is None else round(100 * val, 2)
                rec[f"{c.name} %full"] = _pct(val, rmean, c.name, why, rwhy, notes)
                if why:
                    notes.append(why)
                vals[c.name], refs[c.name] = val, rmean
            avg = _mean(vals.values()) if all(v is not None for v in vals.values()) else None
            ravg = _mean(refs.values()) if all(v is not None for v in refs.values()) else None
            if avg is None:
                notes.append("avg: a column is empty")
            rec["avg"] = math.nan if avg is None else round(100 * avg, 2)
            rec["avg %full"] = _pct(avg, ravg, "avg", None, None if ravg is not None else "a reference column is empty",
                                    notes)
            rec.update(cost_cells(runs, [plan.run_dir(model, c.dataset, row.spec) for c in cols], row.spec, notes))
            rec["notes"] = "; ".join(dict.fromkeys(notes))
            out.append(rec)
    return pd.DataFrame(out)


COST_COLUMNS = ("row-layers %", "FLOPs %full", "scoring %full")


def cost_cells(runs: Runs, run_dirs: list[str], spec: str, notes: list[str]) -> dict[str, float]:
    """A row's compute beside its score, summed over every record of its runs (issue #33, item 4).

    From each record's audit ``cost`` (:func:`kvbench.eval.audit.request_cost`): ``row-layers %`` = 100 × Σ visual
    row-layers recomputed / Σ ``n_visual · n_layers``; ``FLOPs %full`` = 100 × Σ (scoring + executor) / Σ
    full-prefill decoder FLOPs of the same requests; ``scoring %full`` = the scoring pass's part of it. Full prefill
    is 100 / 100 / 0 by definition. Runs whose rows carry no ``cost`` (made before the audit counted it, or
    missing) give NaN with a note. Vision-encoder FLOPs are left out: every method reads the cached image
    features, and full prefill's re-encoding is not a decoder cost.
    """
    if parse_method_spec(spec).name == "full":
        return dict(zip(COST_COLUMNS, (100.0, 100.0, 0.0)))
    sums = {"row_layers": 0, "rows": 0, "flops": 0, "scoring": 0, "full": 0}
    for run in dict.fromkeys(run_dirs):
        rows = runs.rows(run)
        if rows is None:
            return dict.fromkeys(COST_COLUMNS, math.nan)
        for r in rows.values():
            cost = (r.get("plan") or {}).get("cost")
            if cost is None:
                if r.get("status") == "error":
                    continue  # a failed record has no plan; its score (0) is noted with the errors
                notes.append(f"cost: {run} has records without an audited cost (rerun it to count)")
                return dict.fromkeys(COST_COLUMNS, math.nan)
            p = r["plan"]
            sums["row_layers"] += cost["row_layers"]
            sums["rows"] += p["n_visual"] * p["n_layers"]
            sums["flops"] += cost["scoring"] + cost["executor"]
            sums["scoring"] += cost["scoring"]
            sums["full"] += cost["full_prefill"]
    if not sums["full"]:
        return dict.fromkeys(COST_COLUMNS, math.nan)
    return {"row-layers %": round(100 * sums["row_layers"] / sums["rows"], 1),
            "FLOPs %full": round(100 * sums["flops"] / sums["full"], 1),
            "scoring %full": round(100 * sums["scoring"] / sums["full"], 1)}


def _pct(val, ref, name, why, rwhy, notes) -> float:
    if val is None:
        return math.nan
    if ref is None:
        notes.append(f"{name} %full: full-prefill reference empty ({rwhy})")
        return math.nan
    if ref == 0:
        notes.append(f"{name} %full: full prefill scores 0")
        return math.nan
    return round(100 * val / ref, 1)


def _column_counts(runs: Runs, plan: ConduitPlan, target: str) -> str:
    parts = []
    for c in plan.columns(target):
        ns = set()
        for m in plan.models:
            scores, _ = runs.column(plan.run_dir(m, c.dataset, plan.reference), c)
            ns.add(0 if scores is None else len(scores))
        parts.append(f"{c.name}={'/'.join(map(str, sorted(ns)))}")
    return ", ".join(parts)


def write_score_table(plan: ConduitPlan, runs: Runs, target: str, out: str | Path) -> pd.DataFrame:
    """Write ``target``'s table (``table1``, ``table2``, ``table4``, ``table5``) to ``out`` as CSV with a header."""
    df = score_table(plan, runs, plan.rows(target), plan.columns(target))
    cols = ", ".join(f"{c.name} = {c.dataset}" + (f" with K in [{c.k[0]}, {c.k[1]}]" if c.k else "")
                     for c in plan.columns(target))
    header = [
        plan.header(table_of(target).title),
        ("# cells: mean per-record score x 100; '<col> %full' = 100 x cell / full-prefill cell (same backbone and "
         f"column; full prefill = {plan.reference}); avg = unweighted mean over columns"),
        f"# columns: {cols}; records per column: {_column_counts(runs, plan, target)}",
        ("# cost (every record of the row's runs, from their audit records): row-layers % = visual rows recomputed x "
         "layers / (visual tokens x layers); FLOPs %full = analytic decoder FLOPs of the scoring pass and the "
         "refresh / those of a full prefill of the same requests (vision encoder excluded); scoring %full = the "
         "scoring pass's part"),
    ]
    header.append(flatness_line(df, plan.columns(target)))
    degenerate = degenerate_line(plan, runs, plan.rows(target), plan.columns(target))
    if degenerate:
        header.append(degenerate)
    # each baseline says which of its forms it is (RefreshPolicy.form); CONDUIT and the references have none
    forms = {p.name: getattr(p.cls, "form", None) for p in (parse_method_spec(r.spec) for r in plan.rows(target))}
    described = [f"{name} = {form}" for name, form in forms.items() if form]
    if described:
        header.append("# baseline forms: " + "; ".join(described))
    contrasts = table_of(target).contrasts
    if contrasts is not None:
        pairs = contrasts(plan, df)
        diffs = [paired_difference(plan, runs, m, a, b, plan.columns(target)) for m, a, b in pairs]
        header += difference_lines(plan, table_of(target).contrast_text, diffs)
        pooled = seed_pooled_differences(plan, runs, pairs, plan.columns(target))
        header += seed_lines(plan, pooled)
        df.insert(2, "kind", "score")
        df = pd.concat([df, pd.DataFrame(diffs), pd.DataFrame(pooled)], ignore_index=True)
        for c in ("wins", "losses", "ties", "n", "seeds", "seeds_above", "seeds_below"):  # integers beside empties
            if c in df:
                df[c] = df[c].astype("Int64")
        df = df[[c for c in df.columns if c != "notes"] + ["notes"]]
    write_csv(df, header, out)
    return df


# --- paired differences (Tables 1 and 5) -------------------------------------------------------

def _policy(row: Row, plain: bool = False) -> str | None:
    """The row's refresh-policy name (with ``plain``: only when the spec sets no parameter besides r)."""
    spec = parse_method_spec(row.spec)
    return spec.name if not plain or not spec.params else None


def _avg(df: pd.DataFrame, model: str, row: Row) -> float:
    hit = df[(df["backbone"] == model) & (df["method"] == row.label) & (df["spec"] == row.spec)]
    return float(hit["avg"].iloc[0])


def table1_contrasts(plan: ConduitPlan, df: pd.DataFrame) -> list[tuple[str, Row, Row]]:
    """``(backbone, CONDUIT row, other budgeted row)`` per backbone and budget block of Table 1: CONDUIT against
    every other budgeted row, the strongest first, then the others in table order.

    Budgeted: the method spec carries a budget (``@r``: not ``reuse`` nor ``full``). Strongest: the highest ``avg``
    in ``df`` (Table 1's score rows), ties to the first in table order; rows with an empty ``avg`` are skipped.
    Every pair gets its own paired CI, so each of the paper's orderings (CONDUIT above every baseline) is tested,
    not only the closest one. A block without exactly one CONDUIT row (policy ``conduit``) gives no pair.
    """
    out = []
    for model in plan.models:
        for r in plan.cfg["budgets"]:
            block = [row for row in plan.rows("table1") if row.r == r]
            ours = [row for row in block if _policy(row) == "conduit"]
            others = [row for row in block if row not in ours and parse_method_spec(row.spec).r is not None
                      and not math.isnan(_avg(df, model, row))]
            if len(ours) == 1 and others:
                best = max(others, key=lambda row: _avg(df, model, row))  # max: first on ties
                out += [(model, ours[0], row) for row in [best] + [o for o in others if o is not best]]
    return out


def table5_contrasts(plan: ConduitPlan, df: pd.DataFrame) -> list[tuple[str, Row, Row]]:
    """``(backbone, composite, ablation)`` for each other row of Table 5; the composite is the one row whose spec
    is plain CONDUIT (``conduit@r``, no parameter changed). No composite row, or two, gives no pair."""
    rows = plan.rows("table5")
    composite = [row for row in rows if _policy(row, plain=True) == "conduit"]
    if len(composite) != 1:
        return []
    return [(model, composite[0], row) for model in plan.models for row in rows if row is not composite[0]]


def paired_difference(plan: ConduitPlan, runs: Runs, model: str, a: Row, b: Row, cols: list[Column]) -> dict:
    """Row ``a`` minus row ``b`` on ``model``, per record, paired by record id within each column.

    Returns:
        A table row: ``backbone, regime, r, kind = "paired difference", method = "<a> − <b>", spec``; per column the
        column's mean difference (points); ``diff`` the mean difference over all records pooled across the
        columns (each (column, record) pair once), ``ci95_lo``/``ci95_hi`` its 95% paired-bootstrap CI
        (:func:`paired_bootstrap`, the config's ``gap`` resamples and seed), ``wins``/``losses``/``ties``
        records where ``a`` scores above/below/equal to ``b``, ``n`` records, ``told_apart`` the CI excludes 0
        (points = score difference x 100, 2 decimals). A column without scores leaves the pooled figures empty
        (the reason in ``notes``).

    Raises:
        ValueError: the two runs of a column hold different record ids (not paired).
    """
    boot = plan.cfg["gap"]
    rec = {"backbone": model, "regime": plan.regime(model), "r": a.r, "kind": "paired difference", "method": f"{a.label} − {b.label}",
           "spec": f"{a.spec} − {b.spec}"}
    per_col, notes = column_differences(plan, runs, model, a, b, cols)
    for c in cols:
        rec[c.name] = math.nan if per_col[c.name] is None else round(100 * float(per_col[c.name].mean()), 2)
    if notes:
        return {**rec, "n": 0, "notes": "; ".join(notes + ["pooled difference: a column is empty"])}
    stats = paired_stats(np.concatenate(list(per_col.values())), boot["resamples"], boot["seed"])
    # CONDUIT's column order: n before told_apart
    return {**rec, **{k: stats[k] for k in ("diff", "ci95_lo", "ci95_hi", "wins", "losses", "ties", "n",
                                            "told_apart")}, "notes": ""}


def column_differences(plan: ConduitPlan, runs: Runs, model: str, a: Row, b: Row, cols: list[Column]
                       ) -> tuple[dict[str, np.ndarray | None], list[str]]:
    """Per column, the per-record differences ``a − b`` on ``model`` (``(n,)`` float, [0, 1] units, sorted record
    id order; None where a run is missing), and the reasons of the missing ones.

    Raises:
        ValueError: the two runs of a column hold different record ids (not paired).
    """
    out, notes = {}, []
    for c in cols:
        sa, why_a = runs.column(plan.run_dir(model, c.dataset, a.spec), c)
        sb, why_b = runs.column(plan.run_dir(model, c.dataset, b.spec), c)
        if sa is None or sb is None:
            notes += [w for w in (why_a, why_b) if w]
            out[c.name] = None
            continue
        if set(sa) != set(sb):
            raise ValueError(f"{model}/{c.name}: runs of {a.spec} and {b.spec} hold different records; cannot "
                             "pair them")
        out[c.name] = np.array([sa[i] - sb[i] for i in sorted(sa)])
    return out, notes


def seed_groups(plan: ConduitPlan) -> dict[str, list[str]]:
    """``{regime: backbones}`` for each regime that ``conduit.regimes`` gives to two or more backbones: those are
    training seeds of one regime (seed replicas ``<zoo entry>-s<k>``, the same recipe from another seed)."""
    groups: dict[str, list[str]] = {}
    for m in plan.models:
        if plan.regime(m):
            groups.setdefault(plan.regime(m), []).append(m)
    return {k: v for k, v in groups.items() if len(v) >= 2}


def seed_pooled_differences(plan: ConduitPlan, runs: Runs, contrasts: list[tuple[str, Row, Row]],
                            cols: list[Column]) -> list[dict]:
    """One row per regime with two or more training seeds and per contrast ``(a, b)`` that every seed of it has
    (issue #33, item 2): the mean over seeds of each seed's pooled paired difference, its 95% CI by a bootstrap over
    seeds and records (:func:`kvbench.report.paired.seed_pooled_stats`), how many seeds have it above / below 0 and
    whether every seed agrees (``every_seed``). The per-seed rows are the backbones' own paired-difference rows.

    Returns:
        Table rows: ``backbone = "<regime> (<k> seeds)"``, ``regime``, ``r``, ``kind = "seed-pooled difference"``,
        ``method``, ``spec``, per column the mean over seeds of the column's mean difference, then
        ``diff, ci95_lo, ci95_hi, told_apart, seeds, seeds_above, seeds_below, every_seed, n, notes``.
    """
    boot, out = plan.cfg["gap"], []
    for regime, models in seed_groups(plan).items():
        pairs = {}
        for model, a, b in contrasts:
            if model in models:
                pairs.setdefault((a, b), []).append(model)
        for (a, b), have in pairs.items():
            if sorted(have) != sorted(models):
                continue  # a contrast some seed lacks (an empty avg there) is not pooled
            rec = {"backbone": f"{regime} ({len(models)} seeds)", "regime": regime, "r": a.r, "kind": SEED_KIND,
                   "method": f"{a.label} − {b.label}", "spec": f"{a.spec} − {b.spec}"}
            groups, notes = [], []
            per_col = {c.name: [] for c in cols}
            for m in models:
                d, why = column_differences(plan, runs, m, a, b, cols)
                notes += why
                for c in cols:
                    if d[c.name] is not None:
                        per_col[c.name].append(float(d[c.name].mean()))
                if not why:
                    groups.append(np.concatenate(list(d.values())))
            for c in cols:
                rec[c.name] = round(100 * float(np.mean(per_col[c.name])), 2) if len(per_col[c.name]) == len(models) \
                    else math.nan
            if notes:
                out.append({**rec, "n": 0, "notes": "; ".join(notes + ["seed-pooled difference: a column is empty"])})
                continue
            out.append({**rec, **seed_pooled_stats(groups, boot["resamples"], boot["seed"]), "notes": ""})
    return out


def pair_names(rows: list[dict], extra=lambda d: "") -> str:
    """``backbone/a − b at r = x (diff [lo, hi]<extra>)`` of paired rows, ``; ``-joined ("none" when empty)."""
    return "; ".join(f"{d['backbone']}/{d['method']}" + ("" if d["r"] is None else f" at r = {d['r']:g}")
                     + f" ({d['diff']:+.2f} [{d['ci95_lo']:+.2f}, {d['ci95_hi']:+.2f}]{extra(d)})"
                     for d in rows) or "none"


def shared_warmup_note(plan: ConduitPlan) -> str:
    """What the zoo seed replicas among the grouped backbones share with their entry (kvbench.train.recipes.
    SHARED_WARMUP), as a clause of the seed-pooled header line; "" when none shares a phase."""
    shared = {}
    for models in seed_groups(plan).values():
        for m in models:
            if seed_replica(m) is not None and zoo_spec(m).recipe_name in SHARED_WARMUP:
                shared.setdefault(SHARED_WARMUP[zoo_spec(m).recipe_name], []).append(m)
    return "".join(f" ({', '.join(ms)} start from their entry's training state after its phases through {phase!r} "
                   "and draw only the later phases' batches from their own seed, so the spread between seeds leaves "
                   "out what the earlier phases would add)" for phase, ms in shared.items())


def seed_lines(plan: ConduitPlan, pooled: list[dict]) -> list[str]:
    """Header lines of the seed-pooled rows: how they are made, and which orderings hold in every seed. Where a
    regime has a single backbone (one training seed), one line says that its orderings rest on one seed and that
    their CIs cover records only."""
    grouped = {m for models in seed_groups(plan).values() for m in models}
    single = [m for m in plan.models if plan.regime(m) and m not in grouped]
    lines = [] if not single else [
        f"# one training seed: the orderings of {', '.join(single)} rest on one trained model each and their CIs "
        "cover records only, not model-to-model variation (a retrain can move a row by more than these CIs); "
        "config/confirm.yaml adds two more seeds per regime and pools each ordering over them"]
    if not pooled:
        return lines
    boot = plan.cfg["gap"]

    def name(rows: list[dict]) -> str:
        return pair_names(rows, lambda d: f", seeds {d['seeds_above']} above / {d['seeds_below']} below 0")

    done = [d for d in pooled if d["n"]]
    held = [d for d in done if d["every_seed"] and d["told_apart"]]
    return lines + [
        (f"# seed-pooled differences (rows with kind = '{SEED_KIND}'): the regime's backbones are training seeds of "
         f"one recipe{shared_warmup_note(plan)}; diff = mean over seeds of each seed's pooled paired difference (each "
         "seed weighs the same; records per seed: the backbone rows' n); 95% CI by a two-level bootstrap (seeds "
         f"with replacement, then each drawn seed's records with replacement), {boot['resamples']} resamples, seed "
         f"{boot['seed']}: it covers model-to-model variation, which the per-backbone CIs do not"),
        f"# orderings that hold in every seed (every seed's difference on one side of 0 and the seed-and-record CI "
        f"excludes 0): {name(held)}",
        f"# orderings that do NOT hold in every seed: {name([d for d in done if d not in held])}",
    ]


def difference_lines(plan: ConduitPlan, contrast: str, diffs: list[dict]) -> list[str]:
    """Header lines of a table's paired-difference rows: the method, and which pairs can(not) be told apart."""
    boot = plan.cfg["gap"]
    done = [d for d in diffs if d["n"]]
    return [
        (f"# paired differences (rows with kind = 'paired difference', below the scores): {contrast}. Per record "
         "a - b, paired by record id within each column, x 100; a column cell is that column's mean difference; "
         "diff = mean over all records pooled across the columns (each column's records once: not the avg of "
         "the columns), n records; 95% CI of diff: paired bootstrap over the pooled records, percentile method, "
         f"{boot['resamples']} resamples, seed {boot['seed']}; wins/losses/ties = records where a scores "
         "above/below/equal to b; told_apart = the CI excludes 0"),
        f"# told apart (95% CI excludes 0): {pair_names([d for d in done if d['told_apart']])}",
        f"# CANNOT be told apart (95% CI includes 0): {pair_names([d for d in done if not d['told_apart']])}",
    ]


def degenerate_line(plan: ConduitPlan, runs: Runs, rows: list[Row], cols: list[Column]) -> str | None:
    """Header line naming the rows whose runs had a degenerate layer schedule, or None when no run had one.

    Degenerate: the executed plan recomputed visual tokens at layer 0 only (audit field ``degenerate``, set by
    CONDUIT's as-run CacheBlend/KVShare schedule when ⌈r·N⌉·L ≤ N, i.e. on a model with about ≤ 1/r layers), so
    the row equals cache reuse beyond layer 0. Read from every record of the row's runs, per backbone, budget
    and dataset (``n of m records``: N varies per record, so a run can be partly degenerate).
    """
    found = []
    for model in plan.models:
        for row in rows:
            parts = []
            for dataset in dict.fromkeys(c.dataset for c in cols):
                recs = runs.rows(plan.run_dir(model, dataset, row.spec))
                if not recs:
                    continue
                n = sum(1 for r in recs.values() if (r.get("plan") or {}).get("degenerate"))
                if n:
                    parts.append(f"{dataset} {n} of {len(recs)} records")
            if parts:
                r = "" if row.r is None else f" at r = {row.r:g}"
                found.append(f"{model}/{row.label}{r} ({row.spec}: {', '.join(parts)})")
    if not found:
        return None
    return ("# DEGENERATE layer schedules (every visual token recomputed at layer 0, none after: equal to cache "
            "reuse beyond layer 0, since layer-0 K/V do not depend on the prefix; the as-run CacheBlend/KVShare "
            "schedule on a model with about <= 1/r layers): " + "; ".join(found))


def flatness_line(df: pd.DataFrame, cols: list[Column]) -> str:
    """Header line with each column's spread across rows (max - min, points), per backbone block; says FLAT for a
    block whose every column has spread 0.

    Issue #3 asks that a table that comes out flat on the smoke profile say so in its header
    instead of being tuned until it is not; identical scores in every column is that case. The spread is taken
    within each backbone's block: taken over the whole table, a flat block (the mild regime) was never flagged
    beside one that was not (issue #33).
    """
    parts, flat = [], []
    blocks = list(df.groupby("backbone", sort=False)) if "backbone" in df and len(df) else [(None, df)]
    for model, block in blocks:
        spreads = {c.name: float(block[c.name].max() - block[c.name].min())
                   for c in cols if block[c.name].notna().any()}
        text = ", ".join(f"{k} {v:.2f}" for k, v in spreads.items()) or "no column has scores"
        is_flat = bool(spreads) and all(v == 0 for v in spreads.values())
        name = "" if len(blocks) == 1 else f"{model}{' (' + str(block['regime'].iloc[0]) + ')' if 'regime' in block else ''}: "
        parts.append(f"{name}{'FLAT, ' if is_flat and len(blocks) > 1 else ''}{text}")
        flat.append(is_flat)
    if len(blocks) == 1 and flat[0]:
        return (f"# FLAT on this profile: every row scores the same in every column (spread {parts[0]} points), "
                "so these methods are not told apart here")
    per = ", per backbone" if len(blocks) > 1 else ""
    line = f"# spread across rows (max - min, points){per}: {'; '.join(parts)}"
    if any(flat):
        line += (" (FLAT: every row of that backbone scores the same in every column, so its methods are not told "
                 "apart here)")
    return line


# --- staleness gap -----------------------------------------------------------------------------

def staleness_gap(plan: ConduitPlan, runs: Runs) -> pd.DataFrame:
    """reuse − full prefill per backbone and column (plus each multi-image dataset pooled over K).

    Returns:
        DataFrame ``backbone, regime, column, n, full, reuse, gap, ci95_lo, ci95_hi, significant, notes``
        (points; ``significant``: the CI excludes 0).

    Raises:
        ValueError: the two runs of a column hold different record ids (not paired).
    """
    boot = plan.cfg["gap"]
    cols = list(plan.columns("staleness_gap"))
    pooled = {c.dataset for c in plan.multi if c.k is not None}
    cols += [Column(f"{d} (all K)", d) for d in dict.fromkeys(c.dataset for c in plan.multi) if d in pooled]
    out = []
    for model in plan.models:
        for c in cols:
            rec = {"backbone": model, "regime": plan.regime(model), "column": c.name}
            a, why_a = runs.column(plan.run_dir(model, c.dataset, canonical("reuse")), c)
            b, why_b = runs.column(plan.run_dir(model, c.dataset, plan.reference), c)
            if a is None or b is None:
                out.append({**rec, "n": 0, "notes": "; ".join(w for w in (why_a, why_b) if w)})
                continue
            if set(a) != set(b):
                raise ValueError(f"{model}/{c.name}: reuse and full runs hold different records; cannot pair them")
            ids = sorted(a)
            d = np.array([a[i] - b[i] for i in ids])
            lo, hi = paired_bootstrap(d, boot["resamples"], boot["seed"])
            out.append({**rec, "n": len(ids), "full": round(100 * _mean(b.values()), 2),
                        "reuse": round(100 * _mean(a.values()), 2), "gap": round(100 * float(d.mean()), 2),
                        "ci95_lo": round(100 * lo, 2), "ci95_hi": round(100 * hi, 2),
                        "significant": bool(lo > 0 or hi < 0), "notes": ""})
    cols_out = ["backbone", "regime", "column", "n", "full", "reuse", "gap", "ci95_lo", "ci95_hi", "significant", "notes"]
    return pd.DataFrame(out).reindex(columns=cols_out)


def write_staleness_gap(plan: ConduitPlan, runs: Runs, out: str | Path) -> pd.DataFrame:
    """Write :func:`staleness_gap` with a header that says where the gap is (not) significant."""
    df = staleness_gap(plan, runs)
    boot = plan.cfg["gap"]
    done = df[df["n"] > 0]  # columns without records are neither (their reason is in notes)

    def name(d: pd.DataFrame) -> str:
        return ", ".join(f"{r.backbone}/{r.column}" for r in d.itertuples()) or "none"

    sig, nonsig = done[done["significant"].astype(bool)], done[~done["significant"].astype(bool)]
    header = [
        plan.header("staleness gap: cache reuse (stale per-image KV, r = 0) minus full prefill"),
        (f"# gap = mean over records of (reuse score - full-prefill score) x 100, paired by record; 95% CI: paired "
         f"bootstrap, percentile method, {boot['resamples']} resamples, seed {boot['seed']}"),
        f"# gap significant at 95% (CI excludes 0): {name(sig)}",
        f"# gap NOT significant at 95% (CI includes 0): {name(nonsig)}",
    ]
    write_csv(df, header, out)
    return df


# --- Figure 3 ----------------------------------------------------------------------------------

def mean_ci(plan: ConduitPlan, runs: Runs, model: str, row: Row, cols: list[Column]) -> dict:
    """95% CI of a row's ``avg`` (unweighted mean over ``cols`` of the column means) on ``model``.

    Bootstrap of the mean per point, not paired: records are resampled within each column
    (:func:`paired_bootstrap` with the columns as strata; the config's ``gap`` resamples and seed).

    Returns:
        ``{"ci95_lo", "ci95_hi"}`` in points (2 decimals) and ``n`` (records over the columns); NaN bounds and
        ``n = 0`` when a column has no scores.
    """
    boot = plan.cfg["gap"]
    vals, strata = [], []
    for c in cols:
        scores, _ = runs.column(plan.run_dir(model, c.dataset, row.spec), c)
        if scores is None:
            return {"ci95_lo": math.nan, "ci95_hi": math.nan, "n": 0}
        vals += [scores[i] for i in sorted(scores)]
        strata += [c.name] * len(scores)
    lo, hi = paired_bootstrap(np.array(vals), boot["resamples"], boot["seed"], strata=np.array(strata))
    return {"ci95_lo": round(100 * lo, 2), "ci95_hi": round(100 * hi, 2), "n": len(vals)}


def fig3_data(plan: ConduitPlan, runs: Runs) -> pd.DataFrame:
    """Budget-quality points: ``backbone, regime, method, spec, r, avg, ci95_lo, ci95_hi, n, avg %full, FLOPs %full,
    notes`` (``avg``: the multi-image column average, points; its 95% CI by :func:`mean_ci`; ``FLOPs %full``: the
    point's decoder FLOPs, scoring pass included, as % of full prefill's over the same records, :func:`cost_cells`),
    plus the full-prefill and reuse levels as methods with r = NaN."""
    rows = plan.fig3_rows()
    t = score_table(plan, runs, rows, plan.multi)
    # score_table lists the rows of each backbone in order, so its rows line up with (model, row)
    ci = pd.DataFrame([mean_ci(plan, runs, m, row, plan.multi) for m in plan.models for row in rows])
    t = pd.concat([t.reset_index(drop=True), ci], axis=1)
    return t[["backbone", "regime", "method", "spec", "r", "avg", "ci95_lo", "ci95_hi", "n", "avg %full", "FLOPs %full",
              "notes"]]


def write_fig3(plan: ConduitPlan, runs: Runs, out_pdf: str | Path, out_csv: str | Path) -> pd.DataFrame:
    """Figure 3: average multi-image score vs refresh budget r, one line per budgeted method with 95% CI error bars,
    one panel per backbone (staleness regime); full prefill and cache reuse as horizontal lines with their CI as a
    band. A second row plots the same points against their decoder FLOPs (scoring pass included) as % of full
    prefill, so a method that buys its score with a scoring pass shows it (issue #33, item 4). The plotted numbers
    go to ``out_csv``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = fig3_data(plan, runs)
    curve = df[df["r"].notna()]
    boot = plan.cfg["gap"]
    fig, axes = plt.subplots(2, len(plan.models), figsize=(5 * len(plan.models), 8), squeeze=False)
    for ax, model in zip(axes[1], plan.models):  # score against compute
        sub = df[df["backbone"] == model]
        for method, pts in sub.groupby("method", sort=False):
            pts = pts.sort_values("FLOPs %full")
            err = [pts["avg"] - pts["ci95_lo"], pts["ci95_hi"] - pts["avg"]]
            ax.errorbar(pts["FLOPs %full"], pts["avg"], yerr=err, marker="o", markersize=4, capsize=3, linewidth=1,
                        label=method, linestyle="-" if pts["r"].notna().all() else "none")
        ax.set_xlabel("decoder FLOPs, scoring pass included (% of full prefill)")
        ax.set_ylabel("average score (points), 95% CI")
        ax.set_title(model + (f" ({plan.regime(model)} staleness)" if plan.regime(model) else ""), fontsize=9)
        ax.legend(fontsize=7)
    for ax, model in zip(axes[0], plan.models):
        sub = curve[curve["backbone"] == model]
        for method, pts in sub.groupby("method", sort=False):
            pts = pts.sort_values("r")
            err = [pts["avg"] - pts["ci95_lo"], pts["ci95_hi"] - pts["avg"]]
            ax.errorbar(pts["r"], pts["avg"], yerr=err, marker="o", markersize=4, capsize=3, linewidth=1,
                        label=method)
        for label, style in (("Full prefill", "--"), ("Cache reuse", ":")):
            level = df[(df["backbone"] == model) & (df["method"] == label)]
            if len(level) and not level["avg"].isna().all():
                lv = level.iloc[0]
                ax.axhline(float(lv["avg"]), color="k", linestyle=style, linewidth=1, label=label)
                ax.axhspan(float(lv["ci95_lo"]), float(lv["ci95_hi"]), color="k", alpha=0.08, linewidth=0)
        ax.set_xscale("symlog", linthresh=0.02)
        ax.set_xlabel("refresh budget r (fraction of visual tokens)")
        ax.set_ylabel("average score (points), 95% CI")
        ax.set_title(model + (f" ({plan.regime(model)} staleness)" if plan.regime(model) else ""), fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(plan.header("Figure 3 (budget-quality curves)").lstrip("# "), fontsize=8)
    fig.tight_layout()
    with atomic_path(out_pdf) as tmp:
        fig.savefig(tmp, format="pdf", metadata={"CreationDate": None})  # no timestamp: same bytes on a rerun
    plt.close(fig)
    header = [plan.header("Figure 3 data (average over multi-image columns, points)"),
              (f"# ci95_lo, ci95_hi: 95% CI of avg (error bars; bands for the full-prefill and reuse levels): "
               f"bootstrap of the mean per point, not paired, records resampled within each column, percentile "
               f"method, {boot['resamples']} resamples, seed {boot['seed']}; n = records over the columns")]
    write_csv(df, header, out_csv)
    return df


def plan_and_runs(spec: str | dict, root: str | Path = ".") -> tuple[ConduitPlan, Runs]:
    """The :class:`ConduitPlan` and :class:`Runs` of the workflow's JSON ``spec``: ``{"profile", "conduit": section,
    "splits": {dataset: path}, "zoo_models": [...]}`` (``"allow_missing": true``: missing runs give empty cells).

    Raises:
        ValueError: ``spec`` is not that JSON, or the section is invalid.
    """
    spec = load_spec(spec, "conduit")
    plan = ConduitPlan(spec["conduit"], spec["profile"], spec.get("zoo_models", ()))
    return plan, Runs(root, spec.get("splits", {}), allow_missing=bool(spec.get("allow_missing", False)))


def _score_table(key: str, spec: str | dict, out: str | Path, root: str | Path = ".") -> pd.DataFrame:
    plan, runs = plan_and_runs(spec, root)
    return write_score_table(plan, runs, key, out)


def _gap(key: str, spec: str | dict, out: str | Path, root: str | Path = ".") -> pd.DataFrame:
    plan, runs = plan_and_runs(spec, root)
    return write_staleness_gap(plan, runs, out)


def _evidence_table(key: str, spec: str | dict, out: str | Path, root: str | Path = ".") -> pd.DataFrame:
    """Tables 14 and 15 (:mod:`kvbench.report.conduit.evidence`) with the profile header."""
    plan, runs = plan_and_runs(spec, root)
    if key == "table14":
        cfg = {**evidence.EVIDENCE_DEFAULTS, **plan.cfg.get("evidence", {})}
        df = evidence.table14(plan, runs, cfg)
        notes = [f"# allocation: records of {[c.name for c in evidence.evidence_columns(plan, cfg)]} in quartiles of the "
                 "attention gap (evidence page minus the strongest distractor, image coefficients of "
                 f"conduit@{cfg['r']}:use_v_norm=false); scores minus full prefill in points; evidence share = the "
                 "share of refreshed token-layers on the answer-bearing page (meta.page).",
                 f"# audit: records where CONDUIT@{cfg['r']} and full prefill answer differently; classes in order: low "
                 f"page coverage (<= {cfg['coverage']:.0%} of the evidence page's tokens refreshed), near-tied "
                 f"(CONDUIT's evidence and best distractor page scores within {cfg['tie']:.0%}), other; recovered = "
                 f"the CONDUIT@{cfg['recover_r']} answer equals full prefill's."]
    else:
        df = evidence.table15(plan, runs)
        notes = ["# the case record is the first record of its column in split order that the runs evaluated "
                 "(chosen before any answer is read); figures/conduit/fig4.pdf draws where each method refreshed."]
    write_csv(df, [plan.header(table_of(key).title), *notes], out)
    return df


def report_fig4(spec: str | dict, out: str | Path, out_csv: str | Path, root: str | Path = ".") -> pd.DataFrame:
    """Entry point of ``kvbench report conduit-fig4``: the case study's refreshed tokens, page by page
    (:func:`kvbench.report.conduit.evidence.draw_fig4`); the plotted numbers go to ``out_csv``."""
    plan, runs = plan_and_runs(spec, root)
    col, rid = evidence.case_record(plan, runs, plan.cfg.get("case_study", {}))
    df = evidence.fig4_data(plan, runs)
    # image paths are relative to the split's directory, which Runs reads as given
    evidence.draw_fig4(df, runs.records(col.dataset)[rid], Path(runs.splits[col.dataset]).parent, out)
    write_csv(df, [plan.header("Figure 4 data (case study: refreshed visual tokens per page)")], out_csv)
    return df


_NOT_THE_PAPER = ("On the smoke profile the backbone is the tiny zoo VLM and the columns are docpages K buckets "
                  "(digitgrid for Table 2): these are not the paper's numbers.")
_DIFFS = ("Below the scores, paired-difference rows (``kind``) give a minus b per record, paired by record id, with "
          "the mean over all records pooled across the columns, its paired-bootstrap 95% CI, wins/losses/ties and "
          "whether the CI excludes 0; the header names the pairs that cannot be told apart.")
_CELLS = ("The CSV's ``#`` header lines name the columns, the records per column and the spread across rows "
          "(a table that comes out flat says so).")

#: CONDUIT's accuracy tables (:class:`~kvbench.plan.base.Table`); Figure 3 is :func:`write_fig3`.
TABLES: dict[str, Table] = {t.name: t for t in (
    Table("conduit/table1", "CONDUIT", "conduit",
          "Table 1 (main results: budgeted refresh methods vs full prefill, per budget r)",
          "**CONDUIT Table 1** (paper §4.2, main results): answer score of each budgeted refresh method (cache "
          "reuse, CacheBlend as CONDUIT runs it and in its paper form, MPIC, KVShare, ProphetKV, CONDUIT) over the "
          "stale per-image KV cache, at refresh budgets r = 0.05 and r = 0.10, against full prefill. Cells are mean "
          "per-record score x 100 per column, ``%full`` the share of the full-prefill cell, ``avg`` the unweighted "
          "mean over columns (the paper's five-dataset average). When a row's layer schedule was degenerate (the "
          "as-run CacheBlend/KVShare schedule on a model with about <= 1/r layers puts the whole budget at layer 0, "
          "which equals cache reuse), a ``# DEGENERATE`` header line names the row, budget and records, computed "
          f"from the runs' audit records. {_DIFFS} {_CELLS} {_NOT_THE_PAPER}",
          _score_table, contrasts=table1_contrasts,
          contrast_text=("a = CONDUIT, b = each other budgeted row of the same backbone and budget block (the rows "
                         "whose method carries @r, reuse and full excluded), the strongest first (highest avg above; "
                         "ties: the first in table order), then the others in table order")),
    Table("conduit/table2", "CONDUIT", "conduit",
          "Table 2 (K=1: one image cached under a generic instruction; r = 0, r = 0.05, full prefill)",
          "**CONDUIT Table 2** (paper §4.2, K = 1): one image cached under a generic instruction and served under "
          "the benchmark's own; CONDUIT with no visual token recomputed (r = 0) and with the top-throughput 5% "
          f"refreshed (r = 0.05), against full prefill. Cells are mean per-record score x 100. {_CELLS} "
          f"{_NOT_THE_PAPER}",
          _score_table),
    Table("conduit/table4", "CONDUIT", "conduit", "Table 4 (λ ablation of the image coefficient)",
          "**CONDUIT Table 4** (paper §4.4, λ ablation): CONDUIT at r = 0.10 with the image-coefficient strength λ "
          "swept from 0 (no cross-image amplification) to 1 (the paper's default). Cells are mean per-record score "
          f"x 100 per column. {_CELLS} {_NOT_THE_PAPER}",
          _score_table),
    Table("conduit/table5", "CONDUIT", "conduit",
          "Table 5 (component ablation: query-attention only, intra-image throughput only, composite)",
          "**CONDUIT Table 5** (paper §4.4, component ablation at r = 0.10): query-attention only (no value-norm "
          "weighting), intra-image throughput only (no image coefficient) and the composite score. Cells are mean "
          f"per-record score x 100. {_DIFFS} {_CELLS} {_NOT_THE_PAPER}",
          _score_table, contrasts=table5_contrasts,
          contrast_text="a = the composite (the row that is plain conduit@r), b = each other ablation row"),
    Table("conduit/table14", "CONDUIT", "conduit",
          "Table 14 (evidence allocation by attention-gap quartile; failure audit)",
          "**CONDUIT Table 14** (paper §D.4): records in quartiles of the attention gap between the "
          "answer-bearing page and the strongest distractor; per quartile CONDUIT's and raw-attention top-k's "
          "(ProphetKV) score minus full prefill and share of the refresh budget on the evidence page; then a failure "
          "audit of the records where CONDUIT and full prefill answer differently (low page coverage / near-tied / "
          f"other) and how many recover at r = 0.2. Computed from the runs' audit records. {_NOT_THE_PAPER}",
          _evidence_table),
    Table("conduit/table15", "CONDUIT", "conduit",
          "Table 15 (case study: one multi-page record, every method at the case budget)",
          "**CONDUIT Table 15** (paper §D.4, with Figure 4): one multi-page record (the first of its column in "
          "split order), every method's answer at r = 0.10 against full prefill, and the share of each method's "
          f"refresh spent on the answer-bearing page. {_NOT_THE_PAPER}",
          _evidence_table),
    Table("conduit/staleness_gap", "CONDUIT", "conduit",
          "staleness gap: cache reuse (stale per-image KV, r = 0) minus full prefill",
          "**CONDUIT staleness gap** (the premise of paper §1 and the cache-reuse protocol of §4.1; not a table of "
          "the paper): score of plain cache reuse (stale per-image KV, r = 0) minus full prefill, per backbone and "
          "column, paired by record, x 100, with a 95% paired-bootstrap confidence interval and whether it "
          "excludes 0. A refresh policy can only recover a gap that exists. On the smoke profile the backbone is "
          "the tiny zoo VLM on docpages K buckets and digitgrid: these are not the paper's numbers.",
          _gap),
)}


def table_of(key: str) -> Table:
    """The :data:`TABLES` entry of a target key (``table1``, ``staleness_gap``).

    Raises:
        ValueError: no such table (naming the known targets).
    """
    if f"conduit/{key}" not in TABLES:
        raise ValueError(f"unknown CONDUIT target {key!r}; expected one of {targets()}")
    return TABLES[f"conduit/{key}"]


def report_fig3(spec: str | dict, out: str | Path, out_csv: str | Path, root: str | Path = ".") -> pd.DataFrame:
    """Entry point of ``kvbench report conduit/fig3``: :func:`write_fig3` from the workflow's JSON ``spec``
    (:func:`plan_and_runs`)."""
    plan, runs = plan_and_runs(spec, root)
    return write_fig3(plan, runs, out, out_csv)
