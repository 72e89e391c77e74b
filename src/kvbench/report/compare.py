"""Our tables beside the papers' published figures: ``results/<paper>/<table>.compare.csv`` and ``results/compare.md``.

One compare CSV per built table (``kvbench report compare``), in three parts (column ``part``):

- ``cell``: every numeric cell of ours (score rows x data columns) with the published figure it corresponds to
  (:class:`~kvbench.report.published.Entry` of kind value, range or qualitative), matched by table, method (our row
  label), setting (``r``, ``alpha``, ...), column semantics (``avg`` = the paper's ``average``, ``avg %full`` = its
  ``% of full prefill``, a dataset column = ``each``; ResidualKV ``KR_packed %`` = the paper's KR, ``CR %`` = CR)
  and backbone. ``diff`` = ours − published (range: the distance outside ``[low, high]``, 0 inside). A cell without a
  published neighbour is kept with an empty ``published`` and its ``reason``; one with several (a range and a value)
  has a row each.
- ``ordering``: every published ordering of two methods (an ``ordering`` or ``difference`` entry, or two published
  values of one table, backbone, column and metric) against ours: our difference a − b, with the 95% CI of the
  table's paired-difference rows where it has one (CONDUIT Tables 1 and 5: pooled over records for the ``average``
  column), else the point difference, shown but not judged. Verdicts: ``agrees``, ``disagrees``, ``cannot be
  told apart`` (CI includes 0), or ``no CI, not judged: ...`` (the direction of a point difference, which may be
  one record: not counted as agreement or disagreement); a published tie agrees when ours cannot be told apart. ``count``
  entries give ours as k of n without a verdict (the cell sets differ).
- ``published only``: entries of this table no cell of ours matched, with the reason.

On the smoke profile (a table whose header says ``tiny zoo`` or ``RANDOM weights``) our backbones are not the paper's:
each stands in for every published backbone (``paper_backbone``), ``comparable`` is False and the header says the
absolute differences mean nothing; the orderings are the comparison. On the paper profile a published backbone
matches the config models ``backbones`` names for it, and the absolute differences are the comparison.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import pandas as pd

from kvbench.report.paired import KIND, MINUS, SEED_KIND
from kvbench.utils.io import atomic_path, write_csv
from kvbench.report.published import Entry, Published, load_published

PAPERS = {"conduit": "CONDUIT", "residualkv": "ResidualKV"}
COLUMNS = ["part", "backbone", "regime", "paper_backbone", "method", "budget", "column", "metric", "unit", "ours",
           "published", "published_low", "published_high", "diff", "ci95_lo", "ci95_hi", "verdict", "comparable",
           "entry", "source", "reason"]
_ZOO_MARKS = ("tiny zoo", "RANDOM weights", "not the paper's models")


@dataclass(frozen=True)
class Cell:
    """One numeric cell of our table, described in the published vocabulary.

    Attributes:
        backbone, regime: our model (config name) and its staleness regime (CONDUIT, else "").
        method: our row label; budget: our setting (``{"r": 0.1}``, ``{"alpha": 0.001}``).
        column: our column name; columns: the published column names it answers to (``average``, ``each``, ...).
        metric, unit: the published metric and unit it is (values converted to that unit).
        value: the cell, in ``unit``.
    """

    backbone: str
    regime: str
    method: str
    budget: dict
    column: str
    columns: frozenset
    metric: str
    unit: str
    value: float | str
    slot: str = ""

    @property
    def where(self) -> str:
        """Where the cell sits apart from its method: two methods' cells of one ordering share it (the column, or
        the row key of tables whose methods are columns, e.g. Table 13's ks_raw and ks_normalised)."""
        return self.slot or self.column


@dataclass
class Ours:
    """One built table of ours: ``name`` (``conduit/table1``), ``header`` lines, ``df``, its cells, whether it ran on
    the zoo, and its paired-difference rows (``{(backbone, r, a, b): row}``)."""

    name: str
    header: list[str]
    df: pd.DataFrame
    zoo: bool
    cells: list[Cell] = field(default_factory=list)
    paired: dict = field(default_factory=dict)

    @property
    def paper_dir(self) -> str:
        return self.name.split("/", 1)[0]

    @property
    def key(self) -> str:
        return self.name.split("/", 1)[1]


def _num(x) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def _fmt_budget(b: dict) -> str:
    return ", ".join(f"{k} = {v:g}" for k, v in sorted(b.items()))


# --- reading our tables --------------------------------------------------------------------------

