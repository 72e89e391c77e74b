"""Phase 2 refresh executor: recompute chosen tokens through the model's own decoder layers (CONDUIT §3.5, App. A.1).

At each decoder layer ``l`` a set of *computed rows* (sequence indices) runs
through that layer's real module (norm, attention, MLP). Their new K/V are
written into a copy of the layer's base K/V (the stale, re-rotated image cache;
zeros at text), and their queries attend over **all** T keys of that copy with
an exact per-position causal mask (row at sequence index i sees keys 0..i), so
refreshed tokens see refreshed and reused entries alike, as in the authors'
block-sparse Phase 2 (``model_runner.py``; rows = active segments, columns =
all). Every other entry is reused as is. Text rows are computed at every layer
(budgets count visual tokens only); visual rows follow a
:class:`LayerSchedule`: one set for all layers (CONDUIT, ProphetKV, MPIC), or
a non-increasing nested set per layer (CacheBlend, KVShare), chosen up front or
on the fly from the layer's new vs. old K/V.

The base tensors are cloned per layer, so the reusable cache is never modified;
with ``in_place=True`` the writes go straight into them instead, so no second
copy of the stale cache exists (the timed serving path, where each request is
assembled afresh). A request refreshed in place is marked consumed and refused
afterwards (its visual entries are no longer the stale cache).

Output (:class:`ExecResult`): float32 logits of the last position and the
assembled post-RoPE K/V per layer, convertible to a ``DynamicCache`` for greedy
decoding with the HF model (:func:`greedy_decode`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvbench.reuse.adapter import VLMAdapter
from kvbench.reuse.assemble import AssembledRequest


@dataclass
class LayerState:
    """What a schedule sees at layer ``layer`` (all tensors batch 1; indices are sequence indices).

    Attributes:
        rows: int64 ``[n]`` rows computed at this layer, ascending (text + active visual).
        active_visual: int64 visual rows computed at this layer, ascending.
        keys, values: ``[1, n_kv, T, hd]`` the layer's K/V after this layer's writes (post-RoPE K).
        old_keys, old_values: ``[1, n_kv, n, hd]`` the base K/V (stale cache) at ``rows`` before this layer's
            writes (read them with :meth:`old_at`), or None unless the schedule reads them
            (:meth:`LayerSchedule.reads_old_kv`): only the computed rows are kept, never a copy of all T.
        queries: ``[1, n_heads, m, hd]`` post-RoPE queries of ``query_rows``, or None unless the schedule asked.
        query_rows: int64 ``[m]`` sequence indices of ``queries``: ``rows``, or the subset the schedule named
            (:meth:`LayerSchedule.query_mask`), so rows nobody reads get no query projection.
        scale: the attention's softmax scale.
    """

    layer: int
    rows: torch.Tensor
    active_visual: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    old_keys: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    queries: torch.Tensor | None = None
    scale: float = 1.0
    query_rows: torch.Tensor | None = None

    def old_at(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Base K/V before this layer's writes at sequence indices ``idx`` (int64 ``[m]``, a subset of ``rows``):
        two ``[1, n_kv, m, hd]`` tensors.

        Raises:
            RuntimeError: the schedule did not ask for them at this layer (:meth:`LayerSchedule.reads_old_kv`).
        """
        if self.old_keys is None or self.old_values is None:
            raise RuntimeError(f"layer {self.layer}: old K/V were not kept; the schedule that reads them must say so "
                               "in reads_old_kv(layer)")
        pos = torch.searchsorted(self.rows, idx)
        return self.old_keys[:, :, pos], self.old_values[:, :, pos]


class LayerSchedule:
    """Which visual rows are computed at each layer. The base class is static.

    Args:
        per_layer: visual sequence indices per layer (a single tensor means the
            same set at every layer). Sets must be nested and non-increasing
            (a token dropped at layer l has no hidden state to resume from).
    """

    def __init__(self, per_layer: torch.Tensor | Sequence[torch.Tensor]):
        self.per_layer = per_layer

    def _at(self, layer: int) -> torch.Tensor:
        if torch.is_tensor(self.per_layer):
            return self.per_layer
        return self.per_layer[layer]

    def start(self) -> torch.Tensor:
        """Visual rows computed at layer 0."""
        return self._at(0)

    def wants_queries(self, layer: int) -> bool:
        """Whether :class:`LayerState` at ``layer`` must carry queries."""
        return False

    def reads_old_kv(self, layer: int) -> bool:
        """Whether :class:`LayerState` at ``layer`` must carry the computed rows' base K/V from before the
        writes (deviation scores)."""
        return False

    def query_mask(self, rows: torch.Tensor) -> torch.Tensor | None:
        """Bool ``[n]`` over this layer's computed ``rows``: whose queries :class:`LayerState` carries when
        :meth:`wants_queries` holds (None: every row's)."""
        return None

    def observe(self, state: LayerState) -> None:
        """Called after each layer with the final K/V of that layer."""

    def advance(self, state: LayerState) -> torch.Tensor:
        """Visual rows computed at layer ``state.layer + 1`` (a subset of the rows computed at this layer)."""
        return self._at(state.layer + 1)


