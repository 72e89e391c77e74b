"""Quest: query-aware page selection over a full KV cache.

Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024
(`mit-han-lab/Quest`, ``evaluation/quest_attention.py``). The KV cache is kept whole (KR 100%) and split
into pages of ``page_size`` consecutive tokens; each page is summarised by the channel-wise min and max
of its (post-RoPE) keys. For each query, the upper bound of its logits on a page,
``Σ_d max(q_d · max_d, q_d · min_d)``, ranks the pages per query head; attention reads the top pages
up to the token budget, never fewer than 3 pages (the authors' ``max(3, budget // page_size)``). The
first two layers stay dense (the authors' ``layer_id < 2``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvbench.compress.cache import KVView, LayerContext, PressCache, Press, StoreLayer

DENSE_LAYERS = 2   # the authors' evaluation code keeps layers 0 and 1 dense
MIN_PAGES = 3      # the authors' max(3, token_budget // chunk_size)


def page_bounds(keys: torch.Tensor, page: torch.Tensor, n_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel-wise min and max of the keys of every page.

    Args:
        keys: ``[1, H, n, D]`` keys; page: int64 ``[n]`` page index of every key (position // page_size).
        n_pages: number of pages (pages with no key get +inf min / −inf max).

    Returns:
        ``(kmin, kmax)`` float32 ``[1, H, n_pages, D]``.
    """
    _, h, _, d = keys.shape
    idx = page.view(1, 1, -1, 1).expand(1, h, -1, d)
    kmin = torch.full((1, h, n_pages, d), math.inf, device=keys.device).scatter_reduce(2, idx, keys.float(), "amin")
    kmax = torch.full((1, h, n_pages, d), -math.inf, device=keys.device).scatter_reduce(2, idx, keys.float(), "amax")
    return kmin, kmax


def page_scores(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound of q·k over a page: ``Σ_d max(q_d·max_d, q_d·min_d)``.

    Args:
        query: ``[1, H_q, t, D]``; kmin/kmax: ``[1, H_kv, P, D]`` (KV heads repeated for GQA).

    Returns:
        float32 ``[1, H_q, t, P]``; empty pages (infinite bounds) score −inf.
    """
    groups = query.shape[1] // kmin.shape[1]
    kmin, kmax = kmin.repeat_interleave(groups, 1), kmax.repeat_interleave(groups, 1)
    empty = torch.isinf(kmin[..., 0])                                                 # [1, H_q, P]
    kmin, kmax = kmin.masked_fill(torch.isinf(kmin), 0), kmax.masked_fill(torch.isinf(kmax), 0)
    q = query.float().unsqueeze(-2)                                                   # [1, H_q, t, 1, D]
    bound = torch.maximum(q * kmax.unsqueeze(2), q * kmin.unsqueeze(2)).sum(-1)      # [1, H_q, t, P]
    return bound.masked_fill(empty.unsqueeze(2), -math.inf)


class QuestLayer(StoreLayer):
    """A Quest layer: full storage, per-query page selection in :meth:`narrow`."""

    def __init__(self, ctx: LayerContext, cache: PressCache, press: "QuestPress"):
        super().__init__(ctx, cache)
        self.press = press

    def narrow(self, query: torch.Tensor, view: KVView) -> torch.Tensor | None:
        """Bool ``[1, H_q, t, n]``: the keys of the pages each query row selects.

        Per query row at position p: the visible pages are those holding a position <= p (page of a key
        = its position // page_size); the page containing p is always selected; the others are ranked
        by :func:`page_scores` (computed only over keys at positions <= p), and the top pages fill
        ``max(MIN_PAGES, ceil(keep · (p + 1) / page_size))`` pages in all (capped at the visible
        pages), per query head. Returns None (dense) in the first two layers, for a chunk with no history
        (the context prefill is exact, as for every press), and for multi-token chunks when
        ``sparse_prefill`` is False (the authors' ``q_len > 1`` branch).
        """
        t = query.shape[2]
        qpos = self._query_pos
        kpos = view.positions[0, 0]
        hist = kpos < qpos[0]
        if (self.ctx.layer_idx < DENSE_LAYERS or not hist.any()
                or (t > 1 and not self.press.sparse_prefill)):
            return None
        ps = self.press.page_size
        page = kpos // ps
        n_pages = int(page.max()) + 1
        # Bounds of the history once; each row adds the prefix of the chunk it sees (the chunk's keys are
        # the view's last t keys, at positions qpos), so a row never bounds keys it cannot attend.
        hmin, hmax = page_bounds(view.keys[..., hist, :], page[hist], n_pages)
        ck, cpage = view.keys[..., ~hist, :], page[~hist]
        scores = torch.empty(1, query.shape[1], t, n_pages, device=query.device)
        for r in range(t):
            cmin, cmax = page_bounds(ck[..., :r + 1, :], cpage[:r + 1], n_pages)
            scores[:, :, r:r + 1] = page_scores(query[:, :, r:r + 1], torch.minimum(hmin, cmin),
                                                torch.maximum(hmax, cmax))
        cur = (qpos // ps).view(1, 1, t, 1)
        scores.scatter_(3, cur.expand(1, query.shape[1], t, 1), math.inf)        # current page first
        budget = torch.tensor([self.press.n_pages(int(p) + 1) for p in qpos], device=query.device).view(1, 1, t, 1)
        rank = scores.argsort(-1, descending=True).argsort(-1)                   # rank of every page
        chosen = (rank < budget) & (scores > -math.inf)                          # never an empty page
        return chosen.gather(3, page.view(1, 1, 1, -1).expand(1, query.shape[1], t, -1))


@dataclass
class QuestPress(Press):
    """Quest (Tang et al., ICML 2024): query-aware page selection, full KV kept.

    Parameters
    ----------
    keep : float, 0.3 — token budget as a share of the keys visible to the query (ResidualKV authors'
        baseline config "Quest page 16, keep 0.3"; the authors of Quest give an absolute budget).
    page_size : int, 16 — tokens per page (Quest's ``chunk_size``).
    sparse_prefill : bool, True — select pages for every row of a multi-token chunk that has history
        (the question chunk of :func:`kvbench.compress.generate.greedy_generate` reads the compressed
        cache, as for every press); False = the authors' code, dense attention for any chunk longer than
        one token. The context chunk (no history) is always dense.

    Raises ValueError for keep outside (0, 1] or page_size < 1.
    """

    name = "quest"
    exact = {"keep": 1.0}
    keep: float = 0.3
    page_size: int = 16
    sparse_prefill: bool = True

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.keep <= 1:
            raise ValueError(f"keep must be in (0, 1], got {self.keep}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")

    def n_pages(self, n_visible: int) -> int:
        """Pages read by a query that sees ``n_visible`` keys: ``max(3, ceil(keep · n / page_size))``.

        The authors round the budget down (``token_budget // chunk_size``); rounding up to whole pages
        makes keep = 1 the full cache (the caller caps the count at the pages that exist)."""
        return max(MIN_PAGES, math.ceil(self.keep * n_visible / self.page_size))

    def make_layer(self, ctx: LayerContext, cache: PressCache) -> StoreLayer:
        return QuestLayer(ctx, cache, self)

    def compute_ratio(self, n_layers: int) -> float | None:
        """CR on long contexts: (2 + (L − 2) · keep) / L (first two layers dense; the 3-page minimum and
        the rounding to whole pages make short contexts denser)."""
        dense = min(DENSE_LAYERS, n_layers)
        return (dense + (n_layers - dense) * self.keep) / n_layers