def read_ours(path: str | Path, name: str | None = None) -> Ours:
    """Read a built table (``#`` header lines, then CSV) and describe its cells (:class:`Cell`).

    ``name``: ``<paper>/<table>``; default from the path ``results/<paper>/<table>.csv``.

    Raises:
        ValueError: the name's paper is not conduit/residualkv, or the table's columns are not a format this
            module reads (naming the columns it expected).
    """
    path = Path(path)
    name = name or f"{path.parent.name}/{path.name.removesuffix('.csv')}"
    if name.split("/", 1)[0] not in PAPERS or "/" not in name:
        raise ValueError(f"table {name!r}: expected <paper>/<table> with paper one of {sorted(PAPERS)} "
                         "(pass --name when the path is not results/<paper>/<table>.csv)")
    header = [ln.rstrip("\n") for ln in path.read_text(encoding="utf-8").splitlines() if ln.startswith("#")]
    df = pd.read_csv(path, comment="#", keep_default_na=True)
    text = " ".join(header)
    ours = Ours(name, header, df, zoo=any(m in text for m in _ZOO_MARKS))
    if "backbone" not in df.columns:
        if "model" in df.columns:
            df["backbone"] = df["model"]
        else:  # ResidualKV tables name their one model in the header; Table 3 its timing model
            m = re.search(r"(?:timing )?model (\S+)", text)
            df["backbone"] = m.group(1).rstrip(";,") if m else ""
    # one blank for "no regime" (ResidualKV tables have no column, CONDUIT's blank cells read back as NaN)
    df["regime"] = df["regime"].astype(object).where(df["regime"].notna(), "").astype(str) if "regime" in df.columns else ""
    key = ours.key
    if ours.paper_dir == "residualkv" and key == "tableI":
        _table_i_cells(ours)
    elif ours.paper_dir == "residualkv":
        _rkv_cells(ours)
    elif key == "table3":
        _latency_cells(ours)
    elif key in ("table11", "table12", "table13"):
        _diag_cells(ours)
    elif key == "table14":
        _evidence_cells(ours)
    elif key == "table15":
        _case_cells(ours)
    elif {"method", "avg"} <= set(df.columns):
        _score_cells(ours)
    else:
        raise ValueError(f"{path}: not a table format this comparison reads (expected CONDUIT score columns "
                         f"method, avg, ...; got {list(df.columns)})")
    return ours


def _data_columns(df: pd.DataFrame) -> list[str]:
    """CONDUIT score tables: the dataset columns (each has a '<col> %full' partner)."""
    return [c for c in df.columns if f"{c} %full" in df.columns and c != "avg"]


def _score_cells(ours: Ours) -> None:
    df = ours.df
    kind = df["kind"] if "kind" in df.columns else pd.Series("score", index=df.index)
    data = _data_columns(df)
    for i, row in df[kind == "score"].iterrows():
        budget = {} if _num(row.get("r")) is None else {"r": _num(row["r"])}
        base = dict(backbone=row["backbone"], regime=row["regime"],
                    method=row["method"], budget=budget)
        for col in data + ["avg"]:
            scope = frozenset({"average"} if col == "avg" else {"each", col})
            for c, metric, unit in ((col, "score", "points"), (f"{col} %full", "% of full prefill", "% of full prefill")):
                v = _num(row.get(c))
                if c in df.columns and v is not None:
                    ours.cells.append(Cell(**base, column=c, columns=scope, metric=metric, unit=unit, value=v))
    _collect_paired(ours, df[kind.isin([KIND, SEED_KIND])])  # a seed-pooled row is judged as its regime's


def _collect_paired(ours: Ours, rows: pd.DataFrame) -> None:
    """A table's paired-difference rows (``method`` = ``a − b``) by ``(backbone, r, a, b)``."""
    for _, row in rows.iterrows():
        a, _, b = str(row["method"]).partition(MINUS)
        ours.paired[(row["backbone"], _num(row.get("r")), a, b)] = row


#: ResidualKV tables whose paper column is one benchmark that our ``avg`` stands in for on every profile: Table V has
#: one task (AIME in the paper; the long-generation smoke task on the zoo), so its score is the table's average
SINGLE_COLUMN = {"tableV": "AIME"}


def _rkv_cells(ours: Ours) -> None:
    df = ours.df
    if "method" not in df.columns:  # Table VI: one row per alpha, the main codec's ResidualKV
        df["method"] = "ResidualKV"
    start = list(df.columns).index("spec") + 1 if "spec" in df.columns else 0
    tasks = list(df.columns[start:list(df.columns).index("avg")]) if "avg" in df.columns else []
    named = {"avg": ("average", "score", "points"), "KR_packed %": ("KR", "KR", "%"), "CR %": ("CR", "CR", "%")}
    for col in df.columns:
        m = re.fullmatch(r"refs @ (\d+)", col) or re.fullmatch(r"share @ (\d+) %", col)
        if m and int(m.group(1)) == 262144:  # the paper counts references at 262K
            named[col] = (("references at 262K", "references", "tokens") if col.startswith("refs")
                          else ("reference share at 262K", "reference share", "%"))
    kind = df["kind"] if "kind" in df.columns else pd.Series("score", index=df.index)
    _collect_paired(ours, df[kind == KIND])
    for _, row in df[kind == "score"].iterrows():
        budget = {} if "alpha" not in df.columns else {"alpha": _num(row["alpha"])}
        for col in tasks + list(named):
            v = _num(row.get(col)) if col in df.columns else None
            if v is None:
                continue
            column, metric, unit = named.get(col, (col, "score", "points"))
            scope = frozenset({column} if col in named else {"each", col})
            if col == "avg" and ours.key in SINGLE_COLUMN:
                scope |= {SINGLE_COLUMN[ours.key]}
            ours.cells.append(Cell(row["backbone"], "", row["method"], budget, col, scope, metric, unit, v))


