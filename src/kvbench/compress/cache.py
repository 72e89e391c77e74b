"""The shared machinery of every compression method: a transformers ``Cache`` whose layers store what a
method keeps, and one attention function that reads it.

A compression method is a :class:`StoreLayer` subclass (one per decoder layer) with three hooks:

- :meth:`StoreLayer.history`: the stored tokens as attention should read them (post-RoPE keys, values and
  the absolute position of every key, per KV head, since eviction may keep different tokens per head);
- :meth:`StoreLayer.commit`: store a chunk of new tokens once its attention has run (so a single-chunk
  prefill is exact, as in the ResidualKV code and in SnapKV/KVzip, and methods that score the chunk with
  its own queries, e.g. SnapKV's observation window, see those queries);
- :meth:`StoreLayer.narrow` (optional): a per-query mask over the keys read (Quest's page selection);
- :attr:`StoreLayer.after_commit` (optional): a selector's step after the commit (OmniKV's filter
  layers), set by the press that builds the layer, so a selector composes with any store;
- :meth:`StoreLayer.attach` (optional): forward hooks on the layer's attention module while the model runs,
  for a store that needs a tensor the cache is not given (ResidualKV on Qwen3 codes ``k_proj`` outputs,
  before ``k_norm``: :mod:`kvbench.compress.residualkv.keys`).

Keys reach ``update`` post-RoPE (and post key norm); a store that codes pre-RoPE keys inverts RoPE at the
keys' positions (:meth:`LayerContext.unrotate`) and, after restoring, applies the key norm (if its model has
one) and then RoPE (:meth:`LayerContext.rotate`).

:class:`PressCache` calls them from ``update`` and from the attention function registered as
``"kvbench_press"``, which builds the causal mask from the key positions (the model's own mask has the
logical length and is ignored: a compressed cache returns fewer keys than positions). Per-step facts
that the layers of one forward share (OmniKV's selected token indices, chosen at a filter layer and read
by the following sparse layers) live in :attr:`PressCache.step`, the nano-vllm "context" pattern.

Shapes: batch size 1 throughout (both papers decode at batch 1); keys/values ``[1, H_kv, n, D]`` in the
model dtype; positions int64 ``[1, H_kv, n]``; queries ``[1, H_q, t, D]`` post-RoPE.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from kvbench.compress.accounting import StoredBytes, held_bytes
from kvbench.compress.buffers import KVBuffer, shared_over_heads
from kvbench.models import rope

ATTN_NAME = "kvbench_press"
_active: contextvars.ContextVar["PressCache | None"] = contextvars.ContextVar("kvbench_press_cache", default=None)


@dataclass
class KVView:
    """Keys, values and key positions as attention reads them.

    ``keys``/``values`` ``[1, H_kv, n, D]`` (keys post-RoPE at their own positions), ``positions`` int64
    ``[1, H_kv, n]`` (absolute token positions; a key is visible to query position p iff its position <= p).
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor

    @staticmethod
    def dense(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> "KVView":
        """A view whose every head holds the same tokens: ``positions`` int64 ``[n]``."""
        pos = positions.view(1, 1, -1).expand(keys.shape[0], keys.shape[1], -1)
        return KVView(keys, values, pos)

    @staticmethod
    def cat(views: list["KVView | None"]) -> "KVView":
        """Concatenate along tokens (None entries skipped); every view must have the same heads."""
        vs = [v for v in views if v is not None and v.keys.shape[-2] > 0]
        if len(vs) == 1:
            return vs[0]
        return KVView(torch.cat([v.keys for v in vs], -2), torch.cat([v.values for v in vs], -2),
                      torch.cat([v.positions for v in vs], -1))

    def __len__(self) -> int:
        return self.keys.shape[-2]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, values, positions)``, for :func:`~kvbench.compress.accounting.held_bytes`."""
        return self.keys, self.values, self.positions


class RopeTable:
    """cos/sin of the model's RoPE at positions ``0..cap-1``, grown by doubling and indexed by position, so
    restoring keys at their positions is a gather, not a rotary-embedding call per restore.

    One per :class:`PressCache`, shared by its layers (the rotary embedding is the decoder stack's; a table
    per layer would hold the same values L times). Tables ``[cap, head_dim]`` in the model dtype, computed by
    the model's own rotary module (:func:`kvbench.models.rope.cos_sin`) over ``arange(cap)``. Not counted in
    a layer's resident bytes: it depends on positions only, like the model's weights.
    """

    def __init__(self, rotary_emb: Any, dtype: torch.dtype):
        self.rotary_emb, self.dtype = rotary_emb, dtype
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None
        self.needed = 0

    def reach(self, n: int) -> None:
        """Positions up to ``n - 1`` may be looked up (a layer that rotates calls it with its logical length).
        The bound is a host int, so a lookup never reads a position tensor back to know whether to grow."""
        self.needed = max(self.needed, n)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[1, n, head_dim]`` at int64 ``positions`` ``[n]`` (all below :meth:`reach`'s bound)."""
        cap = 0 if self.cos is None else self.cos.shape[0]
        if cap < self.needed:
            cap = max(self.needed, 2 * cap)
            cos, sin = rope.cos_sin(self.rotary_emb, torch.arange(cap, device=positions.device).view(1, -1), self.dtype)
            self.cos, self.sin = cos[0], sin[0]
        return self.cos.index_select(0, positions).unsqueeze(0), self.sin.index_select(0, positions).unsqueeze(0)


