"""Tolerances that follow from the arithmetic, not from the machine a test was written on.

Two floating-point computations of the same mathematics (a cached key rotated later vs the key computed in place,
a batched vs an unbatched matmul) differ by rounding. A length-``n`` dot product computed in any order satisfies
``|fl(sum a_i b_i) - sum a_i b_i| <= gamma_n * sum |a_i b_i|`` with ``gamma_n ~ n * eps`` (Higham, *Accuracy and
Stability of Numerical Algorithms*, 2nd ed., section 3.1), and BLAS libraries choose the order by shape, thread
count and CPU. So a comparison of two paths gets ``eps(dtype) x magnitude x depth``: ``depth`` is the number of
roundings one result accumulates along the longer path (the reduction length of its matmuls, plus its elementwise
steps), ``magnitude`` the largest value compared.
"""
from __future__ import annotations

import torch


def arith_atol(ref: torch.Tensor, depth: int, dtype: torch.dtype | None = None) -> float:
    """Absolute tolerance ``eps(dtype) * max|ref| * depth`` for comparing two computation paths of ``ref``.

    Args:
        ref: the reference result (any shape, floating dtype).
        depth: roundings along the longer path (e.g. the inner dimension of its last matmul).
        dtype: the arithmetic's dtype (default ``ref.dtype``).
    """
    assert depth >= 1, depth
    return torch.finfo(dtype or ref.dtype).eps * float(ref.abs().max()) * depth
