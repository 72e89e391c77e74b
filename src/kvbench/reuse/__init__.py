"""CONDUIT-side KV reuse engine: per-image caches, request assembly, scoring pass, refresh executor, policies.

Pipeline (CONDUIT §3): :class:`~kvbench.reuse.cache_store.ImageKVStore` (each image prefilled alone under
the generic prefix, pre-RoPE K/V on disk) → :func:`~kvbench.reuse.assemble.prepare` (serving prefix +
re-rotated caches + question) → :func:`~kvbench.reuse.scoring.scoring_pass` (Stage I) → a policy's
:class:`~kvbench.reuse.policies.RefreshPlan` → :func:`~kvbench.reuse.executor.execute` (Phase 2).
"""
from kvbench.reuse.adapter import VLMAdapter, adapter_for
from kvbench.reuse.assemble import AssembledRequest, assemble, prepare
from kvbench.reuse.cache_store import CacheMismatchError, ImageKV, ImageKVStore
from kvbench.reuse.executor import (
    ExecResult,
    LayerSchedule,
    continuation_logprob,
    execute,
    full_prefill,
    greedy_decode,
)
from kvbench.reuse.policies import available_policies, get_policy, refresh, run_record
from kvbench.reuse.scoring import ScoringPass, scoring_pass
from kvbench.reuse.validate import budget_count, check_ratio, check_strength

__all__ = [
    "AssembledRequest", "CacheMismatchError", "ExecResult", "ImageKV", "ImageKVStore", "LayerSchedule",
    "ScoringPass", "VLMAdapter", "adapter_for", "assemble", "available_policies", "budget_count", "check_ratio",
    "check_strength", "continuation_logprob", "execute", "full_prefill", "get_policy", "greedy_decode", "prepare", "refresh",
    "run_record", "scoring_pass",
]
