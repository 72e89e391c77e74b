"""Method specs: one grammar for refresh policies (CONDUIT) and compression presses (ResidualKV).

Grammar::

    spec   := name [ "+" selector ] [ "@" r ] [ ":" key "=" value { "," key "=" value } ]
    value  := true | false | none | <int> | <float> | <int>+<int>+... (a list) | <word>

e.g. ``reuse``, ``full``, ``conduit@0.1:lam=0.5``, ``conduit@0.1:layers=2+3+4``, ``snapkv:keep=0.3``,
``residualkv:full_layers=0+1``, ``residualkv+omnikv:full_layers=0+1,keep=0.2``. ``name`` is a method of one :class:`Family`: a
dataclass whose fields are the method's hyper-parameters. A spec is parsed once (:func:`parse`): the
values are typed from the class's field annotations, then the class is constructed, so its own
``__post_init__`` checks them; a bad spec therefore fails while the Snakemake DAG is built, and
nothing here repeats a method's validation. Resources (a trained codec, a tokenizer) are fields a
spec never sets (:attr:`Family.resources`); they are loaded when the method meets a model.

A **composed** spec ``<storage>+<selector>`` names a storage method that takes another method of its
family as its ``selector`` field (kvpress's ``ComposedPress`` / ``AdaKVPress(SnapKVPress())`` idea):
``residualkv+omnikv`` stores residual codes and lets OmniKV's filter layers choose what the sparse layers
restore. The storage class lists the selectors it accepts (``selectors`` class attribute); each
parameter goes to whichever of the two has a field of that name (a name both declare is refused when
the classes are composed; a field both inherit from the family's base class, a press's ``protocol``,
belongs to the storage, which runs the request), the selector is built first, and the storage's
``__post_init__`` checks the pair.

:attr:`MethodSpec.canonical` is one string per distinct run (aliases resolved, parameters sorted, values
as the constructed method holds them); :attr:`MethodSpec.slug` is its run-directory name.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_SPEC = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9_-]*)(?:\+(?P<selector>[A-Za-z0-9][A-Za-z0-9_-]*))?"
                   r"(?:@(?P<r>[^:]*))?(?::(?P<params>.*))?$")
_SLUG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class Family:
    """A family of methods named by specs: refresh policies or compression presses.

    Attributes:
        name: ``"refresh"``, ``"press"`` or ``"full"`` (recorded in :attr:`MethodSpec.family`).
        classes: spec name (aliases included) -> dataclass; read when a spec is parsed, so a registry
            filled by import-time registration may be passed.
        budgeted: names take a budget ``@r`` (r in [0, 1], the refresh ratio), required unless fixed.
        fixed_r: names whose budget is fixed by definition (``reuse``: 0, ``full``: 1); ``@r`` refused.
        drops_defaults: the canonical form leaves out parameters equal to the field default, so
            ``conduit@0.1:lam=1`` and ``conduit@0.1`` are one run. Presses keep what the spec spelled,
            so ResidualKV run names and table ``spec`` columns show every setting (docs/decisions/workflow.md,
            "One spec grammar").
        resources: fields never set from a spec (paths and objects given when the method is built).
    """

    name: str
    classes: Mapping[str, type]
    budgeted: bool = False
    fixed_r: Mapping[str, float] = field(default_factory=dict)
    drops_defaults: bool = False
    resources: tuple[str, ...] = ()

    def parameters(self, cls: type) -> dict[str, dataclasses.Field]:
        """Fields of ``cls`` a spec may set (dataclass fields minus :attr:`resources` and ``selector``, which a
        composed spec names as ``<storage>+<selector>``)."""
        return {f.name: f for f in dataclasses.fields(cls)
                if f.init and f.name not in self.resources and f.name != "selector"}


@dataclass(frozen=True)
class MethodSpec:
    """A parsed, validated method spec.

    Attributes:
        family: the :attr:`Family.name` it belongs to.
        name: canonical method name (the class's ``name``; aliases resolved).
        cls: the method's dataclass.
        r: refresh ratio in [0, 1] for budgeted names, None otherwise (and for fixed-budget names).
        params: the parameters the spec sets, typed, as the constructed method holds them (defaults
            dropped where the family says so).
        fixed_r: the budget a fixed-budget name runs at (None for others).
        selector_cls: the selector's dataclass of a composed spec (``name`` is then ``<storage>+<selector>``
            and ``params`` holds both methods' parameters), None otherwise.
    """

    family: str
    name: str
    cls: type
    r: float | None = None
    params: dict = field(default_factory=dict)
    fixed_r: float | None = None
    selector_cls: type | None = None

    @property
    def policy(self) -> str:
        """The refresh policy's name (same as :attr:`name`; the CONDUIT side's word)."""
        return self.name

    @property
    def effective_r(self) -> float:
        """The ratio a refresh policy runs at (0 for ``reuse``, 1 for ``full``).

        Raises:
            ValueError: the spec has no budget (a press).
        """
        r = self.fixed_r if self.r is None else self.r
        if r is None:
            raise ValueError(f"{self.canonical!r} has no refresh budget r")
        return r

    @property
    def canonical(self) -> str:
        """One string per distinct run (module docstring)."""
        out = self.name + ("" if self.r is None else f"@{fmt(self.r)}")
        if self.params:
            out += ":" + ",".join(f"{k}={fmt(v)}" for k, v in sorted(self.params.items()))
        return out

    @property
    def slug(self) -> str:
        """Run-directory name of :attr:`canonical`: ``conduit@0.1:lam=0.5`` -> ``conduit_r0.1_lam-0.5``,
        ``residualkv:full_layers=0+1`` -> ``residualkv_full_layers-0.1``.

        Raises:
            ValueError: characters outside ``[A-Za-z0-9._-]`` remain (e.g. a word value with a space).
        """
        out = (self.canonical.replace("@", "_r").replace(":", "_").replace(",", "_").replace("=", "-")
               .replace("+", "."))
        if not _SLUG.fullmatch(out):
            raise ValueError(f"method spec {self.canonical!r} gives the path component {out!r}, which has "
                             "characters outside [A-Za-z0-9._-]")
        return out

    def build(self, **resources: Any) -> Any:
        """A new instance of the method with these parameters and ``resources`` (e.g. ``codec_dir``); a
        composed spec builds its selector first and gives it to the storage as ``selector``."""
        if self.selector_cls is None:
            return self.cls(**self.params, **resources)
        own, sel = _split(self.cls, self.selector_cls, self.params)
        return self.cls(**own, selector=self.selector_cls(**sel), **resources)


def _split(storage: type, selector: type, params: dict) -> tuple[dict, dict]:
    """``params`` of a composed spec as (storage's, selector's), by field name."""
    own = {f.name for f in dataclasses.fields(storage)}
    return ({k: v for k, v in params.items() if k in own}, {k: v for k, v in params.items() if k not in own})


def fmt(v: Any) -> str:
    """A value as the grammar writes it (``true``, ``none``, ``0.1``, ``2+3+4``)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "none"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "+".join(fmt(x) for x in v)
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


