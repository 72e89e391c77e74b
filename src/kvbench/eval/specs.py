"""Method specs: one string per refresh run, for config files and the command line (CONDUIT §4).

Grammar::

    spec   := policy [ "@" r ] [ ":" key "=" value { "," key "=" value } ]
    value  := true | false | none | <int> | <float> | <int>+<int>+... (a list) | <word>

e.g. ``reuse``, ``full``, ``conduit@0.1``, ``prophetkv@0.05``, ``conduit@0.1:lam=0.5``,
``conduit@0.1:use_v_norm=false``, ``conduit@0.1:layers=2+3+4``. ``r`` is the visual-token budget
ratio in [0, 1] (⌈r·N_visual⌉ tokens, :func:`kvbench.reuse.budget_count`); ``reuse`` (r = 0) and
``full`` (r = 1) take none. Parsing validates everything (policy, r, parameter names and values, e.g.
λ in [0, 1]) without a model, so a bad spec fails while the Snakemake DAG is built.

:func:`canonical` gives one string per distinct run (alias names resolved, parameters sorted,
defaults dropped: ``conduit@0.1:lam=1`` is ``conduit@0.1``); :func:`slug` turns it into a path
component.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any

from kvbench.reuse import available_policies, get_policy
from kvbench.reuse.policies import REGISTRY
from kvbench.reuse.validate import check_ratio

#: Policies whose budget is fixed by definition (no ``@r``): name -> the r they run at.
FIXED_R = {"reuse": 0.0, "full": 1.0}

_SPEC = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9_-]*)(?:@(?P<r>[^:]*))?(?::(?P<params>.*))?$")


@dataclass(frozen=True)
class MethodSpec:
    """A parsed method spec.

    Attributes:
        policy: canonical policy name (``full`` for the full-prefill reference).
        r: budget ratio in [0, 1], or None for ``reuse``/``full``.
        params: policy parameters that differ from the policy's defaults.
    """

    policy: str
    r: float | None = None
    params: dict = field(default_factory=dict)

    @property
    def canonical(self) -> str:
        """One string per distinct run (see module docstring)."""
        out = self.policy + ("" if self.r is None else f"@{_fmt(self.r)}")
        if self.params:
            out += ":" + ",".join(f"{k}={_fmt(v)}" for k, v in sorted(self.params.items()))
        return out

    @property
    def effective_r(self) -> float:
        """The ratio the policy runs at (0 for ``reuse``, 1 for ``full``)."""
        return FIXED_R[self.policy] if self.r is None else self.r


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "none"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "+".join(_fmt(x) for x in v)
    return str(v)


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    if "+" in text:
        return [_value(x) for x in text.split("+")]
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _typed(spec: str, key: str, value: Any, param: inspect.Parameter) -> Any:
    """Check ``value`` against the type of the policy parameter's default / annotation.

    Without this, ``use_v_norm=no`` became the string "no" and the policy's ``bool(...)``
    read it as True: the ablation silently ran as default CONDUIT.
    """
    default, note = param.default, str(param.annotation)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"method spec {spec!r}: {key} must be true or false, got {value!r}")
    elif isinstance(default, (int, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"method spec {spec!r}: {key} must be a number, got {value!r}")
    elif "list[int]" in note and value is not None:
        value = [value] if isinstance(value, int) and not isinstance(value, bool) else value
        if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                  for x in value):
            raise ValueError(f"method spec {spec!r}: {key} must be layer indices >= 0 joined by '+' "
                             f"(e.g. {key}=2+3+4), got {value!r}")
    return value


def _plain_methods() -> list[str]:
    """Registry methods named without a spec (``full``)."""
    from kvbench.eval.methods import METHODS

    return sorted(n for n in METHODS if n not in ("refresh", "compress"))


def _press_names() -> list[str]:
    from kvbench.compress.registry import PRESSES

    return sorted(PRESSES)


def parse_method_spec(spec: str) -> MethodSpec:
    """Parse and validate a method spec (no model needed).

    Raises:
        ValueError: naming the spec: unknown method/policy (message lists the valid ones), a budgeted
            policy without ``@r`` or ``reuse``/``full`` with one, r outside [0, 1], an unknown parameter
            name, or a bad parameter value (e.g. λ outside [0, 1]).
    """
    if not isinstance(spec, str):
        raise ValueError(f"method spec must be a string, got {spec!r}")  # noqa: TRY004 (one error type for bad specs)
    m = _SPEC.match(spec.strip())
    if m is None:
        raise ValueError(f"method spec {spec!r} is malformed; expected <policy>[@<r>][:key=value,...], "
                         "e.g. conduit@0.1:lam=0.5")
    name = m["name"]
    if name not in REGISTRY and name != "full":
        raise ValueError(f"unknown evaluation method {name!r}; expected one of {_plain_methods()} or a refresh "
                         f"spec <policy>@<r>[:key=value,...] with policy in {available_policies()}, or a "
                         f"compression press spec <press>[:key=value,...] with press in {_press_names()}")
    policy = "full" if name == "full" else REGISTRY[name].name
    r = None
    if m["r"] is not None:
        if policy in FIXED_R:
            raise ValueError(f"method spec {spec!r}: {policy!r} runs at r = {FIXED_R[policy]:g} by definition; "
                             f"drop '@{m['r']}' (conduit@{m['r']} is the budgeted form)")
        try:
            r = check_ratio(float(m["r"]))
        except ValueError:
            raise ValueError(f"method spec {spec!r}: r must be a refresh ratio in [0, 1] (fraction of visual "
                             f"tokens), got {m['r']!r}") from None
    elif policy not in FIXED_R:
        raise ValueError(f"method spec {spec!r}: policy {policy!r} needs a budget, e.g. {policy}@0.1 (r in [0, 1])")
    params = _parse_params(spec, policy, m["params"])
    return MethodSpec(policy=policy, r=r, params=params)


def _parse_params(spec: str, policy: str, text: str | None) -> dict:
    if text is None:
        return {}
    if policy == "full":
        raise ValueError(f"method spec {spec!r}: 'full' takes no parameters")
    cls = REGISTRY[policy]
    signature = inspect.signature(cls.__init__).parameters
    accepted = [p for p in signature if p != "self"]
    params: dict[str, Any] = {}
    for item in text.split(","):
        key, sep, val = item.partition("=")
        key = key.strip()
        if not sep or not key or not val.strip():
            raise ValueError(f"method spec {spec!r}: parameter {item!r} is not key=value")
        if key not in accepted:
            raise ValueError(f"method spec {spec!r}: unknown parameter {key!r} for policy {policy!r}; "
                             f"accepted: {accepted or 'none'}")
        if key in params:
            raise ValueError(f"method spec {spec!r}: parameter {key!r} given twice")
        params[key] = _typed(spec, key, _value(val.strip()), signature[key])
    try:
        given, default = get_policy(policy, **params).params(), get_policy(policy).params()
    except (TypeError, ValueError) as e:
        raise ValueError(f"method spec {spec!r}: {e}") from None
    # keep the normalised value (e.g. lam=1 -> 1.0) and drop what equals the default
    return {k: given.get(k, v) for k, v in params.items() if k not in given or given[k] != default.get(k)}


def canonical(spec: str) -> str:
    """Canonical form of a spec (aliases resolved, parameters sorted, defaults dropped)."""
    return parse_method_spec(spec).canonical


def with_budget(spec: str, r: float) -> str:
    """``spec`` (a policy with optional parameters, no ``@r``) at budget ``r``; ``reuse``/``full`` unchanged.

    Raises:
        ValueError: ``spec`` already has a budget, or is invalid.
    """
    name, _, params = spec.partition(":")
    if "@" in name:
        raise ValueError(f"method {spec!r} already has a budget; list it without '@r'")
    if name in FIXED_R:
        return canonical(spec)
    return canonical(f"{name}@{r!r}" + (f":{params}" if params else ""))


def slug(spec: str) -> str:
    """Path component of a spec's run directory (``[A-Za-z0-9._-]``): ``conduit@0.1:lam=0.5`` -> ``conduit_r0.1_lam-0.5``.

    Injective on canonical specs in practice; :func:`slugs` checks a whole set.
    """
    out = canonical(spec).replace("@", "_r").replace(":", "_").replace(",", "_").replace("=", "-").replace("+", ".")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", out):
        raise ValueError(f"method spec {spec!r} gives the path component {out!r}, which has characters "
                         "outside [A-Za-z0-9._-]")
    return out


def slugs(specs: list[str]) -> dict[str, str]:
    """``{slug: canonical spec}`` of ``specs``.

    Raises:
        ValueError: two distinct canonical specs share a slug, or a spec is invalid.
    """
    out: dict[str, str] = {}
    for s in specs:
        c, k = canonical(s), slug(s)
        if out.get(k, c) != c:
            raise ValueError(f"method specs {out[k]!r} and {c!r} map to the same run directory {k!r}")
        out[k] = c
    return out


def check_method_spec(name: str) -> str:
    """Validate an ``eval.methods`` entry: a registry name (``full``) or a refresh spec; returns it canonical.

    Raises:
        ValueError: as :func:`parse_method_spec` (``unknown method 'x'`` for unknown names).
    """
    if name in _plain_methods():
        return name
    return canonical(name)