def _table_i_cells(ours: Ours) -> None:
    """ResidualKV Table I (:mod:`kvbench.report.residualkv.table_i`): each model's 2d_k, d_c and d_ff as the published
    ``codec`` column's metrics of the same names (method ``codec``, unit ``dims``)."""
    for _, row in ours.df.iterrows():
        for col in ("2d_k", "d_c", "d_ff"):
            v = _num(row.get(col))
            if v is not None:
                ours.cells.append(Cell(row["backbone"], "", "codec", {}, col, frozenset({"codec"}), col, "dims", v))


def _latency_cells(ours: Ours) -> None:
    metrics = {"prefill_tflops": ("prefill TFLOPs", "TFLOPs", 1.0), "pct_of_full_flops": ("% of full-prefill FLOPs", "%", 1.0),
               "ttft_ms_median": ("TTFT", "s", 1e-3), "speedup": ("TTFT speedup", "x", 1.0),
               "scoring_ms_median": ("scoring time", "ms", 1.0), "scoring_pct_of_ttft": ("scoring % of TTFT", "%", 1.0)}
    # the mean row averages our contexts, which are not the paper's (4k/8k/16k): the column says which they are
    ctx = ours.df.loc[ours.df["pages"].astype(str) != "mean", "context_tokens"].map(_num).dropna()
    ours_ctx = "/".join(f"{round(k / 1024)}k" for k in sorted(set(ctx))) or "no"
    for _, row in ours.df.iterrows():
        if str(row["pages"]) == "mean":
            scope = {"mean over contexts"}
            where = f"mean over our {ours_ctx} contexts"
        else:
            k = _num(row.get("context_tokens")) or 0
            scope = {"each context", f"{round(k / 1024)}k"}
            where = str(row["pages"])
        budget = {} if str(row["method"]).partition(":")[0] == "full" else {"r": _num(row["r"])}
        for col, (metric, unit, scale) in metrics.items():
            v = _num(row.get(col))
            if v is not None:
                ours.cells.append(Cell(row["backbone"], "", row["label"], budget, f"{col} [{where}]",
                                       frozenset(scope), metric, unit, v * scale))


def _diag_cells(ours: Ours) -> None:
    df, key = ours.df, ours.key
    for _, row in df.iterrows():
        regime = row["regime"]
        where = " ".join(f"{k}={row[k]}" for k in ("dataset", "layer", "r", "types") if k in df.columns)

        def add(method, col, scope, metric, unit):
            v = _num(row.get(col))
            if v is not None:
                ours.cells.append(Cell(row["backbone"], regime, method, {}, f"{col} [{where}]", frozenset(scope),
                                       metric, unit, v, slot=f"[{where}]"))
        if key == "table11":
            for col in ("attention_x", "conduit_x", "key_norm_x", "oracle_x"):
                add("query-attention rules" if col in ("attention_x", "conduit_x") else col, col,
                    {"each layer and budget"}, "projected residual error reduction vs random", "x")
            add("value-norm only", "value_norm_x", {"each layer and budget"}, "projected residual error reduction vs random", "x")
            add("surrogate ordering", "spearman_surrogate", {"each budget"}, "Spearman correlation", "Spearman")
        elif key == "table12":
            if str(row["layer"]) == "mean":
                add("cached value norm", "vnorm_spearman", {"layer average"}, "Spearman(cached, fresh value norm)", "Spearman")
            else:
                for col in [c for c in df.columns if c.startswith("overlap_")]:
                    add("rank overlaps", col, {"each layer"}, "overlap / independent-decile expectation", "ratio")
        else:  # table13: the 'all' layer row is the pooled cross-type distance
            scope = {"mean cross-type"} if str(row["layer"]) == "all" else {"each layer"}
            add("raw", "ks_raw", scope, "KS distance", "KS")
            add("normalised by g_j", "ks_normalised", scope, "KS distance", "KS")


