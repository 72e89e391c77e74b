"""SnapKV in its decoding form: the cache is also compressed while the answer is generated (ResidualKV Table V).

After the context prefill SnapKV evicts as :class:`~kvbench.compress.presses.snapkv.SnapKVPress` does (``keep``; 1.0
keeps the prompt whole). Then, every ``interval`` decode steps, the whole cache of each layer (prompt tokens that
survived and generated tokens) is scored with SnapKV's scores over the queries of those ``interval`` steps, buffered
as they run (:func:`~kvbench.compress.presses.snapkv.snapkv_scores`: window-summed softmax attention, pooled along
tokens, averaged over each KV head's query group), and each KV head keeps its ``target_size`` best tokens; the
buffered steps' own tokens score +inf (SnapKV keeps its observation window), so ``target_size >= interval``. Between
two compressions the cache holds at most ``target_size + interval - 1`` tokens.

The form is kvpress's ``DecodingPress`` (NVIDIA/kvpress, ``kvpress/presses/generation/decoding_press.py`` at
173dd743): it acts at decode steps only, buffers the recent decode steps per layer, every ``compression_steps``
(default 10) steps scores the whole cache with its scorer over that buffer and keeps ``token_buffer_size`` (default
1,024) tokens, then clears the buffer; ``PrefillDecodingPress`` pairs it with a prefill press, as ``keep`` does here.
Differences, stated: kvpress buffers hidden states and lets its scorer recompute what it needs (its docstring lists
SnapKV among the presses that do not work there, for want of position embeddings at decode time); here the cache
hands the layer its post-RoPE queries, so the buffer holds the queries themselves and SnapKV's own scores apply.
Named ``interval`` and ``target_size`` here (kvpress: ``compression_steps``, ``token_buffer_size``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.compress.cache import KVView, LayerContext, PressCache
from kvbench.compress.presses.eviction import topk_mask
from kvbench.compress.presses.snapkv import SnapKVLayer, SnapKVPress, snapkv_scores


class SnapKVDecodingLayer(SnapKVLayer):
    """:class:`SnapKVLayer` (prefill eviction) plus the decoding-time compression of the module docstring."""

    def __init__(self, ctx: LayerContext, cache: PressCache, press: "SnapKVDecodingPress"):
        super().__init__(ctx, cache, press)
        self._queries: list[torch.Tensor] = []   # post-RoPE queries [1, H_q, 1, D] of the decode steps since the last
        self.compressions = 0                    # decoding-time compressions so far (tests, audit)

    def commit(self, chunk: KVView, query: torch.Tensor) -> None:
        """Store ``chunk`` as SnapKV does; at a decode step (a one-token chunk after the first) buffer its query and,
        every ``press.interval`` of them, keep the ``press.target_size`` best tokens per KV head."""
        first = self._stored is None
        super().commit(chunk, query)
        if first or len(chunk) != 1:
            return
        self._queries.append(query)
        if len(self._queries) < self.press.interval:
            return
        window = torch.cat(self._queries, dim=2)            # [1, H_q, interval, D]
        self._queries = []
        view = self._stored
        if len(view) <= self.press.target_size:
            return
        # the buffered steps' tokens are the last `interval` stored ones (appended after any eviction, the same on
        # every head: SnapKV keeps equal counts per head, so no padding sits among them)
        scores = snapkv_scores(window, view.keys, self.press.kernel, self.press.pooling)
        self.evict(topk_mask(scores, self.press.target_size))
        self.compressions += 1

    def reset(self) -> None:
        super().reset()
        self._queries = []
        self.compressions = 0


@dataclass
class SnapKVDecodingPress(SnapKVPress):
    """SnapKV that also compresses during decoding (ResidualKV Table V's long generation; module docstring).

    SnapKV (https://arxiv.org/abs/2404.14469) evicts at the prefill as :class:`SnapKVPress`; then, every
    ``interval`` decode steps, SnapKV's scores over those steps' queries keep ``target_size`` tokens per KV head:
    the form of kvpress's ``DecodingPress`` (``NVIDIA/kvpress``, ``kvpress/presses/generation/decoding_press.py``).

    Parameters
    ----------
    keep, window, kernel, pooling : as :class:`SnapKVPress`, acting at the prefill.
    target_size : int, default 256 — tokens each KV head keeps after a decoding-time compression (kvpress's
        ``token_buffer_size``; 1,024 there).
    interval : int, default 16 — decode steps between compressions, whose queries score the cache (kvpress's
        ``compression_steps``; 10 there).

    With ``keep=1.0`` the prompt is kept whole and only decoding compresses (kvpress's ``DecodingPress`` alone);
    an ``interval`` longer than the decode makes it :class:`SnapKVPress`.

    Raises ValueError for ``interval`` < 1, ``target_size`` < ``interval`` (the buffered steps' own tokens are always
    kept), and as :class:`SnapKVPress`.
    """

    name = "snapkv_decoding"
    exact = {"keep": 1.0, "target_size": 1 << 30}
    target_size: int = 256
    interval: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        for field_name in ("target_size", "interval"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{field_name} must be an int, got {value!r}")
        if self.interval < 1:
            raise ValueError(f"interval must be >= 1 decode step, got {self.interval}")
        if self.target_size < self.interval:
            raise ValueError(f"target_size must be >= interval (the {self.interval} buffered steps' tokens are kept), "
                             f"got target_size={self.target_size}")

    def make_layer(self, ctx: LayerContext, cache: PressCache) -> SnapKVDecodingLayer:
        """A :class:`SnapKVDecodingLayer` reading this press's settings."""
        return SnapKVDecodingLayer(ctx, cache, self)

    def kept_target(self, n_context: int, n_tokens: int, n_layers: int) -> float | None:
        """None (measured only): what decoding keeps depends on how many decode steps ran since the last
        compression, which the request's token counts do not say."""
        return None