@dataclass
class LayerContext:
    """What a store layer may need from the model: its index and RoPE, to restore pre-RoPE keys
    (ResidualKV, Palu) at their own positions. ``rope``: the cache's cos/sin table (None: one of its own)."""

    layer_idx: int
    n_layers: int
    rotary_emb: Any
    apply_rope: Any
    dtype: torch.dtype
    rope: RopeTable | None = None

    def __post_init__(self) -> None:
        if self.rope is None:
            self.rope = RopeTable(self.rotary_emb, self.dtype)

    def rotate(self, k_pre: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Post-RoPE keys ``[1, H, n, D]`` from pre-RoPE ``k_pre`` (model dtype) at int64 ``positions`` ``[n]``."""
        cos, sin = self.rope(positions)
        # the model's own rotation; its query output is not used, so the query is one position of one head (it
        # still broadcasts to [1, 1, n, D]); an empty query is much slower on CPU (measured 4 ms vs 0.6 at n 1,349)
        _, out = self.apply_rope(k_pre[:, :1, :1], k_pre, cos, sin)
        return out

    def unrotate(self, k_post: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE keys ``[1, H, n, D]`` from post-RoPE ``k_post`` at ``positions`` ``[n]`` (exact inverse:
        :func:`kvbench.models.rope.unrotate`)."""
        cos, sin = self.rope(positions)
        _, out = self.apply_rope(k_post[:, :1, :1], k_post, cos, -sin)
        return out


class StoreLayer(CacheLayerMixin):
    """One decoder layer of a compressed KV cache. The default stores every token exactly (the full cache),
    in a preallocated buffer that grows by an eighth (:class:`~kvbench.compress.buffers.KVBuffer`): a step's
    chunk is written in place after the stored tokens and attention reads one view of the buffer, so the
    full cache every method is compared to reads its cache once per step and copies it only when it grows.
    A subclass that overrides :meth:`history` gets ``history() + chunk`` (:meth:`KVView.cat`) instead.

    Subclasses override :meth:`history`, :meth:`commit`, optionally :meth:`narrow`, and for KR
    (:mod:`kvbench.compress.accounting`) :meth:`packed_bytes` (the paper's accounting, by part) and
    :meth:`held_tensors` (every tensor held between steps, for the resident bytes); :meth:`stored_bytes`
    reports both.
    """

    is_compileable = False
    is_croppable = False

    def __init__(self, ctx: LayerContext, cache: "PressCache"):
        super().__init__()
        self.ctx = ctx
        self.cache = cache
        self.seen = 0                      # tokens written to this layer (the logical length)
        self._buf = KVBuffer()           # the stored tokens (preallocated, grown by an eighth: buffers.py)
        self._pending: KVView | None = None
        self._view: KVView | None = None
        self._query_pos: torch.Tensor | None = None
        self._staged: KVView | None = None  # this step's chunk, written in the buffer but not yet counted
        self._read_bytes = 0                # K/V bytes the latest step read (read_bytes)
        #: called as ``after_commit(layer, chunk, query)`` once :meth:`commit` stored ``chunk`` (``_view``
        #: still the keys this step's attention read): a selector composed with this store
        self.after_commit: Callable[[StoreLayer, KVView, torch.Tensor], None] | None = None

    @property
    def _stored(self) -> KVView | None:
        """The tokens this layer stores exactly (None while it stores none): a view of its preallocated
        buffer. Assigning a view replaces them (an eviction), None empties the store."""
        view = self._buf.view()
        return None if view is None else KVView(*view)

    @_stored.setter
    def _stored(self, view: KVView | None) -> None:
        self._buf.replace(None if view is None else view.tensors())

    # -- the method's hooks ------------------------------------------------------------------
    def history(self) -> KVView | None:
        """The stored tokens as attention reads them (None before the first commit)."""
        return self._stored

    def commit(self, chunk: KVView, query: torch.Tensor) -> None:
        """Store ``chunk`` (its exact post-RoPE K/V) after its attention ran; ``query`` ``[1, H_q, t, D]``.
        The base store already wrote the chunk in place when it built the step's view (:meth:`update`), so
        committing it only counts it."""
        if chunk is self._staged:
            self._buf.commit_staged(len(chunk))
        else:
            self._buf.append(*chunk.tensors())
        self._staged = None

    def view_with(self, chunk: KVView) -> KVView:
        """What this step's attention reads: :meth:`history` followed by ``chunk`` (its exact K/V). The base
        store (also eviction's and Quest's, which keep its :meth:`history`) writes the chunk in place after the
        stored tokens and returns one view of its buffer, no copy of the cache (the chunk is counted at
        :meth:`commit`); a store with its own :meth:`history` gets ``KVView.cat([history(), chunk])``, or
        overrides this to build its view in one copy."""
        if type(self).history is StoreLayer.history:
            return self._stage(chunk)
        return KVView.cat([self.history(), chunk])

    def _stage(self, chunk: KVView) -> KVView:
        """Write ``chunk`` in place after the stored tokens (counted at :meth:`commit`) and return one view of
        the buffer: stored tokens followed by the chunk, no copy of the cache."""
        self._staged = chunk
        return KVView(*self._buf.stage(*chunk.tensors()))

    def attach(self, attn: Any) -> list:
        """Hooks this layer needs on ``attn`` (its decoder layer's attention module) while the model runs:
        registered by :func:`press_attention` on entry and removed on exit (also after an exception).
        Returns the handles (``torch.utils.hooks.RemovableHandle``); default: none."""
        return []

    def narrow(self, query: torch.Tensor, view: KVView) -> torch.Tensor | None:
        """Optional bool mask ``[1, H_q, t, n]`` (True = may attend) over ``view``; None keeps all."""
        return None

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
               scaling: float | None) -> torch.Tensor:
        """This step's attention output ``[1, H_q, t, D]`` over what :meth:`update` returned (``key``/``value``
        ``[1, H_kv, n, D]``, ``mask`` the bool ``[1, 1 or H_q, t, n]`` or None). Default: SDPA with GQA through
        ``enable_gqa`` (the KV heads are not repeated, one read of the cache). A store whose step computes part
        of the output another way overrides it (ResidualKV's latent V)."""
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)

    def visible(self, view: KVView) -> int:
        """Keys a one-token step's query may attend, for the CR record: every key of the step's view (default);
        a store that attends tokens it did not put in the view (a fused restore kernel) adds them."""
        return len(view)

    def hides_keys(self) -> bool:
        """True when :meth:`history` may return keys that no query may read (eviction's padding slots), so
        even a one-token step needs the position mask. Default False: a decode step then builds no mask."""
        return False

    def packed_bytes(self) -> StoredBytes:
        """Packed bytes by part (``resident`` left 0); default: FP16 K and V of every stored key (positions
        are not counted: stored keys are already RoPE'd, as in a plain cache)."""
        n = 0 if self._stored is None else self._stored.keys.numel() + self._stored.values.numel()
        return StoredBytes(layer=self.ctx.layer_idx, full_layer=2 * n)

    def held_tensors(self) -> Iterable[torch.Tensor | None]:
        """Every tensor this layer holds between steps; subclasses add theirs (``yield from
        super().held_tensors()``). Default: the stored keys, values and int64 positions, and any step state
        still set (:func:`_press_attention` drops the step's view after the layer's attention)."""
        yield from self._buf.tensors()
        for view in (self._pending, self._view):
            if view is not None:
                yield from view.tensors()
        yield self._query_pos

    def read_bytes(self) -> int:
        """Bytes of K/V the latest step's attention read from this layer, in the form it holds them (int; 0
        before any step): for this exact store, every key and value of the step's view at the model's
        width (what SDPA reads; positions are not counted). A store whose step reads a packed form overrides
        it (KIVI, ResidualKV); Fig. 8's bandwidth columns sum it over layers (:mod:`kvbench.bench.bandwidth`)."""
        return self._read_bytes

    def kept_share(self) -> float:
        """Share of the tokens written to this layer (``seen``) whose K/V it still holds in some form (exact,
        quantised, coded), mean over KV heads; default 1.0 (a store that drops nothing). Eviction overrides it."""
        return 1.0

    def stored_bytes(self) -> StoredBytes:
        """Packed bytes by part (:meth:`packed_bytes`) and resident bytes (:meth:`held_tensors` through
        :func:`~kvbench.compress.accounting.held_bytes`), int bytes."""
        return dataclasses.replace(self.packed_bytes(), resident=held_bytes(self.held_tensors()))

    # -- transformers' layer API -----------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Return history + the new chunk (exact) for this step's attention; the chunk is committed after it."""
        if key_states.shape[0] != 1:
            raise ValueError(f"compressed caches run at batch size 1, got batch {key_states.shape[0]}")
        self.is_initialized = True
        t = key_states.shape[-2]
        pos = torch.arange(self.seen, self.seen + t, device=key_states.device)
        self._pending = KVView.dense(key_states, value_states, pos)
        self._query_pos = pos
        self._view = self.view_with(self._pending)
        # host ints from shapes: the audit of read_bytes() reads nothing back
        self._read_bytes = 2 * self._view.keys.numel() * self._view.keys.element_size()
        self.seen += t
        return self._view.keys, self._view.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.seen = 0
        self._stored = self._pending = self._view = self._staged = None
        self.is_initialized = False