def is_int(v: Any) -> bool:
    """Whether ``v`` is an integer and not a bool (YAML's and JSON's ``true`` is no count)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def typed(spec: str, key: str, value: Any, f: dataclasses.Field) -> Any:
    """``value`` checked against field ``f``'s annotation (a string under ``from __future__ import annotations``).

    bool fields take ``true``/``false`` only (``use_v_norm=no`` once became the string "no", which the
    policy read as True: the ablation silently ran as default CONDUIT); numbers take numbers, and a float
    field holds a float (``keep=1`` is ``keep=1.0``: one canonical form, so one run); words take
    words; layer lists (``list[int]``, ``tuple[int, ...]``) take indices >= 0 joined by ``+`` (one index
    is a list of one); ``none`` only where the annotation allows None.

    Raises:
        ValueError: naming the spec, the key, the value and what was expected.
    """
    ann = str(f.type).replace(" ", "")
    kinds = [a for a in ann.split("|") if a != "None"]
    if value is None:
        if len(kinds) < len(ann.split("|")) or f.default is None:
            return None
        raise ValueError(f"method spec {spec!r}: {key} cannot be none (expected {ann})")
    kind = kinds[0] if kinds else "Any"
    if kind == "bool" and not isinstance(value, bool):
        raise ValueError(f"method spec {spec!r}: {key} must be true or false, got {value!r}")
    if kind == "int" and not is_int(value):
        raise ValueError(f"method spec {spec!r}: {key} must be an integer, got {value!r}")
    if kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))
                            or not math.isfinite(value)):
        raise ValueError(f"method spec {spec!r}: {key} must be a number, got {value!r}")
    if kind == "float":
        return float(value)   # keep=1 and keep=1.0 are one run (one canonical form)
    if kind == "str" and not isinstance(value, str):
        raise ValueError(f"method spec {spec!r}: {key} must be a word, got {value!r}")
    if kind in ("list[int]", "tuple[int,...]"):
        items = [value] if is_int(value) else value
        if not isinstance(items, list) or not all(is_int(x) and x >= 0 for x in items):
            raise ValueError(f"method spec {spec!r}: {key} must be layer indices >= 0 joined by '+' "
                             f"(e.g. {key}=2+3+4), got {value!r}")
        return tuple(items) if kind.startswith("tuple") else list(items)
    return value


def _find(name: str, families: tuple[Family, ...]) -> Family | None:
    return next((fam for fam in families if name in fam.classes), None)


def parse(spec: str, *families: Family) -> MethodSpec:
    """Parse and validate ``spec`` as a method of the first of ``families`` that has its name (no model needed).

    Raises:
        ValueError: naming the spec: malformed, unknown name (listing the known ones), a budget where
            none is taken or none where one is needed, r outside [0, 1], an unknown or repeated
            parameter, a value of the wrong type, or a value the method's own checks refuse.
    """
    if not isinstance(spec, str):
        raise ValueError(f"method spec must be a string, got {spec!r}")  # noqa: TRY004 (one error type for bad specs)
    m = _SPEC.match(spec.strip())
    if m is None:
        raise ValueError(f"method spec {spec!r} is malformed; expected <name>[+<selector>][@<r>][:key=value,...] "
                         "(at most one selector), e.g. conduit@0.1:lam=0.5, snapkv:keep=0.3 or "
                         "residualkv+omnikv:full_layers=0+1,keep=0.2")
    fam = _find(m["name"], families)
    if fam is None:
        known = "; ".join(f"{f.name}: {sorted(f.classes)}" for f in families)
        raise ValueError(f"unknown method {m['name']!r} in spec {spec!r}; known methods ({known})")
    cls = fam.classes[m["name"]]
    name = cls.name
    sel_cls = None if m["selector"] is None else _selector(spec, fam, cls, m["selector"])
    fixed = fam.fixed_r.get(name)
    r = _budget(spec, fam, name, fixed, m["r"])
    fields = fam.parameters(cls)
    if sel_cls is not None:
        name = f"{name}+{sel_cls.name}"
        fields = fields | fam.parameters(sel_cls)
    params = _params(spec, fields, name, m["params"], cls)
    owned = [k for k in getattr(cls, "storage_owns", {}).get(getattr(sel_cls, "name", None), ()) if k in params]
    if owned:
        raise ValueError(f"method spec {spec!r}: {name!r} takes {owned} from the storage {cls.name!r}; drop them")
    try:
        if sel_cls is None:
            method, sel = cls(**params), None
        else:
            own, theirs = _split(cls, sel_cls, params)
            sel = sel_cls(**theirs)
            method = cls(**own, selector=sel)
    except (TypeError, ValueError) as e:
        raise ValueError(f"method spec {spec!r}: {e}") from None
    own_fields = _field_names(cls)
    held = {k: getattr(method if k in own_fields else sel, k) for k in params}
    if fam.drops_defaults:
        held = {k: v for k, v in held.items() if v != fields[k].default}
    return MethodSpec(family=fam.name, name=name, cls=cls, r=r, params=held, fixed_r=fixed, selector_cls=sel_cls)


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _selector(spec: str, fam: Family, cls: type, text: str) -> type:
    """The selector class ``text`` of a composed spec whose storage is ``cls``.

    Raises:
        ValueError: ``cls`` takes no selector, or not this one (listing those it takes), or the two
            classes share a parameter name (a spec could not say whose it is).
    """
    takes = tuple(getattr(cls, "selectors", ()))
    sel = fam.classes.get(text)
    if sel is None or sel.name not in takes:
        what = f"takes the selectors {list(takes)}" if takes else "takes no selector"
        raise ValueError(f"method spec {spec!r}: {cls.name!r} {what}, not {text!r}")
    own, other = fam.parameters(cls), fam.parameters(sel)
    # a field both inherit from the family's base class (a press's `protocol`) is the run's: the storage holds it
    shared = {n for n in own.keys() & other.keys() if own[n] is not other[n]}
    if shared:
        raise ValueError(f"method spec {spec!r}: {cls.name!r} and {sel.name!r} both have the parameter(s) "
                         f"{sorted(shared)}, so the spec cannot say whose they are")
    return sel


def _budget(spec: str, fam: Family, name: str, fixed: float | None, text: str | None) -> float | None:
    if text is None:
        if fam.budgeted and fixed is None:
            raise ValueError(f"method spec {spec!r}: {name!r} needs a budget, e.g. {name}@0.1 (r in [0, 1])")
        return None
    if fixed is not None:
        raise ValueError(f"method spec {spec!r}: {name!r} runs at r = {fixed:g} by definition; drop '@{text}' "
                         f"(conduit@{text} is the budgeted form)")
    if not fam.budgeted:
        raise ValueError(f"method spec {spec!r}: {name!r} takes no budget '@{text}' (a {fam.name} method)")
    try:
        r = float(text)
    except ValueError:
        r = math.nan
    if not 0.0 <= r <= 1.0:
        raise ValueError(f"method spec {spec!r}: r must be a refresh ratio in [0, 1] (fraction of visual "
                         f"tokens), got {text!r}")
    return r


def _params(spec: str, fields: dict[str, dataclasses.Field], name: str, text: str | None,
            cls: type | None = None) -> dict[str, Any]:
    if text is None:
        return {}
    params: dict[str, Any] = {}
    for item in text.split(","):
        key, sep, val = item.partition("=")
        key = key.strip()
        if not sep or not key or not val.strip():
            raise ValueError(f"method spec {spec!r}: parameter {item!r} is not key=value")
        if key not in fields:
            takes = getattr(cls, "selectors", ()) if "+" not in name else ()
            hint = ("; a selector is named with the method: " + ", ".join(f"{name}+{t}:..." for t in takes)
                    if takes else "")
            raise ValueError(f"method spec {spec!r}: unknown parameter {key!r} for {name!r}; "
                             f"accepted: {sorted(fields) or 'none'}{hint}")
        if key in params:
            raise ValueError(f"method spec {spec!r}: parameter {key!r} given twice")
        params[key] = typed(spec, key, _value(val.strip()), fields[key])
    return params


def slugs(specs: list[MethodSpec]) -> dict[str, str]:
    """``{slug: canonical spec}`` of ``specs``.

    Raises:
        ValueError: two distinct canonical specs share a slug.
    """
    out: dict[str, str] = {}
    for s in specs:
        c, k = s.canonical, s.slug
        if out.get(k, c) != c:
            raise ValueError(f"method specs {out[k]!r} and {c!r} map to the same run directory {k!r}")
        out[k] = c
    return out
