"""Attention supervision of two heads: a previous-token head and an induction head (and optionally a skip head).

Why: a zoo LM (8 layers, d=128) trained on random-offset copy sat on the
induction plateau for the whole CPU budget (docs/log.md, "2026-11-30 LM
recipe: attention supervision": 2-3% copy accuracy after 430-500 steps, kv retrieval at chance), and
every long-context retrieval task needs that circuit. The two-head induction
mechanism (Olsson et al., 2022, "In-context learning and induction heads";
Bietti et al., 2023, "Birth of a transformer") forms slowly because neither
head gets a gradient before the other exists. Supervising where the two heads
attend breaks that deadlock: with it the copy task passed 60% after 590 steps
on one CPU thread (same recipe without it: 0.5% at 240 steps and rising slowly).
Only the attention pattern is supervised; what the heads write (their OV
circuits) and every other weight are learned from the task loss alone.

The log-attention of the watched heads is captured by an attention function
registered with transformers' ``AttentionInterface`` that runs SDPA for the
actual output, so the model's forward pass is unchanged.

The optional *skip* head (:data:`SKIP_HEAD`) is the induction lookup keyed by the token before the current
one (``[.. a b .. a x] -> b``): the lookup of the chain-pairs task (:func:`kvbench.data.chain.sample_chain_pairs`),
where two chains are written in alternation, so the variable to continue is the one written two tokens back. It
shares the induction head's key/value group (GQA), whose keys already hold the previous token: only the query
differs (the previous token instead of the current one).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

#: ``(layer, query head)`` supervised to attend to the previous position.
PREVIOUS_TOKEN_HEAD = (0, 0)
#: ``(layer, query head)`` supervised to attend to the position after the latest earlier
#: occurrence of the current token (the induction pattern ``[.. a b .. a] -> b``).
INDUCTION_HEAD = (1, 0)
#: ``(layer, query head)`` optionally supervised to attend to the position after the latest earlier occurrence of
#: the *previous* token (``[.. a b .. a x] -> b``; :func:`skip_targets`).
SKIP_HEAD = (1, 1)
ATTN_NAME = "kvbench_head_supervision"

_watch: dict[int, tuple[int, ...]] = {}
_captured: dict[tuple[int, int], torch.Tensor] = {}


def _supervised_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """SDPA, plus the causal log-attention ``[B, T, T]`` (float32) of each watched head of this layer."""
    layer = getattr(module, "layer_idx", -1)
    for head in _watch.get(layer, ()):
        q, k = query[:, head], key[:, head // (query.shape[1] // key.shape[1])]  # GQA: the head's KV group
        scores = (q @ k.transpose(1, 2)).float() * kwargs.get("scaling", q.shape[-1] ** -0.5)
        T = scores.shape[-1]
        future = torch.ones(T, T, dtype=torch.bool, device=scores.device).triu(1)
        _captured[layer, head] = torch.log_softmax(scores.masked_fill(future, float("-inf")), -1)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(ATTN_NAME, _supervised_attention)


def previous_token_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """int64 ``[B, T]``: ``t - 1`` at position ``t`` (``-1`` at position 0: no target)."""
    B, T = input_ids.shape
    return (torch.arange(T) - 1).expand(B, T).clone()


def induction_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """int64 ``[B, T]``: ``i + 1`` for the latest ``i < t`` with ``input_ids[i] == input_ids[t]``, else ``-1``."""
    out = torch.full(input_ids.shape, -1, dtype=torch.long)
    for b, row in enumerate(input_ids.tolist()):
        last: dict[int, int] = {}
        for t, tok in enumerate(row):
            if tok in last:
                out[b, t] = last[tok] + 1
            last[tok] = t
    return out


def skip_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """int64 ``[B, T]``: ``i + 1`` for the latest ``i < t - 1`` with ``input_ids[i] == input_ids[t - 1]``, else ``-1``
    (the induction target of the token before ``t``: what a two-back lookup reads)."""
    out = torch.full(input_ids.shape, -1, dtype=torch.long)
    for b, row in enumerate(input_ids.tolist()):
        last: dict[int, int] = {}
        for t in range(1, len(row)):
            prev = row[t - 1]
            if prev in last:
                out[b, t] = last[prev] + 1
            last[prev] = t - 1
    return out


@contextmanager
def supervise_heads(model: Any, skip: bool = False) -> Iterator[None]:
    """Within the block, forward passes of ``model`` capture the supervised heads' attention (with ``skip``, also
    :data:`SKIP_HEAD`'s).

    Restores the model's attention implementation on exit (the saved
    checkpoint keeps SDPA).
    """
    old = model.config._attn_implementation
    _watch.clear()
    for layer, head in (PREVIOUS_TOKEN_HEAD, INDUCTION_HEAD) + ((SKIP_HEAD,) if skip else ()):
        _watch[layer] = _watch.get(layer, ()) + (head,)
    model.set_attn_implementation(ATTN_NAME)
    try:
        yield
    finally:
        _watch.clear()
        _captured.clear()
        model.set_attn_implementation(old)


def head_supervision_loss(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean NLL of the supervised heads' attention on their targets, after a forward pass.

    Args:
        input_ids: int64 ``[B, T]`` of that forward pass.
        attention_mask: ``[B, T]``, 0 at padding (padded positions get no target).

    Raises:
        RuntimeError: no forward pass ran inside :func:`supervise_heads`.
    """
    return _nll({PREVIOUS_TOKEN_HEAD: previous_token_targets(input_ids), INDUCTION_HEAD: induction_targets(input_ids)},
                attention_mask, "head_supervision_loss")


def skip_supervision_loss(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean NLL of :data:`SKIP_HEAD`'s attention on :func:`skip_targets`, after a forward pass inside
    ``supervise_heads(model, skip=True)`` (arguments and errors as :func:`head_supervision_loss`)."""
    return _nll({SKIP_HEAD: skip_targets(input_ids)}, attention_mask, "skip_supervision_loss")


def _nll(targets: dict[tuple[int, int], torch.Tensor], attention_mask: torch.Tensor, caller: str) -> torch.Tensor:
    if not all(head in _captured for head in targets):
        raise RuntimeError(f"{caller} needs a forward pass inside supervise_heads(model"
                           f"{', skip=True' if SKIP_HEAD in targets else ''})")
    loss = torch.zeros(())
    for head, target in targets.items():
        logp = _captured.pop(head)
        valid = (target >= 0) & (attention_mask > 0)
        if valid.any():
            loss = loss + F.nll_loss(logp[valid], target[valid])
    return loss
