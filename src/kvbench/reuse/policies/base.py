"""Refresh policies: the abstraction, the registry and the one entry point that runs a policy.

A :class:`RefreshPolicy` turns the shared scoring pass (or nothing) into a
:class:`RefreshPlan` (which visual rows are recomputed at which layer); the
same executor (:mod:`kvbench.reuse.executor`) carries out every plan, so
methods differ only in their selection rule (docs/architecture: "Two
abstractions carry the methods").
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import torch

from kvbench.reuse.adapter import VLMAdapter
from kvbench.reuse.assemble import AssembledRequest, prepare
from kvbench.reuse.cache_store import ImageKVStore
from kvbench.reuse.executor import ExecResult, LayerSchedule, execute, full_prefill
from kvbench.reuse.scoring import ScoringPass, scoring_pass
from kvbench.reuse.validate import check_ratio
from kvbench.utils.spec import Family


@dataclass
class RefreshPlan:
    """What to recompute.

    Attributes:
        schedule: visual rows per layer; None means full prefill with the model's own forward.
        selected: visual sequence indices of a single-set policy (None for layer-wise ones).
        scores: float32 ``[N_visual]`` final ranking scores where the policy has them.
        coefficients: float32 ``[K]`` image coefficients where the policy has them.
        text_rows: text rows computed in Phase 2 (None: all text).
        base_from_stage1: Phase 2 reuses the scoring pass's K/V (needed when ``text_rows`` is a subset).
        info: policy-specific extras (layer counts, variant name, ...).
    """

    schedule: LayerSchedule | None
    selected: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    coefficients: torch.Tensor | None = None
    text_rows: torch.Tensor | None = None
    base_from_stage1: bool = False
    info: dict = field(default_factory=dict)


@dataclass
class RefreshResult:
    """A policy run: its output, its plan, and the scoring pass when one ran."""

    policy: str
    r: float
    output: ExecResult
    plan: RefreshPlan
    scoring: ScoringPass | None = None

    @property
    def n_selected(self) -> int | None:
        return None if self.plan.selected is None else int(self.plan.selected.numel())


@dataclass
class RefreshPolicy(ABC):
    """Base class: ``plan(req, scoring, r)`` → :class:`RefreshPlan`.

    A policy is a dataclass whose fields are its parameters (what a method spec such as
    ``conduit@0.1:lam=0.5`` sets, typed from the field annotations by :mod:`kvbench.utils.spec`);
    ``__post_init__`` validates them, so constructing a policy is checking it (also while the Snakemake
    DAG is built). What the tables and the cost model need to know about a policy lives here too:

    - ``label``: its name in the papers' tables (CONDUIT Table 3);
    - ``form``: for a baseline offered in more than one form, which one this is (a header line of the
      tables that use it says so); None for CONDUIT itself and the references;
    - :meth:`visual_rows`: the visual rows it recomputes at each layer, analytically (the check on the
      measured FLOPs of Table 3, :mod:`kvbench.bench.cost`), and :meth:`mass_layers`.
    """

    name: ClassVar[str]
    label: ClassVar[str]
    form: ClassVar[str | None] = None
    uses_scoring: ClassVar[bool] = True
    #: Plans from the full prefill's K/V (an oracle; :meth:`plan` then gets that :class:`ExecResult` as ``scoring``).
    reads_fresh: ClassVar[bool] = False
    #: Runs the model's own forward (vision tower included) instead of the Phase 2 executor.
    model_forward: ClassVar[bool] = False

    def params(self) -> dict[str, Any]:
        """The policy's parameters (recorded with each run)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @abstractmethod
    def plan(self, req: AssembledRequest, scoring: ScoringPass | ExecResult | None, r: float) -> RefreshPlan:
        """The refresh plan for ``req`` at visual-token budget ratio ``r``; ``scoring`` is the scoring pass
        (``uses_scoring``), the full prefill's result (``reads_fresh``: an oracle) or None."""

    @abstractmethod
    def visual_rows(self, req: AssembledRequest, r: float, n_layers: int) -> list[int]:
        """Visual rows the plan of ``req`` at ratio ``r`` computes at each of ``n_layers`` layers
        (analytic, from the policy's definition; ``k = ⌈r·N_visual⌉``)."""

    def check_layers(self, n_layers: int) -> None:
        """Check the policy's layer indices against a model with ``n_layers`` decoder layers (also at DAG time,
        from the config's model shape). Default: a ``layers`` field, when the policy has one, within the model.

        Raises:
            ValueError: a layer index the model does not have, naming it.
        """
        bad = [i for i in (getattr(self, "layers", None) or []) if not 0 <= i < n_layers]
        if bad:
            raise ValueError(f"layers {bad} outside the model's {n_layers} layers")

    def phase2_text_rows(self, req: AssembledRequest) -> int:
        """Text rows Phase 2 computes at every layer (the analytic cost): all of them by default."""
        return int(req.text_index.numel())

    def mass_layers(self, rows: list[int]) -> list[int]:
        """Layers after which the policy also computes the queries of every computed row and their
        attention mass (KVShare's reselection); ``rows``: :meth:`visual_rows`. Default: none."""
        return []


