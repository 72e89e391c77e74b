"""FastV: after layer K−1, keep the visual tokens the last prompt token attends most; drop the rest from layer K on.

Chen et al., "An Image is Worth 1/2 Tokens After Layer 2: Plug-and-Play Inference Acceleration for Large
Vision-Language Models", ECCV 2024 (https://arxiv.org/abs/2403.06764); original repo ``pkunlp-icler/FastV``.
What its code does (``src/transformers/src/transformers/models/llama/modeling_llama.py`` and
``fastv_forward.py``, ``LlamaModel.forward``, the "FASTV" block; the same rule in the HF port
``src/FastV/llava-hf/transformers/src/transformers/models/llama/modeling_llama.py``, ``fastv_forward``):

- at layer ``K`` it takes layer ``K−1``'s attention map (softmax weights, the eager path's
  ``output_attentions``), averages it over heads, takes the LAST token's row, restricted to the image span, and
  keeps the top ``round(n_image · (1 − R))`` image tokens (``topk``; the HF port rounds, the LLaVA path passes the
  count in ``fast_v_attention_rank``);
- layers ``>= K`` then never read the dropped tokens: the paper's evaluation masks them (token masking, no
  speed-up), the latency path slices them out of the hidden states with their position ids
  (``position_ids = keep_indexs``: kept tokens keep their original positions), and the KV-cache variant
  (``modeling_llama_fastv_kvcache.py``) prunes the prefill's cache once, so every decoding step reads the same
  kept set (README, "Support KV Cache");
- ``K = 0`` selects at random (no earlier attention map).

Defaults ``K = 2``, ``R = 0.5`` (the title's setting and the README's latency rows, ``K=2 R=50%``).

Here (``kvbench.compress.presses.visual``): the selection is made after layer ``K−1``'s attention in the
prefill chunk that holds the visual tokens (:attr:`~kvbench.compress.cache.StoreLayer.after_commit`), from the
chunk's last query row: the prompt's last token under the ``one_pass`` protocol (the original), the context's
last token under ``shared_context``. Layers ``>= K`` hide the dropped tokens from every kept query during that
chunk and evict them at its commit; layers ``< K`` keep every token (as the original's cache). ``K >= 1`` is
required (the random ``K = 0`` variant is not a baseline of the paper). Softmax scale ``1/sqrt(head_dim)``,
the Llama/Qwen2 attention's. Parameters are FastV's ``K`` and ``R`` under the field names ``layer`` and
``keep = 1 − R`` (the kept share, as every other press's ``keep``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.compress.cache import KVView, LayerContext, PressCache
from kvbench.compress.presses.eviction import budget
from kvbench.compress.presses.visual import (
    Reduction,
    VisualLayer,
    VisualPress,
    VisualState,
    attention_received,
    check_layer,
    check_share,
)


@dataclass
class FastVPress(VisualPress):
    """FastV (Chen et al., ECCV 2024, arXiv 2403.06764): keep the ``keep`` share of the visual tokens that
    layer ``layer − 1``'s last query attends most; layers ``>= layer`` neither read nor store the others
    (module docstring).

    Parameters
    ----------
    layer : int, 2 — FastV's K, the first layer without the dropped tokens (>= 1; layers below keep all).
    keep : float, 0.5 — share of the visual tokens kept, 1 − FastV's R; the count is ``round(keep · n_vis)``,
        at least 1 (:func:`~kvbench.compress.presses.eviction.budget`); 1.0 keeps every token (the full cache).

    Raises ValueError for ``layer`` < 1 or not an int, ``keep`` outside (0, 1], or (:meth:`check_layers`) a
    ``layer`` the model does not have; at the prefill, for a request without visual tokens or whose visual
    tokens cross a prefill chunk.
    """

    name = "fastv"
    exact = {"keep": 1.0}
    layer: int = 2
    keep: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        check_layer("layer", self.layer, minimum=1)
        check_share("keep", self.keep)

    def check_layers(self, n_layers: int) -> None:
        if self.layer >= n_layers:
            raise ValueError(f"fastv layer={self.layer} is outside the model's {n_layers} layers")

    def make_layer(self, ctx: LayerContext, cache: PressCache, state: VisualState | None = None) -> VisualLayer:
        layer = super().make_layer(ctx, cache, state)
        if ctx.layer_idx == self.layer - 1:
            layer.after_commit = self.score
        return layer

    def score(self, layer: VisualLayer, chunk: KVView, query: torch.Tensor) -> None:
        """After layer K−1's attention in the selection chunk: rank the visual tokens by the attention the chunk's
        last query row gives them over every key this layer read (softmax, mean over heads:
        :func:`~kvbench.compress.presses.visual.attention_received`), keep the top ``round(keep · n_vis)``."""
        if not layer.holds_visual(query.shape[2]):
            return
        vis = layer.cache.visual
        view = layer._view
        idx = torch.searchsorted(view.positions[0, 0], vis.positions)     # every token is in the view here
        scores = attention_received(query[:, :, -1:], view.keys)[idx]           # [n_vis]
        k = budget(self.keep, len(vis.positions))
        dropped = torch.ones_like(vis.positions, dtype=torch.bool)
        dropped[scores.topk(k).indices] = False
        layer.state.reduction = Reduction(start=self.layer, removed=vis.positions[dropped])
