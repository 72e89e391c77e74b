"""Training-time attention mask: the question side reaches the prompt text only through the pages.

Why (issue #3, item 9; docs/decisions.md, "Per-cell reading loss"): trained on
answers alone, the zoo VLM applied the serving instruction at the answer
position and read only the raw digit from the page, so a page cached under
another prefix gave the same answer as a fresh one. During training, the
positions after the last visual token (question, answers, extra queries) are
kept from attending to the text before it, except position 0, so the
instruction can reach the answer only through the visual tokens, which read it
while the page is prefilled. At evaluation the mask is the ordinary causal one.

Modes (``Phase.hide_prompt``):
- ``"prefix"``: hide the keys before the first visual token (the serving prefix);
- ``"text"``: hide every non-visual key before the last visual token (the prefix
  and the text between pages, which could otherwise relay the instruction).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTN_NAME = "kvbench_hidden_prompt"
MODES = ("", "prefix", "text")
_block: dict[str, torch.Tensor] = {}


def _attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """SDPA with ``_block["mask"]`` (bool ``[B, T, T]``, True = may not attend) removed from the decoder's mask."""
    block = _block.get("mask")
    T = query.shape[-2]
    if block is not None and "Vision" not in type(module).__name__ and block.shape[-1] == T == key.shape[-2]:
        if attention_mask is None:
            allowed = torch.ones(T, T, dtype=torch.bool, device=query.device).tril()[None, None]
        elif attention_mask.dtype == torch.bool:
            allowed = attention_mask
        else:
            allowed = attention_mask == 0
        # transformers may pass no mask for a custom implementation; padded keys are dropped here either way
        attention_mask = allowed & ~block[:, None] & _block["keys_valid"][:, None, None, :]
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(ATTN_NAME, _attention)


def hidden_keys(input_ids: torch.Tensor, image_token_id: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Which queries may not see which keys, for one sequence.

    Args:
        input_ids: int64 ``[T]``.
        image_token_id: the visual placeholder token.
        mode: one of :data:`MODES` (``""``: nothing hidden).

    Returns:
        ``(queries, keys)``, bool ``[T]`` each: queries after the last visual
        token; keys as the mode says (never position 0).

    Raises:
        ValueError: unknown mode, or a sequence without visual tokens.
    """
    if mode not in MODES:
        raise ValueError(f"hide_prompt must be one of {MODES}, got {mode!r}")
    T = input_ids.shape[0]
    queries = torch.zeros(T, dtype=torch.bool)
    keys = torch.zeros(T, dtype=torch.bool)
    if not mode:
        return queries, keys
    visual = (input_ids == image_token_id).nonzero()[:, 0]
    if len(visual) == 0:
        raise ValueError("hide_prompt needs a sequence with visual tokens")
    first, last = int(visual[0]), int(visual[-1])
    queries[last + 1:] = True
    if mode == "prefix":
        keys[1:first] = True
    else:
        keys[1:last] = input_ids[1:last] != image_token_id
    return queries, keys


@contextmanager
def hide_prompt(model: Any, queries: torch.Tensor, keys: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> Iterator[None]:
    """Within the block, ``model``'s decoder attention hides ``keys`` from ``queries`` (bool ``[B, T]`` each).

    ``attention_mask`` (``[B, T]``, 0 at padding) is applied too, whatever mask transformers
    builds for a custom attention implementation. Restores the implementation on exit.
    """
    old = model.config._attn_implementation
    _block["mask"] = queries[:, :, None] & keys[:, None, :]
    _block["keys_valid"] = (torch.ones_like(queries) if attention_mask is None else attention_mask.bool())
    model.set_attn_implementation(ATTN_NAME)
    try:
        yield
    finally:
        _block.clear()
        model.set_attn_implementation(old)
