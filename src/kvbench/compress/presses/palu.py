"""Palu: low-rank KV cache from a truncated SVD of the key/value projections.

Chang et al., "Palu: KV-Cache Compression with Low-Rank Projection", ICLR 2025 (arXiv 2407.21118,
`shadowpa0327/Palu`). Group-head low-rank decomposition (G-LRD, §3.2): the rows of ``k_proj`` (and
``v_proj``) belonging to a group of ``g`` KV heads, W_g ``[g·D, hidden]``, are factored by SVD,
W_g = U Σ Vᵀ. The cache stores the latent h = U_rᵀ (k − b) ``[r]`` per token and group (r = top
singular directions; U_rᵀ W_g x = Σ_r V_rᵀ x, Palu's "down" projection) and reconstructs
k = U_r h + b at read (Palu's "up" projection). Keys are stored pre-RoPE (the post-RoPE key is
unrotated, as Palu caches the latent before RoPE) and re-rotated at their own positions after
reconstruction. Full rank is exact: k − b lies in the column space of W_g.

Every token is attended (CR 100%); KR = kept rank / (g·D) = ``rank_ratio`` (latents counted at FP16).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.compress.accounting import StoredBytes
from kvbench.compress.cache import KVView, LayerContext, PressCache, Press, StoreLayer, decoder_layers

FP16_BYTES = 2   # latents are counted at FP16, the full cache's precision (accounting.py)

# model -> {(rank_ratio, group_heads): per-layer bases}; weak keys so a dropped model frees its bases.
_BASES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


@dataclass
class LowRankBasis:
    """The low-rank factors of one projection (k_proj or v_proj) of one layer.

    ``up``: per head group, the top-r left singular vectors U_r float32 ``[g·D, r]``; ``bias``:
    float32 ``[H_kv·D]`` (zeros when the projection has none); ``group_heads``: g; ``head_dim``: D.
    """

    up: list[torch.Tensor]
    bias: torch.Tensor
    group_heads: int
    head_dim: int

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Latents of ``x`` ``[n, H_kv·D]`` (projection outputs): per group ``[n, r]`` float32."""
        x = x.float() - self.bias
        w = self.group_heads * self.head_dim
        return [x[:, i * w:(i + 1) * w] @ u for i, u in enumerate(self.up)]

    def decode(self, latents: list[torch.Tensor]) -> torch.Tensor:
        """Reconstructed projection outputs ``[n, H_kv·D]`` float32 from per-group latents."""
        return torch.cat([h @ u.T for h, u in zip(latents, self.up)], -1) + self.bias


