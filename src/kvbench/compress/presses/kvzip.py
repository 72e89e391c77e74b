"""KVzip: query-agnostic eviction scored by how much a context-reconstruction pass attends each KV pair.

After the context prefill, the model is teacher-forced on "repeat the previous context" followed by the
context itself, reading the cached context. Each cached KV pair's score is the maximum softmax attention
it receives from the reconstruction queries (max over query positions and over the KV head's GQA group);
the pass writes nothing to the cache. Then the lowest-scoring pairs are evicted before the question.

Based on KVzip (Kim et al. 2025, https://arxiv.org/abs/2505.23416, §3.2-3.3); original repo
``snu-mllab/KVzip`` (``model/wrapper.py`` ``self_task``/``scoring``, ``attention/score.py``
``_get_score``/``_threshold``), read for facts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench.compress.cache import KVView, LayerContext, Press, PressCache
from kvbench.compress.presses.eviction import EvictingLayer, budget, check_keep, topk_mask

LEVELS = ("pair", "pair-uniform")


def reconstruction_scores(query: torch.Tensor, chunk_keys: torch.Tensor, repeat_keys: torch.Tensor) -> torch.Tensor:
    """KVzip's score of cached keys from one reconstruction chunk (``attention/score.py`` ``_get_score``).

    Args:
        query: post-RoPE reconstruction queries ``[1, H_q, r, D]``.
        chunk_keys: the cached context keys being scored ``[1, H_kv, c, D]`` (the chunk the pass repeats).
        repeat_keys: the reconstruction tokens' own keys ``[1, H_kv, r, D]`` (causal among themselves).

    Returns:
        float32 ``[1, H_kv, c]``: max over query positions and the GQA group of the softmax attention
        (scale ``1/sqrt(D)``) over ``[chunk_keys, repeat_keys]``. As the original, the softmax sees only
        the scored chunk and the repeat tokens (no system prompt here, so no sink keys); it runs in float32
        where the original uses the model dtype. The shapes (from the press's own scoring pass) are asserted.
    """
    _, h_q, r, d = query.shape
    h_kv, c = chunk_keys.shape[1], chunk_keys.shape[2]
    assert query.shape[0] == 1 and h_q % h_kv == 0, f"query {tuple(query.shape)}, {h_kv} KV heads"
    assert chunk_keys.shape[-1] == d and repeat_keys.shape == (1, h_kv, r, d), f"repeat keys {tuple(repeat_keys.shape)}"
    keys = torch.cat([chunk_keys, repeat_keys], -2).float()
    # One batched matmul per KV head over its (group x position) query rows: no broadcast copies.
    q = query.float().reshape(1, h_kv, (h_q // h_kv) * r, d)
    logits = (q @ keys.transpose(-1, -2)).mul_(1 / math.sqrt(d))                   # [1, H_kv, g·r, c + r]
    future = torch.arange(r, device=q.device).view(1, -1) > torch.arange(r, device=q.device).view(-1, 1)
    logits.view(1, h_kv, -1, r, c + r)[..., c:].masked_fill_(future, float("-inf"))
    return logits.softmax(-1)[..., :c].amax(dim=2)


class KVzipLayer(EvictingLayer):
    """Stores every token; during the reconstruction pass (``scoring`` set) it scores the cached context
    instead of storing the pass's tokens."""

    def __init__(self, ctx: LayerContext, cache: PressCache):
        super().__init__(ctx, cache)
        self.scoring: tuple[int, int] | None = None   # [start, end) of the context chunk being repeated
        self.score: torch.Tensor | None = None        # float32 [1, H_kv, T]

    def commit(self, chunk: KVView, query: torch.Tensor) -> None:
        """Outside scoring: append ``chunk``. In scoring: record :func:`reconstruction_scores` of the
        cached tokens ``[start, end)`` and drop ``chunk`` (the cache is left as it was)."""
        if self.scoring is None:
            super().commit(chunk, query)
            return
        start, end = self.scoring
        self.score[..., start:end] = reconstruction_scores(query, self._stored.keys[:, :, start:end], chunk.keys)


@dataclass
class KVzipPress(Press):
    """KVzip (https://arxiv.org/abs/2505.23416): context-reconstruction scoring, then keep the top ``ratio``
    of the context's KV pairs.

    Reconstruction input per context chunk of ``chunk_size`` tokens (original ``self_task``): ``prompt``
    (later chunks: ``continue_prompt`` + the previous chunk's last ``overlap`` tokens), then ``suffix``,
    then the chunk, at positions after the context. The original's suffix is the chat template's
    assistant header; kvbench prompts without a chat template, so the default is ``"\\n"`` (kvpress's
    choice for template-less models).

    Parameters
    ----------
    ratio : float, default 0.3 — share of the context's KV pairs kept (KVzip / ResidualKV configs).
    level : str, default "pair" — "pair": one threshold over all layers, KV heads and tokens (the
        original default, non-uniform budgets); "pair-uniform": ``round(ratio · T)`` per KV head.
    chunk_size : int, default 2000 — reconstruction chunk (original ``self_task``).
    overlap : int, default 8 — previous-chunk tokens quoted in ``continue_prompt``.
    prompt, continue_prompt, suffix : str — the original repo's repeat prompts; see above for suffix.
    tokenizer : optional — encodes the prompts (``encode(text, add_special_tokens=False)``); None loads
        ``AutoTokenizer.from_pretrained(model.config.name_or_path)`` at scoring time.

    Raises ValueError for ``ratio`` outside (0, 1], an unknown level, ``chunk_size < 1`` or ``overlap < 0``.
    """

    name = "kvzip"
    serves = ("text",)   # its context pass re-reads the context from token ids, which cannot carry images
    exact = {"ratio": 1.0}
    context_pass = True   # query-agnostic: the reconstruction pass scores the context before the question exists
    ratio: float = 0.3
    level: str = "pair"
    chunk_size: int = 2000
    overlap: int = 8
    prompt: str = "\n\nRepeat the previous context exactly."
    continue_prompt: str = "\n\nRepeat the part of the previous context exactly, starting with "
    suffix: str = "\n"
    tokenizer: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_keep("ratio", self.ratio)
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {self.level!r}")
        if self.chunk_size < 1 or self.overlap < 0:
            raise ValueError(f"chunk_size must be >= 1 and overlap >= 0, got {self.chunk_size}, {self.overlap}")

    def make_layer(self, ctx: LayerContext, cache: PressCache) -> KVzipLayer:
        """A :class:`KVzipLayer`."""
        return KVzipLayer(ctx, cache)

    def repeat_inputs(self, tok: Any, context_ids: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
        """``(start, end, ids [1, r])`` per context chunk: the reconstruction input that repeats
        ``context_ids[:, start:end]`` (``context_ids`` int64 ``[1, T]``)."""
        def enc(text: str) -> torch.Tensor:
            return torch.tensor([list(tok.encode(text, add_special_tokens=False))], dtype=torch.int64)

        out = []
        suffix = enc(self.suffix)
        for start in range(0, context_ids.shape[1], self.chunk_size):
            end = min(start + self.chunk_size, context_ids.shape[1])
            head = enc(self.prompt) if start == 0 else torch.cat(
                [enc(self.continue_prompt), context_ids[:, max(0, start - self.overlap):start].cpu()], 1)
            out.append((start, end, torch.cat([head, suffix, context_ids[:, start:end].cpu()], 1)))
        return out

    @torch.no_grad()
    def after_context(self, model: Any, cache: PressCache, context_ids: torch.Tensor) -> None:
        """Score the cached context by reconstruction (KVzip §3.2) and evict all but the top ``ratio``
        (§3.3). Call inside :func:`~kvbench.compress.cache.press_attention` with ``context_ids`` int64
        ``[1, T]`` just prefilled; ``cache.attended`` is left without the scoring pass's entries.
        ``ratio = 1`` keeps everything and skips the pass."""
        if self.ratio == 1.0:
            return
        layers: list[KVzipLayer] = list(cache.layers)
        n_ctx = context_ids.shape[1]
        tok = self.tokenizer
        if tok is None:
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(model.config.name_or_path)
        for layer in layers:
            layer.score = torch.zeros(layer._stored.positions.shape, dtype=torch.float32,
                                      device=layer._stored.keys.device)
        n_steps = len(cache.attended)
        try:
            for start, end, ids in self.repeat_inputs(tok, context_ids):
                for layer in layers:
                    layer.scoring = (start, end)
                positions = torch.arange(n_ctx, n_ctx + ids.shape[1]).view(1, -1)
                model(input_ids=ids.to(model.device), position_ids=positions.to(model.device), cache=cache,
                      use_cache=True, logits_to_keep=1)
                for layer in layers:                 # the pass wrote nothing: rewind the logical length
                    layer.seen = n_ctx
        finally:
            for layer in layers:
                layer.scoring = None
            del cache.attended[n_steps:]
        scores = torch.stack([layer.score for layer in layers])                    # [L, 1, H_kv, T]
        if self.level == "pair":
            keep = topk_mask(scores.flatten(), budget(self.ratio, scores.numel())).view(scores.shape)
        else:
            keep = topk_mask(scores, budget(self.ratio, n_ctx))
        for layer, mask in zip(layers, keep):
            layer.evict(mask)
            layer.score = None

    def kept_target(self, n_context: int, n_tokens: int, n_layers: int) -> float | None:
        """(kept context pairs per layer and head + tokens after the context) / ``n_tokens``: ``round(ratio · T)``
        per head for "pair-uniform"; ``ratio · T`` for "pair" (its one threshold over all layers and heads
        rounds once over L · H_kv · T pairs, so the mean differs by at most one pair)."""
        kept = budget(self.ratio, n_context) if self.level == "pair-uniform" else self.ratio * n_context
        return (kept + n_tokens - n_context) / n_tokens

    def compute_ratio(self, n_layers: int) -> float | None:
        """``ratio``: the share of context KV pairs attended after eviction (question and decoded tokens
        add to the measured CR)."""
        return self.ratio
