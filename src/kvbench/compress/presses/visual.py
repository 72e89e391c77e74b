"""Shared machinery of the visual-token presses (FastV, PACT, DivPrune: the baselines of ResidualKV Table II).

The three originals shorten the LLM's input sequence: DivPrune before layer 0 (it prunes the projector output),
FastV and PACT at a layer ``s`` (they drop, or merge, hidden states there), so layers ``>= s`` neither compute
nor cache the removed visual tokens, and layers ``< s`` cache every token. Here the model's forward is not
ours, so the same effect is obtained from the cache (:class:`VisualLayer`):

- the request's visual tokens are :attr:`PressCache.visual <kvbench.compress.cache.PressCache.visual>`
  (:class:`~kvbench.compress.cache.VisualTokens`); a request without them is refused (ValueError: these
  methods act on visual tokens only, and a text request would silently run as the full cache);
- during the prefill chunk that holds the visual tokens (the *selection chunk*), every layer ``>= s`` masks
  the removed tokens' keys for every query that is not itself removed (:meth:`VisualLayer.narrow`); a
  removed token's own query row still reads every key (its output is never read, and an all-masked row
  would give NaN), so the kept tokens' hidden states are those of the shortened sequence;
- at that chunk's commit, layers ``>= s`` evict the removed tokens (:meth:`EvictingLayer.evict
  <kvbench.compress.presses.eviction.EvictingLayer.evict>`): later chunks and decoding never see them,
  and KR is measured from the bytes kept (merged tokens count as stored tokens).

One difference stays, by construction: kept tokens keep their original position ids (RoPE), with gaps where
tokens were removed. FastV's and PACT's originals do the same (they slice the position ids with the hidden
states); DivPrune's builds the LLM input from the pruned features, so its positions are contiguous.

The decision (which positions go, from which layer on) is a :class:`Reduction`, one per request, held by a
:class:`VisualState` that the layers of one cache share (built by :meth:`VisualPress.new_cache`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvbench.compress.cache import KVView, LayerContext, Press, PressCache, VisualTokens
from kvbench.compress.presses.eviction import EvictingLayer


def check_share(name: str, value: float, *, low_open: bool = True) -> None:
    """Raise ValueError unless ``value`` is a share in (0, 1] (``low_open``) or [0, 1]."""
    ok = (0.0 < value <= 1.0) if low_open else (0.0 <= value <= 1.0)
    if isinstance(value, bool) or not ok:
        raise ValueError(f"{name} must be in {'(0, 1]' if low_open else '[0, 1]'}, got {value!r}")


def check_layer(name: str, value: int, minimum: int = 0) -> None:
    """Raise ValueError unless ``value`` is an int >= ``minimum`` (a decoder layer index)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum} (a decoder layer index), got {value!r}")


