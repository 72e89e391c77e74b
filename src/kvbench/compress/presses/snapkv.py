"""SnapKV: evict the prefix tokens that the prompt's last queries (the observation window) attend little.

At the end of the context prefill, the last ``window`` queries' softmax attention over the prefix keys is
summed over the window, smoothed along tokens by a 1-D pooling, averaged over each KV head's group of query
heads, and the top ``keep`` share of the prefix is kept per KV head, plus the window itself. Later chunks
(question, decoded tokens) are appended and never evicted.

Based on SnapKV (Li et al. 2024, https://arxiv.org/abs/2404.14469, §4.2-4.3, Listing 1); original repo
``FasterDecoding/SnapKV`` (``snapkv_utils.py``: window 32, avg-pool kernel 5; kernel 7 / max-pool are
ablations and the ResidualKV authors' baseline configuration).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench.compress.cache import KVView, LayerContext, Press, PressCache
from kvbench.compress.presses.eviction import EvictingLayer, budget, check_keep, topk_mask

POOLINGS = ("avg", "max")


def snapkv_scores(query_window: torch.Tensor, keys: torch.Tensor, kernel: int = 5, pooling: str = "avg",
                  window_in_keys: bool = True) -> torch.Tensor:
    """SnapKV importance of every key for one layer (SnapKV §4.2, Listing 1), per KV head.

    Args:
        query_window: post-RoPE queries ``[1, H_q, w, D]`` of the observation window.
        keys: post-RoPE keys ``[1, H_kv, n, D]`` (``H_q`` a multiple of ``H_kv``).
        kernel: odd pooling width along tokens (5: original repo; 7: ResidualKV authors' config).
        pooling: ``"avg"`` (original default; zero padding counted, as ``F.avg_pool1d``) or ``"max"``.
        window_in_keys: the last ``w`` keys are the window's own tokens (query ``i`` sits at key
            position ``n - w + i``, causal among them); they are scored ``+inf`` (always kept) and the
            pooling runs over the ``n - w`` prefix keys only, as the original. False: every key is a
            prefix key visible to every window query (scoring a stored prefix with new queries).

    Returns:
        float32 ``[1, H_kv, n]``: window-summed softmax attention (scale ``1/sqrt(D)``), computed in
        float32, pooled per query head, then averaged over each KV head's GQA group (kvpress's
        aggregation; the original repeats KV heads instead and loses the GQA memory saving).

    Raises:
        ValueError: batch != 1, ``H_q`` not a multiple of ``H_kv``, head dims differ, ``w > n`` with
            ``window_in_keys``, an even or non-positive ``kernel``, or ``pooling`` not in ``POOLINGS``.
    """
    if query_window.dim() != 4 or keys.dim() != 4 or query_window.shape[0] != 1 or keys.shape[0] != 1:
        raise ValueError(f"expected [1, H, t, D] tensors, got query {tuple(query_window.shape)}, keys {tuple(keys.shape)}")
    _, h_q, w, d = query_window.shape
    _, h_kv, n, d_k = keys.shape
    if h_q % h_kv or d != d_k:
        raise ValueError(f"query heads/dim {h_q}/{d} do not fit key heads/dim {h_kv}/{d_k}")
    if window_in_keys and w > n:
        raise ValueError(f"window of {w} queries longer than the {n} keys it is part of")
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"kernel must be an odd integer >= 1, got {kernel}")
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    q = query_window.float().view(1, h_kv, h_q // h_kv, w, d)
    logits = q @ keys.float().unsqueeze(2).transpose(-1, -2) / math.sqrt(d)        # [1, H_kv, g, w, n]
    if window_in_keys:
        key_pos = torch.arange(n, device=keys.device)
        query_pos = torch.arange(n - w, n, device=keys.device)
        logits = logits.masked_fill(key_pos.view(1, -1) > query_pos.view(-1, 1), float("-inf"))
    n_prefix = n - w if window_in_keys else n
    mass = logits.softmax(-1).sum(-2)[..., :n_prefix]                               # [1, H_kv, g, n_prefix]
    flat = mass.flatten(0, 2).unsqueeze(1)                                          # [H_kv * g, 1, n_prefix]
    pool = F.avg_pool1d if pooling == "avg" else F.max_pool1d
    pooled = pool(flat, kernel_size=kernel, stride=1, padding=kernel // 2) if n_prefix else flat
    scores = pooled.view(1, h_kv, h_q // h_kv, n_prefix).mean(2)
    if window_in_keys:
        scores = torch.cat([scores, scores.new_full((1, h_kv, w), float("inf"))], -1)
    return scores


class SnapKVLayer(EvictingLayer):
    """Stores every token, then evicts the prefix of the first chunk once its attention ran (the chunk's
    own queries are the observation window)."""

    def __init__(self, ctx: LayerContext, cache: PressCache, press: "SnapKVPress"):
        super().__init__(ctx, cache)
        self.press = press

    def commit(self, chunk: KVView, query: torch.Tensor) -> None:
        """Append ``chunk``; if it is the first chunk and longer than the window, keep the top
        ``press.layer_budget`` prefix tokens per KV head plus the window (``query`` ``[1, H_q, t, D]``)."""
        first = self._stored is None
        super().commit(chunk, query)
        t = len(chunk)
        w = self.press.window
        if not first or t <= w:                   # later chunks, or a context within the window: keep all
            return
        n_prefix = t - w
        k = self.press.layer_budget(self.ctx.layer_idx, self.ctx.n_layers, n_prefix)
        scores = snapkv_scores(query[:, :, -w:], chunk.keys, self.press.kernel, self.press.pooling)
        keep = torch.cat([topk_mask(scores[..., :n_prefix], k),
                          torch.ones_like(scores[..., n_prefix:], dtype=torch.bool)], -1)
        self.evict(keep)


@dataclass
class SnapKVPress(Press):
    """SnapKV (https://arxiv.org/abs/2404.14469): after the context prefill keep, per KV head, the
    ``keep`` share of the prefix that the last ``window`` queries attend most, plus the window.

    Parameters
    ----------
    keep : float, default 0.3 — share of the prefix (context minus window) kept per KV head (the ResidualKV
        authors' configuration); the kept count is ``round(keep · (T − window))``, at least 1. The window is
        kept on top, so the share of the context kept is ``(round(keep · (T − w)) + w) / T``: 41% for
        ``keep=0.3`` on a 200-token context (50 + 32 of 200); :meth:`kept_target`, and the audit row's
        measured ``kept`` and ``kr_packed``, report that, not ``keep``.
    window : int, default 32 — observation window (original repo and ResidualKV configs).
    kernel : int, default 5 — pooling width (original repo; the ResidualKV authors use 7).
    pooling : str, default "avg" — "avg" (original) or "max" (ablation).

    Raises ValueError for ``keep`` outside (0, 1], ``window`` < 1, an even kernel or unknown pooling.
    """

    name = "snapkv"
    exact = {"keep": 1.0}
    keep: float = 0.3
    window: int = 32
    kernel: int = 5
    pooling: str = "avg"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_keep("keep", self.keep)
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be an odd integer >= 1, got {self.kernel}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")

    def layer_budget(self, layer_idx: int, n_layers: int, n_prefix: int) -> int:
        """Prefix tokens kept per KV head in layer ``layer_idx``: ``round(keep · n_prefix)``, in [1, n_prefix]."""
        return budget(self.keep, n_prefix)

    def token_scores(self, query: torch.Tensor, view: KVView) -> torch.Tensor:
        """SnapKV scores of every token of ``view`` for a store that keeps or drops a token across all its
        KV heads (the selector of ``residualkv+snapkv``, whose codes span the heads): the last
        ``min(window, t)`` rows of ``query`` ``[1, H_q, t, D]`` are the observation window, whose own keys
        end ``view``; returns float32 ``[n]`` (:func:`snapkv_scores` with this press's ``kernel`` and
        ``pooling``, averaged over KV heads; the window's own tokens score +inf)."""
        w = min(self.window, query.shape[-2])
        return snapkv_scores(query[..., -w:, :], view.keys, self.kernel, self.pooling).mean(dim=(0, 1))

    def make_layer(self, ctx: LayerContext, cache: PressCache) -> SnapKVLayer:
        """A :class:`SnapKVLayer` reading this press's settings."""
        return SnapKVLayer(ctx, cache, self)

    def kept_target(self, n_context: int, n_tokens: int, n_layers: int) -> float | None:
        """(prefix budget + window + tokens after the context) / ``n_tokens``, prefix budget
        :meth:`layer_budget` averaged over layers; all tokens when the context is within the window."""
        n_prefix = n_context - self.window
        if n_prefix <= 0:
            return 1.0
        kept = sum(self.layer_budget(i, n_layers, n_prefix) for i in range(n_layers)) / n_layers
        return (kept + self.window + n_tokens - n_context) / n_tokens

    def compute_ratio(self, n_layers: int) -> float | None:
        """None (measured only): ``keep`` is the share of the prefix kept; the window and the question/decoded
        tokens add to it (CR = (round(keep·(T − w)) + w) / T for the context), so it is not the CR."""
        return None
