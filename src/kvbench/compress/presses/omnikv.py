"""OmniKV: token selection at a few full "filter" layers, shared by the sparse layers that follow.

Hao et al., "OmniKV: Dynamic Context Selection for Efficient Long-Context LLMs", ICLR 2025
(`antgroup/OmniKV`; the same mechanism inside ResidualKV's code, `CURRENTF/Sparse-vLLM` b5169d6).
Every layer keeps its full KV (KR 100%). A filter layer attends densely; after its attention, at a decode
step (one query row), it scores the candidate tokens (neither sinks nor in the recent raw window) by the
raw q·k logits of the current query, max over query heads, and keeps the top ``int(keep · n_candidates)``
(at least one), or ``min(keep_tokens, n_candidates)`` with an absolute ``keep_tokens``. The sparse layers up to the next filter layer read sinks + selected + window, one set
shared by all heads. A multi-token chunk (the question chunk, a later prefill chunk) selects nothing, so
every layer reads every token, unless ``sparse_prefill`` is set; its rows are then aggregated by
``row_agg`` (the mean, as the authors' scoring function does, or the max). Layers before the first filter
layer are dense.

What the authors' code does (``CURRENTF/Sparse-vLLM``, HF path ``src/deltakv/``, read in the stored
copies of these files, which postdate b5169d6; docs/decisions/presses.md, "OmniKV selection"):

- ``modeling/{qwen2,llama}/*_with_compress_inference.py``: the observation (filter) layer selects only when
  ``chunk_prefill_accel_omnikv or q_len == 1``, and only once flushed (compressed) tokens exist. The flag
  defaults to False (``configs/model_config_cls.py``); the README's LongBench command sets it True but
  prefills the whole prompt as one chunk (``chunk_prefill_size`` 2,048,000), which has no flushed token, so
  on the paper's benchmarks only decode steps select. (With the flag on, a later multi-token chunk would
  select ``num_top_tokens_in_prefill`` tokens, an absolute 4096 there.) The cache (``modeling/kv_cache.py``)
  keeps the latest ``top_token_idx`` per filter layer and restores every coded token of a sparse layer while
  there is none: every prefill chunk before the first decode step reads everything.
- ``modeling/token_select.py``, ``omnikv_token_selection``: raw logits (no softmax, no scaling; GQA by
  repeating KV heads), **mean over query rows**, then max over query heads; pooling off
  (``pool_kernel_size`` 1) and no score EMA (``omnikv_score_method`` 'last') by default; the count is
  ``int(n · ratio)`` for a ratio ``<= 1`` (else an absolute count), clamped to ``[1, n]``.
- Candidates are the flushed (compressed) tokens after the sinks: sinks and the raw recent buffer are
  always read by the sparse layers.

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
from typing import Any, ClassVar, Protocol

import torch

from kvbench.compress import checks
from kvbench.compress.cache import KVView, LayerContext, PressCache, Press, StoreLayer

#: OmniKVPress.keep's default: ``keep_tokens`` may be set only while ``keep`` is left at it
KEEP_DEFAULT = 0.17

# The authors' filter layers for the models they released (docs/decisions/presses.md, "OmniKV").
AUTHORS_FILTER_LAYERS = {32: (2, 8, 18), 28: (2, 4, 7, 14)}


class Selector(Protocol):
    """What :func:`filter_step` needs from its press."""

    n_sink: int
    window: int
    block: int
    audit_steps: int
    sparse_prefill: bool
    row_agg: str

    def n_keep(self, n_candidates: int) -> int: ...


#: how :func:`filter_step` aggregates a multi-token chunk's query rows (per query head, before the max
#: over heads): "mean" as the authors' ``omnikv_token_selection``, "max" the former form here
ROW_AGGREGATIONS = ("mean", "max")


def keep_count(keep: float, n_candidates: int) -> int:
    """``ceil(keep · n)`` clamped to ``[1, n]`` (0 when there is no candidate): ResidualKV+SnapKV's budget
    of coded tokens (OmniKV's own is :meth:`OmniKVPress.n_keep`, rounded down as the authors do)."""
    if n_candidates <= 0:
        return 0
    return max(1, min(n_candidates, math.ceil(keep * n_candidates)))


def token_scores(query: torch.Tensor, keys: torch.Tensor, row_agg: str = "mean") -> torch.Tensor:
    """Candidate scores ``[n]`` float32: raw logits q·k (no softmax, no scaling), aggregated over the query
    rows by ``row_agg`` per query head, then the max over query heads.

    Args:
        query: ``[1, H_q, t, D]`` post-RoPE queries of the chunk.
        keys: ``[1, H_kv, n, D]`` post-RoPE candidate keys (GQA: each KV head serves ``H_q / H_kv`` query
            heads, the group's rows multiply the head's keys once; the authors repeat the KV heads, the same
            logits up to float rounding).
        row_agg: "mean" (the authors') or "max" over the ``t`` rows; the same at a decode step (``t`` = 1).
    """
    _, h_q, t, d = query.shape
    h_kv = keys.shape[1]
    # GQA without repeating the keys: each KV head's group of query heads are rows of one product
    q = query.float().reshape(1, h_kv, (h_q // h_kv) * t, d)
    logits = (q @ keys.float().transpose(-1, -2)).view(1, h_q, t, -1)            # [1, H_q, t, n]
    rows = logits.mean(dim=2) if row_agg == "mean" else logits.amax(dim=2)       # [1, H_q, n]
    return rows.amax(dim=(0, 1))


def filter_step(selector: Selector, layer: StoreLayer, chunk: KVView, query: torch.Tensor) -> None:
    """OmniKV's filter step at ``layer``, after its attention read ``layer._view`` and committed ``chunk``.

    With ``query`` ``[1, H_q, t, D]`` the chunk's post-RoPE queries. A multi-token chunk (``t > 1``) with
    ``selector.sparse_prefill`` False selects nothing: ``cache.step.selected`` stays None and the sparse
    layers of this forward read every token (the authors select only at ``q_len == 1``). Otherwise the
    candidates are the positions ``n_sink <= p < boundary`` (:func:`candidate_end`: the tokens before the
    chunk minus the ``window`` latest, or with a coding ``block`` the tokens the storage has coded);
    score(p) = :func:`token_scores` (raw q·k_p, rows aggregated by ``selector.row_agg``, max over query heads)
    with the keys this layer's attention read (dequantised ones for a quantised store); the top
    ``selector.n_keep(n_candidates)`` positions, sorted, int64 ``[m]``, go to ``cache.step.selected`` and the
    first ``selector.audit_steps`` selections to ``cache.selections``. With no candidate, ``selected`` is an
    empty int64 tensor. The candidate index is the absolute token position, the same index the sparse
    layers' stores use.

    The filter layer must be a full store (exact or KIVI-style): its view holds every token, position p at
    index p, so the candidates are a slice and their count a host int (no read-back: docs/decisions/residualkv.md, "No
    host synchronisation in a decode step"); asserted.

    Raises:
        RuntimeError: with ``KVBENCH_CHECKS=1``, a view not in position order.
    """
    if query.shape[-2] > 1 and not selector.sparse_prefill:
        return   # the authors' `chunk_prefill_accel_omnikv or q_len == 1`: None makes sparse layers read all
    view, cache = layer._view, layer.cache
    assert len(view) == layer.seen, f"layer {layer.ctx.layer_idx}: a filter layer holds every token (a full store)"
    if checks.ENABLED and not torch.equal(view.positions[0, 0], torch.arange(layer.seen, device=view.keys.device)):
        raise RuntimeError(f"layer {layer.ctx.layer_idx}: the filter layer's view is not in position order")
    lo, hi = selector.n_sink, candidate_end(selector, layer.seen - len(chunk))
    if hi <= lo:
        cache.step.selected = torch.zeros(0, dtype=torch.long, device=view.keys.device)
        return
    scores = token_scores(query, view.keys[..., lo:hi, :], selector.row_agg)   # [n_cand]
    selected = (scores.topk(selector.n_keep(hi - lo)).indices + lo).sort().values
    cache.step.selected = selected
    cache.record_selection(selected, selector.audit_steps)


def candidate_end(selector: Selector, n_before: int) -> int:
    """End (exclusive) of the candidate positions when ``n_before`` tokens precede the chunk: the tokens
    before the ``window`` latest, ``n_before − window``. A storage that codes in blocks (ResidualKV's
    ``block``, set on its selector as ``selector.block``) holds ``window`` to ``window + block − 1`` raw
    tokens, so its candidates end where its coded tokens end: ``n_sink + ⌊(n_before − n_sink − window) /
    block⌋ · block`` (the authors' ``get_observable_compressed_length``); ``block`` 1 is the first form."""
    coded = max(0, n_before - selector.n_sink - selector.window) // selector.block * selector.block
    return selector.n_sink + coded


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
        # the store holds every token, position p at index p, and the filter selected only positions in
        # [n_sink, seen - window): one gather with a host-known count (no mask to reduce)
        n = len(stored)
        sink = min(self.selector.n_sink, n)
        dev = selected.device
        idx = torch.cat([torch.arange(sink, device=dev), selected,
                         torch.arange(max(sink, n - self.selector.window), n, device=dev)])
        if checks.ENABLED and not (idx.diff() > 0).all():
            raise RuntimeError(f"layer {self.ctx.layer_idx}: selected positions {selected.tolist()} overlap the "
                               f"sinks or the window")
        return KVView.dense(stored.keys.index_select(2, idx), stored.values.index_select(2, idx), idx)


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
    keep_tokens : int or None, None — an absolute count instead: the sparse layers read
        ``min(keep_tokens, n_candidates)`` candidates at a selecting step (the authors' ``num_top_tokens``
        above 1, e.g. ResidualKV's decode keep of 2,048 for Llama-3.1-8B). Exclusive with a ``keep`` other
        than its default. In ``residualkv+omnikv`` it is the selector's, like ``keep``.
    filter_layers : tuple of int, () — filter layers; () = the authors' choice for 32-layer
        (Llama-3.1-8B: 2, 8, 18) and 28-layer (Qwen2.5-7B: 2, 4, 7, 14) models, otherwise
        ``(2, round(18/32 · L))`` (8 layers: 2, 4): layers 0-1 dense as in every authors' config, the last
        filter at the same depth share as Llama's layer 18. Layers before the first filter are dense.
    n_sink : int, 8 — leading tokens always read; window : int, 128 — latest tokens always read
        (ResidualKV's cache defaults, so that OmniKV and ResidualKV+OmniKV differ only in storage).
    audit_steps : int, 8 — selections recorded in ``cache.selections``.
    sparse_prefill : bool, False — select also in a multi-token chunk that has candidates (the question
        chunk after the context, a later prefill chunk). False is the authors' form
        (``chunk_prefill_accel_omnikv: false``): such a chunk reads every token at every layer, and only
        decode steps are sparse. The name is Quest's field of the same meaning.
    row_agg : str, "mean" — how a multi-token chunk's query rows are aggregated per query head before the
        max over heads: "mean" (the authors' ``omnikv_token_selection``) or "max" (a token any row attends
        strongly). Decode steps have one row, so it only matters with ``sparse_prefill``.

    Raises ValueError for keep outside (0, 1], ``keep_tokens`` not an int >= 1 or set together with a
    non-default ``keep``, negative n_sink/window/audit_steps, a ``row_agg`` other than "mean"/"max", or
    (in :meth:`new_cache`) a filter layer outside the model.
    """

    name = "omnikv"
    exact = {"keep": 1.0}
    #: the storage's coding block (:func:`candidate_end`); 1 for OmniKV's own exact store. Not a spec field:
    #: ``residualkv+omnikv`` sets it on the selector it builds from the storage's ``block``.
    block: ClassVar[int] = 1
    keep: float = KEEP_DEFAULT
    keep_tokens: int | None = None
    filter_layers: tuple[int, ...] = ()
    n_sink: int = 8
    window: int = 128
    audit_steps: int = 8
    sparse_prefill: bool = False
    row_agg: str = "mean"

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.keep <= 1:
            raise ValueError(f"keep must be in (0, 1], got {self.keep}")
        if self.keep_tokens is not None:
            k = self.keep_tokens
            if not isinstance(k, int) or isinstance(k, bool) or k < 1:
                raise ValueError(f"keep_tokens (absolute candidates kept) must be an int >= 1, got {k!r}")
            if self.keep != KEEP_DEFAULT:
                raise ValueError(f"keep={self.keep} (a share of the candidates) and keep_tokens={k} (an absolute "
                                 f"count) both set the selected count; set one")
        if self.row_agg not in ROW_AGGREGATIONS:
            raise ValueError(f"row_agg must be one of {ROW_AGGREGATIONS} (over a chunk's query rows), got {self.row_agg!r}")
        for name in ("n_sink", "window", "audit_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        self.filter_layers = layer_list("filter_layers", self.filter_layers)

    def n_keep(self, n_candidates: int) -> int:
        """Selected tokens for ``n_candidates`` candidates: ``min(keep_tokens, n)`` when ``keep_tokens`` is
        set, else ``int(keep · n)`` clamped to ``[1, n]`` (the authors' rounding, down, of a ratio budget);
        0 without a candidate."""
        if n_candidates <= 0:
            return 0
        if self.keep_tokens is not None:
            return min(n_candidates, self.keep_tokens)
        return max(1, min(n_candidates, int(n_candidates * self.keep)))

    def selection_form(self) -> str:
        """One line on when and how this press selects, for table headers."""
        when = (f"decode steps and multi-token chunks (query rows: {self.row_agg})" if self.sparse_prefill
                else "decode steps only (a multi-token chunk reads every token)")
        count = f"min({self.keep_tokens}, n)" if self.keep_tokens is not None else "int(keep·n)"
        return f"{when}; raw q·k, max over query heads; {count} candidates"

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
