"""Training-time attention mask: the question side reaches the prompt text only through the pages.

Why (issue #3, item 9; docs/decisions/zoo.md, "Per-cell reading term and hidden prompt"): trained on
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

Stale-page records (``Phase.stale_pages``, :func:`stale_page_block`): a second, decoy
instruction follows the true one in the system prompt; the pages see only the true
one and the question side only the decoy, and the answer is the true instruction's.
Why: a 24-layer model trained with the mask alone still answered under reuse as under
full prefill (it read the serving instruction from the prompt text through attention
that training had always hidden), so the strong regime was lost at depth
(docs/decisions/zoo.md, "Two staleness regimes"). A decoy the
question side can see but must not follow makes that path useless in training, as it
is useless to a model whose pages carry the instruction.
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
    """SDPA with ``_block["mask"]`` (bool ``[B, T, T]``, True = may not attend; query rows, key columns)
    removed from the decoder's mask."""
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


def stale_page_block(input_ids: torch.Tensor, image_token_id: int, mode: str, decoy: torch.Tensor) -> torch.Tensor:
    """The hidden pairs of one stale-page record: the question side as in ``mode`` but seeing the decoy, the pages
    (first to last visual token, with the text between them) not seeing it.

    Args:
        input_ids: int64 ``[T]``.
        image_token_id: the visual placeholder token.
        mode: ``"prefix"`` or ``"text"`` (:func:`hidden_keys`).
        decoy: bool ``[T]``, the decoy instruction's tokens (before the first visual token).

    Returns:
        bool ``[T, T]``, True where query row t may not attend to key column s.

    Raises:
        ValueError: ``mode`` is ``""`` or unknown, or ``decoy`` is empty, misshaped or not before the first
            visual token.
    """
    if mode not in MODES or not mode:
        raise ValueError(f"stale pages need hide_prompt 'prefix' or 'text', got {mode!r}")
    if decoy.shape != input_ids.shape or decoy.dtype != torch.bool or not decoy.any():
        raise ValueError(f"decoy must be a non-empty bool mask of shape {tuple(input_ids.shape)}, "
                         f"got {decoy.dtype} {tuple(decoy.shape)} with {int(decoy.sum())} tokens")
    queries, keys = hidden_keys(input_ids, image_token_id, mode)
    visual = (input_ids == image_token_id).nonzero()[:, 0]
    first, last = int(visual[0]), int(visual[-1])
    if int(decoy.nonzero()[-1]) >= first:
        raise ValueError("the decoy instruction must come before the first visual token")
    pages = torch.zeros_like(queries)
    pages[first:last + 1] = True
    return (queries[:, None] & (keys & ~decoy)[None, :]) | (pages[:, None] & decoy[None, :])


@contextmanager
def hide_prompt(model: Any, block: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Iterator[None]:
    """Within the block, ``model``'s decoder attention hides the pairs of ``block`` (bool ``[B, T, T]``, True where
    query row t may not attend to key column s: :func:`hidden_keys` as ``queries[:, None] & keys[None, :]``, or
    :func:`stale_page_block`).

    ``attention_mask`` (``[B, T]``, 0 at padding) is applied too, whatever mask transformers
    builds for a custom attention implementation. Restores the implementation on exit.
    """
    old = model.config._attn_implementation
    _block["mask"] = block
    _block["keys_valid"] = (torch.ones(block.shape[:2], dtype=torch.bool, device=block.device)
                            if attention_mask is None else attention_mask.bool())
    model.set_attn_implementation(ATTN_NAME)
    try:
        yield
    finally:
        _block.clear()
        model.set_attn_implementation(old)