@dataclass
class ExecResult:
    """Output of one execution.

    Attributes:
        logits: float32 ``[vocab]`` at the last position.
        keys, values: per layer ``[1, n_kv, T, hd]`` (post-RoPE keys), the cache a decode step reads.
        computed_visual: per layer, visual sequence indices recomputed there (their new K/V are the ones in
            ``keys``/``values``; every other visual entry is the base K/V).
        next_position: position of the first generated token.
        mrope: whether positions are 3-axis.
    """

    logits: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    computed_visual: list[torch.Tensor] = field(default_factory=list)
    next_position: int = 0
    mrope: bool = False

    @property
    def layer_counts(self) -> list[int]:
        """Visual tokens recomputed per layer."""
        return [int(t.numel()) for t in self.computed_visual]

    def to_cache(self) -> DynamicCache:
        """A fresh ``DynamicCache`` holding copies of the K/V (decoding appends to it, never to ``keys``)."""
        cache = DynamicCache()
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            cache.update(k.clone(), v.clone(), i)
        return cache


class _RowWriter:
    """Duck-typed cache handed to one decoder layer: scatters the computed rows' K/V into the full copy."""

    def __init__(self, state: LayerState):
        self.state = state

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        st = self.state
        st.keys.index_copy_(2, st.rows, key_states.to(st.keys.dtype))
        st.values.index_copy_(2, st.rows, value_states.to(st.values.dtype))
        return st.keys, st.values


def _check_subset(sub: torch.Tensor, sup: torch.Tensor, layer: int, what: str) -> None:
    if sub.numel() and not bool(torch.isin(sub, sup).all()):
        raise ValueError(f"layer {layer}: {what} set is not a subset of the rows computed there "
                         "(per-layer selections must be nested and non-increasing)")


