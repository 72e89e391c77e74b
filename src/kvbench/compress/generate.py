"""Greedy decoding of one text record through a compressed cache.

The prompt is context + question, prefilled in one or two chunks as the press's ``protocol`` says
(:attr:`kvbench.compress.cache.Press.protocol`): ``one_pass`` (one chunk, exact; only decoding reads the
compressed cache: the authors' LongBench protocol) or ``shared_context`` (the context chunk is compressed,
then the question chunk and decoding read it: SCBench's shared-context setting). The answer is then
decoded greedily, each step reading the compressed cache. Why both: on the smoke tasks, whose answers are
a few tokens, ``one_pass`` leaves little to compress before the first answer token
(``docs/decisions.md``, "ResidualKV").
"""
from __future__ import annotations

from typing import Any

import torch

from kvbench.compress.cache import PressCache, Press, press_attention


def split_prompt(tok: Any, record: dict) -> tuple[torch.Tensor, int]:
    """Token ids ``[1, T]`` of ``context + question`` (tokenised together, as the full-cache method does)
    and the index of the first question token.

    A token that straddles the boundary (the context's trailing "." merging with the question's "\\n")
    belongs to the context chunk.

    Raises:
        ValueError: the record has no ``context``/``question`` text, or the tokenizer gives no offsets.
    """
    if not isinstance(record.get("context"), str) or not isinstance(record.get("question"), str):
        raise ValueError(f"record {record.get('id')!r}: compression runs need text 'context' and 'question' fields")
    text = record["context"] + record["question"]
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    boundary = len(record["context"])
    split = next((i for i, (start, _) in enumerate(offsets) if start >= boundary), len(ids))
    return torch.tensor([ids]), split


@torch.inference_mode()
def greedy_generate(model: Any, press: Press, ids: torch.Tensor, split: int, max_new_tokens: int,
                    eos: set[int]) -> tuple[list[int], PressCache]:
    """Prefill ``ids[:, :split]`` then ``ids[:, split:]`` through ``press``'s cache, then decode greedily.

    Args:
        ids: int64 ``[1, T]`` prompt ids; ``split``: first id of the second chunk (0 or T: one chunk; the
            caller applies the protocol, :meth:`~kvbench.compress.cache.Press.first_chunk`).
        max_new_tokens: decode budget; decoding stops after an id in ``eos`` (kept in the output).

    Returns:
        ``(new_ids, cache)``: the generated ids and the cache (for its audit: stored bytes, attended
        counts, OmniKV selections).
    """
    cache = press.new_cache(model)
    chunks = [c for c in (ids[:, :split], ids[:, split:]) if c.shape[1]]
    out: list[int] = []
    with press_attention(model, cache):
        pos = 0
        for i, chunk in enumerate(chunks):
            logits = _forward(model, cache, chunk, pos)
            pos += chunk.shape[1]
            if i == 0 and len(chunks) > 1:
                press.after_context(model, cache, chunk)
        for _ in range(max_new_tokens):
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
            if nxt in eos or len(out) == max_new_tokens:
                break
            logits = _forward(model, cache, torch.tensor([[nxt]]), pos)
            pos += 1
    return out, cache


def _forward(model: Any, cache: PressCache, ids: torch.Tensor, start: int) -> torch.Tensor:
    positions = torch.arange(start, start + ids.shape[1]).view(1, -1)
    return model(input_ids=ids.to(model.device), position_ids=positions.to(model.device), cache=cache,
                 use_cache=True).logits
