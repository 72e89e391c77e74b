"""OmniKV: token selection at a few full "filter" layers, shared by the sparse layers that follow.

Hao et al., "OmniKV: Dynamic Context Selection for Efficient Long-Context LLMs", ICLR 2025
(`antgroup/OmniKV`; the same mechanism inside ResidualKV's code, `CURRENTF/Sparse-vLLM` b5169d6).
Every layer keeps its full KV (KR 100%). A filter layer attends densely; after its attention it scores
the candidate tokens (neither sinks nor in the recent raw window) by raw q·k logits of the current
queries, max over query heads and query rows, and keeps the top ``ceil(keep · n_candidates)``. The
sparse layers up to the next filter layer read sinks + selected + window, one set shared by all heads.
Layers before the first filter layer are dense.

:func:`filter_step` is the one implementation of the filter step. It runs after a layer's commit
(:attr:`~kvbench.compress.cache.StoreLayer.after_commit`), so it composes with any store: OmniKV's own
exact layers here, and ResidualKV's full layers (FP16 or KIVI-style 4-bit) when :class:`OmniKVPress` is
the selector of ``residualkv+omnikv`` (:mod:`kvbench.compress.residualkv.cache`), with the storage's sinks
and window.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvbench.compress.cache import KVView, LayerContext, PressCache, Press, StoreLayer

# The authors' filter layers for the models they released (sources.md, "OmniKV inside it").
AUTHORS_FILTER_LAYERS = {32: (2, 8, 18), 28: (2, 4, 7, 14)}


class Selector(Protocol):
    """What :func:`filter_step` needs from its press."""

    n_sink: int
    window: int
    audit_steps: int

    def n_keep(self, n_candidates: int) -> int: ...


def keep_count(keep: float, n_candidates: int) -> int:
    """``ceil(keep · n)`` clamped to ``[1, n]`` (0 when there is no candidate): OmniKV's budget as a
    ratio (``num_of_selected_tokens`` given as a float), at least one token kept."""
    if n_candidates <= 0:
        return 0
    return max(1, min(n_candidates, math.ceil(keep * n_candidates)))


def filter_step(selector: Selector, layer: StoreLayer, chunk: KVView, query: torch.Tensor) -> None:
    """OmniKV's filter step at ``layer``, after its attention read ``layer._view`` and committed ``chunk``.

    With ``query`` ``[1, H_q, t, D]`` the chunk's post-RoPE queries: candidates are the positions ``p`` of
    the view with ``n_sink <= p < boundary``, ``boundary = (tokens before the chunk) − window``;
    score(p) = max over query heads and rows of q·k_p (raw logits, no softmax, no scaling, GQA by
    repeating KV heads), with the keys this layer's attention read (dequantised ones for a quantised
    store); the top ``selector.n_keep(n_candidates)`` positions, sorted, int64 ``[m]``, go to
    ``cache.step.selected`` and the first ``selector.audit_steps`` non-empty selections to
    ``cache.selections``. With no candidate, ``selected`` is an empty int64 tensor. The candidate index
    is the absolute token position, the same index the sparse layers' stores use.
    """
    view, cache = layer._view, layer.cache
    boundary = layer.seen - len(chunk) - selector.window
    pos = view.positions[0, 0]
    cand = (pos >= selector.n_sink) & (pos < boundary)
    if not cand.any():
        cache.step.selected = torch.zeros(0, dtype=torch.long, device=pos.device)
        return
    keys = view.keys[..., cand, :].repeat_interleave(query.shape[1] // view.keys.shape[1], 1)
    scores = (query.float() @ keys.float().transpose(-1, -2)).amax(dim=(0, 1, 2))   # [n_cand]
    top = scores.topk(selector.n_keep(int(cand.sum()))).indices
    selected = pos[cand][top].sort().values
    cache.step.selected = selected
    if len(cache.selections) < selector.audit_steps:
        cache.selections.append(selected.tolist())


class SparseLayer(StoreLayer):
    """A layer after a filter layer: stores every token exactly, reads sinks + selected + window.

    ``history()`` returns the stored tokens whose position is a sink (``< n_sink``), in
    ``cache.step.selected``, or in the recent window (``>= seen − window``), in position order.
    """

    def __init__(self, ctx: LayerContext, cache: PressCache, selector: Selector):
        super().__init__(ctx, cache)
        self.selector = selector

    def history(self) -> KVView | None:
        stored = self._stored
        selected = self.cache.step.selected
        if stored is None or selected is None:
            return stored
        pos = stored.positions[0, 0]
        keep = (pos < self.selector.n_sink) | (pos >= self.seen - self.selector.window) | torch.isin(pos, selected)
        return KVView(stored.keys[..., keep, :], stored.values[..., keep, :], stored.positions[..., keep])


def layer_list(name: str, value: int | Iterable[int]) -> tuple[int, ...]:
    """Layer indices of a press parameter as a tuple, validated.

    Args:
        name: the parameter's name, for the error message (``filter_layers``, ``full_layers``).
        value: one int (one layer: a spec's ``filter_layers=1``) or an iterable of ints (tuple, list, set,
            ...). Bools are refused, not read as 0/1.

    Returns:
        The indices sorted (one canonical form, so ``0+1`` and ``1+0`` are one run).

    Raises:
        ValueError: a negative, non-integer or repeated index, naming ``name``.
        TypeError: ``value`` is neither an int nor iterable.
    """
    items = (value,) if isinstance(value, int) and not isinstance(value, bool) else tuple(value)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise ValueError(f"{name} must be layer indices >= 0 (e.g. {name}=0+1), got {value!r}")
    if len(set(items)) < len(items):
        # a repeated layer would be counted twice (KR's full-layer share) and name a second run
        raise ValueError(f"{name} lists a layer twice: {value!r}")
    return tuple(sorted(items))


@dataclass
class OmniKVPress(Press):
    """OmniKV (Hao et al., ICLR 2025): full KV everywhere, token selection at filter layers.

    Parameters
    ----------
    keep : float, 0.17 — share of the candidate tokens the sparse layers read (ResidualKV authors'
        OmniKV baseline config; OmniKV's ``num_of_selected_tokens`` as a ratio).
    filter_layers : tuple of int, () — filter layers; () = the authors' choice for 32-layer
        (Llama-3.1-8B: 2, 8, 18) and 28-layer (Qwen2.5-7B: 2, 4, 7, 14) models, otherwise
        ``(2, round(18/32 · L))`` (8 layers: 2, 4): layers 0-1 dense as in every authors' config, the last
        filter at the same depth share as Llama's layer 18. Layers before the first filter are dense.
    n_sink : int, 8 — leading tokens always read; window : int, 128 — latest tokens always read
        (ResidualKV's cache defaults, so that OmniKV and ResidualKV+OmniKV differ only in storage).
    audit_steps : int, 8 — selections recorded in ``cache.selections``.

    Raises ValueError for keep outside (0, 1], negative n_sink/window/audit_steps, or (in
    :meth:`new_cache`) a filter layer outside the model.
    """

    name = "omnikv"
    exact = {"keep": 1.0}
    keep: float = 0.17
    filter_layers: tuple[int, ...] = ()
    n_sink: int = 8
    window: int = 128
    audit_steps: int = 8

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.keep <= 1:
            raise ValueError(f"keep must be in (0, 1], got {self.keep}")
        for name in ("n_sink", "window", "audit_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        self.filter_layers = layer_list("filter_layers", self.filter_layers)

    def n_keep(self, n_candidates: int) -> int:
        """Selected tokens for ``n_candidates`` candidates (:func:`keep_count`)."""
        return keep_count(self.keep, n_candidates)

    def layers_for(self, n_layers: int) -> tuple[int, ...]:
        """The filter layers used on an ``n_layers`` model (the default rule in the class docstring)."""
        if self.filter_layers:
            bad = [i for i in self.filter_layers if not 0 <= i < n_layers]
            if bad:
                raise ValueError(f"filter_layers {bad} outside the model's {n_layers} layers")
            return self.filter_layers
        if n_layers in AUTHORS_FILTER_LAYERS:
            return AUTHORS_FILTER_LAYERS[n_layers]
        return tuple(sorted({i for i in (2, round(18 * n_layers / 32)) if i < n_layers}))

    def check_layers(self, n_layers: int) -> None:
        self.layers_for(n_layers)

    def filter(self, layer: StoreLayer, chunk: KVView, query: torch.Tensor) -> None:
        """:func:`filter_step` with this press's settings (a layer's ``after_commit`` hook)."""
        filter_step(self, layer, chunk, query)

    def new_cache(self, model: Any) -> PressCache:
        self.check_layers(model.config.get_text_config().num_hidden_layers)   # validates before building
        return super().new_cache(model)

    def make_layer(self, ctx: LayerContext, cache: PressCache) -> StoreLayer:
        filters = self.layers_for(ctx.n_layers)
        if ctx.layer_idx in filters:
            layer = StoreLayer(ctx, cache)
            layer.after_commit = self.filter
            return layer
        if not filters or ctx.layer_idx < filters[0]:
            return StoreLayer(ctx, cache)
        return SparseLayer(ctx, cache, self)

    def compute_ratio(self, n_layers: int) -> float | None:
        """None (measured only): the sparse layers read sinks + ``keep`` of the candidates + window,
        so CR ≈ (n_dense + n_filter + n_sparse · keep) / L on contexts much longer than the window."""
        return None
