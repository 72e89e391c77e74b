"""Greedy (or seeded sampled) decoding of one text record through a compressed cache.

The prompt is context + question, prefilled in one or two chunks as the press's ``protocol`` says
(:attr:`kvbench.compress.cache.Press.protocol`): ``one_pass`` (one chunk, exact; only decoding reads the
compressed cache: the authors' LongBench protocol) or ``shared_context`` (the context chunk is compressed,
then the question chunk and decoding read it: SCBench's shared-context setting). The answer is then
decoded greedily, each step reading the compressed cache. Why both: on the smoke tasks, whose answers are
a few tokens, ``one_pass`` leaves little to compress before the first answer token
(``docs/decisions/residualkv.md``, "Prompt protocols").
"""
from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of a decode (HF ``generate``'s meaning): ``temperature`` > 0 divides the logits, then
    ``top_k`` (0: off) keeps the k most likely tokens and ``top_p`` (1.0: off) the smallest set whose probability
    reaches p, and a token is drawn with torch's default generator (which the runner seeds per record,
    :func:`kvbench.eval.runner.record_seed`). ``temperature == 0`` is greedy decoding.

    ResidualKV Table V's paper profile samples, as Qwen3-Thinking models are meant to be run (their model card's
    thinking-mode settings: temperature 0.6, top-p 0.95, top-k 20); the paper states none (§V-B, Table V).

    Raises:
        ValueError: a negative temperature, ``top_p`` outside (0, 1], or a negative ``top_k``.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0: off), got {self.top_k!r}")

    def pick(self, logits: torch.Tensor) -> int:
        """The next token id from last-position ``logits`` ``[V]``: argmax when greedy, else a draw."""
        if self.temperature == 0:
            return int(logits.argmax())
        x = logits.float() / self.temperature
        if self.top_k:
            kth = torch.topk(x, min(self.top_k, x.numel())).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p < 1:
            p, order = torch.sort(x.softmax(-1), descending=True)
            drop = p.cumsum(-1) - p >= self.top_p       # tokens after the set that already reached top_p
            x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        return int(torch.multinomial(x.softmax(-1), 1))


GREEDY = Sampling()


def final_question_ids(tok: Any, record: dict) -> tuple[list[int], int] | None:
    """``(ids, max_new_tokens)`` of a record's final question (``record["final"]``: asked after the generated answer,
    :func:`kvbench.data.chain.sample_chain_pairs`), tokenised on its own as in training; None when it has none."""
    final = record.get("final")
    if not final:
        return None
    return tok(final["question"], add_special_tokens=False)["input_ids"], int(final["max_new_tokens"])


@torch.inference_mode()
def greedy_generate(model: Any, press: Press, ids: torch.Tensor, split: int, max_new_tokens: int,
                    eos: set[int], sampling: Sampling = GREEDY,
                    then: tuple[list[int], int] | None = None, tail: int = 0) -> tuple[list[int], PressCache]:
    """Prefill ``ids[:, :split]`` then ``ids[:, split:T - tail]`` through ``press``'s cache, feed the last ``tail``
    ids one per step (decode steps), then decode greedily (or as ``sampling`` says).

    Args:
        ids: int64 ``[1, T]`` prompt ids; ``split``: first id of the second chunk (0 or T: one chunk; the
            caller applies the protocol, :meth:`~kvbench.compress.cache.Press.first_chunk`).
        tail: prompt ids fed as decode steps (:attr:`~kvbench.compress.cache.Press.decode_tail`, clamped by the
            caller to the question), ``0 <= tail < T`` and ``T - tail >= split`` when ``split < T``.
        max_new_tokens: decode budget; decoding stops after an id in ``eos`` (kept in the output).
        sampling: :class:`Sampling` (default greedy).
        then: optional ``(question ids, budget)`` (:func:`final_question_ids`): after the answer, the question's
            ids are fed one per step as decode steps (so they enter the cache as generated tokens do, through the
            press's decoding-time compression), then up to ``budget`` more tokens are decoded.

    Returns:
        ``(new_ids, cache)``: the generated ids (with ``then``: answer, question ids, final answer) and the cache
        (for its audit: stored bytes, attended counts, OmniKV selections).
    """
    n = ids.shape[1]
    head = n - tail
    if not 0 <= tail < n or (split < n and split > head):
        raise ValueError(f"tail must be in [0, {n}) and leave the first chunk ({split} ids) whole, got {tail}")
    cache = press.new_cache(model)
    out: list[int] = []
    with press_attention(model, cache):
        pos = 0
        for end in sorted({c for c in (split, head) if 0 < c <= head}):
            logits = forward_chunk(model, cache, ids[:, pos:end], pos)
            if end == split < n:
                press.after_context(model, cache, ids[:, :end])
            pos = end
        for pos in range(head, n):
            logits = forward_chunk(model, cache, ids[:, pos:pos + 1], pos)
        pos = n
        pos, logits = _decode(model, cache, logits, pos, max_new_tokens, eos, sampling, out)
        if then is not None:
            question, budget = then
            for t in [out[-1]] + question[:-1]:   # the answer's last token was decoded, not yet forwarded
                forward_chunk(model, cache, torch.tensor([[t]]), pos)
                pos += 1
            out += question
            logits = forward_chunk(model, cache, torch.tensor([question[-1:]]), pos)
            _decode(model, cache, logits, pos + 1, budget, eos, sampling, out)
    return out, cache


def _decode(model: Any, cache: PressCache, logits: torch.Tensor, pos: int, budget: int, eos: set[int],
            sampling: Sampling, out: list[int]) -> tuple[int, torch.Tensor]:
    """Decode up to ``budget`` ids from ``logits`` into ``out`` (stopping after an EOS); returns the next position
    and the last logits. The last decoded id is not forwarded."""
    for i in range(budget):
        nxt = sampling.pick(logits[0, -1])
        out.append(nxt)
        if nxt in eos or i + 1 == budget:
            break
        logits = forward_chunk(model, cache, torch.tensor([[nxt]]), pos)
        pos += 1
    return pos, logits


def forward_chunk(model: Any, cache: PressCache, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Logits ``[1, t, vocab]`` of token ids ``[1, t]`` at positions ``start .. start + t - 1``, through ``cache``
    (one prefill chunk or one decode step; the caller holds :func:`press_attention`)."""
    positions = torch.arange(start, start + ids.shape[1]).view(1, -1)
    return model(input_ids=ids.to(model.device), position_ids=positions.to(model.device), cache=cache,
                 use_cache=True).logits