def causal_rows_mask(rows: torch.Tensor, T: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask ``[1, 1, n, T]``: 0 where key index <= row index, dtype-min elsewhere."""
    allowed = torch.arange(T, device=rows.device)[None, :] <= rows[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=rows.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def check_fresh(req: AssembledRequest) -> None:
    """Raise ValueError when ``req`` was refreshed in place (its visual K/V are no longer the stale cache)."""
    if req.consumed:
        raise ValueError("this assembled request was refreshed in place (in_place=True), so its K/V are no longer "
                         "the stale cache; assemble the request again")


@torch.no_grad()
def execute(adapter: VLMAdapter, req: AssembledRequest, schedule: LayerSchedule, *,
            base_keys: list[torch.Tensor] | None = None, base_values: list[torch.Tensor] | None = None,
            text_rows: torch.Tensor | None = None, in_place: bool = False) -> ExecResult:
    """Run the decoder with the visual rows of ``schedule`` (plus text rows) computed, the rest reused.

    Args:
        adapter: the model adapter.
        req: the assembled request.
        schedule: visual rows per layer.
        base_keys, base_values: per layer ``[1, n_kv, T, hd]`` entries for rows not computed
            (default: ``req.stale_k`` / ``req.stale_v``). Not modified unless ``in_place``.
        text_rows: text rows computed at every layer (default: all text). Passing a subset
            (e.g. the trailing query) requires base K/V that are valid at the other text rows.
        in_place: write the computed rows into the base tensors themselves (no per-layer copy); the output's
            K/V are then those tensors. When the base is the request's own cache and visual rows are written,
            ``req`` is marked consumed.

    Raises:
        ValueError: ``req`` was consumed by an earlier in-place run, a schedule set is not a subset of the
            visual tokens or of the previous layer's set, or ``text_rows`` lacks the last position (its logits
            are the output).
    """
    check_fresh(req)
    base_keys = req.stale_k if base_keys is None else base_keys
    base_values = req.stale_v if base_values is None else base_values
    text_rows = req.text_index if text_rows is None else text_rows
    T = req.seq_len
    if int(text_rows.max()) != T - 1:
        raise ValueError("text_rows must contain the last position (its logits are the output)")
    vis = torch.sort(schedule.start().to(req.visual_index.device)).values
    _check_subset(vis, req.visual_index, 0, "visual")
    rows = torch.sort(torch.cat([text_rows, vis])).values
    h = req.embeds[:, rows]
    keys, values, computed = [], [], []
    mask, mask_rows = None, None
    for li, layer in enumerate(adapter.layers):
        attn = layer.self_attn
        if mask_rows is None or mask_rows.numel() != rows.numel():   # rows only ever shrink: same size = same set
            mask, mask_rows = causal_rows_mask(rows, T, h.dtype), rows
        bk, bv = base_keys[li], base_values[li]
        state = LayerState(layer=li, rows=rows, active_visual=vis, keys=bk if in_place else bk.clone(),
                           values=bv if in_place else bv.clone(),
                           scale=float(getattr(attn, "scaling", adapter.head_dim ** -0.5)))
        if schedule.reads_old_kv(li):   # gathered before the writes (a copy of the computed rows only)
            state.old_keys, state.old_values = bk[:, :, rows], bv[:, :, rows]
        writer = _RowWriter(state)
        cos, sin = req.cos[:, rows], req.sin[:, rows]
        hook = None
        if schedule.wants_queries(li):
            sel = schedule.query_mask(rows)
            state.query_rows = rows if sel is None else rows[sel]

            def grab(_m, _args, kwargs, _st=state, _li=li, _cos=cos, _sin=sin, _sel=sel):
                x = kwargs["hidden_states"]
                if _sel is not None:   # only the rows the schedule reads: no query projection for the others
                    x, _cos, _sin = x[:, _sel], _cos[:, _sel], _sin[:, _sel]
                _st.queries = adapter.queries(_li, x, _cos, _sin)
            hook = attn.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            out = layer(h, attention_mask=mask, position_embeddings=(cos, sin),
                        cache=writer, use_cache=True, position_ids=None)
        finally:
            if hook is not None:
                hook.remove()
        h = out[0] if isinstance(out, tuple) else out
        keys.append(state.keys)
        values.append(state.values)
        computed.append(vis)
        schedule.observe(state)
        if li + 1 < len(adapter.layers):
            nxt = torch.sort(schedule.advance(state).to(rows.device)).values
            _check_subset(nxt, vis, li + 1, "visual")
            keep = torch.isin(rows, torch.cat([text_rows, nxt]))
            h, rows, vis = h[:, keep], rows[keep], nxt
    if in_place and base_keys[0] is req.stale_k[0] and any(c.numel() for c in computed):
        req.consumed = True
    h = adapter.decoder.norm(h)
    logits = adapter.lm_head(h[:, -1]).float()[0]
    return ExecResult(logits=logits, keys=keys, values=values, computed_visual=computed,
                      next_position=req.next_position, mrope=adapter.mrope)


@torch.no_grad()
def full_prefill(adapter: VLMAdapter, req: AssembledRequest) -> ExecResult:
    """The model's own forward over the whole request (vision tower included): the reference every refresh
    is measured against (``full`` policy)."""
    out = adapter.full_forward(req.enc)
    cache = out.cache
    keys = [cache.layers[i].keys for i in range(adapter.n_layers)]
    values = [cache.layers[i].values for i in range(adapter.n_layers)]
    return ExecResult(logits=out.logits[0, -1].float(), keys=keys, values=values,
                      computed_visual=[req.visual_index] * adapter.n_layers,
                      next_position=req.next_position, mrope=adapter.mrope)


@torch.no_grad()
def greedy_decode(adapter: VLMAdapter, result: ExecResult, n_tokens: int) -> list[int]:
    """Greedy-decode ``n_tokens`` tokens with the HF model from ``result``'s logits and K/V.

    The first token is the argmax of ``result.logits``; each later one is one
    model step over a ``DynamicCache`` copy of the assembled K/V, at position
    ``next_position + i`` on every RoPE axis (the HF rule for text after the
    last image: max position + 1, then +1 per token).
    """
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    cache = result.to_cache()
    tok = int(result.logits.argmax())
    out = [tok]
    for i in range(1, n_tokens):
        pos = torch.tensor([[result.next_position + i - 1]], device=adapter.device)
        if result.mrope:
            pos = pos[None].expand(3, 1, 1)
        step = adapter.model(input_ids=torch.tensor([[tok]], device=adapter.device), position_ids=pos,
                             cache=cache, use_cache=True)
        cache = step.cache
        tok = int(step.logits[0, -1].argmax())
        out.append(tok)
    return out


@torch.no_grad()
def continuation_logprob(adapter: VLMAdapter, result: ExecResult, continuation: list[int]) -> tuple[float, bool]:
    """Log-likelihood of ``continuation`` after the executed prompt, from ``result``'s logits and K/V.

    The first token is scored by ``result.logits``; the rest by one forward
    pass of ``continuation[:-1]`` over a ``DynamicCache`` copy of the K/V, at
    positions ``next_position + i`` on every RoPE axis (as in :func:`greedy_decode`).
    lmms-eval's ``loglikelihood`` contract (multiple-choice tasks).

    Args:
        continuation: token ids (>= 1).

    Returns:
        ``(sum of log-probabilities in nats, whether every token is the greedy argmax)``.

    Raises:
        ValueError: an empty continuation.
    """
    if not continuation:
        raise ValueError("continuation must have at least one token")
    logits = [result.logits.float()]
    if len(continuation) > 1:
        n = len(continuation) - 1
        pos = torch.arange(result.next_position, result.next_position + n, device=adapter.device)[None]
        if result.mrope:
            pos = pos[None].expand(3, 1, n)
        out = adapter.model(input_ids=torch.tensor([continuation[:-1]], device=adapter.device), position_ids=pos,
                            cache=result.to_cache(), use_cache=True)
        logits += list(out.logits[0].float())
    lp = torch.log_softmax(torch.stack(logits), -1)
    target = torch.tensor(continuation, device=lp.device)
    total = float(lp.gather(1, target[:, None]).sum())
    return total, bool((lp.argmax(-1) == target).all())
