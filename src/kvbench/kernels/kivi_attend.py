"""Decode attention over a KIVI-quantised layer, dequantising in-kernel (KIVI, Liu et al., ICML 2024).

Layout (as ``compress/presses/kivi.py`` stores it, levels packed as :mod:`.group_quant` packs them; C = H_kv·D
channels, head h at channels h·D..(h+1)·D; n tokens in order):

- keys, post-RoPE, per channel in groups of ``group`` (G) consecutive tokens: the first n_kq = NB·G tokens
  quantised, block b holding tokens b·G..b·G+G−1 (``KIVILayer.kq.codes[b]``: levels [C, G], one fp16
  zmin/scale per channel); the rest raw (``k_raw``, tokens n_kq..n−1; fewer than KIVI's residual R);
- values per token in groups of ``v_group`` consecutive channels of one head: the first n_vq tokens
  quantised (``vq.codes`` concatenated), the latest ``v_raw`` tokens raw (n_vq..n−1).

So a token's key may be quantised while its value is still raw. The kernel reads one block of tokens at a time,
dequantises K and V in registers (level·step + zmin in float32, as ``quant.dequantize``) and runs the
split online softmax of :mod:`.flash_decode`; the dequantised rows are never written.

Used by the caches: ``KIVILayer`` (``compress/presses/kivi.py``; also ResidualKV's quantised full layers,
``QuantizedFullLayer``) keeps a packed mirror of its per-block codes in this layout and calls
``kvbench.kernels.kivi_attend(q, layout)`` at a one-token decode step where ``kernels.use_triton`` holds.
"""
from dataclasses import dataclass

import torch

from kvbench.kernels._triton import jit, next_pow2, nonempty, tl, unit_stride
from kvbench.kernels.flash_decode import BLOCK_N, check_query, combine, partials, plan_splits, sdpa_decode, softmax_step
from kvbench.kernels.group_quant import PackedCodes, check_pack, group_dequant_ref

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class KIVILayout:
    """One KIVI layer's K/V, packed (module docstring).

    Fields
    ------
    k_codes : uint8 [NB, C, G·bits/8] — key levels of block b, channel c, packed along the G tokens.
    k_zmin, k_scale : float16 [NB, C] — per (block, channel).
    k_raw : float [n_kr, C] — raw keys of tokens NB·G..n−1.
    v_codes : uint8 [n_vq, C·bits/8] — value levels per token, packed along channels.
    v_zmin, v_scale : float16 [n_vq, C / v_group].
    v_raw : float [n_vr, C] — raw values of tokens n_vq..n−1 (n_vq + n_vr = NB·G + n_kr = n).
    bits : int — 2, 4 or 8. group : int — G, tokens per key group. v_group : int — channels per value group.
    """

    k_codes: torch.Tensor
    k_zmin: torch.Tensor
    k_scale: torch.Tensor
    k_raw: torch.Tensor
    v_codes: torch.Tensor
    v_zmin: torch.Tensor
    v_scale: torch.Tensor
    v_raw: torch.Tensor
    bits: int
    group: int
    v_group: int

    @property
    def n_tokens(self) -> int:
        """Tokens held (every one attended)."""
        return self.k_codes.shape[0] * self.group + self.k_raw.shape[0]

    def key_codes(self) -> PackedCodes:
        """The key blocks as :class:`PackedCodes` rows, one per (block, channel): [NB·C, G·bits/8]."""
        nb, c = self.k_codes.shape[:2]
        return PackedCodes(self.k_codes.reshape(nb * c, self.k_codes.shape[2]), self.k_zmin.reshape(nb * c, 1),
                           self.k_scale.reshape(nb * c, 1), self.bits, self.group)

    def value_codes(self) -> PackedCodes:
        """The quantised values as :class:`PackedCodes` [n_vq, C·bits/8]."""
        return PackedCodes(self.v_codes, self.v_zmin, self.v_scale, self.bits, self.v_group)


