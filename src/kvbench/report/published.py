"""The papers' published figures (``config/published/<paper>.yaml``), loaded and checked.

Each file is transcribed once from the papers (CONDUIT arXiv 2609.05821v1, ResidualKV arXiv 2602.08005v2; each entry
names its section, table and page); :mod:`kvbench.report.compare` sets our tables beside it. An :class:`Entry` is one published figure or
claim, of one kind:

- ``value``: one published cell (``value``);
- ``range``: a claim that a quantity lies in ``[low, high]`` (``open_high``: "over ``high``");
- ``difference``: ``a − b`` published as a number (``value``, or ``values`` one per backbone when the source does
  not say which backbone has which);
- ``ordering``: ``a <relation> b`` for every method of ``b``, without a number;
- ``count``: "``value`` of ``of``" cells for which ``method`` holds;
- ``qualitative``: words only (``text``).

``backbone`` is a paper backbone named under ``backbones`` (which maps it to the config model names that are that
checkpoint), ``each`` (the claim holds per backbone), ``average`` (over backbones) or ``unassigned`` (the source
does not say which). ``column`` is the paper's column (``average``: the multi-dataset average; ``each``: every
dataset column). ``budget``: the setting (``r``, ``alpha``, ``KR``, ``CR``, ...), numbers or lists of numbers.

Errors name the file and the entry (its index and id).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

KINDS = ("value", "range", "difference", "ordering", "count", "qualitative")
SCOPES = ("each", "average", "unassigned")
RELATIONS = (">", "<", "=")
#: Units between whose values an ordering means nothing (a generated answer, a case count, a layer width).
NON_ORDINAL_UNITS = frozenset({"answer", "cases", "dims"})
#: Target ids as our targets name them: CONDUIT numbers in Arabic, ResidualKV in Roman (as the papers number them).
TABLE_ID = {"CONDUIT": re.compile(r"(table[1-9][0-9]*|fig[1-9][0-9]*)"),
            "ResidualKV": re.compile(r"(table[IVX]+|fig[1-9][0-9]*)")}
_FIELDS = {"id", "table", "source", "kind", "backbone", "column", "method", "a", "b", "relation", "budget", "metric",
           "unit", "value", "values", "low", "high", "open_high", "of", "text"}
_REQUIRED = {"value": {"method"}, "range": {"method", "low", "high"}, "difference": {"a", "b"},
             "ordering": {"a", "b", "relation"}, "count": {"method", "value", "of"}, "qualitative": {"method", "text"}}


class PublishedError(ValueError):
    """A published-figures file that does not follow the schema (the message names the file and entry)."""


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class Entry:
    """One published figure or claim (module docstring); checked in ``__post_init__``.

    Raises:
        ValueError: a missing or unknown field, a kind without its fields, a non-numeric value, low > high.
    """

    id: str
    table: str
    source: dict
    kind: str
    backbone: str
    column: str
    metric: str
    unit: str
    method: str | None = None
    a: str | None = None
    b: tuple[str, ...] = ()
    relation: str | None = None
    budget: dict = field(default_factory=dict)
    value: float | None = None
    values: tuple[float, ...] = ()
    low: float | None = None
    high: float | None = None
    open_high: bool = False
    of: int | None = None
    text: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind {self.kind!r} is not one of {list(KINDS)}")
        missing = [k for k in sorted(_REQUIRED[self.kind]) if getattr(self, k) in (None, (), "")]
        if missing:
            raise ValueError(f"a {self.kind} entry needs {missing}")
        for k in ("id", "table", "backbone", "column", "metric", "unit"):
            if not isinstance(getattr(self, k), str) or not getattr(self, k):
                raise ValueError(f"{k} must be a non-empty string, got {getattr(self, k)!r}")
        if not isinstance(self.source, dict) or set(self.source) != {"doc", "where"}:
            raise ValueError(f"source must be {{doc, where}}, got {self.source!r}")
        if self.kind == "value" and not _number(self.value):
            raise ValueError(f"value must be a number, got {self.value!r}")
        if self.kind == "difference" and (self.value is None) == (not self.values):
            raise ValueError("a difference needs exactly one of value (a number) or values (one per backbone)")
        for x in ((self.value,) if self.value is not None else ()) + tuple(self.values) + tuple(
                v for v in (self.low, self.high) if v is not None):
            if not _number(x):
                raise ValueError(f"published numbers must be finite numbers, got {x!r}")
        if self.kind == "range" and self.low > self.high:
            raise ValueError(f"range low {self.low} > high {self.high}")
        if self.relation is not None and self.relation not in RELATIONS:
            raise ValueError(f"relation {self.relation!r} is not one of {list(RELATIONS)}")
        if self.kind == "count" and not (isinstance(self.of, int) and 0 <= self.value <= self.of):
            raise ValueError(f"a count needs 0 <= value <= of (integers), got {self.value!r} of {self.of!r}")
        if not isinstance(self.budget, dict):
            raise ValueError(f"budget must be a mapping (r, alpha, KR, ...), got {self.budget!r}")
        for k, v in self.budget.items():
            if not (_number(v) or (isinstance(v, list) and v and all(_number(x) for x in v))):
                raise ValueError(f"budget {k} must be a number or a list of numbers, got {v!r}")

    def budgets(self) -> list[dict]:
        """The settings the entry covers, one dict each (a list under a budget key expands)."""
        out = [{}]
        for k, v in self.budget.items():
            out = [{**d, k: x} for d in out for x in (v if isinstance(v, list) else [v])]
        return out

    @property
    def ordinal(self) -> bool:
        """Whether an ordering between two values of this unit means something (:data:`NON_ORDINAL_UNITS`)."""
        return self.unit not in NON_ORDINAL_UNITS


@dataclass(frozen=True)
class Published:
    """One paper's published figures: ``paper`` (CONDUIT | ResidualKV), ``arxiv``, ``docs`` (key -> the name of the
    transcribed source document), ``backbones`` (paper backbone -> config model names), ``entries``; ``path`` it came from."""

    paper: str
    arxiv: str
    docs: dict
    backbones: dict
    entries: tuple[Entry, ...]
    path: str = ""

    def for_table(self, key: str) -> list[Entry]:
        """The entries of target ``key`` (``table1``, ``tableIII``, ``fig3``)."""
        return [e for e in self.entries if e.table == key]

    def source(self, e: Entry) -> str:
        """Where ``e`` comes from: paper, arXiv id, document, section/page."""
        return f"{self.paper} arXiv {self.arxiv}, {self.docs[e.source['doc']]}: {e.source['where']}"

    def models_of(self, backbone: str) -> list[str]:
        """Config model names that are paper backbone ``backbone`` (none for each/average/unassigned)."""
        return list(self.backbones.get(backbone, []))


def load_published(path: str | Path) -> Published:
    """Read and check ``config/published/<paper>.yaml``.

    Raises:
        PublishedError: the file is missing or not YAML, a top-level key is missing, or an entry breaks the schema
            (the message names the file, the entry's index and id, and what was expected).
    """
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise PublishedError(f"{path}: cannot read the published figures ({e})") from e
    if not isinstance(doc, dict):
        raise PublishedError(f"{path}: expected a mapping with paper, arxiv, docs, backbones, entries")
    for k in ("paper", "arxiv", "docs", "backbones", "entries"):
        if k not in doc:
            raise PublishedError(f"{path}: missing top-level key {k!r}")
    paper = doc["paper"]
    if paper not in TABLE_ID:
        raise PublishedError(f"{path}: paper {paper!r} is not one of {sorted(TABLE_ID)}")
    if not isinstance(doc["backbones"], dict) or not all(isinstance(v, list) for v in doc["backbones"].values()):
        raise PublishedError(f"{path}: backbones must map each paper backbone to a list of config model names")
    entries, seen = [], set()
    for i, raw in enumerate(doc["entries"] or []):
        where = f"{path}: entry {i} ({raw.get('id', '?') if isinstance(raw, dict) else repr(raw)})"
        if not isinstance(raw, dict):
            raise PublishedError(f"{where}: expected a mapping")
        unknown = sorted(set(raw) - _FIELDS)
        if unknown:
            raise PublishedError(f"{where}: unknown field(s) {unknown}; expected some of {sorted(_FIELDS)}")
        fields = dict(raw)
        if isinstance(fields.get("b"), str):
            fields["b"] = [fields["b"]]
        for k in ("b", "values"):
            if k in fields:
                if not isinstance(fields[k], list):
                    raise PublishedError(f"{where}: {k} must be a list, got {fields[k]!r}")
                fields[k] = tuple(fields[k])
        for k in ("method", "a", "column", "backbone", "metric", "unit", "text"):
            if k in fields and fields[k] is not None:
                fields[k] = str(fields[k])
        try:
            e = Entry(**fields)
        except TypeError as err:  # a required field absent
            raise PublishedError(f"{where}: {err}") from err
        except ValueError as err:
            raise PublishedError(f"{where}: {err}") from err
        if e.id in seen:
            raise PublishedError(f"{where}: duplicate id {e.id!r}")
        seen.add(e.id)
        if not TABLE_ID[paper].fullmatch(e.table):
            raise PublishedError(f"{where}: table {e.table!r} is not a {paper} target id "
                                 f"(pattern {TABLE_ID[paper].pattern})")
        if e.backbone not in SCOPES and e.backbone not in doc["backbones"]:
            raise PublishedError(f"{where}: backbone {e.backbone!r} is neither one of {list(SCOPES)} nor under "
                                 f"backbones ({sorted(doc['backbones'])})")
        if e.source["doc"] not in doc["docs"]:
            raise PublishedError(f"{where}: source doc {e.source['doc']!r} is not under docs ({sorted(doc['docs'])})")
        entries.append(e)
    return Published(paper, str(doc["arxiv"]), dict(doc["docs"]), dict(doc["backbones"]), tuple(entries), str(path))
