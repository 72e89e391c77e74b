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

#: Default layers of the supervised heads: ``(previous-token head's layer, induction head's layer)``
#: (:attr:`kvbench.train.recipes.Phase.head_layers` sets others).
HEAD_LAYERS = (0, 1)
#: ``(layer, query head)`` supervised to attend to the previous position (at the default layers).
PREVIOUS_TOKEN_HEAD = (HEAD_LAYERS[0], 0)
#: ``(layer, query head)`` supervised to attend to the position after the latest earlier
#: occurrence of the current token (the induction pattern ``[.. a b .. a] -> b``).
INDUCTION_HEAD = (HEAD_LAYERS[1], 0)
#: ``(layer, query head)`` optionally supervised to attend to the position after the latest earlier occurrence of
#: the *previous* token (``[.. a b .. a x] -> b``; :func:`skip_targets`): head 1 of the induction head's layer.
SKIP_HEAD = (HEAD_LAYERS[1], 1)
ATTN_NAME = "kvbench_head_supervision"

_watch: dict[int, tuple[int, ...]] = {}
_captured: dict[tuple[int, int], torch.Tensor] = {}
#: the heads :func:`supervise_heads` watches now: ``{"previous": (layer, head), "induction": ..., "skip": ...}``
_heads: dict[str, tuple[int, int]] = {}


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
def supervise_heads(model: Any, skip: bool = False, layers: tuple[int, int] = HEAD_LAYERS) -> Iterator[None]:
    """Within the block, forward passes of ``model`` capture the supervised heads' attention: query head 0 of
    ``layers[0]`` (previous token) and of ``layers[1]`` (induction), with ``skip`` also head 1 of ``layers[1]``.

    Restores the model's attention implementation on exit (the saved
    checkpoint keeps SDPA).

    Raises:
        ValueError: ``layers`` not two layer indices of the model with the previous-token head's before the
            induction head's (the induction head reads what the previous-token head wrote).
    """
    n = model.config.get_text_config().num_hidden_layers
    prev, ind = (int(x) for x in layers)
    if not 0 <= prev < ind < n:
        raise ValueError(f"head_layers must be (previous-token layer, induction layer) with 0 <= previous < induction "
                         f"< {n} (the model's layers), got {tuple(layers)}")
    old = model.config._attn_implementation
    _watch.clear()
    _heads.clear()
    _heads.update(previous=(prev, 0), induction=(ind, 0), **({"skip": (ind, 1)} if skip else {}))
    for layer, head in _heads.values():
        _watch[layer] = _watch.get(layer, ()) + (head,)
    model.set_attn_implementation(ATTN_NAME)
    try:
        yield
    finally:
        _watch.clear()
        _captured.clear()
        _heads.clear()
        model.set_attn_implementation(old)


def head_supervision_loss(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean NLL of the supervised heads' attention on their targets, after a forward pass.

    Args:
        input_ids: int64 ``[B, T]`` of that forward pass.
        attention_mask: ``[B, T]``, 0 at padding (padded positions get no target).

    Raises:
        RuntimeError: no forward pass ran inside :func:`supervise_heads`.
    """
    if not _heads:
        raise RuntimeError("head_supervision_loss needs a forward pass inside supervise_heads(model)")
    return _nll({_heads["previous"]: previous_token_targets(input_ids), _heads["induction"]: induction_targets(input_ids)},
                attention_mask, "head_supervision_loss")


def skip_supervision_loss(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean NLL of :data:`SKIP_HEAD`'s attention on :func:`skip_targets`, after a forward pass inside
    ``supervise_heads(model, skip=True)`` (arguments and errors as :func:`head_supervision_loss`)."""
    if "skip" not in _heads:
        raise RuntimeError("skip_supervision_loss needs a forward pass inside supervise_heads(model, skip=True)")
    return _nll({_heads["skip"]: skip_targets(input_ids)}, attention_mask, "skip_supervision_loss")


def _nll(targets: dict[tuple[int, int], torch.Tensor], attention_mask: torch.Tensor, caller: str) -> torch.Tensor:
    if not all(head in _captured for head in targets):
        raise RuntimeError(f"{caller} needs a forward pass inside supervise_heads(model"
                           f"{', skip=True' if 'skip' in _heads and _heads['skip'] in targets else ''})")
    loss = torch.zeros(())
    for head, target in targets.items():
        logp = _captured.pop(head)
        valid = (target >= 0) & (attention_mask > 0)
        if valid.any():
            loss = loss + F.nll_loss(logp[valid], target[valid])
    return loss
