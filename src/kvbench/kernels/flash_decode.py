"""Split-KV decode attention ("flash-decoding"): the machinery shared by the decode kernels.

One decode query per head attends over n tokens that a kernel produces block by block (raw, dequantised or
restored K/V). The tokens are cut into ``num_splits`` contiguous runs of blocks; one program per (KV head,
split) keeps an online softmax over its run (running max m, normaliser l, unnormalised output o), and a
combine step merges the splits: out = Σ_s e^{m_s − M} o_s / Σ_s e^{m_s − M} l_s with M = max_s m_s
(Dao et al., "Flash-Decoding for long-context inference", 2023). Splitting lets a short query with a
long history occupy many programs; an empty split keeps m = −inf, l = 0 and drops out of the sum.

GQA: query head i reads KV head i // G, G = H_q / H_kv (the layout of ``repeat_interleave`` and of
``F.scaled_dot_product_attention(..., enable_gqa=True)``); a program serves the G query heads of its KV head.
"""
import math

import torch
import torch.nn.functional as F

from kvbench.kernels._triton import jit, next_pow2, reduce_max, reduce_sum, tl

#: tokens per block of the decode kernels (16: the smallest tl.dot tile)
BLOCK_N = 16
#: at most this many splits per KV head (enough programs for a GPU; more only adds combine work)
MAX_SPLITS = 64


@jit
def softmax_step(m_i, l_i, scores):
    """One online-softmax update with a block of ``scores`` [G, N] (−inf where masked; every block holds
    at least one real token, so the new max is finite). Returns (m, l, alpha, p): the running max and
    normaliser after the block, the factor that rescales what was accumulated before, and exp(scores − m)."""
    m_new = tl.maximum(m_i, reduce_max(scores, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    return m_new, l_i * alpha + reduce_sum(p, 1), alpha, p


@jit
def _combine_kernel(o_ptr, m_ptr, l_ptr, out_ptr, n_splits, s_oh, s_os, s_mh, s_outh,
                    D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[h] = Σ_s e^{m_s − M} o_s / Σ_s e^{m_s − M} l_s, one program per query head."""
    h = tl.program_id(0)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < n_splits
    m = tl.load(m_ptr + h * s_mh + offs_s, mask=mask_s, other=float("-inf"))
    l = tl.load(l_ptr + h * s_mh + offs_s, mask=mask_s, other=0.0)
    o = tl.load(o_ptr + h * s_oh + offs_s[:, None] * s_os + offs_d[None, :],
                mask=mask_s[:, None] & (offs_d[None, :] < D), other=0.0)
    w = tl.exp(m - reduce_max(m, 0))           # empty splits: e^{-inf} = 0
    out = reduce_sum(w[:, None] * o, 0) / reduce_sum(w * l, 0)
    tl.store(out_ptr + h * s_outh + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < D)


def plan_splits(n_blocks: int, n_kv_heads: int, num_splits: int | None) -> tuple[int, int]:
    """``(num_splits, blocks_per_split)`` for ``n_blocks`` token blocks. ``num_splits`` None: enough splits
    that H_kv × splits programs reach about 128 (at most :data:`MAX_SPLITS`), never more than the blocks.
    A given value is kept even above ``n_blocks`` (empty splits are legal; the tests use them).

    Raises ValueError for num_splits < 1.
    """
    if num_splits is None:
        num_splits = max(1, min(MAX_SPLITS, n_blocks, math.ceil(128 / max(1, n_kv_heads))))
    elif num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    return num_splits, max(1, math.ceil(n_blocks / num_splits))


def partials(h_q: int, num_splits: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-split outputs ``o`` [H_q, S, D], maxima ``m`` and normalisers ``l`` [H_q, S], float32."""
    return (torch.empty(h_q, num_splits, head_dim, dtype=torch.float32, device=device),
            torch.empty(h_q, num_splits, dtype=torch.float32, device=device),
            torch.empty(h_q, num_splits, dtype=torch.float32, device=device))


def combine(o: torch.Tensor, m: torch.Tensor, l: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Merge the splits of :func:`partials` into ``[H_q, D]`` in ``dtype`` (Triton combine kernel)."""
    h_q, n_splits, d = o.shape
    out = torch.empty(h_q, d, dtype=dtype, device=o.device)
    _combine_kernel[(h_q,)](o, m, l, out, n_splits, o.stride(0), o.stride(1), m.stride(0), out.stride(0),
                            D=d, BLOCK_S=next_pow2(n_splits, 2), BLOCK_D=next_pow2(d))
    return out


def check_query(q: torch.Tensor, n_kv_heads: int, head_dim: int) -> int:
    """Check a decode query ``q`` [H_q, D] (float32/float16/bfloat16) against H_kv KV heads of ``head_dim``;
    returns G = H_q / H_kv.

    Raises ValueError naming the bad shape or dtype (H_q not a multiple of H_kv, D mismatch or odd D).
    """
    if q.dim() != 2 or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q must be a float32/float16/bfloat16 [H_q, D] tensor (one decode query per head), "
                         f"got {q.dtype} {tuple(q.shape)}")
    if q.shape[1] != head_dim or head_dim % 2:
        raise ValueError(f"q head dim {q.shape[1]} must equal the KV head dim {head_dim} (even, for RoPE halves)")
    if n_kv_heads < 1 or q.shape[0] % n_kv_heads:
        raise ValueError(f"H_q = {q.shape[0]} query heads must be a multiple of H_kv = {n_kv_heads} KV heads (GQA)")
    return q.shape[0] // n_kv_heads


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None) -> torch.Tensor:
    """The references' attention: ``q`` [H_q, D] over ``k``, ``v`` [H_kv, n, D] with
    ``F.scaled_dot_product_attention(..., enable_gqa=True)`` in q's dtype; returns [H_q, D]."""
    out = F.scaled_dot_product_attention(q[None, :, None, :], k[None].to(q.dtype), v[None].to(q.dtype),
                                         scale=softmax_scale, enable_gqa=True)
    return out[0, :, 0, :]
