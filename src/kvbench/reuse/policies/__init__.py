"""Refresh policies, one small module each, registered by name (see :func:`available_policies`).

Every module of this package is imported here, so a new policy is one file: a :class:`RefreshPolicy`
dataclass decorated with :func:`register` (docs/architecture.md, "Adding a refresh policy").
"""
import importlib
import pkgutil

from kvbench.reuse.policies.base import (
    REFRESH,
    REGISTRY,
    RefreshPlan,
    RefreshPolicy,
    RefreshResult,
    available_policies,
    get_policy,
    refresh,
    register,
    run_record,
)

# Registration happens when a policy's module is imported; modules starting with "_" are helpers.
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if not _module.startswith("_") and _module != "base":
        importlib.import_module(f"{__name__}.{_module}")

__all__ = ["REFRESH", "REGISTRY", "RefreshPlan", "RefreshPolicy", "RefreshResult", "available_policies", "get_policy",
           "refresh", "register", "run_record"]
