"""Decode attention of a ResidualKV sparse layer that restores coded tokens on the fly (ResidualKV §IV-B/C).

One decode query per head attends over what the layer holds (``compress/residualkv/cache.py``):

(a) raw tokens, post-RoPE K/V as the model wrote them: the sinks and the raw window;
(b) the selected references: pre-RoPE K‖V stored FP8 e4m3 (or float), rotated here at their positions;
(c) the selected coded tokens: kv̂ = f_d(z̃) + mean of the token's valid references (k-NN mean; a zero mean
    when none is valid, the codec without references), z̃ the dequantised code (:mod:`.group_quant`),
    f_d the linear decoder W_d [d_kv, d_c] (+ bias); K‖V split per head, K rotated at the token's position.

The Triton kernel restores each block of tokens in registers and feeds it straight to an online softmax
(:mod:`.flash_decode`): restored K/V are never written to memory, which is what the torch path spends its
time on (the whole reference pool converted per step, the restored K/V materialised, then attended).

**Latent V (``latent_v=True``; beyond the paper).** f_d is linear, so the coded tokens' share of the output,
Σ_i a_i (W_V z̃_i + b_V + m_i), equals W_V (Σ_i a_i z̃_i) + Σ_i a_i (b_V + m_i): the kernel accumulates
attention-weighted codes [G, d_c] and applies W_V once per split instead of decoding V for every token
(per block G·d_c instead of N·d_c·D multiply-adds for V). Same result up to float rounding (tested).

RoPE: the rotate-half form of Llama / Qwen2 (``apply_rotary_pos_emb``): with k = [k1, k2] (halves of D),
rot(k) = [k1·cos1 − k2·sin1, k2·cos2 + k1·sin2], cos/sin rows from a table indexed by position.

Not supported: a key norm between restore and RoPE (Qwen3's ``k_norm``): that path stays in torch.

Integration contract (the lead's decode refactor): a sparse layer holding its raw tokens as [H_kv, n, D]
post-RoPE tensors and its coded tokens in one contiguous :class:`CodedLayer` store calls, per decode step,
``kvbench.kernels.restore_attend(q, k_raw, v_raw, layer, ref_sel, code_sel)`` with the OmniKV selection as
row indices into that store (``ref_sel`` / ``code_sel``; None = all, the standalone cache), and uses the
[H_q, D] output as the layer's attention output; ``linear_decoder`` gives W_d from the trained codec.
"""
from dataclasses import dataclass

import torch

from kvbench.kernels._triton import jit, next_pow2, nonempty, tl, unit_stride
from kvbench.kernels.flash_decode import BLOCK_N, check_query, combine, partials, plan_splits, sdpa_decode, softmax_step
from kvbench.kernels.group_quant import PackedCodes, check_codes, dequant_tile, group_dequant_ref
from kvbench.kernels.reference_mean import mean_reference

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True)
class CodedLayer:
    """What one ResidualKV sparse layer holds besides its raw tokens, as the restore kernel reads it.

    Fields
    ------
    refs : [R, d_kv] — references' pre-RoPE K‖V (K of all KV heads first, head h at columns h·D..(h+1)·D,
        then V likewise; d_kv = 2·H_kv·D), float8_e4m3fn (§V-A) or float32/float16/bfloat16.
    ref_pos : [R] int — their absolute positions.
    codes : :class:`PackedCodes` of T coded tokens (bits 2/4/8 packed, or 16 = fp16 codes).
    nbr : [T, k] int16/int32/int64 — each coded token's reference rows (k may be 0: no references).
    valid : [T, k] bool — which of them count in the mean.
    code_pos : [T] int — the coded tokens' absolute positions.
    w_d : [d_kv, d_c] float — the linear decoder f_d (``nn.Linear`` weight layout; :func:`linear_decoder`).
    b_d : [d_kv] float or None — its bias.
    cos, sin : [P, D] float — RoPE at positions 0..P−1 (the model's rotary module, HF layout with the halves
        repeated); every position in ``ref_pos`` and ``code_pos`` must be < P.
    """

    refs: torch.Tensor
    ref_pos: torch.Tensor
    codes: PackedCodes
    nbr: torch.Tensor
    valid: torch.Tensor
    code_pos: torch.Tensor
    w_d: torch.Tensor
    b_d: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor


