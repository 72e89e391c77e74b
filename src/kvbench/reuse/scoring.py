"""Stage I: the one query-conditioned scoring pass and its pieces (CONDUIT §3.3-3.5, App. A.2).

The pass runs the decoder with every text token computed and every visual
token taken from the stale, re-rotated cache (exactly plain reuse, r = 0). At
each layer l it reads the post-RoPE queries of the trailing text (the tokens
after the last image: the question and any template suffix; the authors'
``tail_text`` in ``model_runner_kv_score.py``) and records, per visual token t:

- α_l(t): causal softmax attention mass from those queries onto key t, with all
  T keys in the softmax, averaged over query tokens and query heads (GQA: query
  head h reads KV head h // (n_heads / n_kv_heads), as HF's ``repeat_kv``);
- ‖V_l(t)‖₂: L2 norm of the cached value over all KV heads of that layer.

From these, policies build their scores: CONDUIT's throughput
s(t) = mean_l α_l(t)·‖V_l(t)‖ (all layers by default, subset configurable), the
image coefficient c_j = 1 + λ(m_j / mean_k m_k − 1) with m_j the mean of
max(s, 0) over image j's tokens (c = 1 when K = 1), and one global top-k of
s(t)·c_j(t) with k = ⌈r·N_visual⌉ (``recompute.py``: ``select_kv_score_positions``,
``apply_kv_score_image_score_bias``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvbench.reuse.adapter import VLMAdapter
from kvbench.reuse.assemble import AssembledRequest
from kvbench.reuse.executor import ExecResult, LayerSchedule, LayerState, execute
from kvbench.reuse.validate import budget_count, check_strength


#: Largest logits block (elements) :func:`attention_mass` materialises at once; longer query sets go in chunks.
MASS_CHUNK_ELEMENTS = 1 << 25


def attention_mass(q: torch.Tensor, k: torch.Tensor, query_pos: torch.Tensor, scale: float,
                   chunk_elements: int = MASS_CHUNK_ELEMENTS) -> torch.Tensor:
    """Mean causal attention mass of queries on every key.

    Args:
        q: post-RoPE queries ``[1, n_heads, n_q, hd]``.
        k: post-RoPE keys ``[1, n_kv_heads, T, hd]`` (all keys of the layer).
        query_pos: int64 ``[n_q]`` sequence index of each query (it sees keys 0..pos).
        scale: softmax scale (the attention module's ``scaling``).
        chunk_elements: at most this many float32 logits exist at once: queries are taken in chunks, so
            KVShare's mass from every computed row (n_q = T) never builds a ``[n_heads, T, T]`` map
            (17 GB at 16k tokens and 16 heads). The result does not depend on it beyond float rounding.

    Returns:
        float32 ``[T]``: softmax weight on each key, averaged over queries and heads
        (rows sum to 1, so the result sums to 1).

    GQA without repeating K: query head h reads KV head h // (n_heads / n_kv_heads), as HF's ``repeat_kv``, so the
    queries are grouped per KV head and multiplied by that head's keys once (no ``[n_heads, T, hd]`` copy of K).

    Raises:
        ValueError: n_heads is not a multiple of n_kv_heads, or no query.
    """
    n_heads, n_kv = q.shape[1], k.shape[1]
    if n_heads % n_kv:
        raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv})")
    n_q = q.shape[2]
    if n_q == 0:
        raise ValueError("attention_mass needs at least one query")
    T, hd, g = k.shape[2], k.shape[3], n_heads // n_kv
    kt = k[0].float().transpose(1, 2)                               # [n_kv, hd, T]
    keys = torch.arange(T, device=q.device)
    step = max(1, chunk_elements // (n_heads * T))

    def probs(a: int) -> torch.Tensor:   # [n_kv, g, m, T] for queries a..a+step
        qc, pos = q[0, :, a:a + step].float(), query_pos[a:a + step]
        m = qc.shape[1]
        logits = torch.bmm(qc.reshape(n_kv, g * m, hd), kt) * scale   # heads h = j·g + i of KV head j, then queries
        return torch.softmax(logits.view(n_kv, g, m, T).masked_fill(keys[None, :] > pos[:, None], float("-inf")), -1)

    if step >= n_q:   # one block: the plain mean (bitwise the repeated-K form)
        return probs(0).mean(dim=(0, 1, 2))
    total = torch.zeros(T, dtype=torch.float32, device=q.device)
    for a in range(0, n_q, step):
        total += probs(a).sum(dim=(0, 1, 2))
    return total / (n_heads * n_q)


def value_norms(v: torch.Tensor) -> torch.Tensor:
    """float32 ``[T]``: ‖V(t)‖₂ over all KV heads and channels of ``v`` ``[1, n_kv, T, hd]``."""
    return v[0].float().transpose(0, 1).reshape(v.shape[2], -1).norm(dim=-1)


def layer_mean(per_layer: torch.Tensor, layers: Sequence[int] | None = None) -> torch.Tensor:
    """Mean over the selected layers of ``per_layer`` ``[L, N]`` (all layers when ``layers`` is None).

    Raises:
        ValueError: empty or out-of-range layer list.
    """
    L = per_layer.shape[0]
    if layers is None:
        return per_layer.mean(dim=0)
    layers = list(layers)
    if not layers or any(not 0 <= i < L for i in layers):
        raise ValueError(f"layers must be a non-empty list of indices in 0..{L - 1}, got {layers}")
    return per_layer[torch.tensor(sorted(set(layers)), device=per_layer.device)].mean(dim=0)


def image_coefficients(scores: torch.Tensor, image_ids: torch.Tensor, n_images: int, lam: float) -> torch.Tensor:
    """Image coefficients c_j = 1 + λ(m_j / mean_k m_k − 1), m_j = mean of max(score, 0) over image j (float32 ``[K]``).

    c = 1 exactly when K = 1 or λ = 0, and when every m_j is 0 (nothing to amplify).

    Raises:
        ValueError: λ outside [0, 1].
    """
    lam = check_strength(lam)
    ones = torch.ones(n_images, dtype=torch.float32, device=scores.device)
    if n_images <= 1 or lam == 0.0:
        return ones
    s = scores.float().clamp_min(0.0)
    sums = torch.zeros(n_images, dtype=torch.float32, device=s.device).scatter_add_(0, image_ids, s)
    counts = torch.zeros_like(sums).scatter_add_(0, image_ids, torch.ones_like(s))
    m = sums / counts.clamp_min(1.0)
    mean_m = m.mean()
    if float(mean_m) <= 0.0:
        return ones
    return 1.0 + lam * (m / mean_m - 1.0)


#: Tie rules of :func:`top_k`: ``"first"`` keeps the earlier index, ``"random"`` a uniformly random one.
TIE_RULES = ("first", "random")


def top_k(scores: torch.Tensor, k: int, ties: str = "first") -> torch.Tensor:
    """Indices (ascending) of the ``k`` largest ``scores`` (float ``[n]``), int64 ``[k]``.

    ``ties="first"``: equal scores go to the earlier index (deterministic). ``"random"``: to a uniformly random one,
    from a permutation drawn from torch's global generator, which the eval runner seeds per record
    (:mod:`kvbench.eval.runner`), so a run is still a function of its seed. The authors' ``torch.topk`` leaves the
    order of ties unspecified (docs/decisions/reuse.md, "The first shrink's ties").
    """
    assert ties in TIE_RULES, ties
    if ties == "first":
        order = torch.sort(-scores.float(), stable=True).indices
    else:
        perm = torch.randperm(scores.numel(), device=scores.device)
        order = perm[torch.sort(-scores.float()[perm], stable=True).indices]
    return torch.sort(order[:k]).values


@dataclass
class ScoringPass:
    """Per-layer signals of the scoring pass, at visual tokens (order of ``request.visual_index``).

    Attributes:
        request: the assembled request.
        attn: float32 ``[L, N_visual]`` α_l(t).
        vnorm: float32 ``[L, N_visual]`` ‖V_l(t)‖₂ of the cached (stale) values.
        stage1: the pass's own output = plain reuse (r = 0).
    """

    request: AssembledRequest
    attn: torch.Tensor
    vnorm: torch.Tensor
    stage1: ExecResult

    def token_scores(self, layers: Sequence[int] | None = None, use_v_norm: bool = True) -> torch.Tensor:
        """float32 ``[N_visual]``: mean over ``layers`` of α_l(t)·‖V_l(t)‖ (or α_l(t) alone)."""
        per_layer = self.attn * self.vnorm if use_v_norm else self.attn
        return layer_mean(per_layer, layers)

    def coefficients(self, scores: torch.Tensor, lam: float) -> torch.Tensor:
        """Image coefficients ``[K]`` from ``scores`` (see :func:`image_coefficients`)."""
        return image_coefficients(scores, self.request.image_of_visual, self.request.n_images, lam)

    def select(self, scores: torch.Tensor, r: float) -> torch.Tensor:
        """Visual sequence indices of the global top-⌈r·N_visual⌉ by ``scores``."""
        idx = top_k(scores, budget_count(r, self.request.n_visual))
        return self.request.visual_index[idx]


class _ScoringSchedule(LayerSchedule):
    """No visual row computed; after each layer, α_l and ‖V_l‖ at visual tokens are recorded."""

    def __init__(self, req: AssembledRequest):
        super().__init__(req.visual_index[:0])
        self.req = req
        self.attn: list[torch.Tensor] = []
        self.vnorm: list[torch.Tensor] = []

    def wants_queries(self, layer: int) -> bool:
        return True

    def query_mask(self, rows: torch.Tensor) -> torch.Tensor:
        """Only the trailing text's rows need queries (§3.3: the attention mass of the query tokens)."""
        return torch.isin(rows, self.req.query_index)

    def observe(self, state: LayerState) -> None:
        mass = attention_mass(state.queries, state.keys, state.query_rows, state.scale)
        self.attn.append(mass[self.req.visual_index])
        self.vnorm.append(value_norms(state.values[:, :, self.req.visual_index]))


def scoring_pass(adapter: VLMAdapter, req: AssembledRequest, in_place: bool = False) -> ScoringPass:
    """Run Stage I on ``req`` (text computed over the stale visual cache) and collect α and ‖V‖ per layer.

    Cost (§3.3, App. A.2): every text row runs through every layer, as in plain reuse; only the trailing
    query rows get the extra query projection, and the attention mass is taken from those rows over all T
    keys (``[n_kv, g·n_query, T]`` logits per layer, never a ``[T, T]`` map).

    Args:
        in_place: write the text rows' K/V into ``req.stale_k``/``stale_v`` instead of a per-layer copy
            (no second copy of the stale cache; the visual entries are untouched, so ``req`` stays usable,
            and ``stage1``'s K/V are then the request's own tensors).

    Raises:
        ValueError: the request has no token after its last image (nothing to score with), or it was
            consumed by an in-place refresh.
    """
    if req.query_index.numel() == 0:
        raise ValueError("the request ends with an image: no trailing text to condition the scoring pass on")
    sched = _ScoringSchedule(req)
    out = execute(adapter, req, sched, in_place=in_place)
    return ScoringPass(request=req, attn=torch.stack(sched.attn), vnorm=torch.stack(sched.vnorm), stage1=out)