@dataclass
class StepState:
    """Facts shared by the layers of one forward pass (reset by :meth:`PressCache.begin_step`).

    ``selected``: OmniKV's token positions chosen at the latest filter layer, int64 ``[m]``.
    """

    selected: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class VisualTokens:
    """The visual tokens of a VLM request, for the presses that act on them (FastV, PACT, DivPrune: ResidualKV
    Table II baselines). Set by the caller on :attr:`PressCache.visual` before the prefill that contains them;
    text-only requests leave it None, and a press that needs it raises ValueError naming the record's kind.

    ``positions``: int64 ``[n_vis]``, ascending absolute token positions of the image/video placeholder tokens in
    the prompt (the positions the cache's keys carry). ``embeds``: ``[n_vis, hidden]`` in the model dtype, the
    language model's input embeddings at those positions (the vision projector's output; DivPrune and PACT select
    on them). ``grids``: per image ``(t, h, w)`` of merged patches (``image_grid_thw`` divided by the spatial
    merge size), in prompt order, so ``positions`` split into images row-major over ``h x w`` (Fig. 13's patch
    map, PACT's spatial neighbours).
    """

    positions: torch.Tensor
    embeds: torch.Tensor
    grids: list[tuple[int, int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.positions.dim() != 1 or self.positions.dtype != torch.int64:
            raise ValueError(f"positions must be int64 [n_vis], got {self.positions.dtype} {tuple(self.positions.shape)}")
        if self.embeds.dim() != 2 or self.embeds.shape[0] != self.positions.shape[0]:
            raise ValueError(f"embeds must be [n_vis={self.positions.shape[0]}, hidden], got {tuple(self.embeds.shape)}")
        if self.grids and sum(t * h * w for t, h, w in self.grids) != self.positions.shape[0]:
            raise ValueError(f"grids {self.grids} hold {sum(t * h * w for t, h, w in self.grids)} tokens, "
                             f"not the {self.positions.shape[0]} positions given")


class PressCache(Cache):
    """A transformers ``Cache`` of :class:`StoreLayer` objects, one per decoder layer.

    Use it inside :func:`press_attention` (which switches the model's attention to ``"kvbench_press"``);
    pass ``position_ids`` explicitly or let the model derive them from :meth:`get_seq_length` (the logical
    length: the number of tokens written, not the number stored).

    Records per forward: ``attended`` (per layer, the mean over KV heads of keys the LAST query row may
    attend, for CR) and ``selections`` (OmniKV positions per decode step, for the audit record). Both are
    kept as device tensors while the model runs and reduced to ints when read, so recording them never
    synchronises a decode step with the host (docs/decisions/residualkv.md, "No host synchronisation in a decode step").
    """

    def __init__(self, model: Any, layer_factory: Any):
        text_cfg = model.config.get_text_config()
        n_layers = text_cfg.num_hidden_layers
        attn = decoder_layers(model)[0].self_attn
        rotary = _rotary(model)
        table = RopeTable(rotary, model.dtype)
        layers = []
        for i in range(n_layers):
            ctx = LayerContext(i, n_layers, rotary, rope.rotation_fn(attn), model.dtype, table)
            layers.append(layer_factory(ctx, self))
        super().__init__(layers=layers)
        self.step = StepState()
        #: the request's visual tokens (:class:`VisualTokens`), set by the caller before the prefill; None: text
        self.visual: VisualTokens | None = None
        self._attended: list[list[int | torch.Tensor]] = []
        self._selections: list[list[int] | torch.Tensor] = []

    def begin_step(self) -> None:
        """Reset per-forward state (called by the attention function at layer 0)."""
        self.step = StepState()
        self._attended.append([])

    def record_attended(self, count: int | torch.Tensor) -> None:
        """This forward's count for the next layer: an int, or a 0-d integer tensor reduced when read."""
        self._attended[-1].append(count)

    def record_selection(self, selected: torch.Tensor, limit: int) -> None:
        """Keep ``selected`` (int64 ``[m]``) for the audit record while fewer than ``limit`` are kept."""
        if len(self._selections) < limit:
            self._selections.append(selected)

    @property
    def attended(self) -> list[list[int]]:
        """Per forward, per layer: keys the last query row may attend, mean over KV heads (int). The list
        itself is the cache's record (a caller may cut it, as KVzip drops its scoring pass's entries)."""
        pending = [x for row in self._attended for x in row if isinstance(x, torch.Tensor)]
        if pending:   # one host read for every count recorded since the last read
            values = iter(torch.stack([x.reshape(()).to(torch.long) for x in pending]).tolist())
            for row in self._attended:
                row[:] = [next(values) if isinstance(x, torch.Tensor) else x for x in row]
        return self._attended

    @property
    def selections(self) -> list[list[int]]:
        """OmniKV's selected positions of the first recorded steps (lists of ints)."""
        self._selections[:] = [s.tolist() if isinstance(s, torch.Tensor) else s for s in self._selections]
        return self._selections

    def stored_bytes(self) -> list[StoredBytes]:
        """Per-layer bytes by part (:class:`kvbench.compress.accounting.StoredBytes`)."""
        return [layer.stored_bytes() for layer in self.layers]


def decoder_layers(model: Any) -> Any:
    """The text decoder layers (``nn.ModuleList``) of a HF causal LM or VLM: ``get_decoder().layers``, or
    ``model.model.layers`` for a model without ``get_decoder``."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return inner.layers


def _rotary(model: Any) -> Any:
    inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return inner.rotary_emb


def _press_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, **kwargs):
    """Attention over what the active :class:`PressCache` returned, masked by key positions.

    GQA through ``enable_gqa`` (the KV heads are not repeated to the query heads); no mask at a one-token
    step without :meth:`StoreLayer.narrow` when the store hides no key (:meth:`StoreLayer.hides_keys`), since
    every stored key precedes the query; otherwise a bool mask ``[1, 1, t, n]`` (``[1, H_q, t, n]`` when heads
    hold different tokens). The attended count is recorded without reading it back (:attr:`PressCache.attended`).
    """
    cache = _active.get()
    if cache is None:
        raise RuntimeError(f"attention implementation {ATTN_NAME!r} needs an active PressCache (press_attention)")
    layer: StoreLayer = cache.layers[module.layer_idx]
    if module.layer_idx == 0:
        cache.begin_step()
    view = layer._view
    extra = layer.narrow(query, view)
    if extra is None and query.shape[2] == 1 and not layer.hides_keys():
        # a decode step whose store holds no padding: every key is visible to the one query row
        allowed, attended = None, layer.visible(view)
    else:
        allowed = _visible(view.positions, layer._query_pos, query.shape[1])     # [1, 1 or H_q, t, n]
        if extra is not None:
            allowed = allowed & extra
        attended = allowed[:, :, -1].sum() // allowed.shape[1]   # a tensor: read when cache.attended is
    cache.record_attended(attended)
    out = layer.attend(query, key, value, allowed, scaling)
    pending, layer._pending = layer._pending, None
    layer.commit(pending, query)
    if layer.after_commit is not None:
        layer.after_commit(layer, pending, query)
    layer._view = layer._query_pos = None   # the step's working copy is not held between steps
    return out.transpose(1, 2).contiguous(), None


def _visible(key_pos: torch.Tensor, query_pos: torch.Tensor, n_query_heads: int) -> torch.Tensor:
    """Bool mask ``[1, 1, t, n]`` (key position <= query position) when every KV head holds the same
    positions (``key_pos`` ``[1, H_kv, n]`` one row expanded: a host-side stride test), else per query head
    ``[1, H_q, t, n]`` (each KV head's row repeated to its GQA group)."""
    if shared_over_heads(key_pos):
        return key_pos[:, :1, None, :] <= query_pos.view(1, 1, -1, 1)
    allowed = key_pos[:, :, None, :] <= query_pos.view(1, 1, -1, 1)
    return allowed.repeat_interleave(n_query_heads // key_pos.shape[1], dim=1)


AttentionInterface.register(ATTN_NAME, _press_attention)


@contextlib.contextmanager
def press_attention(model: Any, cache: PressCache) -> Iterator[PressCache]:
    """Within the block, ``model``'s attention reads ``cache`` through ``"kvbench_press"`` and the hooks of
    :meth:`StoreLayer.attach` are on; restores the model's attention implementation and removes the hooks on
    exit (also after an exception)."""
    old = model.config._attn_implementation
    token = _active.set(cache)
    handles: list = []
    try:
        for layer, dec in zip(cache.layers, decoder_layers(model)):
            handles.extend(layer.attach(dec.self_attn))
        model.set_attn_implementation(ATTN_NAME)
        yield cache
    finally:
        for h in handles:
            h.remove()
        model.set_attn_implementation(old)
        _active.reset(token)


#: Evaluation protocols (:attr:`Press.protocol`).
PROTOCOLS = ("one_pass", "shared_context")


@dataclass
class Press:
    """A compression method: a dataclass of its hyper-parameters that builds one :class:`StoreLayer` per
    decoder layer (kvpress style: one method per file, one registry line). The base class is the full,
    exact cache.

    Parameters:
        protocol: how a record's prompt meets the cache (every press has it; keyword-only):
            ``"shared_context"`` (default): the context is prefilled as one chunk and compressed, then the
            question is prefilled as a second chunk that reads the compressed cache, then decoding (SCBench's
            shared-context setting, ResidualKV Table IV). ``"one_pass"``: context + question are prefilled as
            one chunk, so the chunk's own attention is exact and only decoding reads the compressed cache
            (the authors' LongBench run, ``benchmark/long_bench/pred.py`` at ``CURRENTF/Sparse-vLLM@b5169d6``;
            Tables III, VII, VIII). A press whose scoring needs the context alone (:attr:`context_pass`,
            KVzip) prefills context then question under both.
        decode_tail: the question's last ``decode_tail`` tokens (at most all of its tokens) are fed one per step
            as decode steps after the prefill, under either protocol and for each query of a multi-query record
            (keyword-only; 0, the default, feeds none). With the zoo's one-token answers (the key is the
            question's last token) this makes the answer read the compressed cache as a decoded token does, so
            a decode-time selector (OmniKV) selects for it and quantised or coded stores serve it; the full cache
            is unchanged by it (the same attention, chunked). Beyond the papers, whose LongBench answers are
            long enough to decode through the cache: docs/decisions/residualkv.md, "Prompt protocols".

    Raises:
        ValueError: ``protocol`` not in :data:`PROTOCOLS`; ``decode_tail`` not an int >= 0.
    """

    name = "full"
    #: Parameters under which the press keeps every token exactly, so it must reproduce the full cache (the
    #: registry-driven check in tests/test_press_matrix.py); resources (a codec) are the test's to give.
    exact: ClassVar[dict] = {}
    #: The press scores the context alone in :meth:`after_context` (query-agnostic, KVzip), so the context is
    #: always its own chunk.
    context_pass: ClassVar[bool] = False
    #: Record kinds the press can answer (``kvbench eval`` refuses a split with others before loading the model):
    #: visual-token presses need images, a context pass (KVzip) re-reads the context from token ids, so text only.
    serves: ClassVar[tuple[str, ...]] = ("text", "vlm")

    protocol: str = field(default="shared_context", kw_only=True)
    decode_tail: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        tail = self.decode_tail
        if not isinstance(tail, int) or isinstance(tail, bool) or tail < 0:
            raise ValueError(f"decode_tail (question tokens fed as decode steps) must be an int >= 0, got {tail!r}")

    def first_chunk(self, n_prompt: int, split: int) -> int:
        """Where the first prefill chunk of a prompt of ``n_prompt`` tokens ends, given the first question
        token ``split``: ``split`` (two chunks) or ``n_prompt`` (one chunk), by :attr:`protocol`."""
        return split if self.protocol == "shared_context" or self.context_pass else n_prompt

    def make_layer(self, ctx: LayerContext, cache: PressCache) -> StoreLayer:
        """The store of decoder layer ``ctx.layer_idx``."""
        return StoreLayer(ctx, cache)

    def load(self) -> None:
        """Read and check the press's resources (e.g. ResidualKV's trained codec) before its first request.
        Construction never reads them, so a spec is checked by constructing its press (also at DAG time).
        Default: nothing."""

    def check_layers(self, n_layers: int) -> None:
        """Check the press's layer indices against a model with ``n_layers`` decoder layers (also at DAG time,
        from the config's model shape). Default: nothing.

        Raises:
            ValueError: a layer index the model does not have (or a layer set the method cannot run with).
        """

    def new_cache(self, model: Any) -> PressCache:
        """An empty cache for one request on ``model``."""
        return PressCache(model, self.make_layer)

    def after_context(self, model: Any, cache: PressCache, context_ids: torch.Tensor) -> None:
        """Called once after the context chunk is prefilled (before the question chunk), inside
        :func:`press_attention`; e.g. KVzip's context-reconstruction scoring pass. Default: nothing."""

    def compute_ratio(self, n_layers: int) -> float | None:
        """CR the method targets by construction (None: measured only)."""
        return 1.0

    def kept_target(self, n_context: int, n_tokens: int, n_layers: int) -> float | None:
        """Share of a request's ``n_tokens`` tokens (the first ``n_context`` of them the context chunk) that the
        press's configured budget keeps by construction, mean over layers and KV heads: the target the
        measured ``kept`` of the audit row (:meth:`StoreLayer.kept_share`) is compared with. None: the press
        drops nothing (kept 1.0) or has no closed form. Default None."""
        return None

    def kr_formula(self, n_tokens: int, n_layers: int, d_kv: int, codec: Any = None) -> float | None:
        """KR by the paper's closed form (ResidualKV §V-A) at ``n_tokens`` on a model of ``n_layers`` layers and
        K‖V width ``d_kv``; None for methods without one (their KR is measured only). ``codec``: the codec
        config of presses that have one."""
        return None
