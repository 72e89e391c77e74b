"""The evaluation methods by spec: the one place a spec string becomes a method (a leaf: nothing in
``kvbench`` imports it but the runner, the CLI, the lmms-eval adapter and the reports).

A spec (:mod:`kvbench.utils.spec`) names one of three kinds of evaluation method:

- ``full``: :class:`~kvbench.eval.methods.FullCache` (``model.generate``, the exact KV cache);
- a refresh policy of :data:`kvbench.reuse.policies.REFRESH` (``reuse``, ``conduit@0.1:lam=0.5``):
  :class:`~kvbench.eval.refresh.RefreshMethod`;
- a compression press of :data:`kvbench.compress.registry.PRESS` (``snapkv:keep=0.3``):
  :class:`~kvbench.eval.compress.CompressMethod`.

The registries of policies and presses are filled by the method files themselves (a new policy or press
is one file plus its registration); nothing here lists them.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from kvbench.compress.registry import PRESS
from kvbench.eval.compress import CompressMethod
from kvbench.eval.methods import EvalMethod, FullCache
from kvbench.eval.refresh import RefreshMethod
from kvbench.reuse.policies import REFRESH
from kvbench.utils.spec import Family, MethodSpec, fmt, parse, slugs

#: Evaluation methods that are their own spec: ``full``, the exact-cache reference (no budget).
PLAIN = Family("plain", {FullCache.name: FullCache}, fixed_r={FullCache.name: 1.0})

#: The evaluation method that runs the specs of each family of KV-cache methods.
RUNNERS: dict[str, type[EvalMethod]] = {"refresh": RefreshMethod, "press": CompressMethod}


def parse_method_spec(spec: str) -> MethodSpec:
    """Parse and validate any method spec (``full``, a refresh policy or a press; no model needed).

    Raises:
        ValueError: as :func:`kvbench.utils.spec.parse` (an unknown name lists every known method).
    """
    return parse(spec, PLAIN, REFRESH, PRESS)


def canonical(spec: str) -> str:
    """Canonical form of a spec (aliases resolved, parameters sorted; refresh defaults dropped)."""
    return parse_method_spec(spec).canonical


def slug(spec: str) -> str:
    """Run-directory name of a spec (:attr:`kvbench.utils.spec.MethodSpec.slug`)."""
    return parse_method_spec(spec).slug


def run_slugs(specs: list[str]) -> dict[str, str]:
    """``{slug: canonical spec}`` of ``specs``.

    Raises:
        ValueError: an invalid spec, or two distinct specs sharing a run directory.
    """
    return slugs([parse_method_spec(s) for s in specs])


def with_budget(spec: str, r: float) -> str:
    """``spec`` (a refresh policy with optional parameters, no ``@r``) at budget ``r``, canonical;
    a fixed-budget one (``reuse``, ``full``) unchanged.

    Raises:
        ValueError: ``spec`` already has a budget, or is invalid.
    """
    name, _, params = spec.partition(":")
    if "@" in name:
        raise ValueError(f"method {spec!r} already has a budget; list it without '@r'")
    if name in REFRESH.fixed_r or name in PLAIN.classes:
        return canonical(spec)
    return canonical(f"{name}@{r!r}" + (f":{params}" if params else ""))


def with_params(spec: str, **params: Any) -> str:
    """``spec`` with ``params`` set (replacing equal keys), canonical (e.g. a stride sweep's rows)."""
    parsed = parse_method_spec(spec)
    merged = {**parsed.params, **params}
    head = parsed.name + ("" if parsed.r is None else f"@{parsed.r!r}")
    return canonical(head + (":" + ",".join(f"{k}={fmt(v)}" for k, v in merged.items()) if merged else ""))


def check_method_spec(spec: str) -> str:
    """Validate an ``eval.methods`` entry; returns it canonical.

    Raises:
        ValueError: as :func:`parse_method_spec`.
    """
    return canonical(spec)


def get_method(spec: str, **params: Any) -> EvalMethod:
    """The evaluation method of ``spec`` with method parameters ``params`` (e.g. ``cache_dir`` of a refresh
    run, ``codec_dir`` of a ResidualKV press).

    Raises:
        ValueError: invalid spec, or a parameter the method does not take (listing the accepted ones).
    """
    parsed = parse_method_spec(spec)
    cls = parsed.cls if parsed.family == PLAIN.name else RUNNERS[parsed.family]
    accepted = sorted(f.name for f in dataclasses.fields(cls) if f.init and f.name != "spec")
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"method {spec!r}: unknown method parameter(s) {unknown}; accepted: {accepted or 'none'}")
    return cls(**params) if parsed.family == PLAIN.name else cls(spec=spec, **params)