def _evidence_cells(ours: Ours) -> None:
    audit = {"differing answers": "differing answers", "low page coverage": "low page coverage",
             "near-tied": "near-tied", "other": "attention drift"}
    for _, row in ours.df.iterrows():
        b, regime, group = row["backbone"], row["regime"], str(row["group"])
        if row["part"] == "allocation":
            for col, method, metric, unit in (
                    ("CONDUIT - full", "CONDUIT", "CONDUIT − full prefill", "points"),
                    ("CONDUIT evidence share %", "CONDUIT", "evidence-page budget share", "%"),
                    ("raw top-k evidence share %", "raw-attention top-k", "evidence-page budget share", "%")):
                v = _num(row.get(col))
                if v is not None:
                    ours.cells.append(Cell(b, regime, method, {}, f"{col} [{group}]", frozenset({group}), metric, unit, v,
                                           slot=f"[{group}]"))
        else:
            # ours 'other' is the remainder after low coverage and near-tied; the paper's remainder is its 4 drift cases
            n = _num(row.get("records"))
            if n is not None and group in audit:
                ours.cells.append(Cell(b, regime, audit[group], {}, f"records [{group}]", frozenset({"audit"}), "cases", "cases", n))
            rec = _num(row.get("recovered"))
            if rec is not None and group == "low page coverage":
                ours.cells.append(Cell(b, regime, "low page coverage, recovered at r = 0.20", {}, f"recovered [{group}]",
                                       frozenset({"audit"}), "cases", "cases", rec))


def _case_cells(ours: Ours) -> None:
    """Table 15's answers: every row of the case study (reuse and full prefill included) at the case's budget,
    the one r its budgeted specs carry (the paper's case is "at r = 0.10" for every method)."""
    budgets = {float(m.group(1)) for spec in ours.df["spec"].astype(str) if (m := re.search(r"@([0-9.]+)", spec))}
    budget = {"r": budgets.pop()} if len(budgets) == 1 else {}
    for _, row in ours.df.iterrows():
        ours.cells.append(Cell(row["backbone"], row["regime"], row["method"],
                               budget, "answer", frozenset({"answer"}), "generated answer", "answer", str(row["answer"])))


# --- matching ---------------------------------------------------------------------------------

#: Budget keys that describe a published row's operating point rather than select a setting: ResidualKV's tables
#: label a row "(KR 19%, CR 20%)", which our KR/CR columns measure for our own row; they never pick our cell.
OPERATING_POINT = frozenset({"KR", "CR"})


def _setting(budget: dict) -> dict:
    """The keys of a published budget that select a setting (:data:`OPERATING_POINT` removed)."""
    return {k: v for k, v in budget.items() if k not in OPERATING_POINT}


def _budget_ok(want: dict, have: dict) -> bool:
    return all(k in have and have[k] is not None and math.isclose(have[k], v, abs_tol=1e-9)
               for k, v in _setting(want).items())


class Want(NamedTuple):
    """What a published figure speaks for: an entry's method, column, metric, budgets and backbone, or an
    ordering's side (its own method and budget with the entry's other fields)."""

    method: str
    column: str
    metric: str
    budgets: tuple[dict, ...]
    backbone: str

    @staticmethod
    def of(e: Entry, method: str | None = None, budget: dict | None = None) -> "Want":
        return Want(method or e.method, e.column, e.metric, tuple(e.budgets()) if budget is None else (budget,),
                    e.backbone)


def _mismatch(pub: Published, w: Want, c: Cell, zoo: bool) -> tuple[int, str] | None:
    """None when ``w`` is ``c``'s published neighbour, else ``(how far it matched, why not)``: the first field that
    differs, in the order method, column, metric, budget, backbone (the entry that matched furthest explains a
    cell without a neighbour best)."""
    if w.method != c.method:
        return 0, f"no published figure for method {c.method!r}"
    if w.column not in c.columns:
        return 1, f"no published figure for column {c.column!r}"
    if w.metric != c.metric:
        return 2, f"no published figure for the metric {c.metric!r} of {c.method!r}"
    if not any(_budget_ok(b, c.budget) for b in w.budgets):
        return 3, f"published only at {_fmt_budget(w.budgets[0])}, ours is at {_fmt_budget(c.budget) or 'no budget'}"
    if w.backbone not in ("each", "average", "unassigned") and not zoo and c.backbone not in pub.models_of(w.backbone):
        return 4, f"published for {w.backbone} ({', '.join(pub.models_of(w.backbone)) or 'no config model'}), not {c.backbone}"
    return None


def _cell_rows(pub: Published, ours: Ours) -> tuple[list[dict], set]:
    entries = [e for e in pub.for_table(ours.key) if e.kind in ("value", "range", "qualitative")]
    rows, used = [], set()
    for c in ours.cells:
        base = {"part": "cell", "backbone": c.backbone, "regime": c.regime, "method": c.method,
                "budget": _fmt_budget(c.budget), "column": c.column, "metric": c.metric, "unit": c.unit, "ours": c.value}
        misses, hit = [], False
        for e in entries:
            miss = _mismatch(pub, Want.of(e), c, ours.zoo)
            if miss:
                misses.append(miss)
                continue
            hit = True
            used.add(e.id)
            row = {**base, "paper_backbone": e.backbone, "entry": e.id, "source": pub.source(e),
                   "comparable": not ours.zoo and e.unit != "answer"}
            if e.kind == "value":
                row["published"] = e.value
                # a width (dims) has no meaningful order between two methods, but ours - published is its mismatch
                if (e.ordinal or e.unit == "dims") and isinstance(c.value, float):
                    row["diff"] = round(c.value - e.value, 4)
                else:
                    row["reason"] = "not a number to subtract (see the ordering part)"
            elif e.kind == "range":
                row["published_low"], row["published_high"] = e.low, e.high
                hi = math.inf if e.open_high else e.high
                row["diff"] = round(c.value - e.low if c.value < e.low else (c.value - hi if c.value > hi else 0.0), 4)
                row["reason"] = f"published range {e.low:g}-{e.high:g}{'+' if e.open_high else ''}; diff = distance outside it"
            else:
                row["reason"] = f"qualitative: {e.text}"
            if ours.zoo:
                row["reason"] = "; ".join(x for x in (row.get("reason"), "tiny zoo model: the absolute difference is not meaningful") if x)
            rows.append(row)
        if not hit:
            # the entry that matched furthest (method, column, metric, budget, backbone) explains best
            why = max(misses, key=lambda m: m[0])[1] if misses else f"the sources give no figure for {pub.paper} {ours.key}"
            rows.append({**base, "reason": why})
    return rows, used


