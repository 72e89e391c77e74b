"""Reference schedules and nearest-reference retrieval (ResidualKV, arXiv 2602.08005v2 §IV-A).

A reference token is stored directly (FP8 in deployment); every other non-sink, non-window token is
coded as a residual against the mean of its k nearest *earlier* references (ResidualKV §IV-A). Which tokens
are references depends only on absolute positions, so a context prefilled in one chunk or in many gets
the same references.

Two grids (see docs/decisions/residualkv.md, "Reference grids"):

- ``"paper"`` (default, §IV-A): p_0 = n_sink, p_{m+1} = p_m + s + floor(α (p_m − n_sink));
  sinks (positions < n_sink) are kept raw as sinks and are not references.
- ``"code"`` (authors' `src/deltakv/modeling/cache_pipeline.py`, Sparse-vLLM b5169d6): the sinks are the
  initial references; with α = 0 the fixed-stride grid restarts in every ``block``-token block counted
  from n_sink (13 references per 128 tokens at stride 10); with α > 0 the dynamic grid runs on absolute
  positions from n_sink, as in the paper.

The mean over a token's references is :func:`kvbench.kernels.reference_mean.mean_reference` (shared with the
restore kernel's reference).
"""

from __future__ import annotations

import math

import torch

GRIDS = ("paper", "code")

# Distance-matrix chunk: at most this many float32 entries (16 MiB) per chunk of tokens.
_CHUNK_ENTRIES = 1 << 22


def check_schedule(n_sink: int, stride: int, alpha: float, grid: str, block: int) -> None:
    """Raise ValueError naming the first bad schedule parameter (stride or block < 1, n_sink < 0, alpha not finite
    and >= 0, grid not in :data:`GRIDS`)."""
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    if not (alpha >= 0.0 and math.isfinite(alpha)):
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha}")
    if n_sink < 0:
        raise ValueError(f"n_sink must be >= 0, got {n_sink}")
    if grid not in GRIDS:
        raise ValueError(f"grid must be one of {GRIDS}, got {grid!r}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")


def _dynamic_positions(end: int, n_sink: int, stride: int, alpha: float) -> list[int]:
    """p_0 = n_sink, p_{m+1} = p_m + stride + floor(alpha (p_m − n_sink)), all p_m < end.

    A loop over references, not tokens: the count grows like log_{1+α}(T) (§IV-A)."""
    out: list[int] = []
    p = n_sink
    while p < end:
        out.append(p)
        p += stride + math.floor(alpha * (p - n_sink))
    return out


