"""Several queries answered from one compressed context: SCBench's multi-request (SCDQ) mode, ResidualKV Table IV.

SCBench (Li et al., arXiv 2412.10319; ``microsoft/MInference`` ``scbench/``) has two shared-context modes:

- **multi-turn** (its default): the queries of one context are asked in turn, and each turn's query and answer
  stay in the cache for the next;
- **multi-request** (``--same_context_different_query``, "SCDQ"): the context is encoded once and every query
  reads the cache *after the context* independently (``GreedySearch.test_scdq`` in ``scbench/eval_utils.py``:
  the context is prefilled by ``_encode``; each query is decoded with ``update_global_past_kv=False`` and its
  tokens dropped by ``clear_temp_kv_cache()`` before the next one).

ResidualKV's Table IV uses the SCDQ subset (ResidualKV §V-A, §V-B), so this module implements multi-request:
:func:`answer_queries` prefills the context once as its own chunk (compressed by the press, the
``shared_context`` protocol), takes a :class:`Snapshot` of every store layer, and for each query restores it,
prefills the query chunk and decodes greedily. The context is never recomputed.

Why a snapshot rather than truncating each layer back to its post-context length: a compressed store changes
more than its length after the context (ResidualKV codes the tokens that leave its raw window and may add
references; eviction stores write in place into their buffers; OmniKV's selector state lives in its layers), so
a truncation would be one method per press family. A deep copy of each layer's state, with the model's modules,
the press and the layers' shared context excluded, is one method for every press; the registry-driven test
(tests/test_multiquery.py) checks that N queries through it equal N fresh single-query runs for every press.
Cost: one copy of the post-context cache (the snapshot) held beside the live one, and a copy per query.
"""
from __future__ import annotations

import copy
import types
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.compress.cache import LayerContext, Press, PressCache, RopeTable, press_attention
from kvbench.compress.generate import forward_chunk


class Snapshot:
    """The per-request state of every layer of ``cache`` (deep copies of their attributes), restorable in place.

    Not copied (shared with the live layers, they are no per-request state), when a layer holds them as attributes
    (one level: what the stores of :mod:`kvbench.compress` hold): the model's modules (``torch.nn.Module``: a codec,
    a key norm), presses and selectors (and the objects bound methods such as ``after_commit`` are bound to), the
    layers' :class:`~kvbench.compress.cache.LayerContext` and RoPE table; nor, wherever they are referred to, the
    cache itself and the layers themselves (a layer that refers to another keeps referring to the live one). A new
    store that nests such an object deeper gets it copied (correct, only slower); the registry-driven test in
    tests/test_multiquery.py checks the result for every press.
    Restoring assigns fresh copies of the saved attributes to the same layer objects, so hooks registered by
    :meth:`~kvbench.compress.cache.StoreLayer.attach` (closures over the layer) stay valid.
    """

    def __init__(self, cache: PressCache):
        self.cache = cache
        self._keep = self._shared(cache)
        self._state = [self._copy(layer.__dict__) for layer in cache.layers]

    def _shared(self, cache: PressCache) -> dict[int, Any]:
        keep: dict[int, Any] = {id(cache): cache}
        for layer in cache.layers:
            keep[id(layer)] = layer
            for value in layer.__dict__.values():
                if isinstance(value, types.MethodType):
                    value = value.__self__
                if isinstance(value, (torch.nn.Module, Press, LayerContext, RopeTable, PressCache)):
                    keep[id(value)] = value
        return keep

    def _copy(self, state: dict) -> dict:
        return copy.deepcopy(state, dict(self._keep))

    def restore(self) -> None:
        """Put every layer back into its state at the snapshot (the saved copies stay untouched)."""
        for layer, state in zip(self.cache.layers, self._state):
            layer.__dict__.update(self._copy(state))


@dataclass
class QueryAnswer:
    """One query's greedy answer and what the cache did while answering it.

    ``new_ids``: generated ids (EOS included when reached); ``attended``: per forward of this query (its chunk,
    then each decode step), per layer, keys the last query row could read (:attr:`PressCache.attended`);
    ``n_query``: tokens of the query chunk; ``audit``: what the caller's ``audit(cache)`` returned with the cache
    as it was after this query's last step (before the next restore), else None.
    """

    new_ids: list[int]
    attended: list[list[int]]
    n_query: int
    audit: Any = None


@torch.inference_mode()
def answer_queries(model: Any, press: Press, context_ids: torch.Tensor, queries: list[torch.Tensor],
                   max_new_tokens: list[int], eos: set[int], audit: Any = None,
                   tail: int = 0) -> tuple[list[QueryAnswer], PressCache]:
    """Prefill ``context_ids`` once through ``press``'s cache, then answer each query from the post-context cache.

    Args:
        context_ids: int64 ``[1, n_context]``, n_context >= 1: the shared context (one chunk; then
            :meth:`~kvbench.compress.cache.Press.after_context`, e.g. KVzip's scoring pass).
        queries: int64 ``[1, n_q]`` each, n_q >= 1: prefilled as one chunk at positions ``n_context ..``.
        max_new_tokens: decode budget per query (>= 1 each); decoding stops after an id in ``eos`` (kept).
        audit: optional ``audit(cache) -> Any`` called after each query's last step.
        tail: each query's last ``min(tail, n_q)`` ids are fed one per step as decode steps after the rest of
            its chunk (:attr:`~kvbench.compress.cache.Press.decode_tail`); 0 feeds none.

    Returns:
        ``(answers, cache)``: one :class:`QueryAnswer` per query, in order, and the cache (as after the last query).

    Raises:
        ValueError: an empty context or query, or ``max_new_tokens`` not one positive int per query.
    """
    if context_ids.dim() != 2 or context_ids.shape[1] < 1:
        raise ValueError(f"context_ids must be [1, n_context >= 1], got {tuple(context_ids.shape)}")
    if not isinstance(tail, int) or tail < 0:
        raise ValueError(f"tail must be an int >= 0, got {tail!r}")
    if len(max_new_tokens) != len(queries) or any(int(m) < 1 for m in max_new_tokens):
        raise ValueError(f"max_new_tokens must be one positive int per query ({len(queries)}), got {max_new_tokens}")
    for i, q in enumerate(queries):
        if q.dim() != 2 or q.shape[1] < 1:
            raise ValueError(f"query {i} must be [1, n_q >= 1] token ids, got {tuple(q.shape)}")
    cache = press.new_cache(model)
    n_ctx = context_ids.shape[1]
    answers: list[QueryAnswer] = []
    with press_attention(model, cache):
        forward_chunk(model, cache, context_ids, 0)
        press.after_context(model, cache, context_ids)
        snap = Snapshot(cache)
        for i, (q, budget) in enumerate(zip(queries, max_new_tokens)):
            if i:
                snap.restore()
            first = len(cache.attended)
            head = q.shape[1] - min(tail, q.shape[1])
            if head:
                logits = forward_chunk(model, cache, q[:, :head], n_ctx)
            for j in range(head, q.shape[1]):
                logits = forward_chunk(model, cache, q[:, j:j + 1], n_ctx + j)
            pos, out = n_ctx + q.shape[1], []
            while True:
                nxt = int(logits[0, -1].argmax())
                out.append(nxt)
                if nxt in eos or len(out) == int(budget):
                    break
                logits = forward_chunk(model, cache, torch.tensor([[nxt]]), pos)
                pos += 1
            answers.append(QueryAnswer(out, [list(r) for r in cache.attended[first:]], q.shape[1],
                                       audit(cache) if audit is not None else None))
    return answers, cache
