"""Palu: low-rank KV cache from a truncated SVD of the key/value projections.

Chang et al., "Palu: KV-Cache Compression with Low-Rank Projection", ICLR 2025 (arXiv 2407.21118,
`shadowpa0327/Palu`). Group-head low-rank decomposition (G-LRD, §3.2): the rows of ``k_proj`` (and
``v_proj``) belonging to a group of ``g`` KV heads, W_g ``[g·D, hidden]``, are factored by SVD,
W_g = U Σ Vᵀ. The cache stores the latent h = U_rᵀ (k − b) ``[r]`` per token and group (r = top
singular directions; U_rᵀ W_g x = Σ_r V_rᵀ x, Palu's "down" projection) and reconstructs
k = U_r h + b at read (Palu's "up" projection). Keys are stored pre-RoPE (the post-RoPE key is
unrotated, as Palu caches the latent before RoPE) and re-rotated at their own positions after
reconstruction. Full rank is exact: k − b lies in the column space of W_g.

Whitening (``whiten=True``, the default; Palu always whitens, ``palu/decomposition.py``
``get_whiten_scale_matrix`` and ``palu/model/modules/svd_linear.py`` ``_per_head_whiten_decomposition_from_weight``,
adapted from SVD-LLM): on calibration text, the inputs X ``[N, hidden]`` of each layer's ``k_proj`` (the
same normed hidden states feed ``v_proj``) give C = XᵀX and its Cholesky factor S (C = S Sᵀ). Palu factors
W_g S = U Σ Vᵀ and keeps up = U_r √Σ_r, down = √Σ_r V_rᵀ S⁻¹ (S⁻¹ on the input side). Its reconstruction
U_r Σ_r V_rᵀ S⁻¹ x equals U_r U_rᵀ W_g x, so the cache here stores h = U_rᵀ(k − b) with U_r from the SVD of
W_g S instead of W_g: Palu's latent up to the fixed scaling Σ_r^{-1/2} (no effect without latent
quantisation). U_r minimises the calibration error Σ‖k − k̂‖² = ‖(I − U_r U_rᵀ) W_g S‖²_F; plain SVD
(``whiten=False``) minimises ‖(I − U_r U_rᵀ) W_g‖²_F, the error for isotropic inputs.

Every token is attended (CR 100%); KR = kept rank / (g·D) = ``rank_ratio`` (latents counted at FP16).
"""
from __future__ import annotations

import hashlib
import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench.compress.accounting import StoredBytes
from kvbench.compress.cache import KVView, LayerContext, PressCache, Press, StoreLayer, decoder_layers

FP16_BYTES = 2   # latents are counted at FP16, the full cache's precision (accounting.py)

# model -> {setting: per-layer bases or input Gram matrices}; weak keys so a dropped model frees them.
_BASES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
#: Palu's ridge when C = XᵀX is not positive definite: C + (−λ_min + RIDGE)·I (``decomposition.py``)
RIDGE = 1e-3


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


def group_rank(rank_ratio: float, rows: int, hidden: int) -> int:
    """Rank kept per group of ``rows`` = g·D output rows: max(1, round(rank_ratio · rows)), capped at
    min(rows, hidden) (the full rank, exact)."""
    return min(max(1, round(rank_ratio * rows)), rows, hidden)


