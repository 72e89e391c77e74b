"""Shared machinery of the static-eviction presses (SnapKV, PyramidKV, KVzip): a store layer that drops
tokens per KV head, and top-k selection helpers.

Eviction keeps a different token set per KV head (SnapKV §4, KVzip §3: head-wise selection); the KV
heads are never repeated to query heads, so the GQA memory saving survives (the original SnapKV
monkeypatch cached repeated heads: docs/decisions/presses.md, "Static eviction: SnapKV, PyramidKV, KVzip").

A :class:`~kvbench.compress.cache.KVView` needs the same token count on every head. When heads keep
different counts (KVzip's global threshold), shorter heads are padded with zero K/V at position
:data:`PAD_POSITION`, which no query position reaches, so the press attention function
(``key pos <= query pos``) never reads them; :meth:`EvictingLayer.packed_bytes` does not count them (the
resident bytes do, with the int64 per-head positions that eviction makes necessary).
"""
from __future__ import annotations

import torch

from kvbench.compress.accounting import StoredBytes
from kvbench.compress.cache import KVView, StoreLayer

#: Position of padding slots: larger than any query position, so attention masks them out.
PAD_POSITION = torch.iinfo(torch.int64).max


def check_keep(name: str, value: float) -> None:
    """Raise ValueError unless ``0 < value <= 1`` (a keep ratio of the context tokens)."""
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value}")


def budget(keep: float, n: int) -> int:
    """Tokens kept out of ``n`` at ratio ``keep``: ``round(keep * n)`` clamped to ``[min(1, n), n]``, so a
    tiny context keeps at least one token (kvpress reports of zero-token caches)."""
    return min(n, max(1, round(keep * n))) if n > 0 else 0


def topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask ``[..., n]``, True at the ``k`` highest scores along the last dim (ties: torch.topk's order).

    Raises ValueError for ``k`` outside ``[0, n]``.
    """
    n = scores.shape[-1]
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}], got {k}")
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    return mask.scatter_(-1, scores.topk(k, dim=-1).indices, True)


class EvictingLayer(StoreLayer):
    """A store that holds exact K/V of a per-KV-head subset of tokens; subclasses decide when to call
    :meth:`evict`. Until then it behaves as the full cache."""

    def evict(self, keep: torch.Tensor) -> None:
        """Keep only the stored tokens where ``keep`` (bool ``[1, H_kv, n]``, aligned with :meth:`history`)
        is True, in their stored order; heads with fewer kept tokens are padded (module docstring). Called by
        the press's own layer after a commit, with a mask of the stored view's shape (asserted).
        """
        view = self._stored
        assert view is not None, "evict called before anything was stored"
        assert keep.dtype == torch.bool and keep.shape == view.positions.shape, f"keep {keep.dtype} {tuple(keep.shape)}"
        counts = keep.sum(-1)                                              # [1, H_kv]
        width = int(counts.max())
        # Stable sort puts kept slots first, in stored order; slots past a head's count become padding.
        order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices[..., :width]
        real = torch.arange(width, device=keep.device).view(1, 1, -1) < counts.unsqueeze(-1)
        idx = order.unsqueeze(-1).expand(-1, -1, -1, view.keys.shape[-1])
        keys = view.keys.gather(2, idx) * real.unsqueeze(-1)
        values = view.values.gather(2, idx) * real.unsqueeze(-1)
        positions = view.positions.gather(2, order).masked_fill(~real, PAD_POSITION)
        self._stored = KVView(keys, values, positions)
        self._padded = bool((counts < width).any())   # once per eviction, not per step

    def hides_keys(self) -> bool:
        """True once an eviction left padding slots (heads kept different counts): they must be masked."""
        return getattr(self, "_padded", False)

    def kept_counts(self) -> torch.Tensor:
        """Real (non-padding) stored tokens per KV head, int64 ``[H_kv]`` (zeros before the first commit)."""
        if self._stored is None:
            return torch.zeros(0, dtype=torch.int64)
        return (self._stored.positions != PAD_POSITION).sum(-1)[0]

    def packed_bytes(self) -> StoredBytes:
        """FP16 K and V of the kept tokens (2 bytes · 2 · D per kept token per KV head), padding excluded, in
        the ``full_layer`` part. Positions are not counted: kept keys are already RoPE-rotated, as in the
        original repos' caches. (Resident: the padded K/V in the model's dtype and int64 ``[1, H_kv, n]``
        positions, :meth:`~kvbench.compress.cache.StoreLayer.held_tensors`.)"""
        if self._stored is None:
            return StoredBytes(layer=self.ctx.layer_idx)
        head_dim = self._stored.keys.shape[-1]
        return StoredBytes(layer=self.ctx.layer_idx, full_layer=2 * 2 * head_dim * int(self.kept_counts().sum()))

    def kept_share(self) -> float:
        """Kept tokens / tokens written, mean over KV heads (padding excluded; 1.0 before the first commit)."""
        if self._stored is None or not self.seen:
            return 1.0
        return float(self.kept_counts().double().mean()) / self.seen