# --- orderings --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ordering:
    """A published ``a <relation> b`` (``diff`` = a − b where published), at one budget, of one entry or two."""

    a: str
    b: str
    a_budget: dict
    b_budget: dict
    relation: str
    diff: float | None
    entries: tuple[Entry, ...]
    label: str = ""

    @property
    def e(self) -> Entry:
        return self.entries[0]


def published_orderings(pub: Published, key: str) -> list[Ordering]:
    """Every published ordering of table ``key``: ordering and difference entries (one per b and budget) and each
    pair of ordinal value entries with the same backbone, column, metric and unit."""
    out = []
    for e in pub.for_table(key):
        for bud in e.budgets():
            if e.kind == "ordering":
                out += [Ordering(e.a, b, bud, bud, e.relation, None, (e,)) for b in e.b]
            elif e.kind == "difference" and e.value is not None:
                rel = ">" if e.value > 0 else ("<" if e.value < 0 else "=")
                out += [Ordering(e.a, b, bud, bud, rel, e.value, (e,)) for b in e.b]
            elif e.kind == "difference":  # one value per backbone, which is which not given: one ordering if one sign
                signs = {(v > 0) - (v < 0) for v in e.values}
                if len(signs) == 1:
                    rel = {1: ">", -1: "<", 0: "="}[signs.pop()]
                    by = f" by {', '.join(f'{v:g}' for v in e.values)} (one per backbone, which is which not given)"
                    out += [Ordering(e.a, b, bud, bud, rel, None, (e,), f"{e.a} {rel} {b}{by}") for b in e.b]
    values = [e for e in pub.for_table(key) if e.kind == "value" and e.ordinal]
    for i, x in enumerate(values):
        for y in values[i + 1:]:
            if (x.backbone, x.column, x.metric, x.unit) == (y.backbone, y.column, y.metric, y.unit) and \
                    (x.method, x.budget) != (y.method, y.budget):
                d = round(x.value - y.value, 6)
                out.append(Ordering(x.method, y.method, x.budget, y.budget, ">" if d > 0 else ("<" if d < 0 else "="),
                                    d, (x, y)))
    return out


def _find(ours: Ours, pub: Published, o: Ordering, method: str, budget: dict, backbone: str, where: str) -> Cell | None:
    """Our cell of one side of ordering ``o``: ``method`` at ``budget`` in ``backbone``'s ``where`` slot."""
    want = Want.of(o.e, method, budget)
    return next((c for c in ours.cells
                 if c.backbone == backbone and c.where == where and _mismatch(pub, want, c, ours.zoo) is None), None)


#: (metric, pooled cell scope) -> prefix of the paired-difference row's columns that pool it over records: the
#: average score (both papers' tables), and the KR and CR of ResidualKV's tables (:mod:`kvbench.report.paired`).
POOLED = {("score", "average"): "", ("KR", "KR"): "KR_packed % ", ("CR", "CR"): "CR % "}
POOLED_SCOPES = frozenset(scope for _, scope in POOLED)


def _verdict(relation: str, diff: float, lo: float | None, hi: float | None, told: bool | None) -> str:
    sign = {">": 1, "<": -1, "=": 0}[relation]
    if told is not None:
        if not told:
            return "agrees" if sign == 0 else "cannot be told apart"
        return "disagrees" if sign == 0 else ("agrees" if diff * sign > 0 else "disagrees")
    # Without a CI the sign of a point difference is not a verdict (a one-record difference would count as one):
    # shown with the direction, not judged.
    if diff == 0:
        return "no CI, not judged: equal"
    if sign == 0:
        return "no CI, not judged: ours differ"
    return "no CI, not judged: ours " + ("in the paper's direction" if diff * sign > 0 else "against it")