def attention_received(query_row: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Attention each key receives from one query row per head, softmax over all keys, mean over the query heads
    (FastV's score at layer K−1; PACT's EUTI with the mean query of the non-text tokens).

    Args:
        query_row: ``[1, H_q, 1, D]`` (every key visible to it).
        keys: ``[1, H_kv, n, D]`` (``H_q`` a multiple of ``H_kv``: GQA, each KV head serves its group of query heads).

    Returns:
        float32 ``[n]``: softmax(q·k / sqrt(D)) per query head (computed in float32), mean over the ``H_q`` heads.
    """
    _, h_q, _, d = query_row.shape
    h_kv = keys.shape[1]
    q = query_row.float().reshape(1, h_kv, h_q // h_kv, d)
    logits = q @ keys.float().transpose(-1, -2) / math.sqrt(d)                  # [1, H_kv, group, n]
    return logits.softmax(-1).mean(dim=(0, 1, 2))


@dataclass
class Reduction:
    """What a visual press decided for one request.

    ``start``: first layer that neither reads nor stores ``removed`` (int64 ``[m]``, ascending absolute
    positions). PACT's merges: ``centers`` int64 ``[C]`` positions of the tokens that stand for a cluster of two
    or more, ``members`` int64 ``[M]`` positions merged into them (each center included) and ``member_of``
    int64 ``[M]`` the index in ``centers`` of each member's cluster; ``log_size`` float32 ``[C]`` the log of each
    cluster's size (proportional attention). Single-token clusters are neither merged nor biased (log 1 = 0).
    """

    start: int
    removed: torch.Tensor
    centers: torch.Tensor | None = None
    members: torch.Tensor | None = None
    member_of: torch.Tensor | None = None
    log_size: torch.Tensor | None = None


@dataclass
class VisualState:
    """Per-request state shared by the layers of one cache: the visual span (host ints, read once at the first
    forward) and the :class:`Reduction` once decided. ``extra``: what a press captures (PACT's hidden states)."""

    name: str
    first: int | None = None
    last: int | None = None
    reduction: Reduction | None = None
    extra: dict = field(default_factory=dict)

    def init(self, cache: PressCache) -> VisualTokens:
        """The request's visual tokens; records their span.

        Raises:
            ValueError: the request has no visual tokens (``cache.visual`` is None or empty).
        """
        vis = cache.visual
        if vis is None or vis.positions.numel() == 0:
            raise ValueError(f"{self.name!r} acts on visual tokens only, and this request has none "
                             f"(PressCache.visual is {'empty' if vis is not None else 'None'}); run it on image or "
                             f"video records, or use a text press")
        if self.first is None:
            # once per request, before any decode step (no host read in a decode step)
            self.first, self.last = int(vis.positions[0]), int(vis.positions[-1])
        return vis


class VisualLayer(EvictingLayer):
    """A store that, from layer ``reduction.start`` on, hides and then evicts the positions a visual press
    removed (module docstring). Until the press decides, and in layers below ``start``, it is the full cache."""

    def __init__(self, ctx: LayerContext, cache: PressCache, press: VisualPress, state: VisualState):
        super().__init__(ctx, cache)
        self.press, self.state = press, state
        self._reducing = False   # this step is the selection chunk and this layer applies the reduction

    def holds_visual(self, t: int) -> bool:
        """Whether this step's chunk of ``t`` tokens (the latest ``t`` written) holds the visual tokens.

        Raises:
            ValueError: the chunk holds some of them but not all (the visual span crosses a chunk boundary).
        """
        lo, hi = self.seen - t, self.seen
        first, last = self.state.first, self.state.last
        if lo <= first and last < hi:
            return True
        if first < hi and last >= lo:
            raise ValueError(f"{self.press.name!r}: the visual tokens at positions {first}..{last} cross the prefill "
                             f"chunk of positions {lo}..{hi - 1}; prefill them in one chunk")
        return False

    def narrow(self, query: torch.Tensor, view: KVView) -> torch.Tensor | None:
        """Bool ``[1, 1, t, n]`` over ``view`` in the selection chunk from layer ``start`` on: a key is readable
        unless removed, and a removed query row reads every key; None otherwise. At the press's selecting layer
        (:meth:`VisualPress.select`) the reduction is decided first, from this layer's queries and keys."""
        if self.ctx.layer_idx == 0 and self.state.first is None:
            self.state.init(self.cache)
        self._reducing = False
        if not self.holds_visual(query.shape[2]):
            return None
        if self.ctx.layer_idx == self.press.select_layer(self.ctx.n_layers):
            self.state.reduction = self.press.select(self, query, view)
        red = self.state.reduction
        if red is None or self.ctx.layer_idx < red.start:
            return None
        self._reducing = True
        pos = view.positions[0, 0]
        gone = torch.isin(pos, red.removed)                                   # [n]
        gone_query = torch.isin(self._query_pos, red.removed)                 # [t]
        return ((~gone).view(1, -1) | gone_query.view(-1, 1)).view(1, 1, len(gone_query), -1)

    def commit(self, chunk: KVView, query: torch.Tensor) -> None:
        """Store ``chunk``; after the selection chunk, evict the removed positions (layers ``>= start``)."""
        super().commit(chunk, query)
        if self._reducing:
            self.reduce_stored(self.state.reduction)
            self._reducing = False

    def held_tensors(self):
        """The store's tensors; layer 0 also counts the request's :class:`Reduction` (shared by every layer)."""
        yield from super().held_tensors()
        red = self.state.reduction
        if self.ctx.layer_idx == 0 and red is not None:
            yield from (red.removed, red.centers, red.members, red.member_of, red.log_size)

    def reset(self) -> None:
        """Empty the store and forget the request's decision (the state is shared: every layer clears it)."""
        super().reset()
        self._reducing = False
        self.state.first = self.state.last = self.state.reduction = None
        self.state.extra.pop("hidden", None)

    def reduce_stored(self, red: Reduction) -> None:
        """Evict ``red.removed`` from the stored tokens (every KV head keeps the same tokens: no padding)."""
        stored = self._stored
        self.evict(~torch.isin(stored.positions, red.removed))


@dataclass
class VisualPress(Press):
    """Base of the visual-token presses: one :class:`VisualState` per request, :class:`VisualLayer` stores.

    Subclasses set :attr:`layer_class`, and either :meth:`select_layer` + :meth:`select` (decided before that
    layer's attention in the selection chunk) or their own hook (FastV decides after layer K−1's attention).
    """

    #: the press needs :attr:`PressCache.visual` (tests/test_press_matrix.py gives it a span of the prompt)
    serves = ("vlm",)   # Press.serves: a text request has no visual tokens to act on
    layer_class: ClassVar[type[VisualLayer]] = VisualLayer

    def select_layer(self, n_layers: int) -> int | None:
        """The layer whose :meth:`VisualLayer.narrow` calls :meth:`select` in the selection chunk (None: none)."""
        return None

    def select(self, layer: VisualLayer, query: torch.Tensor, view: KVView) -> Reduction:
        """The request's :class:`Reduction`, decided at :meth:`select_layer` before its attention. Abstract: a subclass
        whose :meth:`select_layer` names a layer defines it (DivPrune, PACT; FastV decides in its own hook)."""
        # a contract check, not a missing feature: every press in the registry that names a layer defines select()
        raise TypeError(f"{type(self).__name__}.select_layer names a layer but the press defines no select()")

    def prepare(self, model: Any, state: VisualState) -> None:
        """Per-request setup with the model at hand (PACT's hidden-state hook). Default: nothing."""

    def new_cache(self, model: Any) -> PressCache:
        """An empty cache whose layers share one :class:`VisualState` (layer indices checked first)."""
        self.check_layers(model.config.get_text_config().num_hidden_layers)
        state = VisualState(self.name)
        self.prepare(model, state)
        return PressCache(model, lambda ctx, cache: self.make_layer(ctx, cache, state))

    def make_layer(self, ctx: LayerContext, cache: PressCache, state: VisualState | None = None) -> VisualLayer:
        """The store of layer ``ctx.layer_idx`` (``state``: the request's; a fresh one when not given)."""
        return self.layer_class(ctx, cache, self, state if state is not None else VisualState(self.name))

    def compute_ratio(self, n_layers: int) -> float | None:
        """None (measured only): the share of keys read depends on the request's visual-token count."""
        return None

    def kept_target(self, n_context: int, n_tokens: int, n_layers: int) -> float | None:
        """None: the kept share depends on the request's number of visual tokens, which these arguments do not
        carry (the audit row's measured ``kept`` still reports it)."""
        return None