@dataclass
class Phase2TextPolicy(RefreshPolicy):
    """A scoring-pass policy whose Phase 2 recomputes either every text token or only the trailing query
    (CONDUIT App. A.1; docs/decisions/reuse.md, "Phase 2 executor"). CONDUIT and ProphetKV share this switch.

    Parameters:
        phase2_text: str, default ``"all"``: every text token is recomputed in Phase 2 (r = 1 equals full
            prefill); ``"query"``: as the authors' code runs (``model_runner_kv_score.py``), only the trailing
            query text is, and other text keeps its Stage I K/V (computed over the stale images).
    """

    phase2_text: str = "all"

    def __post_init__(self):
        if self.phase2_text not in ("all", "query"):
            raise ValueError(f"phase2_text must be 'all' or 'query', got {self.phase2_text!r}")

    def text_plan(self, req: AssembledRequest) -> dict[str, Any]:
        """:class:`RefreshPlan` keywords for ``phase2_text``: ``text_rows`` (int64 query indices, or None for all
        text) and ``base_from_stage1`` (the non-query text rows then come from Stage I's K/V)."""
        query_only = self.phase2_text == "query"
        return {"text_rows": req.query_index if query_only else None, "base_from_stage1": query_only}

    def phase2_text_rows(self, req: AssembledRequest) -> int:
        return int((req.query_index if self.phase2_text == "query" else req.text_index).numel())


REGISTRY: dict[str, type[RefreshPolicy]] = {}

#: Refresh policies as a family of method specs (:mod:`kvbench.utils.spec`): ``<policy>@<r>[:key=value,...]``,
#: ``reuse`` and ``full`` at their fixed r, parameters equal to a field default dropped from the canonical form.
REFRESH = Family("refresh", REGISTRY, budgeted=True, fixed_r={"reuse": 0.0, "full": 1.0}, drops_defaults=True)


def register(*names: str):
    """Class decorator: register a policy under ``cls.name`` and any extra ``names``."""
    def deco(cls):
        for n in (cls.name, *names):
            if n in REGISTRY:
                raise ValueError(f"refresh policy {n!r} registered twice")
            REGISTRY[n] = cls
        return cls
    return deco


def available_policies() -> list[str]:
    """Registered policy names, sorted."""
    return sorted(REGISTRY)


def get_policy(name: str, **params: Any) -> RefreshPolicy:
    """Instantiate a registered policy.

    Raises:
        ValueError: unknown name (message lists the registered ones) or a bad parameter.
    """
    if name not in REGISTRY:
        raise ValueError(f"unknown refresh policy {name!r}; expected one of {available_policies()}")
    return REGISTRY[name](**params)


def refresh(adapter: VLMAdapter, req: AssembledRequest, policy: str | RefreshPolicy, r: float,
            in_place: bool = False, **params: Any) -> RefreshResult:
    """Run ``policy`` at budget ratio ``r`` on an assembled request.

    ``r`` and the policy are validated before any model work.

    Args:
        in_place: the scoring pass and Phase 2 write into the request's own stale K/V instead of per-layer
            copies (no second copy of the cache: the serving path of Table 3). Outputs are identical; ``req``
            is consumed (refused by later runs) once Phase 2 recomputed a visual row.

    Raises:
        ValueError: ``r`` outside [0, 1], unknown policy or bad policy parameter, request without
            visual tokens, or a request already consumed by an in-place refresh.
    """
    r = check_ratio(r)
    pol = get_policy(policy, **params) if isinstance(policy, str) else policy
    if req.n_visual == 0:
        raise ValueError("request has no visual tokens; the reuse engine needs >= 1 image")
    sp = scoring_pass(adapter, req, in_place=in_place) if pol.uses_scoring else None
    if pol.reads_fresh:
        assert not pol.uses_scoring, f"policy {pol.name}: reads_fresh replaces the scoring pass"
        plan = pol.plan(req, full_prefill(adapter, req), r)
    else:
        plan = pol.plan(req, sp, r)
    if plan.schedule is None:
        out = full_prefill(adapter, req)
    else:
        base_k = base_v = None
        if plan.base_from_stage1:
            assert sp is not None, f"policy {pol.name}: base_from_stage1 needs the scoring pass (uses_scoring)"
            base_k, base_v = sp.stage1.keys, sp.stage1.values
        out = execute(adapter, req, plan.schedule, base_keys=base_k, base_values=base_v, text_rows=plan.text_rows,
                      in_place=in_place)
    return RefreshResult(policy=pol.name, r=r, output=out, plan=plan, scoring=sp)


def run_record(adapter: VLMAdapter, store: ImageKVStore, record: dict, policy: str, r: float,
               base_dir: str | Path | None = None, **params: Any) -> RefreshResult:
    """Validate, look up/build the record's image caches, assemble, and run ``policy``.

    Raises:
        ValueError: bad ``r``, unknown policy or parameter, or a record without images,
            all before any cache or model work.
    """
    r = check_ratio(r)
    pol = get_policy(policy, **params)
    if not any(p.get("type") == "image" for p in record.get("content", [])):
        raise ValueError(f"record {record.get('id')!r} has no image part; the reuse engine needs >= 1 image")
    req = prepare(adapter, store, record, base_dir)
    return refresh(adapter, req, pol, r)