def _ordering_rows(pub: Published, ours: Ours) -> tuple[list[dict], set]:
    rows, used = [], set()
    backbones = list(dict.fromkeys(c.backbone for c in ours.cells))
    regimes = {c.backbone: c.regime for c in ours.cells}
    for o in published_orderings(pub, ours.key):
        side = lambda m, b: f"{m} ({_fmt_budget(b)})" if b and o.a_budget != o.b_budget else m  # noqa: E731
        pub_text = o.label or f"{side(o.a, o.a_budget)} {o.relation} {side(o.b, o.b_budget)}" + \
                   (f" by {abs(o.diff):g}" if o.diff else "")
        for backbone in backbones:
            slots = list(dict.fromkeys(c.where for c in ours.cells if c.backbone == backbone
                                       and o.e.column in c.columns and c.metric == o.e.metric))
            for slot in slots:
                ca = _find(ours, pub, o, o.a, o.a_budget, backbone, slot)
                cb = _find(ours, pub, o, o.b, o.b_budget, backbone, slot)
                if ca is None or cb is None or not isinstance(ca.value, float):
                    continue
                col = ca.column if ca.column == cb.column else f"{ca.column} vs {cb.column}"
                used.update(e.id for e in o.entries)
                diff, lo, hi, told, note = round(ca.value - cb.value, 4), None, None, None, ""
                r = ca.budget.get("r")
                same = _setting(o.a_budget) == _setting(o.b_budget)   # one setting: the table's paired row applies
                paired = ours.paired.get((backbone, r, o.a, o.b)) if same else None
                flip = 1
                if paired is None and same:
                    paired, flip = ours.paired.get((backbone, r, o.b, o.a)), -1
                prefix = POOLED.get((o.e.metric, next(iter(ca.columns & POOLED_SCOPES), None)))
                if paired is not None and prefix is not None and _num(paired.get(f"{prefix}diff")) is not None:
                    diff = flip * float(paired[f"{prefix}diff"])
                    lo, hi = sorted((flip * float(paired[f"{prefix}ci95_lo"]), flip * float(paired[f"{prefix}ci95_hi"])))
                    told = str(paired[f"{prefix}told_apart"]) == "True"
                    note = "ours: paired difference pooled over records (not the avg of the columns), 95% bootstrap CI"
                elif paired is not None and _num(paired.get(col)) is not None:  # e.g. a KR pair without its CI
                    diff = flip * float(paired[col])
                    note = "ours: the column's paired mean difference; the table's CI is for the pooled difference only"
                else:
                    note = "ours: difference of the two cells; the table has no paired CI for this pair"
                rows.append({"part": "ordering", "backbone": backbone, "regime": regimes.get(backbone, ""),
                             "paper_backbone": o.e.backbone,
                             "method": f"{o.a}{MINUS}{o.b}", "budget": _fmt_budget(ca.budget) if same
                             else f"{_fmt_budget(ca.budget)} vs {_fmt_budget(cb.budget)}",
                             "column": col, "metric": o.e.metric, "unit": o.e.unit, "ours": diff,
                             "published": o.diff if o.diff is not None else (
                                 ", ".join(f"{v:g}" for v in o.e.values) or o.relation), "ci95_lo": lo, "ci95_hi": hi,
                             "verdict": _verdict(o.relation, diff, lo, hi, told), "comparable": True,
                             "entry": "+".join(e.id for e in o.entries),
                             "source": "; ".join(pub.source(e) for e in o.entries),
                             "reason": f"paper: {pub_text}; {note}"})
    rows += _count_rows(pub, ours, used)
    rows += _answer_rows(pub, ours, used)
    return rows, used


def _count_rows(pub: Published, ours: Ours, used: set) -> list[dict]:
    rows = []
    for e in [e for e in pub.for_table(ours.key) if e.kind == "count"]:
        for bud in e.budgets():
            cells = [c for c in ours.cells if c.metric == "score" and _budget_ok(bud, c.budget)]
            k = n = 0
            if MINUS.strip() not in e.method and " > " in e.method:  # "A > B": over backbones, the average column
                a, b = e.method.split(" > ")
                for backbone in dict.fromkeys(c.backbone for c in cells):
                    va = [c.value for c in cells if c.backbone == backbone and c.method == a and "average" in c.columns]
                    vb = [c.value for c in cells if c.backbone == backbone and c.method == b and "average" in c.columns]
                    if va and vb:
                        n, k = n + 1, k + (va[0] > vb[0])
            else:  # "first among budgeted methods": per backbone x dataset column, strictly above every other
                budgeted = set(ours.df.loc[ours.df["spec"].astype(str).str.contains("@"), "method"]) \
                    if "spec" in ours.df.columns else set()
                budgeted -= {"Cache reuse", "Full prefill"}
                for (backbone, col) in dict.fromkeys((c.backbone, c.column) for c in cells if "each" in c.columns):
                    mine = [c.value for c in cells if (c.backbone, c.column) == (backbone, col) and c.method == e.method]
                    rest = [c.value for c in cells if (c.backbone, c.column) == (backbone, col)
                            and c.method in budgeted and c.method != e.method]
                    if mine and rest:
                        n, k = n + 1, k + (mine[0] > max(rest))
            if n:
                used.add(e.id)
                rows.append({"part": "ordering", "backbone": "all", "paper_backbone": e.backbone, "method": e.method,
                             "budget": _fmt_budget(bud), "column": e.column, "metric": e.metric, "unit": e.unit,
                             "ours": f"{k} of {n}", "published": f"{e.value:g} of {e.of}", "verdict": "count (not compared)",
                             "comparable": False, "entry": e.id, "source": pub.source(e),
                             "reason": f"paper: {e.text}; the cell sets differ, so the counts are shown, not judged"})
    return rows


