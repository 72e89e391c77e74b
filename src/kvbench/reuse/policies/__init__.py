"""Refresh policies, one small module each, registered by name (see :func:`available_policies`)."""
from kvbench.reuse.policies import (  # noqa: F401  (registration)
    cacheblend,
    conduit,
    full,
    kvshare,
    mpic,
    prophetkv,
    reuse,
)
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

__all__ = ["REFRESH", "REGISTRY", "RefreshPlan", "RefreshPolicy", "RefreshResult", "available_policies", "get_policy",
           "refresh", "register", "run_record"]