def linear_decoder(codec_layer) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(W_d [d_kv, d_c], b_d [d_kv] or None)`` of a :class:`~kvbench.compress.residualkv.codec.LayerCodec`
    whose decoder is linear (the paper's f_d): one branch's ``nn.Linear`` weight, or for a ``joint=False``
    codec the block-diagonal matrix of its K and V branches (K codes the first d_c/2 latent values).

    Raises ValueError when a branch's decoder is not an ``nn.Linear`` (the reversed codec of Fig. 6).
    """
    try:
        return codec_layer.linear_decoder()
    except ValueError as e:
        raise ValueError(f"restore_attend needs a linear decoder f_d: {e}") from None


def _check(q, k_raw, v_raw, layer: CodedLayer, ref_sel, code_sel, key_norm, softmax_scale) -> tuple[int, int, int]:
    """Validate shapes and dtypes (never values: a value check would synchronise the host on the GPU).
    Returns (H_kv, n_ref, n_code)."""
    if key_norm is not None:
        raise ValueError("restore_attend does not apply a key norm between restore and RoPE (Qwen3 k_norm); "
                         "that model's sparse layers keep the torch path")
    if k_raw.dim() != 3 or k_raw.shape != v_raw.shape or k_raw.dtype != q.dtype or v_raw.dtype != q.dtype:
        raise ValueError(f"k_raw, v_raw must be [H_kv, n_raw, D] tensors of q's dtype {q.dtype}, got "
                         f"{k_raw.dtype} {tuple(k_raw.shape)} and {v_raw.dtype} {tuple(v_raw.shape)}")
    h_kv, _, d = k_raw.shape
    check_query(q, h_kv, d)
    if softmax_scale is not None and not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale}")
    d_kv = 2 * h_kv * d
    refs, codes = layer.refs, layer.codes
    if refs.dim() != 2 or refs.shape[1] != d_kv or refs.dtype not in (torch.float8_e4m3fn, *_FLOATS):
        raise ValueError(f"refs must be [R, d_kv = {d_kv}] float8_e4m3fn/float32/float16/bfloat16, got "
                         f"{refs.dtype} {tuple(refs.shape)}")
    if layer.ref_pos.shape != (refs.shape[0],) or layer.ref_pos.dtype not in _INTS:
        raise ValueError(f"ref_pos must be an int [R = {refs.shape[0]}] tensor, got {layer.ref_pos.dtype} "
                         f"{tuple(layer.ref_pos.shape)}")
    check_codes(codes, None)
    n_tok = len(codes)
    if layer.nbr.dim() != 2 or layer.nbr.shape[0] != n_tok or layer.nbr.dtype not in _INTS \
            or layer.valid.shape != layer.nbr.shape or layer.valid.dtype != torch.bool:
        raise ValueError(f"nbr must be int [T = {n_tok}, k] and valid bool of the same shape, got {layer.nbr.dtype} "
                         f"{tuple(layer.nbr.shape)} and {layer.valid.dtype} {tuple(layer.valid.shape)}")
    if layer.code_pos.shape != (n_tok,) or layer.code_pos.dtype not in _INTS:
        raise ValueError(f"code_pos must be an int [T = {n_tok}] tensor, got {layer.code_pos.dtype} "
                         f"{tuple(layer.code_pos.shape)}")
    if layer.w_d.shape != (d_kv, codes.d_c) or layer.w_d.dtype not in _FLOATS:
        raise ValueError(f"w_d must be a float [d_kv = {d_kv}, d_c = {codes.d_c}] tensor, got {layer.w_d.dtype} "
                         f"{tuple(layer.w_d.shape)}")
    if layer.b_d is not None and layer.b_d.shape != (d_kv,):
        raise ValueError(f"b_d must be [d_kv = {d_kv}] or None, got {tuple(layer.b_d.shape)}")
    if layer.cos.dim() != 2 or layer.cos.shape[1] != d or layer.sin.shape != layer.cos.shape \
            or layer.cos.dtype not in _FLOATS or layer.sin.dtype not in _FLOATS:
        raise ValueError(f"cos, sin must be float [P, D = {d}] tables, got {tuple(layer.cos.shape)} and "
                         f"{tuple(layer.sin.shape)}")
    for name, sel in (("ref_sel", ref_sel), ("code_sel", code_sel)):
        if sel is not None and (sel.dim() != 1 or sel.dtype not in (torch.int32, torch.int64)):
            raise ValueError(f"{name} must be None or int32/int64 [n] row indices, got {sel.dtype} {tuple(sel.shape)}")
    n_ref = refs.shape[0] if ref_sel is None else ref_sel.shape[0]
    n_code = n_tok if code_sel is None else code_sel.shape[0]
    if k_raw.shape[1] + n_ref + n_code == 0:
        raise ValueError("nothing to attend: no raw, reference or coded token")
    return h_kv, n_ref, n_code


def rope_rotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``k`` [..., n, D] with ``cos``/``sin`` [n, D] (Llama/Qwen2 ``apply_rotary_pos_emb``)."""
    k1, k2 = k.chunk(2, -1)
    return k * cos + torch.cat([-k2, k1], -1) * sin


def knn_mean(refs: torch.Tensor, nbr: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean of each token's valid references, float32 [n, d_kv]: the cache's own
    ``mean_reference`` for tokens with a valid reference, zero for a token with none (k = 0: a
    codec without references; the kernel defines that case, the cache never builds it with k > 0)."""
    out = torch.zeros(nbr.shape[0], refs.shape[1], dtype=torch.float32, device=refs.device)
    has = valid.any(1)
    if has.any():
        out[has] = mean_reference(refs.float(), nbr[has].long(), valid[has])
    return out


def restore_attend_ref(q, k_raw, v_raw, layer: CodedLayer, ref_sel=None, code_sel=None, *, softmax_scale=None,
                       latent_v=False, num_splits=None, key_norm=None) -> torch.Tensor:
    """Torch reference of :func:`restore_attend`, as the cache computes it: restore in float32
    (``group_dequant_ref``, k-NN mean, z̃ W_dᵀ + b), cast to q's dtype, rotate there, then
    ``F.scaled_dot_product_attention`` with ``enable_gqa``. ``latent_v`` and ``num_splits`` change how the
    kernel computes, not the result, and are accepted for the same signature."""
    h_kv, _, _ = _check(q, k_raw, v_raw, layer, ref_sel, code_sel, key_norm, softmax_scale)
    d = q.shape[1]
    d_k = h_kv * d
    refs = layer.refs.float()

    def heads(kv, pos):  # [n, d_kv] float32 -> rotated K, V [H_kv, n, D] in q's dtype
        k, v = kv.to(q.dtype).split(d_k, -1)
        k, v = (x.reshape(len(kv), h_kv, d).transpose(0, 1) for x in (k, v))
        return rope_rotate(k, layer.cos[pos].to(q.dtype), layer.sin[pos].to(q.dtype)), v

    ks, vs = [k_raw], [v_raw]
    rows = torch.arange(refs.shape[0], device=refs.device) if ref_sel is None else ref_sel.long()
    if len(rows):
        k, v = heads(refs[rows], layer.ref_pos[rows])
        ks.append(k), vs.append(v)
    rows = torch.arange(len(layer.codes), device=refs.device) if code_sel is None else code_sel.long()
    if len(rows):
        z = group_dequant_ref(layer.codes, rows)
        kv = z @ layer.w_d.float().T + knn_mean(refs, layer.nbr[rows], layer.valid[rows])
        if layer.b_d is not None:
            kv = kv + layer.b_d.float()
        k, v = heads(kv, layer.code_pos[rows])
        ks.append(k), vs.append(v)
    return sdpa_decode(q, torch.cat(ks, 1), torch.cat(vs, 1), softmax_scale)


@jit
def _load_f32(ptrs, mask, FP8: tl.constexpr):
    """Load as float32; FP8: the e4m3 bytes (passed as uint8) reinterpreted, an exact conversion."""
    if FP8:
        x = tl.load(ptrs, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return x


@jit
def _rope(k1, k2, cos_ptr, sin_ptr, pos, s_cos, offs_hd, mask, HD: tl.constexpr):
    """Rotate-half RoPE of pre-RoPE key halves k1, k2 [N, HD] at positions ``pos`` [N]."""
    base = pos[:, None] * s_cos + offs_hd[None, :]
    c1 = tl.load(cos_ptr + base, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + base + HD, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + base, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + base + HD, mask=mask, other=0.0).to(tl.float32)
    return k1 * c1 - k2 * s1, k2 * c2 + k1 * s2


@jit
def _selected(sel_ptr, pos_ptr, offs_n, mask_n, HAS_SEL: tl.constexpr):
    """Store rows (int64) and positions of the selected tokens ``offs_n`` of a block: ``sel[offs_n]`` with a
    selection, else the store's own rows."""
    if HAS_SEL:
        rows = tl.load(sel_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
    else:
        rows = offs_n.to(tl.int64)
    return rows, tl.load(pos_ptr + rows, mask=mask_n, other=0).to(tl.int64)


@jit
def _scores(q1, q2, k1, k2, mask_n):
    """q·k over the two RoPE halves [G, N], −inf past the last token (q already scaled)."""
    s = tl.dot(q1, tl.trans(k1), input_precision="ieee") + tl.dot(q2, tl.trans(k2), input_precision="ieee")
    return tl.where(mask_n[None, :], s, float("-inf"))


@jit
def _restore_attend_kernel(
        q_ptr, kr_ptr, vr_ptr, ref_ptr, rpos_ptr, rsel_ptr, pk_ptr, zmin_ptr, scale_ptr, nbr_ptr, valid_ptr,
        cpos_ptr, csel_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, o_ptr, m_ptr, l_ptr,
        n_raw, n_ref, n_code, blocks_per_split, sm_scale,
        s_q, s_krh, s_krn, s_vrh, s_vrn, s_ref, s_pk, s_sc, s_nbr, s_valid, s_w, s_cos, s_oh, s_os, s_mh,
        G: tl.constexpr, HEAD_DIM: tl.constexpr, D_K: tl.constexpr, D_C: tl.constexpr, BITS: tl.constexpr,
        GROUP: tl.constexpr, K: tl.constexpr, REF_FP8: tl.constexpr, HAS_RSEL: tl.constexpr,
        HAS_CSEL: tl.constexpr, HAS_BIAS: tl.constexpr, LATENT: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_HD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """One program per (KV head, split): the split's blocks of raw, reference and coded tokens, in that order
    of a virtual token list whose segments start on block boundaries."""
    h = tl.program_id(0)
    split = tl.program_id(1)
    HD: tl.constexpr = HEAD_DIM // 2
    offs_g = tl.arange(0, BLOCK_G)
    offs_hd = tl.arange(0, BLOCK_HD)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, BLOCK_C)
    mask_g = offs_g < G
    mask_hd = offs_hd < HD
    mask_d = offs_d < HEAD_DIM
    heads = h * G + offs_g
    q_at = q_ptr + heads[:, None] * s_q + offs_hd[None, :]
    q1 = tl.load(q_at, mask=mask_g[:, None] & mask_hd[None, :], other=0.0).to(tl.float32) * sm_scale
    q2 = tl.load(q_at + HD, mask=mask_g[:, None] & mask_hd[None, :], other=0.0).to(tl.float32) * sm_scale
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    acc_z = tl.full([BLOCK_G, BLOCK_C], 0.0, tl.float32)        # latent V: attention-weighted codes
    nb_raw = (n_raw + BLOCK_N - 1) // BLOCK_N
    nb_ref = (n_ref + BLOCK_N - 1) // BLOCK_N
    lo = split * blocks_per_split
    hi = tl.minimum(lo + blocks_per_split, nb_raw + nb_ref + (n_code + BLOCK_N - 1) // BLOCK_N)
    k_col = h * HEAD_DIM            # this head's K columns in a K‖V row; V columns at D_K + k_col
    wmask_hd = (offs_c[:, None] < D_C) & mask_hd[None, :]
    wmask_d = (offs_c[:, None] < D_C) & mask_d[None, :]
    wv_at = w_ptr + (D_K + k_col + offs_d)[None, :] * s_w + offs_c[:, None]     # W_V rows of head h, transposed

    # (a) raw tokens: post-RoPE K/V as stored
    for b in range(lo, tl.minimum(hi, nb_raw)):
        offs_n = b * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_raw
        mk = mask_n[:, None] & mask_hd[None, :]
        k_at = kr_ptr + h * s_krh + offs_n[:, None] * s_krn + offs_hd[None, :]
        k1 = tl.load(k_at, mask=mk, other=0.0).to(tl.float32)
        k2 = tl.load(k_at + HD, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(vr_ptr + h * s_vrh + offs_n[:, None] * s_vrn + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        m_i, l_i, alpha, p = softmax_step(m_i, l_i, _scores(q1, q2, k1, k2, mask_n))
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        if LATENT:
            acc_z = acc_z * alpha[:, None]

    # (b) selected references: pre-RoPE K‖V, rotated at their positions
    for b in range(tl.maximum(lo, nb_raw), tl.minimum(hi, nb_raw + nb_ref)):
        offs_n = (b - nb_raw) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_ref
        rows, pos = _selected(rsel_ptr, rpos_ptr, offs_n, mask_n, HAS_RSEL)
        mk = mask_n[:, None] & mask_hd[None, :]
        at = ref_ptr + rows[:, None] * s_ref + k_col
        k1 = _load_f32(at + offs_hd[None, :], mk, REF_FP8)
        k2 = _load_f32(at + HD + offs_hd[None, :], mk, REF_FP8)
        v = _load_f32(at + D_K + offs_d[None, :], mask_n[:, None] & mask_d[None, :], REF_FP8)
        k1, k2 = _rope(k1, k2, cos_ptr, sin_ptr, pos, s_cos, offs_hd, mk, HD)
        m_i, l_i, alpha, p = softmax_step(m_i, l_i, _scores(q1, q2, k1, k2, mask_n))
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        if LATENT:
            acc_z = acc_z * alpha[:, None]

    # (c) selected coded tokens: kv̂ = W_d z̃ + b + k-NN mean, restored in registers
    for b in range(tl.maximum(lo, nb_raw + nb_ref), hi):
        offs_n = (b - nb_raw - nb_ref) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_code
        rows, pos = _selected(csel_ptr, cpos_ptr, offs_n, mask_n, HAS_CSEL)
        z = dequant_tile(pk_ptr, zmin_ptr, scale_ptr, rows, mask_n, s_pk, s_sc, offs_c, D_C, BITS, GROUP)
        mean1 = tl.full([BLOCK_N, BLOCK_HD], 0.0, tl.float32)
        mean2 = tl.full([BLOCK_N, BLOCK_HD], 0.0, tl.float32)
        mean_v = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
        count = tl.full([BLOCK_N], 0.0, tl.float32)
        for j in tl.static_range(K):
            idx = tl.load(nbr_ptr + rows * s_nbr + j, mask=mask_n, other=0).to(tl.int64)
            ok = (tl.load(valid_ptr + rows * s_valid + j, mask=mask_n, other=0) != 0) & mask_n
            at = ref_ptr + idx[:, None] * s_ref + k_col
            mean1 += _load_f32(at + offs_hd[None, :], ok[:, None] & mask_hd[None, :], REF_FP8)
            mean2 += _load_f32(at + HD + offs_hd[None, :], ok[:, None] & mask_hd[None, :], REF_FP8)
            mean_v += _load_f32(at + D_K + offs_d[None, :], ok[:, None] & mask_d[None, :], REF_FP8)
            count += ok.to(tl.float32)
        inv = tl.where(count > 0, 1.0 / tl.maximum(count, 1.0), 0.0)[:, None]     # no valid reference: zero mean
        w1 = tl.load(w_ptr + (k_col + offs_hd)[None, :] * s_w + offs_c[:, None], mask=wmask_hd, other=0.0)
        w2 = tl.load(w_ptr + (k_col + HD + offs_hd)[None, :] * s_w + offs_c[:, None], mask=wmask_hd, other=0.0)
        k1 = tl.dot(z, w1.to(tl.float32), input_precision="ieee") + mean1 * inv
        k2 = tl.dot(z, w2.to(tl.float32), input_precision="ieee") + mean2 * inv
        mean_v = mean_v * inv
        if HAS_BIAS:
            k1 += tl.load(b_ptr + k_col + offs_hd, mask=mask_hd, other=0.0).to(tl.float32)[None, :]
            k2 += tl.load(b_ptr + k_col + HD + offs_hd, mask=mask_hd, other=0.0).to(tl.float32)[None, :]
            mean_v += tl.load(b_ptr + D_K + k_col + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        k1, k2 = _rope(k1, k2, cos_ptr, sin_ptr, pos, s_cos, offs_hd, mask_n[:, None] & mask_hd[None, :], HD)
        m_i, l_i, alpha, p = softmax_step(m_i, l_i, _scores(q1, q2, k1, k2, mask_n))
        if LATENT:
            acc = acc * alpha[:, None] + tl.dot(p, mean_v, input_precision="ieee")
            acc_z = acc_z * alpha[:, None] + tl.dot(p, z, input_precision="ieee")
        else:
            wv = tl.load(wv_at, mask=wmask_d, other=0.0).to(tl.float32)
            v = tl.dot(z, wv, input_precision="ieee") + mean_v
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")

    if LATENT:      # W_V once per split: Σ a_i W_V z̃_i = W_V Σ a_i z̃_i
        acc += tl.dot(acc_z, tl.load(wv_at, mask=wmask_d, other=0.0).to(tl.float32), input_precision="ieee")
    out_at = heads[:, None] * s_oh + split * s_os + offs_d[None, :]
    tl.store(o_ptr + out_at, acc, mask=mask_g[:, None] & mask_d[None, :])
    tl.store(m_ptr + heads * s_mh + split, m_i, mask=mask_g)
    tl.store(l_ptr + heads * s_mh + split, l_i, mask=mask_g)


def restore_attend(q, k_raw, v_raw, layer: CodedLayer, ref_sel=None, code_sel=None, *, softmax_scale=None,
                   latent_v=False, num_splits=None, key_norm=None) -> torch.Tensor:
    """Decode attention of one sparse layer over raw, reference and coded tokens, restoring in-kernel
    (Triton; module docstring).

    Parameters
    ----------
    q : [H_q, D] float32/float16/bfloat16 — the decode query, post-RoPE; H_q a multiple of H_kv (GQA).
    k_raw, v_raw : [H_kv, n_raw, D] in q's dtype — raw post-RoPE keys and values (sinks + window).
    layer : :class:`CodedLayer` — references, coded tokens, W_d, RoPE tables.
    ref_sel : int32/int64 [m] rows of ``layer.refs`` attended, or None (all).
    code_sel : int32/int64 [C] rows of the coded store attended, or None (all). Any order; a row listed
        twice is attended twice (as a repeated key would be).
    softmax_scale : float, default D^-0.5.
    latent_v : bool — apply W_V after the attention sum (beyond the paper; same result).
    num_splits : int or None — flash-decoding splits per KV head (None: :func:`flash_decode.plan_splits`).
    key_norm : must be None (a key norm is not supported; raises).

    Returns [H_q, D] in q's dtype (computed in float32).
    Indices and positions are not range-checked (a check would synchronise the host on the GPU).

    Raises ValueError for a key norm, a shape/dtype mismatch (naming it), or nothing to attend.
    """
    h_kv, n_ref, n_code = _check(q, k_raw, v_raw, layer, ref_sel, code_sel, key_norm, softmax_scale)
    d = q.shape[1]
    g = q.shape[0] // h_kv
    q, k_raw, v_raw = map(unit_stride, (q, k_raw, v_raw))
    c = layer.codes
    codes = PackedCodes(*map(unit_stride, (c.packed, c.zmin, c.scale)), c.bits, c.group)
    refs, ref_pos, nbr, valid, code_pos, w_d, cos, sin = map(unit_stride, (
        layer.refs, layer.ref_pos, layer.nbr, layer.valid, layer.code_pos, layer.w_d, layer.cos, layer.sin))
    ref_sel, code_sel = (None if t is None else unit_stride(t) for t in (ref_sel, code_sel))
    if cos.stride(0) != sin.stride(0):      # one row stride serves both tables
        cos, sin = cos.contiguous(), sin.contiguous()
    fp8 = refs.dtype == torch.float8_e4m3fn
    n_blocks = sum(-(-n // BLOCK_N) for n in (k_raw.shape[1], n_ref, n_code))
    n_splits, per_split = plan_splits(n_blocks, h_kv, num_splits)
    o, m, l = partials(q.shape[0], n_splits, d, q.device)
    fp16_codes = codes.bits == 16
    # absent inputs (no selection, no bias, bits 16's side information) pass a pointer the kernel never reads
    ptrs = [k_raw, v_raw, refs.view(torch.uint8) if fp8 else refs, ref_pos, ref_pos if ref_sel is None else ref_sel,
            codes.packed, codes.packed if fp16_codes else codes.zmin, codes.packed if fp16_codes else codes.scale,
            nbr, valid, code_pos, code_pos if code_sel is None else code_sel,
            w_d, w_d if layer.b_d is None else layer.b_d]
    _restore_attend_kernel[(h_kv, n_splits)](
        q, *map(nonempty, ptrs), cos, sin, o, m, l,
        k_raw.shape[1], n_ref, n_code, per_split, d ** -0.5 if softmax_scale is None else softmax_scale,
        q.stride(0), k_raw.stride(0), k_raw.stride(1), v_raw.stride(0), v_raw.stride(1), refs.stride(0),
        codes.packed.stride(0), 0 if fp16_codes else codes.zmin.stride(0), nbr.stride(0),
        valid.stride(0), w_d.stride(0), cos.stride(0), o.stride(0), o.stride(1), m.stride(0),
        G=g, HEAD_DIM=d, D_K=h_kv * d, D_C=codes.d_c, BITS=codes.bits, GROUP=codes.group, K=nbr.shape[1],
        REF_FP8=fp8, HAS_RSEL=ref_sel is not None, HAS_CSEL=code_sel is not None, HAS_BIAS=layer.b_d is not None,
        LATENT=bool(latent_v), BLOCK_G=next_pow2(g), BLOCK_HD=next_pow2(d // 2), BLOCK_D=next_pow2(d),
        BLOCK_N=BLOCK_N, BLOCK_C=next_pow2(codes.d_c))
    return combine(o, m, l, q.dtype)


def restore_attend_bytes(q, k_raw, v_raw, layer: CodedLayer, ref_sel=None, code_sel=None) -> int:
    """Bytes :func:`restore_attend` reads: the query; raw K/V; per selected reference its K‖V row, position
    and cos/sin rows; per selected coded token its packed code, zmin/scale, position, neighbour indices and
    validity, its k neighbours' K‖V rows (every slot: an upper bound, invalid slots are not loaded) and its
    cos/sin rows; the selection indices; W_d and its bias once. Distinct bytes (what memory must deliver at
    least), not cache traffic: splits re-read W_d from cache."""
    def row(t):
        return (t.shape[1] if t.dim() == 2 else 1) * t.element_size()

    def size(t):
        return 0 if t is None else t.numel() * t.element_size()

    codes = layer.codes
    n_ref = layer.refs.shape[0] if ref_sel is None else ref_sel.shape[0]
    n_code = len(codes) if code_sel is None else code_sel.shape[0]
    rope = row(layer.cos) + row(layer.sin)
    per_ref = row(layer.refs) + row(layer.ref_pos) + rope
    per_code = (row(codes.packed) + row(codes.zmin) + row(codes.scale) + row(layer.code_pos) + row(layer.nbr)
                + row(layer.valid) + layer.nbr.shape[1] * row(layer.refs) + rope)
    return (size(q) + size(k_raw) + size(v_raw) + n_ref * per_ref + n_code * per_code + size(ref_sel)
            + size(code_sel) + size(layer.w_d) + size(layer.b_d))