def _answer_rows(pub: Published, ours: Ours, used: set) -> list[dict]:
    """Case studies: whether each method's answer is full prefill's, published vs ours."""
    answers = [e for e in pub.for_table(ours.key) if e.kind == "value" and e.unit == "answer"]
    full = next((e for e in answers if e.method == "Full prefill"), None)
    if full is None:
        return []
    rows = []
    for backbone in dict.fromkeys(c.backbone for c in ours.cells if c.unit == "answer"):
        mine = {c.method: c.value for c in ours.cells if c.backbone == backbone and c.unit == "answer"}
        if "Full prefill" not in mine:
            continue
        for e in answers:
            if e is full or e.method not in mine:
                continue
            used.update({e.id, full.id})
            p, o = e.value == full.value, mine[e.method] == mine["Full prefill"]
            rows.append({"part": "ordering", "backbone": backbone, "paper_backbone": e.backbone,
                         "method": f"{e.method} answers as full prefill", "column": "answer", "metric": "generated answer",
                         "unit": "answer", "ours": "yes" if o else "no", "published": "yes" if p else "no",
                         "verdict": "agrees" if p == o else "disagrees", "comparable": True,
                         "entry": f"{e.id}+{full.id}", "source": pub.source(e),
                         "reason": f"paper: {e.method} answers as full prefill: {'yes' if p else 'no'} ({e.value:g} vs "
                                   f"{full.value:g}); ours: {mine[e.method]} vs {mine['Full prefill']}"})
    return rows


# --- the compare CSV and the page ---------------------------------------------------------------

def compare(table: str | Path, published: str | Path | Published, out: str | Path, name: str | None = None) -> pd.DataFrame:
    """Write ``out`` (``results/<paper>/<table>.compare.csv``) for the built table at ``table`` (module docstring).

    ``published``: the paper's ``config/published/<paper>.yaml`` (or its loaded :class:`Published`).

    Raises:
        ValueError: the table is not a format this module reads, or the published file is not this paper's.
        PublishedError: the published file breaks the schema.
    """
    ours = read_ours(table, name)
    pub = published if isinstance(published, Published) else load_published(published)
    if pub.paper != PAPERS[ours.paper_dir]:
        raise ValueError(f"{getattr(pub, 'path', '')}: published figures of {pub.paper}, but {ours.name} is "
                         f"{PAPERS[ours.paper_dir]}'s")
    cells, used = _cell_rows(pub, ours)
    orders, used2 = _ordering_rows(pub, ours)
    only = [{"part": "published only", "paper_backbone": e.backbone, "method": e.method or f"{e.a}{MINUS}{', '.join(e.b)}",
             "budget": _fmt_budget(e.budget), "column": e.column, "metric": e.metric, "unit": e.unit,
             "published": e.value if e.value is not None else (", ".join(f"{v:g}" for v in e.values) or None),
             "published_low": e.low, "published_high": e.high, "entry": e.id, "source": pub.source(e),
             "reason": "no cell of ours has this method, column, metric and setting" + (f"; {e.text}" if e.text else "")}
            for e in pub.for_table(ours.key) if e.id not in used | used2]
    df = pd.DataFrame(cells + orders + only, columns=COLUMNS)
    for col in ("backbone", "regime", "budget", "reason"):
        df[col] = df[col].fillna("")
    backbones = ", ".join(dict.fromkeys(c.backbone for c in ours.cells))
    profile = ("zoo: ours are the tiny zoo models (" + backbones + ") on smoke data, NOT the paper's models, each standing "
               "in for every published backbone; absolute differences (diff) are not meaningful (comparable = False); "
               "the published ORDERINGS of methods are the comparison") if ours.zoo else (
               "paper: ours are " + backbones + " computed by this pipeline; a published backbone matches the config "
               "models config/published names for it; the absolute differences are the comparison")
    header = [f"# {pub.paper} {ours.key}: ours (results/{ours.name}.csv) beside the published figures "
              f"({pub.path or 'config/published'}; {pub.paper} arXiv {pub.arxiv}). Profile {profile}.",
              f"# our table's header: {ours.header[0].lstrip('# ') if ours.header else '(none)'}",
              "# parts: cell = each numeric cell of ours with its published neighbour (diff = ours − published; range: "
              "distance outside it; empty published: none, see reason); ordering = each published ordering of two "
              "methods against ours (ours = our a − b; CI from the table's paired-difference rows where it has them; "
              "verdict agrees / disagrees / cannot be told apart, 'no CI, not judged' where ours is a point difference); "
              "published only = published entries no cell of ours matched",
              "# columns: " + ", ".join(COLUMNS)]
    for _, r in df[df["part"] == "ordering"].iterrows():
        ci = f" [{r['ci95_lo']:+.2f}, {r['ci95_hi']:+.2f}]" if pd.notna(r["ci95_lo"]) else ""
        ours_s = f"{r['ours']:+.2f}" if isinstance(r["ours"], float) else str(r["ours"])
        header.append(f"# {r['verdict']}: {r['reason'].split(';')[0]} ({r['column']}, {r['budget'] or 'no budget'}); "
                      f"ours ({r['backbone']}{', ' + r['regime'] if r['regime'] else ''}): {ours_s}{ci}")
    write_csv(df, header, str(out))
    return df