def low_rank_basis(proj: torch.nn.Linear, n_heads: int, head_dim: int, group_heads: int,
                   rank_ratio: float, whitening: torch.Tensor | None = None) -> LowRankBasis:
    """Truncated SVD of ``proj.weight`` W ``[H_kv·D, hidden]`` per group of ``group_heads`` heads (G-LRD).

    ``whitening``: None (plain SVD of W_g) or S float64 ``[hidden, hidden]`` with XᵀX = S Sᵀ
    (:func:`whitening_factor`): U_r is then taken from the SVD of W_g S (Palu's whitened decomposition,
    module docstring). Rank per group :func:`group_rank`. SVD in float64. Raises ValueError when
    ``n_heads`` is not a multiple of ``group_heads`` or the weight's rows are not ``n_heads · head_dim``; S is
    asserted ``[hidden, hidden]``.
    """
    w = proj.weight.detach().to(torch.float64)
    if w.shape[0] != n_heads * head_dim:
        raise ValueError(f"projection has {w.shape[0]} output rows, expected {n_heads} heads x {head_dim}")
    if n_heads % group_heads:
        raise ValueError(f"{n_heads} KV heads are not a multiple of group_heads = {group_heads}")
    if whitening is not None:
        assert whitening.shape == (w.shape[1], w.shape[1]), f"whitening {tuple(whitening.shape)}, {w.shape[1]} inputs"
        w = w @ whitening.to(device=w.device, dtype=torch.float64)
    rows = group_heads * head_dim
    rank = group_rank(rank_ratio, rows, w.shape[1])
    up = []
    for i in range(n_heads // group_heads):
        u, _, _ = torch.linalg.svd(w[i * rows:(i + 1) * rows], full_matrices=False)
        up.append(u[:, :rank].to(torch.float32))
    bias = proj.bias.detach().float() if proj.bias is not None else torch.zeros(w.shape[0])
    return LowRankBasis(up, bias.to(proj.weight.device), group_heads, head_dim)


def whitening_factor(gram: torch.Tensor) -> torch.Tensor:
    """S float64 with ``gram`` = S Sᵀ (lower Cholesky factor of C = XᵀX ``[hidden, hidden]``). When C is not
    positive definite (fewer calibration tokens than ``hidden``, a dead channel) Palu's ridge is added first:
    C + (−λ_min + :data:`RIDGE`)·I, λ_min the smallest eigenvalue (absolute 1e-3, as ``decomposition.py``)."""
    c = gram.to(torch.float64)
    s, info = torch.linalg.cholesky_ex(c)
    if int(info) == 0:
        return s
    lam = torch.linalg.eigvalsh(c)[0]
    return torch.linalg.cholesky(c + (-lam + RIDGE) * torch.eye(c.shape[0], dtype=c.dtype, device=c.device))


@torch.no_grad()
def input_grams(model: Any, calib_ids: torch.Tensor) -> list[torch.Tensor]:
    """Per decoder layer C = XᵀX float64 ``[hidden, hidden]``, X the inputs of ``k_proj`` (the normed hidden
    states, which ``v_proj`` reads too) over every token of ``calib_ids`` int64 ``[n_windows, L]``, each window
    forwarded alone (no cache), as Palu's calibration (``decomposition.py``; it accumulates in float32)."""
    grams: list[torch.Tensor | None] = [None] * len(decoder_layers(model))

    def hook(i):
        def add(_module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float64)
            grams[i] = x.T @ x if grams[i] is None else grams[i] + x.T @ x
        return add

    handles = [layer.self_attn.k_proj.register_forward_pre_hook(hook(i)) for i, layer in enumerate(decoder_layers(model))]
    try:
        device = next(model.parameters()).device
        for row in calib_ids:
            model(input_ids=row.view(1, -1).to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return grams


class PaluLayer(StoreLayer):
    """One decoder layer of a Palu cache: per-group latents of pre-RoPE keys and of values."""

    def __init__(self, ctx: LayerContext, cache: PressCache, k_basis: LowRankBasis, v_basis: LowRankBasis):
        super().__init__(ctx, cache)
        self.kb, self.vb = k_basis, v_basis
        self.k_lat: list[list[torch.Tensor]] = []   # per chunk, per group [c, r]
        self.v_lat: list[list[torch.Tensor]] = []
        self.pos: list[torch.Tensor] = []

    def commit(self, chunk: KVView, query: torch.Tensor) -> None:
        self.ctx.rope.reach(self.seen)   # the chunk's positions are below the tokens written
        pos = chunk.positions[0, 0]
        k_pre = self.ctx.unrotate(chunk.keys, pos)
        flat = lambda x: x[0].transpose(0, 1).reshape(x.shape[-2], -1)  # noqa: E731  [1,H,n,D] -> [n, H·D]
        self.k_lat.append(self.kb.encode(flat(k_pre)))
        self.v_lat.append(self.vb.encode(flat(chunk.values)))
        self.pos.append(pos)

    def history(self) -> KVView | None:
        if not self.pos:
            return None
        self.ctx.rope.reach(self.seen)
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
    """Palu (Chang et al., ICLR 2025, arXiv 2407.21118): G-LRD low-rank keys and values, bases from the weights.

    Parameters
    ----------
    rank_ratio : float, 0.5 — kept rank / (g·D) per head group (ResidualKV paper's Palu row: KR 50%).
    group_heads : int, 4 — KV heads per SVD group (Palu's G-LRD group size 4); all heads when the model
        has fewer. Palu's per-layer rank search (Fisher-information allocation) is not reproduced: every
        layer and group keeps the same rank.
    whiten : bool, True — SVD of W_g S with S from calibration text (Palu's form, module docstring); False:
        plain SVD of W_g (a weaker decomposition; label such rows "Palu (unwhitened SVD)"). At full rank
        both are exact and no calibration runs.
    calib_tokens : int, 4096 — calibration tokens (``ceil(calib_tokens / calib_len)`` windows). Palu:
        256 WikiText-2 windows of 2,048 tokens (524,288).
    calib_len : int, 512 — tokens per calibration window (Palu: 2,048).
    seed : int, 0 — which corpus windows calibrate (the document order of the corpus stream).
    calib_ids : resource, None — int64 ``[n_windows, L]`` calibration windows given by the caller (never
        from a spec); None: ``ceil(calib_tokens / calib_len)`` windows of ``calib_len`` tokens of the packed
        corpus train split (:class:`kvbench.compress.residualkv.train.TokenStream`, the codec's training
        text), seeded by ``seed``, tokenised by ``tokenizer``.
    tokenizer : resource, None — for the corpus windows; None loads the model's
        (``AutoTokenizer.from_pretrained(model.config.name_or_path)``).

    The SVD (and the calibration pass) runs in :meth:`new_cache` and is cached per model. Raises ValueError
    for rank_ratio outside (0, 1], group_heads < 1, calib_tokens or calib_len < 1, or a KV head count that
    is not a multiple of the group.
    """

    name = "palu"
    exact = {"rank_ratio": 1.0}  # full rank: exact up to float rounding
    rank_ratio: float = 0.5
    group_heads: int = 4
    whiten: bool = True
    calib_tokens: int = 4096
    calib_len: int = 512
    seed: int = 0
    calib_ids: Any = field(default=None, repr=False, compare=False)
    tokenizer: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.rank_ratio <= 1:
            raise ValueError(f"rank_ratio must be in (0, 1], got {self.rank_ratio}")
        if self.group_heads < 1:
            raise ValueError(f"group_heads must be >= 1, got {self.group_heads}")
        for name in ("calib_tokens", "calib_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def calibration_ids(self, model: Any) -> torch.Tensor:
        """int64 ``[n_windows, L]``: ``calib_ids`` if given, else the seeded corpus windows (class docstring)."""
        if self.calib_ids is not None:
            ids = torch.as_tensor(self.calib_ids, dtype=torch.long)
            return ids.view(1, -1) if ids.dim() == 1 else ids
        from kvbench.compress.residualkv.train import TokenStream   # the corpus and its packing, only when needed
        tok = self.tokenizer
        if tok is None:
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(model.config.name_or_path)
        stream = TokenStream(tok, "train", self.calib_len, self.seed)
        return torch.cat([stream.window(i) for i in range(math.ceil(self.calib_tokens / self.calib_len))])

    def _calib_key(self) -> tuple:
        if self.calib_ids is None:
            return ("corpus", self.calib_tokens, self.calib_len, self.seed)
        ids = torch.as_tensor(self.calib_ids).cpu().contiguous()
        return ("given", tuple(ids.shape), hashlib.sha1(ids.numpy().tobytes()).hexdigest())

    def whitening(self, model: Any) -> list[torch.Tensor]:
        """Per layer S float64 ``[hidden, hidden]`` from the calibration pass (cached per model and calibration)."""
        per_model = _BASES.setdefault(model, {})
        key = ("whitening", self._calib_key())
        if key not in per_model:
            per_model[key] = [whitening_factor(c) for c in input_grams(model, self.calibration_ids(model))]
        return per_model[key]

    def bases(self, model: Any) -> list[tuple[LowRankBasis, LowRankBasis]]:
        """Per layer ``(k_basis, v_basis)`` for ``model`` (computed once per model and setting)."""
        cfg = model.config.get_text_config()
        n_kv = cfg.num_key_value_heads
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        g = min(self.group_heads, n_kv)
        # at full rank U_r U_rᵀ is the identity whatever S is: no calibration pass
        whiten = self.whiten and group_rank(self.rank_ratio, g * d, cfg.hidden_size) < g * d
        per_model = _BASES.setdefault(model, {})
        key = (self.rank_ratio, self.group_heads) + (self._calib_key() if whiten else ("plain",))
        if key not in per_model:
            layers = decoder_layers(model)
            s = self.whitening(model) if whiten else [None] * len(layers)
            per_model[key] = [(low_rank_basis(layer.self_attn.k_proj, n_kv, d, g, self.rank_ratio, s[i]),
                               low_rank_basis(layer.self_attn.v_proj, n_kv, d, g, self.rank_ratio, s[i]))
                              for i, layer in enumerate(layers)]
        return per_model[key]

    def new_cache(self, model: Any) -> PressCache:
        bases = self.bases(model)
        return PressCache(model, lambda ctx, cache: PaluLayer(ctx, cache, *bases[ctx.layer_idx]))

    def make_layer(self, ctx: LayerContext, cache: PressCache) -> StoreLayer:
        raise ValueError("PaluPress needs the model's projection weights: build caches with new_cache(model)")

    def compute_ratio(self, n_layers: int) -> float | None:
        """1.0: every token is attended (reconstructed)."""
        return 1.0