def reference_positions(
    end: int, *, n_sink: int, stride: int, alpha: float = 0.0, grid: str = "paper", block: int = 128
) -> torch.LongTensor:
    """Sorted absolute positions of all reference tokens in [0, end).

    Parameters
    ----------
    end : int — exclusive upper bound on positions (a context length T).
    n_sink, stride, alpha, grid, block — as in :func:`reference_mask`.

    Returns
    -------
    torch.LongTensor [R], ascending. Vectorised for α = 0; a loop over references for α > 0.

    Raises ValueError for end < 0 or a bad schedule (see :func:`reference_mask`).
    """
    check_schedule(n_sink, stride, alpha, grid, block)
    if end < 0:
        raise ValueError(f"end must be >= 0, got {end}")
    sinks = torch.arange(min(n_sink, end), dtype=torch.long)
    if alpha > 0.0:
        grid_pos = torch.tensor(_dynamic_positions(end, n_sink, stride, alpha), dtype=torch.long)
    elif grid == "paper":
        grid_pos = torch.arange(n_sink, max(end, n_sink), stride, dtype=torch.long)
    else:
        # The authors' cache compresses flushed blocks of `block` tokens after the sinks and starts
        # `arange(0, len, stride)` afresh in each one.
        n_blocks = max(0, -(-(end - n_sink) // block))
        offsets = torch.arange(0, block, stride, dtype=torch.long)
        starts = n_sink + block * torch.arange(n_blocks, dtype=torch.long)
        grid_pos = (starts[:, None] + offsets[None, :]).reshape(-1)
        grid_pos = grid_pos[grid_pos < end]
    return torch.cat([sinks, grid_pos]) if grid == "code" else grid_pos


def references_between(
    start: int, end: int, *, n_sink: int, stride: int, alpha: float = 0.0, grid: str = "paper", block: int = 128
) -> list[int]:
    """Reference positions in ``[start, end)``, ascending, as Python ints (the schedule of :func:`reference_mask`,
    computed on the host: a cache coding a block of consecutive positions reads no tensor back to know which of
    them are references). A loop over references for α > 0, ranges otherwise.

    Raises ValueError for a bad schedule (see :func:`reference_mask`).
    """
    check_schedule(n_sink, stride, alpha, grid, block)
    start = max(0, start)
    sinks = list(range(start, min(n_sink, end))) if grid == "code" else []
    if alpha > 0.0:
        return sinks + [p for p in _dynamic_positions(end, n_sink, stride, alpha) if p >= start]
    lo = max(start, n_sink)
    if grid == "paper":
        return list(range(lo + (-(lo - n_sink)) % stride, end, stride))
    return sinks + [p for p in range(lo, end) if (p - n_sink) % block % stride == 0]


def reference_mask(
    positions: torch.LongTensor,
    *,
    n_sink: int,
    stride: int,
    alpha: float = 0.0,
    grid: str = "paper",
    block: int = 128,
    check: bool = True,
) -> torch.BoolTensor:
    """True where the absolute token position is a reference token (§IV-A).

    Parameters
    ----------
    positions : torch.LongTensor, any shape — absolute token positions (>= 0), any order.
    n_sink : int — number of attention-sink tokens at positions 0..n_sink−1.
    stride : int — fixed stride s (α = 0) or initial stride s_0 (α > 0); paper default 10.
    alpha : float — dynamic-stride growth α >= 0 (0 = fixed stride; LongBench uses 0.001).
    grid : "paper" (default) or "code" — see the module docstring; sinks are references only in "code".
    block : int — block length of the "code" grid's per-block restart (authors' recent window, 128).
    check : bool — False skips the negative-position check (a host read; :mod:`kvbench.compress.checks`).

    Returns
    -------
    torch.BoolTensor with the shape and device of ``positions``. Depends only on the values of
    ``positions``, never on how a context is chunked.

    Raises ValueError for stride < 1, alpha < 0, n_sink < 0, block < 1, an unknown grid, a
    non-integer dtype or a negative position.
    """
    check_schedule(n_sink, stride, alpha, grid, block)
    if positions.dtype.is_floating_point or positions.dtype == torch.bool or positions.is_complex():
        raise ValueError(f"positions must be an integer tensor, got dtype {positions.dtype}")
    if positions.numel() == 0:
        return torch.zeros(positions.shape, dtype=torch.bool, device=positions.device)
    pos = positions.to(torch.long)
    if check and (lo := int(pos.min())) < 0:
        raise ValueError(f"positions must be >= 0, got {lo}")
    if alpha == 0.0 and grid == "paper":
        return (pos >= n_sink) & ((pos - n_sink) % stride == 0)
    if alpha == 0.0:
        offset = (pos - n_sink) % block
        return (pos < n_sink) | (offset % stride == 0)
    refs = reference_positions(int(pos.max()) + 1, n_sink=n_sink, stride=stride, alpha=alpha, grid=grid,
                               block=block)
    return torch.isin(pos, refs.to(pos.device))


def reference_count(
    n_tokens: int, *, n_sink: int, stride: int, alpha: float = 0.0, grid: str = "paper", block: int = 128
) -> int:
    """Exact number of reference tokens among positions 0..n_tokens−1 (same schedule as
    :func:`reference_mask`). Closed form for α = 0, a loop over references for α > 0.

    Raises ValueError for n_tokens < 0 or a bad schedule.
    """
    check_schedule(n_sink, stride, alpha, grid, block)
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    sinks = min(n_sink, n_tokens) if grid == "code" else 0
    rest = max(0, n_tokens - n_sink)
    if alpha > 0.0:
        return sinks + len(_dynamic_positions(n_tokens, n_sink, stride, alpha))
    if grid == "paper":
        return -(-rest // stride)
    full, tail = divmod(rest, block)
    return sinks + full * -(-block // stride) + -(-tail // stride)


def approx_reference_count(n_tokens: int, *, n_sink: int, s0: int, alpha: float) -> float:
    """The paper's closed form N_ref(T) ≈ log_{1+α}(1 + α (T − n_sink) / s0) (§IV-A).

    Obtained by dropping the floor in the paper-grid recurrence; for α = 0 the limit (T − n_sink)/s0 is
    returned. Because floor only shortens steps, the exact paper-grid count is >= ceil of this value.
    T < n_sink gives 0. Raises ValueError for n_tokens < 0, n_sink < 0, s0 < 1, alpha < 0.
    """
    check_schedule(n_sink, s0, alpha, "paper", 1)
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    span = max(0, n_tokens - n_sink)
    if alpha == 0.0:
        return span / s0
    return math.log1p(alpha * span / s0) / math.log1p(alpha)


def nearest_references(
    kv: torch.Tensor,
    kv_pos: torch.LongTensor,
    ref_kv: torch.Tensor,
    ref_pos: torch.LongTensor,
    k: int,
    *,
    inclusive: bool = False,
    check: bool = True,
) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """The k_i = min(k, #visible) nearest visible references of each token by squared L2 (§IV-A).

    Parameters
    ----------
    kv : [T, D] float — pre-RoPE K‖V of the tokens to code (any float dtype; ranked in float32).
    kv_pos : [T] integer — their absolute positions.
    ref_kv : [R, D] float — the reference pool (as stored, e.g. after an FP8 round trip).
    ref_pos : [R] integer — absolute positions of the references.
    k : int >= 1 — neighbours per token (paper default 4).
    inclusive : bool — False (paper, causal): reference j is visible to token i iff
        ref_pos[j] < kv_pos[i]. True (authors' code): ref_pos[j] <= kv_pos[i], so a reference may be
        its own nearest neighbour.
    check : bool — False skips the checks that read values back to the host (non-finite input, a token
        with no visible reference, a float32 overflow): a cache's per-block path, :mod:`kvbench.compress.checks`.

    Returns
    -------
    idx : torch.LongTensor [T, k] — indices into the R references, nearest first; ties broken by the
        lower reference index (argmin returns the first minimum), so results are deterministic.
    valid : torch.BoolTensor [T, k] — True for the first k_i slots; invalid slots have idx 0.

    Distances are ||x||² + ||c||² − 2⟨x, c⟩ in float32 (the authors rank by 2⟨x, c⟩ − ||c||², the same
    order), computed in chunks of tokens so memory stays O(chunk · R).

    Raises ValueError for bad shapes, k < 1, non-finite inputs, a float32 overflow of a distance, or a
    token that sees no reference (naming its position).
    """
    if kv.dim() != 2 or ref_kv.dim() != 2 or kv.shape[1] != ref_kv.shape[1]:
        raise ValueError(f"expected kv [T, D] and ref_kv [R, D], got {tuple(kv.shape)} and {tuple(ref_kv.shape)}")
    if kv_pos.shape != (kv.shape[0],) or ref_pos.shape != (ref_kv.shape[0],):
        raise ValueError(f"expected kv_pos [{kv.shape[0]}] and ref_pos [{ref_kv.shape[0]}], "
                         f"got {tuple(kv_pos.shape)} and {tuple(ref_pos.shape)}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    n_tok, n_ref = kv.shape[0], ref_kv.shape[0]
    device = kv.device
    idx = torch.zeros((n_tok, k), dtype=torch.long, device=device)
    valid = torch.zeros((n_tok, k), dtype=torch.bool, device=device)
    if n_tok == 0:
        return idx, valid
    x_all = kv.to(torch.float32)
    refs = ref_kv.to(device=device, dtype=torch.float32)
    if check and not (torch.isfinite(x_all).all() and torch.isfinite(refs).all()):
        raise ValueError("kv and ref_kv must be finite (found NaN or inf)")
    kv_pos = kv_pos.to(device=device, dtype=torch.long)
    rpos = ref_pos.to(device=device, dtype=torch.long)
    n_visible = _count_visible(kv_pos, rpos, inclusive)
    if check and (blind := torch.nonzero(n_visible == 0).flatten()).numel():
        raise ValueError(f"{blind.numel()} token(s) see no reference, first at position "
                         f"{int(kv_pos[blind[0]])} (visibility: ref_pos {'<=' if inclusive else '<'} token position)")
    ref_sq = (refs * refs).sum(1)
    chunk = max(1, _CHUNK_ENTRIES // max(1, n_ref))
    for start in range(0, n_tok, chunk):
        x = x_all[start:start + chunk]
        p = kv_pos[start:start + chunk]
        dist = (x * x).sum(1, keepdim=True) + ref_sq[None, :] - 2.0 * (x @ refs.T)
        dist.clamp_(min=0.0)
        visible = (rpos[None, :] <= p[:, None]) if inclusive else (rpos[None, :] < p[:, None])
        if check and not torch.isfinite(dist[visible]).all():
            raise ValueError("a squared distance overflowed float32; scale kv/ref_kv down")
        dist.masked_fill_(~visible, float("inf"))
        for j in range(min(k, n_ref)):
            best = dist.argmin(1)
            idx[start:start + chunk, j] = best
            dist.scatter_(1, best[:, None], float("inf"))
    valid = torch.arange(k, device=device)[None, :] < n_visible[:, None]
    idx.masked_fill_(~valid, 0)
    return idx, valid


def _count_visible(kv_pos: torch.Tensor, ref_pos: torch.Tensor, inclusive: bool) -> torch.Tensor:
    """Number of references visible to each token, [T] long, via a sorted search (no [T, R] matrix)."""
    sorted_pos = ref_pos.sort().values
    return torch.searchsorted(sorted_pos, kv_pos, right=inclusive)