def read_compare(path: str | Path) -> tuple[list[str], pd.DataFrame]:
    """A compare CSV's ``#`` lines and rows."""
    lines = [ln for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.startswith("#")]
    return lines, pd.read_csv(path, comment="#")


def page(paths: list[str | Path], out: str | Path, note: str = "") -> str:
    """Write ``results/compare.md``: per compare CSV, how many of our cells have a published neighbour, the
    differences, and the orderings that agree, disagree and cannot be told apart. Returns the text."""

    lines = ["# Ours beside the published figures", "",
             "Built by `kvbench report compare-page` from the compare CSVs (`results/<paper>/<table>.compare.csv`, "
             "`kvbench report compare`); the published figures are `config/published/<paper>.yaml`, transcribed from "
             "the papers' summary and notes. On the zoo (smoke profile) only the orderings are a comparison; on the "
             "paper profile the differences are too.", ""]
    if note:
        lines += [note, ""]
    if not paths:
        lines += ['No compare CSV yet: build a table, then `snakemake results/compare.md` (docs/workflow.md, "Targets").']
    for path in sorted(map(str, paths)):
        head, df = read_compare(path)
        m = re.search(r"ours \(results/(.+?)\.csv\)", head[0]) if head else None
        name = m.group(1) if m else Path(path).name.removesuffix(".compare.csv")
        cells = df[df["part"] == "cell"]
        keyed = cells.drop_duplicates(["backbone", "method", "budget", "column"])
        hit = cells[cells["published"].notna() | cells["published_low"].notna() | cells["entry"].notna()]
        n_hit = len(hit.drop_duplicates(["backbone", "method", "budget", "column"]))
        zoo = "Profile zoo" in head[0] if head else False
        lines += [f"## {name}", "", f"- profile: {'zoo (tiny models, orderings only)' if zoo else 'paper models'}",
                  f"- our cells with a published neighbour: {n_hit} of {len(keyed)}"]
        diffs = hit[hit["diff"].notna()]
        if len(diffs):
            lines.append(f"- differences ours − published: {len(diffs)}" + (
                " (not listed: on the zoo they are not meaningful; the compare CSV has them)" if zoo else ""))
            if not zoo:
                for _, r in diffs.iterrows():
                    lines.append(f"  - {r['backbone']} {r['method']} {r['column']} ({r['budget']}): ours {r['ours']} vs "
                                 f"{r['published'] if pd.notna(r['published']) else str(r['published_low']) + '-' + str(r['published_high'])}"
                                 f" -> {float(r['diff']):+.2f} [{r['entry']}]")
        orders = df[df["part"] == "ordering"]
        for label, test in (("agree", lambda v: v.startswith("agrees")), ("disagree", lambda v: v.startswith("disagrees")),
                            ("cannot be told apart", lambda v: v.startswith("cannot")),
                            ("have no CI (shown, not judged)", lambda v: v.startswith("no CI")),
                            ("counts (shown, not judged)", lambda v: v.startswith("count"))):
            sel = orders[orders["verdict"].astype(str).map(test)]
            lines.append(f"- orderings that {label}: {len(sel)}" if not label.startswith("counts") else f"- {label}: {len(sel)}")
            for _, r in sel.iterrows():
                ci = f" [{float(r['ci95_lo']):+.2f}, {float(r['ci95_hi']):+.2f}]" if pd.notna(r["ci95_lo"]) else ""
                ours_s = str(r["ours"])
                try:
                    ours_s = f"{float(r['ours']):+.2f}"
                except ValueError:
                    pass
                lines.append(f"  - {str(r['reason']).split(';')[0]} ({r['column']}, {r['budget'] if pd.notna(r['budget']) else 'no budget'}); "
                             f"ours ({r['backbone']}{', ' + r['regime'] if pd.notna(r['regime']) and r['regime'] else ''}): "
                             f"{ours_s}{ci} — {r['verdict']}")
        only = df[df["part"] == "published only"]
        lines += [f"- published entries without a cell of ours: {len(only)}", ""]
    text = "\n".join(lines) + "\n"
    with atomic_path(out) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")
    return text
