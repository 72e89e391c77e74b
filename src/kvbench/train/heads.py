"""Attention supervision of two heads: a previous-token head and an induction head.

Why: a zoo LM (8 layers, d=128) trained on random-offset copy sat on the
induction plateau for the whole CPU budget (docs/decisions.md, "Training
status": 2-3% copy accuracy after 430-500 steps, kv retrieval at chance), and
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
ATTN_NAME = "kvbench_head_supervision"

_watch: dict[int, int] = {}
_captured: dict[int, torch.Tensor] = {}


def _supervised_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """SDPA, plus the causal log-attention ``[B, T, T]`` (float32) of the watched head of this layer."""
    head = _watch.get(getattr(module, "layer_idx", -1))
    if head is not None:
        q, k = query[:, head], key[:, head // (query.shape[1] // key.shape[1])]  # GQA: the head's KV group
        scores = (q @ k.transpose(1, 2)).float() * kwargs.get("scaling", q.shape[-1] ** -0.5)
        T = scores.shape[-1]
        future = torch.ones(T, T, dtype=torch.bool, device=scores.device).triu(1)
        _captured[module.layer_idx] = torch.log_softmax(scores.masked_fill(future, float("-inf")), -1)
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


@contextmanager
def supervise_heads(model: Any) -> Iterator[None]:
    """Within the block, forward passes of ``model`` capture the two supervised heads' attention.

    Restores the model's attention implementation on exit (the saved
    checkpoint keeps SDPA).
    """
    old = model.config._attn_implementation
    _watch.clear()
    _watch.update({PREVIOUS_TOKEN_HEAD[0]: PREVIOUS_TOKEN_HEAD[1], INDUCTION_HEAD[0]: INDUCTION_HEAD[1]})
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
    if not all(layer in _captured for layer in (PREVIOUS_TOKEN_HEAD[0], INDUCTION_HEAD[0])):
        raise RuntimeError("head_supervision_loss needs a forward pass inside supervise_heads(model)")
    loss = torch.zeros(())
    for (layer, _), targets in ((PREVIOUS_TOKEN_HEAD, previous_token_targets(input_ids)),
                                (INDUCTION_HEAD, induction_targets(input_ids))):
        logp = _captured.pop(layer)
        valid = (targets >= 0) & (attention_mask > 0)
        if valid.any():
            loss = loss + F.nll_loss(logp[valid], targets[valid])
    return loss