def low_rank_basis(proj: torch.nn.Linear, n_heads: int, head_dim: int, group_heads: int,
                   rank_ratio: float) -> LowRankBasis:
    """Truncated SVD of ``proj.weight`` ``[H_kv·D, hidden]`` per group of ``group_heads`` heads (G-LRD).

    Rank per group r = max(1, round(rank_ratio · g·D)), capped at min(g·D, hidden) (the full rank, exact).
    SVD in float64. Raises ValueError when ``n_heads`` is not a multiple of ``group_heads`` or the
    weight's rows are not ``n_heads · head_dim``.
    """
    w = proj.weight.detach().to(torch.float64)
    if w.shape[0] != n_heads * head_dim:
        raise ValueError(f"projection has {w.shape[0]} output rows, expected {n_heads} heads x {head_dim}")
    if n_heads % group_heads:
        raise ValueError(f"{n_heads} KV heads are not a multiple of group_heads = {group_heads}")
    rows = group_heads * head_dim
    rank = min(max(1, round(rank_ratio * rows)), rows, w.shape[1])
    up = []
    for i in range(n_heads // group_heads):
        u, _, _ = torch.linalg.svd(w[i * rows:(i + 1) * rows], full_matrices=False)
        up.append(u[:, :rank].to(torch.float32))
    bias = proj.bias.detach().float() if proj.bias is not None else torch.zeros(w.shape[0])
    return LowRankBasis(up, bias.to(proj.weight.device), group_heads, head_dim)


class PaluLayer(StoreLayer):
    """One decoder layer of a Palu cache: per-group latents of pre-RoPE keys and of values."""

    def __init__(self, ctx: LayerContext, cache: PressCache, k_basis: LowRankBasis, v_basis: LowRankBasis):
        super().__init__(ctx, cache)
        self.kb, self.vb = k_basis, v_basis
        self.k_lat: list[list[torch.Tensor]] = []   # per chunk, per group [c, r]
        self.v_lat: list[list[torch.Tensor]] = []
        self.pos: list[torch.Tensor] = []

    def commit(self, chunk: KVView, query: torch.Tensor) -> None:
        pos = chunk.positions[0, 0]
        k_pre = self.ctx.unrotate(chunk.keys, pos)
        flat = lambda x: x[0].transpose(0, 1).reshape(x.shape[-2], -1)  # noqa: E731  [1,H,n,D] -> [n, H·D]
        self.k_lat.append(self.kb.encode(flat(k_pre)))
        self.v_lat.append(self.vb.encode(flat(chunk.values)))
        self.pos.append(pos)

    def history(self) -> KVView | None:
        if not self.pos:
            return None
        pos = torch.cat(self.pos)
        join = lambda lat: [torch.cat(g) for g in zip(*lat)]  # noqa: E731  chunks -> per group
        heads = lambda x, d: x.view(x.shape[0], -1, d).transpose(0, 1).unsqueeze(0).to(self.ctx.dtype)  # noqa: E731
        k = heads(self.kb.decode(join(self.k_lat)), self.kb.head_dim)
        v = heads(self.vb.decode(join(self.v_lat)), self.vb.head_dim)
        return KVView.dense(self.ctx.rotate(k, pos), v, pos)

    def packed_bytes(self) -> StoredBytes:
        """The latents at FP16 (the bases are model weights, shared by all requests: not counted)."""
        n = sum(h.numel() for lat in self.k_lat + self.v_lat for h in lat)
        return StoredBytes(layer=self.ctx.layer_idx, codes=n * FP16_BYTES)

    def held_tensors(self):
        """Resident: the float32 latents and the int64 positions of every chunk."""
        yield from super().held_tensors()
        for lat in self.k_lat + self.v_lat:
            yield from lat
        yield from self.pos


@dataclass
class PaluPress(Press):
    """Palu (Chang et al., ICLR 2025): G-LRD low-rank keys and values, bases from the model's weights.

    Parameters
    ----------
    rank_ratio : float, 0.5 — kept rank / (g·D) per head group (ResidualKV paper's Palu row: KR 50%).
    group_heads : int, 4 — KV heads per SVD group (Palu's G-LRD group size 4); all heads when the model
        has fewer. Palu's per-layer rank search (Fisher-information allocation) is not reproduced: every
        layer and group keeps the same rank.

    The SVD is computed in :meth:`new_cache` and cached per model. Raises ValueError for rank_ratio
    outside (0, 1], group_heads < 1, or a KV head count that is not a multiple of the group.
    """

    name = "palu"
    exact = {"rank_ratio": 1.0}  # full rank: exact up to float rounding
    rank_ratio: float = 0.5
    group_heads: int = 4

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.rank_ratio <= 1:
            raise ValueError(f"rank_ratio must be in (0, 1], got {self.rank_ratio}")
        if self.group_heads < 1:
            raise ValueError(f"group_heads must be >= 1, got {self.group_heads}")

    def bases(self, model: Any) -> list[tuple[LowRankBasis, LowRankBasis]]:
        """Per layer ``(k_basis, v_basis)`` for ``model`` (computed once per model and setting)."""
        per_model = _BASES.setdefault(model, {})
        key = (self.rank_ratio, self.group_heads)
        if key not in per_model:
            cfg = model.config.get_text_config()
            n_kv = cfg.num_key_value_heads
            d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            g = min(self.group_heads, n_kv)
            per_model[key] = [(low_rank_basis(layer.self_attn.k_proj, n_kv, d, g, self.rank_ratio),
                               low_rank_basis(layer.self_attn.v_proj, n_kv, d, g, self.rank_ratio))
                              for layer in decoder_layers(model)]
        return per_model[key]

    def new_cache(self, model: Any) -> PressCache:
        bases = self.bases(model)
        return PressCache(model, lambda ctx, cache: PaluLayer(ctx, cache, *bases[ctx.layer_idx]))

    def make_layer(self, ctx: LayerContext, cache: PressCache) -> StoreLayer:
        raise ValueError("PaluPress needs the model's projection weights: build caches with new_cache(model)")

    def compute_ratio(self, n_layers: int) -> float | None:
        """1.0: every token is attended (reconstructed)."""
        return 1.0
