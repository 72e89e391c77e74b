"""The mean of each token's nearest references (ResidualKV, arXiv 2602.08005v2 §IV-A).

A coded token is restored as ``f_d(z̃) + mean`` over its k nearest earlier references
(:func:`kvbench.compress.residualkv.references.nearest_references`). The mean is summed one neighbour slot at a
time, in slot order, so the cache, the codec's training, the compressed image store and the restore kernel's
torch reference (:func:`kvbench.kernels.restore_attend.knn_mean`) round alike; it lives here, in the lowest
package that uses it.
"""
from __future__ import annotations

import torch


def mean_reference(ref_kv: torch.Tensor, idx: torch.LongTensor, valid: torch.BoolTensor, *,
                   check: bool = True) -> torch.Tensor:
    """Mean of each token's valid neighbours, \\bar{KV}_{ref,i} = (1/k_i) Σ_{j∈R_i} kv_j (§IV-A).

    Parameters
    ----------
    ref_kv : [R, D] float (any float dtype, FP8 included) — the reference pool.
    idx : [T, k] long — neighbour indices from
        :func:`~kvbench.compress.residualkv.references.nearest_references`.
    valid : [T, k] bool — which slots count.
    check : bool — False skips the checks that read values back to the host (a token with no valid
        neighbour, an index out of range): a cache's per-step path, :mod:`kvbench.compress.checks`.

    Returns
    -------
    torch.Tensor [T, D] float32. Only the T·k rows the tokens use are read and converted to float32 (never
    the whole pool: a cache restoring a few tokens reads a few references); the sum runs one neighbour
    slot at a time, in slot order.

    Raises ValueError for mismatched shapes, an index out of range, or a token with no valid neighbour.
    """
    if idx.shape != valid.shape or idx.dim() != 2 or ref_kv.dim() != 2:
        raise ValueError(f"expected ref_kv [R, D] and idx, valid [T, k], got {tuple(ref_kv.shape)}, "
                         f"{tuple(idx.shape)}, {tuple(valid.shape)}")
    if check:
        counts = valid.sum(1)
        if (counts == 0).any():
            raise ValueError(f"token row {int(torch.nonzero(counts == 0)[0])} has no valid neighbour")
        used = idx[valid]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= ref_kv.shape[0]):
            raise ValueError(f"neighbour index out of range [0, {ref_kv.shape[0]}): "
                             f"{int(used.min())}..{int(used.max())}")
    n_tok, k = idx.shape
    rows = ref_kv[idx.reshape(-1).clamp(0, max(0, ref_kv.shape[0] - 1))].to(torch.float32)
    return mean_rows(rows.view(n_tok, k, ref_kv.shape[1]), valid)


def mean_rows(rows: torch.Tensor, valid: torch.BoolTensor) -> torch.Tensor:
    """Mean over the valid neighbours of gathered reference rows: ``rows`` float32 ``[T, k, D]`` (row j of
    token i = its j-th neighbour), ``valid`` ``[T, k]`` -> float32 ``[T, D]``. One slot at a time in slot order
    (the sum's rounding is :func:`mean_reference`'s); a token with no valid slot gives NaN (callers check)."""
    acc = torch.zeros((rows.shape[0], rows.shape[2]), dtype=torch.float32, device=rows.device)
    weight = valid.to(torch.float32)
    for j in range(rows.shape[1]):
        acc.addcmul_(rows[:, j], weight[:, j, None])   # acc + row · {0, 1}: the product is exact, one rounding
    return acc.div_(weight.sum(1)[:, None])
