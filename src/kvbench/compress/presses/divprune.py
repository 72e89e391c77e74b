"""DivPrune: keep the most diverse subset of visual tokens (greedy max-min cosine distance), before the LLM.

Alvar et al., "DivPrune: Diversity-based Visual Token Pruning for Large Multimodal Models", CVPR 2025
(https://arxiv.org/abs/2503.02175); original repo ``vbdi/divprune`` (its README: retained ratio
``SUBSET_RATIO`` 0.098 by default in ``run_DivPrune.sh``, LLaVA 1.5-7B). The selection, function ``DivPrune``
in the repo's LLaVA ``llava_arch.py`` (read in the copies the lmms-eval/llmc ports keep of it), on the
projector output of one image, ``n`` tokens:

- distance ``1 − cos`` between every pair of visual embeddings;
- the kept count is ``int(round(ratio · n))``;
- first pick: the token whose nearest other token is farthest (the second smallest entry of its distance
  column, the smallest being its own 0); each next pick: the token whose minimum distance to the tokens
  already picked is largest (``argmax``: ties go to the lowest index). A picked token's own minimum is 0, so it
  is not picked twice unless every remaining token duplicates one picked;
- the kept features go into the LLM input in their original order; the others never reach the LLM.

Here the visual embeddings are :attr:`VisualTokens.embeds <kvbench.compress.cache.VisualTokens.embeds>` (the
language model's input embeddings at the visual positions, i.e. the projector output), all images of the
request together as one set (the original prunes each image's features; with one image per record the two
agree). The dropped tokens are invisible from layer 0 on (:mod:`kvbench.compress.presses.visual`): masked for
every kept query in the prefill chunk that holds them and evicted at its commit, so the kept tokens' hidden
states are those of the pruned input, except for position ids, which stay the original ones here (the
original's LLM sees a shorter, contiguously indexed sequence).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench.compress.cache import KVView
from kvbench.compress.presses.visual import (
    Reduction,
    VisualLayer,
    VisualPress,
    check_share,
)

#: the original repo's default retained ratio (README, ``SUBSET_RATIO`` in ``run_DivPrune.sh``)
DEFAULT_KEEP = 0.098


def cosine_distances(x: torch.Tensor) -> torch.Tensor:
    """``1 − cos`` between the rows of ``x`` ``[n, d]``: float32 ``[n, n]`` (a zero row has distance 1 to all)."""
    u = F.normalize(x.float(), dim=-1)
    return 1.0 - u @ u.T


def divprune_select(embeds: torch.Tensor, k: int) -> torch.Tensor:
    """DivPrune's greedy max-min selection of ``k`` of the ``n`` rows of ``embeds`` ``[n, d]``.

    Returns:
        int64 ``[k]``: picked row indices in pick order (first: the row whose nearest other row is farthest; then
        the row maximising its minimum cosine distance to the rows picked; ties to the lowest index).
        ``k`` must be in ``[1, n]`` (asserted: the press's budget is).
    """
    n = embeds.shape[0]
    assert 1 <= k <= n, f"k must be in [1, {n}], got {k}"
    dist = cosine_distances(embeds)
    if n == 1:
        return torch.zeros(1, dtype=torch.long, device=embeds.device)
    # the nearest OTHER row of each: its own distance is ~0 (not exactly, in float), so mask it
    eye = torch.eye(n, dtype=torch.bool, device=dist.device)
    picked = [int(dist.masked_fill(eye, float("inf")).amin(0).argmax())]
    nearest = dist[picked[0]].clone()                    # min distance of every row to the picked set
    for _ in range(k - 1):
        nearest[picked[-1]] = -1.0                       # never re-pick (the original's own 0 does this)
        i = int(nearest.argmax())
        picked.append(i)
        nearest = torch.minimum(nearest, dist[i])
    return torch.tensor(picked, dtype=torch.long, device=embeds.device)


@dataclass
class DivPrunePress(VisualPress):
    """DivPrune (Alvar et al., CVPR 2025, arXiv 2503.02175): keep ``keep`` of the visual tokens, the most
    diverse by greedy max-min cosine distance of their input embeddings; the others are invisible from
    layer 0 on (module docstring).

    Parameters
    ----------
    keep : float, 0.098 — retained share (the original's ``SUBSET_RATIO``); the count is ``round(keep · n_vis)``,
        at least 1; 1.0 keeps every token (the full cache).

    Raises ValueError for ``keep`` outside (0, 1]; at the prefill, for a request without visual tokens or whose
    visual tokens cross a prefill chunk.
    """

    name = "divprune"
    exact = {"keep": 1.0}
    keep: float = DEFAULT_KEEP

    def __post_init__(self) -> None:
        super().__post_init__()
        check_share("keep", self.keep)

    def select_layer(self, n_layers: int) -> int:
        return 0

    def select(self, layer: VisualLayer, query: torch.Tensor, view: KVView) -> Reduction:
        """Decided at layer 0 from :attr:`VisualTokens.embeds`: :func:`divprune_select` of
        ``max(1, round(keep · n_vis))`` tokens; the rest removed from layer 0 on."""
        vis = layer.cache.visual
        n = len(vis.positions)
        k = min(n, max(1, round(self.keep * n)))
        dropped = torch.ones(n, dtype=torch.bool, device=vis.positions.device)
        dropped[divprune_select(vis.embeds, k)] = False
        return Reduction(start=0, removed=vis.positions[dropped])