def _check(q: torch.Tensor, lay: KIVILayout, softmax_scale) -> int:
    """Validate shapes and dtypes; returns H_kv."""
    if not isinstance(lay, KIVILayout):
        raise ValueError(f"expected a KIVILayout, got {type(lay).__name__}")  # noqa: TRY004  (project: ValueError)
    d = q.shape[-1]
    c = lay.k_raw.shape[1] if lay.k_raw.dim() == 2 else -1
    if c < 1 or d < 1 or c % d:
        raise ValueError(f"k_raw must be [n_kr, C] with C = H_kv·D a multiple of q's head dim {d}, got "
                         f"{tuple(lay.k_raw.shape)}")
    check_query(q, c // d, d)
    if softmax_scale is not None and not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale}")
    check_pack(lay.group, lay.bits, lay.group)
    check_pack(c, lay.bits, lay.v_group)
    if lay.v_group > d or d % lay.v_group:
        raise ValueError(f"v_group = {lay.v_group} must divide the head dim {d} (a value group never spans two heads)")
    nb = lay.k_codes.shape[0] if lay.k_codes.dim() == 3 else -1
    want = {"k_codes": ((nb, c, lay.group * lay.bits // 8), torch.uint8), "k_zmin": ((nb, c), torch.float16),
            "k_scale": ((nb, c), torch.float16), "v_zmin": ((lay.v_codes.shape[0], c // lay.v_group), torch.float16),
            "v_scale": ((lay.v_codes.shape[0], c // lay.v_group), torch.float16),
            "v_codes": ((lay.v_codes.shape[0], c * lay.bits // 8), torch.uint8)}
    for name, (shape, dtype) in want.items():
        t = getattr(lay, name)
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype} {list(shape)}, got {t.dtype} {tuple(t.shape)}")
    for name in ("k_raw", "v_raw"):
        t = getattr(lay, name)
        if t.dim() != 2 or t.shape[1] != c or t.dtype not in _FLOATS:
            raise ValueError(f"{name} must be a float [n, C = {c}] tensor, got {t.dtype} {tuple(t.shape)}")
    n_v = lay.v_codes.shape[0] + lay.v_raw.shape[0]
    if n_v != lay.n_tokens:
        raise ValueError(f"keys cover {lay.n_tokens} tokens ({nb} blocks of {lay.group} + {lay.k_raw.shape[0]} raw) "
                         f"but values {n_v} ({lay.v_codes.shape[0]} quantised + {lay.v_raw.shape[0]} raw)")
    if lay.n_tokens == 0:
        raise ValueError("nothing to attend: the layer holds no token")
    return c // d


def kivi_attend_ref(q: torch.Tensor, lay: KIVILayout, *, softmax_scale=None, num_splits=None) -> torch.Tensor:
    """Torch reference of :func:`kivi_attend`, as ``KIVILayer.history`` reads: dequantise in float32
    (``group_dequant_ref``), cast to q's dtype with the raw tokens, then ``F.scaled_dot_product_attention``
    with ``enable_gqa``. ``num_splits`` is accepted for the same signature."""
    h_kv = _check(q, lay, softmax_scale)
    d = q.shape[1]
    nb, c = lay.k_codes.shape[:2]
    kq = group_dequant_ref(lay.key_codes()).view(nb, c, lay.group).transpose(1, 2).reshape(nb * lay.group, c)
    k = torch.cat([kq.to(q.dtype), lay.k_raw.to(q.dtype)])
    v = torch.cat([group_dequant_ref(lay.value_codes()).to(q.dtype), lay.v_raw.to(q.dtype)])
    return sdpa_decode(q, k.view(-1, h_kv, d).transpose(0, 1), v.view(-1, h_kv, d).transpose(0, 1), softmax_scale)


@jit
def _kivi_attend_kernel(q_ptr, kc_ptr, kz_ptr, ks_ptr, kr_ptr, vc_ptr, vz_ptr, vs_ptr, vr_ptr, o_ptr, m_ptr, l_ptr,
                        n_tok, n_kq, n_vq, blocks_per_split, sm_scale,
                        s_q, s_kcb, s_kcc, s_kz, s_kr, s_vc, s_vz, s_vr, s_oh, s_os, s_mh,
                        G: tl.constexpr, HEAD_DIM: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                        V_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (KV head, split) over its blocks of tokens."""
    h = tl.program_id(0)
    split = tl.program_id(1)
    PER: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < G
    mask_d = offs_d < HEAD_DIM
    cols = h * HEAD_DIM + offs_d                    # this head's channels
    heads = h * G + offs_g
    q = tl.load(q_ptr + heads[:, None] * s_q + offs_d[None, :], mask=mask_g[:, None] & mask_d[None, :],
                other=0.0).to(tl.float32) * sm_scale
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    lo = split * blocks_per_split
    for b in range(lo, tl.minimum(lo + blocks_per_split, (n_tok + BLOCK_N - 1) // BLOCK_N)):
        t = (b * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        mask_n = t < n_tok
        # keys: per-channel groups of GROUP tokens, packed along the tokens; raw after n_kq
        kq_in = mask_n & (t < n_kq)
        mk = kq_in[:, None] & mask_d[None, :]
        blk = t // GROUP
        tt = t % GROUP
        byte = tl.load(kc_ptr + blk[:, None] * s_kcb + cols[None, :] * s_kcc + (tt // PER)[:, None], mask=mk,
                       other=0).to(tl.int32)
        level = (byte >> ((tt % PER) * BITS).to(tl.int32)[:, None]) & LEVELS
        side = blk[:, None] * s_kz + cols[None, :]
        k_deq = (level.to(tl.float32) * tl.load(ks_ptr + side, mask=mk, other=0.0).to(tl.float32)
                 + tl.load(kz_ptr + side, mask=mk, other=0.0).to(tl.float32))
        k_raw = tl.load(kr_ptr + (t - n_kq)[:, None] * s_kr + cols[None, :],
                        mask=(mask_n & (t >= n_kq))[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        k = tl.where(kq_in[:, None], k_deq, k_raw)
        # values: per-token groups of V_GROUP channels, packed along the channels; raw after n_vq
        vq_in = mask_n & (t < n_vq)
        mv = vq_in[:, None] & mask_d[None, :]
        vbyte = tl.load(vc_ptr + t[:, None] * s_vc + (cols // PER)[None, :], mask=mv, other=0).to(tl.int32)
        vlevel = (vbyte >> ((cols % PER) * BITS)[None, :]) & LEVELS
        vside = t[:, None] * s_vz + (cols // V_GROUP)[None, :]
        v_deq = (vlevel.to(tl.float32) * tl.load(vs_ptr + vside, mask=mv, other=0.0).to(tl.float32)
                 + tl.load(vz_ptr + vside, mask=mv, other=0.0).to(tl.float32))
        v_raw = tl.load(vr_ptr + (t - n_vq)[:, None] * s_vr + cols[None, :],
                        mask=(mask_n & (t >= n_vq))[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        v = tl.where(vq_in[:, None], v_deq, v_raw)
        scores = tl.where(mask_n[None, :], tl.dot(q, tl.trans(k), input_precision="ieee"), float("-inf"))
        m_i, l_i, alpha, p = softmax_step(m_i, l_i, scores)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    tl.store(o_ptr + heads[:, None] * s_oh + split * s_os + offs_d[None, :], acc, mask=mask_g[:, None] & mask_d[None, :])
    tl.store(m_ptr + heads * s_mh + split, m_i, mask=mask_g)
    tl.store(l_ptr + heads * s_mh + split, l_i, mask=mask_g)


def kivi_attend(q: torch.Tensor, lay: KIVILayout, *, softmax_scale=None, num_splits=None) -> torch.Tensor:
    """Decode attention of ``q`` [H_q, D] (float32/float16/bfloat16; post-RoPE) over every token of a KIVI
    layer (Triton; module docstring), GQA with H_kv = C / D.

    Parameters
    ----------
    q : [H_q, D] — the decode query; H_q a multiple of H_kv.
    lay : :class:`KIVILayout`.
    softmax_scale : float, default D^-0.5.
    num_splits : int or None — flash-decoding splits per KV head.

    Returns [H_q, D] in q's dtype (computed in float32).
    Raises ValueError for a shape/dtype mismatch (naming it) or an empty layer.
    """
    h_kv = _check(q, lay, softmax_scale)
    d = q.shape[1]
    g = q.shape[0] // h_kv
    q = unit_stride(q)
    kc, kz, ks, kr, vc, vz, vs, vr = map(unit_stride, (lay.k_codes, lay.k_zmin, lay.k_scale, lay.k_raw, lay.v_codes,
                                                      lay.v_zmin, lay.v_scale, lay.v_raw))
    n_blocks = -(-lay.n_tokens // BLOCK_N)
    n_splits, per_split = plan_splits(n_blocks, h_kv, num_splits)
    o, m, l = partials(q.shape[0], n_splits, d, q.device)
    _kivi_attend_kernel[(h_kv, n_splits)](
        q, *map(nonempty, (kc, kz, ks, kr, vc, vz, vs, vr)), o, m, l,
        lay.n_tokens, kc.shape[0] * lay.group, vc.shape[0], per_split,
        d ** -0.5 if softmax_scale is None else softmax_scale,
        q.stride(0), kc.stride(0), kc.stride(1), kz.stride(0), kr.stride(0), vc.stride(0), vz.stride(0), vr.stride(0),
        o.stride(0), o.stride(1), m.stride(0),
        G=g, HEAD_DIM=d, BITS=lay.bits, GROUP=lay.group, V_GROUP=lay.v_group, BLOCK_G=next_pow2(g),
        BLOCK_D=next_pow2(d), BLOCK_N=BLOCK_N)
    return combine(o, m, l, q.dtype)


def kivi_attend_bytes(q: torch.Tensor, lay: KIVILayout) -> int:
    """Bytes :func:`kivi_attend` reads: the query, every packed key and value code with its fp16 zmin/scale,
    and the raw keys and values. Distinct bytes (what memory must deliver at least)."""
    return sum(x.numel() * x.element_size() for x in (q, lay.k_codes, lay.k_zmin, lay.k_scale, lay.k_raw,
                                                        lay.v_codes, lay.v_zmin, lay.v_scale, lay.v_raw))
