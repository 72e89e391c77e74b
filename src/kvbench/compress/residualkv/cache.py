"""The ResidualKV cache (paper §IV-A..C; authors' ``src/deltakv/modeling/cache_pipeline.py`` at b5169d6).

Per sparse layer, a request's tokens are held as

- **sinks**: the first ``n_sink`` tokens, raw (attention sinks; never coded);
- **raw window**: the latest ``window`` tokens, raw (the code keeps a 128-255 token recent buffer);
- **references**: tokens on the stride schedule (:func:`~kvbench.compress.residualkv.references.reference_mask`),
  their pre-RoPE K‖V stored FP8 e4m3 (§V-A; overflow saturates, :func:`~kvbench.kernels.quant.to_fp8`);
- **residual codes**: every other token, z = f_c(kv) − f_c(mean of its k nearest earlier references)
  quantised per token in groups (§IV-A), plus the indices of those references.

A token leaves the raw window when it falls out of it ("compression after the chunk's view is built": a
single-chunk prefill is exact, decode reads restored K/V). Restoring is kv̂ = f_d(z̃) + mean_ref (§IV-B),
split into pre-RoPE K and V, and K is rotated at the token's own position. K is the codec's key quantity
(:mod:`~kvbench.compress.residualkv.keys`, the same tensor as in training): the ``k_proj`` output, so on a
model with a key norm (Qwen3's ``k_norm``) the layer takes it from a ``k_proj`` hook and applies the norm
after restore, before RoPE, as the authors' code; on Qwen2/Llama it inverts RoPE on the cache's keys. References are read as they are
stored (FP8 round trip), and the SAME dequantised references are used to encode and to restore.

Selectors (:class:`ResidualKVPress`, a spec ``residualkv[+<selector>]``), composed with this storage as
kvpress composes presses (``AdaKVPress(SnapKVPress())``):

- none (``residualkv``, standalone): every sparse layer restores all its coded tokens each step (CR 100%,
  §IV-C);
- :class:`~kvbench.compress.presses.omnikv.OmniKVPress` (``residualkv+omnikv``): layers in ``full_layers``
  keep the full KV; a full layer followed by a sparse layer is a **filter layer**: OmniKV's filter step
  (:func:`~kvbench.compress.presses.omnikv.filter_step`, run after the full layer's commit) scores the
  candidates (the positions that sparse layers hold compressed: the storage's sinks and raw window are
  not candidates) and the following sparse layers restore only the selected tokens (plus sinks and
  window). By default, as in the authors' code, only decode steps select: a multi-token chunk restores
  every coded token (the selector's ``sparse_prefill`` and ``row_agg`` are its own fields);
- :class:`~kvbench.compress.presses.snapkv.SnapKVPress` (``residualkv+snapkv``): at the end of the context
  prefill, SnapKV's observation-window scores (its own ``window``, ``kernel`` and ``pooling``; the authors'
  baseline configuration is window 32, max-pool 7) pick ``keep`` of the coded tokens per layer, averaged
  over KV heads since a token's K‖V is coded across heads; the others are dropped for good (references
  stay: other tokens need them).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kvbench import kernels
from kvbench.compress import accounting, checks
from kvbench.compress.accounting import StoredBytes
from kvbench.compress.buffers import Growable, KVBuffer
from kvbench.compress.cache import KVView, LayerContext, PressCache, Press, StoreLayer
from kvbench.compress.presses.kivi import KIVILayer
from kvbench.compress.presses.omnikv import OmniKVPress, keep_count, layer_list
from kvbench.compress.presses.snapkv import SnapKVPress
from kvbench.compress.residualkv import references
from kvbench.compress.residualkv.codec import CodecConfig, ResidualCodec, model_kv_shape
from kvbench.compress.residualkv.keys import codec_keys
from kvbench.compress.residualkv.store import CodeStore, RefPool, index_dtype, restore_mean
from kvbench.kernels import quant
from kvbench.kernels.reference_mean import mean_reference



@functools.lru_cache(maxsize=8)
def _load_codec(path: str) -> ResidualCodec:
    return ResidualCodec.load(path).eval()


#: KIVI's group G (keys: tokens per channel group; values: channels per token group, at most head_dim) of the
#: quantised full-attention layers (:class:`QuantizedFullLayer`), also the KR formula's q_full group
FULL_KV_GROUP = 32
#: forms of the quantised full-attention layers (:class:`QuantizedFullLayer`), with the wording table headers use
FULL_KV_FORMS = {
    "after": "the authors' engine form (full_kv_form=after: the codec's n_sink sinks raw, 32-63 raw tokens, K and V "
             "quantised in 32-token blocks after the chunk's attention, so a one-chunk prefill attends exact K/V)",
    "before": "the authors' HF-reference form (full_kv_form=before: sinks raw, 32-63 raw tokens, quantised before "
              "the chunk's attention, so the prefill already reads its own rows quantised)",
    "kivi": "jy-yuan/KIVI's rule (full_kv_form=kivi: no raw sinks, T mod 32 raw keys, the latest 32 values raw)",
}


class ResidualKVLayer(StoreLayer):
    """A sparse layer of the ResidualKV cache (see the module docstring)."""

    def __init__(self, ctx: LayerContext, cache: PressCache, press: "ResidualKVPress"):
        super().__init__(ctx, cache)
        self.press = press
        self.codec = press.codec_model.layers[ctx.layer_idx]
        self.cfg = press.schedule()
        self.block = press.coding_block()
        self.sink: KVView | None = None
        self.raw = KVBuffer()                          # the raw window: window .. window + block - 1 tokens
        self.pool = RefPool(self.cfg.d_kv, press.ref_fp8)
        self.codes = CodeStore(press.bits, self.cfg.group)
        self.flushed = 0                               # tokens that left the raw window (coded or references)
        #: what the latest step read (:meth:`read_bytes`): (selection or None, pool size, coded tokens) and the
        #: raw bytes (sinks, window, the step's chunk); None before a step read any stored token
        self._read: tuple[torch.Tensor | None, int, int] | None = None
        self._read_raw = 0
        #: latent V (``ResidualKVPress.latent_v``): f_d's (W_K, b_K, W_V [H_kv, D, d_c], b_V) in float32, built
        #: at the first latent step; and this step's (codes z̃ [m, d_c] of the restored rows, zero for references,
        #: their first row in the view), set by a decode step's restore and consumed by :meth:`attend`
        self._f_d: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None] | None = None
        self._latent_now = False
        self._latent: tuple[torch.Tensor, int] | None = None
        #: this step's restore-kernel inputs (:meth:`_kernel_step`): the raw view and the selection (None: all)
        self._fused: tuple[KVView, torch.Tensor | None] | None = None
        self._w_d: tuple[torch.Tensor, torch.Tensor | None] | None = None   # f_d as (W_d, b_d) float32 (_f_d_matrix)
        #: the attention's key norm (Qwen3 ``k_norm``), applied after restore; None: K is the pre-RoPE key
        self.k_norm: torch.nn.Module | None = None
        self._k_in: torch.Tensor | None = None         # this step's k_proj output [t, d_k] (key norm only)
        #: k_proj outputs ``[n, d_k]`` of the raw-window tokens, aligned with ``raw`` (key norm only): what
        #: the codec codes when they leave it. Not counted in KR: the authors hold the window once, pre-norm,
        #: and normalise it at read; here the window also keeps the model's own post-RoPE keys, so that its
        #: attention is exact.
        self.raw_k_in = Growable(0)

    @property
    def n_saturated(self) -> int:
        """Reference values clamped to the FP8 range so far (:func:`~kvbench.kernels.quant.cast_fp8`),
        read back only when asked (the audit)."""
        return int(self.pool.saturated)

    @property
    def window(self) -> KVView | None:
        """The raw window's tokens (None while it holds none)."""
        view = self.raw.view()
        return None if view is None else KVView(*view)

    @property
    def ref_pos(self) -> torch.Tensor:
        """Positions of the stored references, int64 ``[R]`` ascending."""
        return self.pool.positions()

    def refs(self) -> torch.Tensor:
        """Stored references as read back, float32 ``[R, d_kv]``."""
        return self.pool.all()

    # -- the codec's K (keys.py) ------------------------------------------------------------------------
    def attach(self, attn: torch.nn.Module) -> list:
        """With a key norm, hook ``k_proj`` so that each step's pre-norm keys reach :meth:`commit`; without
        one, no hook (the pre-RoPE key is the cache's key with RoPE inverted, :meth:`_kv_pre`)."""
        keys = codec_keys(attn)
        self.k_norm = keys.norm
        if keys.norm is None:
            return []

        def grab(mod, inp, out):
            self._k_in = out.detach()[0]   # [t, H_kv*D]; batch 1 (checked in update)
        return [keys.source.register_forward_hook(grab)]

    # -- storage ---------------------------------------------------------------------------------------
    def _kv_pre(self, view: KVView, k_in: torch.Tensor | None = None) -> torch.Tensor:
        """The codec's K‖V ``[n, d_kv]`` float32 of a dense raw view (heads flattened, K first): K is ``k_in``
        (the tokens' ``k_proj`` outputs ``[n, d_k]``, given with a key norm) or else the view's keys with RoPE
        inverted."""
        flat = lambda x: x[0].transpose(0, 1).reshape(x.shape[-2], -1)  # noqa: E731  [H, n, D] -> [n, H*D]
        k = k_in if k_in is not None else flat(self.ctx.unrotate(view.keys, view.positions[0, 0]))
        return torch.cat([k, flat(view.values)], -1).float()

    def _to_view(self, kv: torch.Tensor, pos: torch.Tensor) -> KVView:
        """Dense view of the codec's ``kv`` ``[n, d_kv]`` at ``pos``: split, reshape to heads, key norm (if
        any), rotate K (the cache's cos/sin table)."""
        n, H = kv.shape[0], self.ctx_heads
        k, v = kv.to(self.ctx.dtype).split(kv.shape[-1] // 2, -1)
        k = k.reshape(n, H, -1).transpose(0, 1).unsqueeze(0)
        v = v.reshape(n, H, -1).transpose(0, 1).unsqueeze(0)
        if self.k_norm is not None:
            with torch.no_grad():
                k = self.k_norm(k)   # per head over D, so [1, H, n, D] normalises as the model's [1, n, H, D]
        return KVView.dense(self.ctx.rotate(k, pos), v, pos)

    @property
    def ctx_heads(self) -> int:
        return self.sink.keys.shape[1] if self.sink is not None else self.raw.keys.data.shape[1]

    def commit(self, chunk: KVView, query: torch.Tensor) -> None:
        self.ctx.rope.reach(self.seen)   # RoPE is inverted at positions below the tokens written
        k_in, self._k_in = self._k_in, None
        if self.k_norm is not None and (k_in is None or len(k_in) != len(chunk)):
            raise RuntimeError(f"layer {self.ctx.layer_idx}: the k_proj hook did not see this chunk's "
                               f"{len(chunk)} keys (got {None if k_in is None else len(k_in)})")
        self._store(chunk, k_in)

    def snap(self, layer: "ResidualKVLayer", chunk: KVView, query: torch.Tensor) -> None:
        """``residualkv+snapkv`` (§IV-C), the ``after_commit`` hook of a sparse layer (``layer`` is ``self``):
        after the context's first chunk, keep the selector's ``keep`` share (``ceil``, at least one) of the
        coded tokens that the chunk's observation window attends most (:meth:`SnapKVPress.token_scores` over
        the keys this step read); references stay. Once per request, so it may read values back."""
        code_pos = self.codes.positions()
        first_chunk = self.seen == len(chunk) > 1   # every token written so far came in this chunk
        if not first_chunk or not len(code_pos):
            return
        view = self._view
        scores = self.press.selector.token_scores(query, view)                      # [n]
        by_pos = torch.full((int(view.positions.max()) + 1,), float("-inf"), device=scores.device)
        by_pos[view.positions[0, 0]] = scores
        s = by_pos[code_pos]
        self.drop_unselected(code_pos[s.topk(keep_count(self.press.selector.keep, len(code_pos))).indices])

    def _store(self, chunk: KVView, k_in: torch.Tensor | None = None) -> None:
        """Hold ``chunk`` as sinks / raw window and code the oldest raw tokens in blocks: nothing until the
        raw window holds ``window + block`` tokens, then ``⌊(raw − window) / block⌋ · block`` of them at once
        (the authors' flush, ``cache_pipeline.py``). ``k_in`` ``[len(chunk), d_k]``: its k_proj outputs (key
        norm only), kept aligned with the window."""
        n_sink_left = self.cfg.n_sink - (0 if self.sink is None else len(self.sink))
        if n_sink_left > 0:
            take = min(n_sink_left, len(chunk))
            # copies, not views: a view would hold the whole chunk's storage for as long as the sinks live
            head = KVView(chunk.keys[..., :take, :].clone(), chunk.values[..., :take, :].clone(),
                          chunk.positions[..., :take].clone())
            self.sink = KVView.cat([self.sink, head])
            chunk = KVView(chunk.keys[..., take:, :], chunk.values[..., take:, :], chunk.positions[..., take:])
            k_in = None if k_in is None else k_in[take:]   # sinks stay raw: never coded
        if len(chunk):
            self.raw.append(*chunk.tensors())
            if k_in is not None:
                self.raw_k_in.append(k_in)
        n_code = max(0, len(self.raw) - self.cfg.window) // self.block * self.block
        if n_code:
            keys, values, positions = self.raw.view()
            old = KVView(keys[..., :n_code, :], values[..., :n_code, :], positions[..., :n_code])
            old_k_in = self.raw_k_in.view()[:n_code] if len(self.raw_k_in) else None
            self._compress(old, old_k_in)
            self.raw.drop_front(n_code)
            self.raw_k_in.drop_front(n_code)

    def _compress(self, old: KVView, k_in: torch.Tensor | None = None) -> None:
        """Code one block of tokens leaving the raw window (§IV-A): its references join the pool (FP8), the
        others get their ``k`` nearest earlier references (one search over the pool for the block), the
        residual code of the codec (one encoder pass over the block's K‖V and one over their means) and are
        quantised. ``k_in``: their k_proj outputs (key norm only). The block's positions are consecutive
        (``n_sink + flushed`` on), so its references are known on the host."""
        kv, pos = self._kv_pre(old, k_in), old.positions[0, 0]
        start, n = self.cfg.n_sink + self.flushed, len(old)
        self.flushed += n
        if checks.ENABLED and not torch.equal(pos, torch.arange(start, start + n, device=pos.device)):
            raise RuntimeError(f"layer {self.ctx.layer_idx}: a coded block is not positions {start}..{start + n - 1}")
        ref_off = self._ref_offsets(start, start + n)
        tok_off = sorted(set(range(n)) - set(ref_off))
        if ref_off:
            at = torch.tensor(ref_off, device=kv.device)
            self.pool.add(kv.index_select(0, at), pos.index_select(0, at), self.seen)
        if not tok_off:
            return
        at = torch.tensor(tok_off, device=kv.device)
        x, x_pos = kv.index_select(0, at), pos.index_select(0, at)
        refs = self.pool.all()
        if self.cfg.references:
            nbr, valid = references.nearest_references(x, x_pos, refs, self.pool.positions(), self.cfg.k,
                                                       check=checks.ENABLED)
            mean = mean_reference(refs, nbr, valid, check=checks.ENABLED)
        else:  # no references: a zero mean, no indices stored
            nbr = torch.zeros(len(tok_off), 0, dtype=torch.long, device=kv.device)
            valid = torch.zeros(len(tok_off), 0, dtype=torch.bool, device=kv.device)
            mean = torch.zeros(len(tok_off), self.cfg.d_kv, device=kv.device)
        with torch.no_grad():
            if self.press.mean_only:  # the authors' Table VIII ablation: a zero code of width d_c, stored
                z = kv.new_zeros(len(tok_off), self.cfg.d_c)
            elif self.press.use_codec:
                z = self.codec.residual_code(x, mean)
            else:  # the raw residual itself, quantised at full width (the authors' "origin" codec)
                z = x - mean
        # bits 32: the payload stored exactly in float32 (the identity-codec invariant; not a paper setting)
        codes = (z.float().clone() if self.press.bits == 32
                 else quant.quantize(z, self.press.bits, self.cfg.group, check=checks.ENABLED))
        self.codes.add(codes, nbr, valid, x_pos, len(self.pool), self.seen)

    def _ref_offsets(self, start: int, end: int) -> list[int]:
        """Offsets from ``start`` of the reference positions in ``[start, end)`` (the schedule is a function
        of positions alone, computed on the host)."""
        if not self.cfg.references:
            return []
        cfg = self.cfg
        return [p - start for p in references.references_between(start, end, n_sink=cfg.n_sink, stride=cfg.stride,
                                                                 alpha=cfg.alpha, grid=cfg.grid)]

    # -- reading ---------------------------------------------------------------------------------------
    def _restore(self, z: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """kv̂ ``[m, d_kv]`` of coded tokens from their dequantised codes ``z`` and reference means (§IV-B). At a
        latent-V step, K is restored and the V half holds only ``mean_V + b_V``: :meth:`attend` adds W_V's
        share from the attention-weighted codes."""
        with torch.no_grad():
            if self.press.mean_only:
                return mean                      # REMOVE_COMP: the code is not read back
            if self._latent_now:
                w_k, b_k, _, b_v = self._decoder()
                d_k = w_k.shape[0]
                out = mean   # the caller's fresh mean, restored in place
                out[:, :d_k] += torch.nn.functional.linear(z, w_k, b_k)
                if b_v is not None:
                    out[:, d_k:] += b_v.reshape(-1)
                return out
            return self.codec.restore(z, mean) if self.press.use_codec else z + mean

    def _f_d_matrix(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """f_d as ``(W_d [d_kv, d_c], b_d [d_kv] or None)`` float32, built once per layer (``block_diag`` makes a
        new tensor each call): what the restore kernel reads and latent V splits."""
        if self._w_d is None:
            w, b = self.codec.linear_decoder()
            self._w_d = (w.float(), None if b is None else b.float())
        return self._w_d

    def _decoder(self):
        """f_d split for latent V, float32: ``(W_K [d_k, d_c], b_K or None, W_V [H_kv, D, d_c], b_V or None)``."""
        if self._f_d is None:
            w, b = self._f_d_matrix()
            d_k, h = self.cfg.d_kv // 2, self.ctx_heads
            self._f_d = (w[:d_k].contiguous(), None if b is None else b[:d_k],
                         w[d_k:].reshape(h, d_k // h, -1).contiguous(), None if b is None else b[d_k:])
        return self._f_d

    def _restore_all(self) -> list[KVView]:
        """Every reference and every coded token (standalone, or a chunk OmniKV does not select for)."""
        parts, latent = [], []
        if len(self.pool):
            parts.append(self._to_view(self.pool.all(), self.pool.positions()))
            latent.append(torch.zeros(len(self.pool), self.cfg.d_c, device=parts[0].keys.device))
        if len(self.codes):
            z, nbr, valid = self.codes.rows()
            mean = (restore_mean(self.pool, nbr, valid)[0] if nbr.shape[1]
                    else z.new_zeros(len(z), self.cfg.d_kv))
            parts.append(self._to_view(self._restore(z, mean), self.codes.positions()))
            latent.append(z)
        if self._latent_now and latent:
            self._latent = (torch.cat(latent), self._n_sink())
        return parts

    def _restore_selected(self, selected: torch.Tensor) -> KVView:
        """The tokens at OmniKV's ``selected`` positions (int64 ``[m]``, each a reference or a coded token of
        this layer), restored with host-known shapes: slots from the position maps, one gather of codes, one of
        the references (the selected ones and the coded tokens' neighbours), one decoder pass; references
        first, then coded tokens, each in position order (the order of :meth:`_restore_all`)."""
        m = len(selected)
        ref_slot, code_slot = self.pool.slot(selected), self.codes.slot(selected)
        is_ref = ref_slot >= 0
        if checks.ENABLED and not (is_ref | (code_slot >= 0)).all():
            raise RuntimeError(f"layer {self.ctx.layer_idx}: selected positions that are neither references nor "
                               f"coded: {selected[~(is_ref | (code_slot >= 0))].tolist()}")
        order = torch.argsort(torch.where(is_ref, selected, selected + self.seen))
        selected, ref_slot, code_slot, is_ref = selected[order], ref_slot[order], code_slot[order], is_ref[order]
        if not len(self.codes):
            return self._to_view(self.pool.rows(ref_slot), selected)
        z, nbr, valid = self.codes.rows(code_slot.clamp(min=0))
        ref_rows = None
        if not nbr.shape[1]:
            mean = z.new_zeros(m, self.cfg.d_kv)
        elif self.cfg.bias:
            mean, ref_rows = restore_mean(self.pool, nbr, valid, ref_slot.clamp(min=0) if len(self.pool) else None)
        else:
            # a selected reference restores as a coded token whose one valid neighbour is itself and whose code is
            # zero: its mean is its row exactly (one slot of weight 1), and f_d(0) = 0 exactly without a bias, so
            # kv̂ is the stored row bit for bit, from the same gather and decoder pass as the coded tokens
            ref_nbr = ref_slot.clamp(min=0)[:, None]
            nbr = torch.where(is_ref[:, None], ref_nbr, nbr)
            valid = torch.where(is_ref[:, None], torch.arange(nbr.shape[1], device=nbr.device) == 0, valid)
            z = torch.where(is_ref[:, None], 0.0, z)
            mean = restore_mean(self.pool, nbr, valid)[0]
        kv = self._restore(z, mean)
        if ref_rows is not None:
            kv = torch.where(is_ref[:, None], ref_rows.to(kv.dtype), kv)
        if self._latent_now:   # a selected reference is stored exact: no code, no W_V share
            self._latent = (z if ref_rows is None else torch.where(is_ref[:, None], 0.0, z), self._n_sink())
        return self._to_view(kv, selected)

    def _n_sink(self) -> int:
        return 0 if self.sink is None else len(self.sink)

    def _parts(self) -> list[KVView | None]:
        """Sinks, the restored tokens (every one, or OmniKV's selection of this step) and the raw window."""
        self.ctx.rope.reach(self.seen)
        selected = self.cache.step.selected   # set only by an OmniKV filter layer of this step
        if selected is None:
            restored = self._restore_all()
        else:
            restored = [self._restore_selected(selected)] if len(selected) else []
        return [self.sink, *restored, self.window]

    def history(self) -> KVView | None:
        if self.seen == 0:   # nothing written yet (not "no sink": a codec may hold n_sink = 0)
            return None
        return KVView.cat(self._parts())

    def view_with(self, chunk: KVView) -> KVView:
        """History and ``chunk`` in one concatenation (not history's, then a second with the chunk)."""
        self._fused = None
        if not self.seen:
            self._read = None
            return chunk
        if self._kernel_step(chunk):
            # the kernel reads the stores and restores in registers: the view is the raw tokens only
            selected = self.cache.step.selected
            raw = KVView.cat([self.sink, self.window, chunk])
            self._fused = (raw, selected)
            self._note_read(selected, chunk)
            return raw
        # latent V at a decode step without a key norm between restore and attention (Qwen3's k_norm acts on K only,
        # but the flag stays off there: untested)
        self._latent_now = self.press.latent_v and len(chunk) == 1 and self.k_norm is None
        self._latent = None
        try:
            parts = self._parts()
        finally:
            self._latent_now = False
        self._note_read(self.cache.step.selected, chunk)
        return KVView.cat([*parts, chunk])

    def _note_read(self, selected: torch.Tensor | None, chunk: KVView) -> None:
        """Record what this step reads, for :meth:`read_bytes`: the selection (None: every stored token), the
        store sizes (host ints) and the raw bytes (sinks, window, the step's chunk). Before this step's commit."""
        self._read = (selected, len(self.pool), len(self.codes))
        self._read_raw = sum(2 * v.keys.numel() * v.keys.element_size()
                             for v in (self.sink, self.window, chunk) if v is not None)

    def _kernel_step(self, chunk: KVView) -> bool:
        """Whether this step runs the Triton restore kernel (:func:`kvbench.kernels.restore_attend`): a one-token
        step, Triton chosen for the device by ``KVBENCH_KERNELS`` (``auto``: CUDA tensors; ``torch`` keeps this
        module's path for comparison; ``triton`` also runs it on the CPU under ``TRITON_INTERPRET=1``), codes at
        2/4/8/16 bits, the codec's linear f_d (not ``use_codec=false`` / ``mean_only``), no key norm, and stores
        holding coded tokens and references (before the first coded block, or with a codec without references, the
        torch path runs)."""
        if len(chunk) != 1 or self.press.bits == 32 or not self.press.use_codec or self.press.mean_only:
            return False
        if not len(self.codes) or not len(self.pool):
            return False
        if self.k_norm is not None or self.codec.config.decoder != "linear":
            return False
        return kernels.use_triton(chunk.keys.device)

    def visible(self, view: KVView) -> int:
        """The raw view, plus the tokens the restore kernel attends from the stores at a kernel step."""
        if self._fused is None:
            return len(view)
        selected = self._fused[1]
        return len(view) + (len(self.pool) + len(self.codes) if selected is None else len(selected))

    def _attend_kernel(self, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """One decode step through :func:`kvbench.kernels.restore_attend` over the stores as held (FP8 references,
        packed codes, indices) and the raw tokens, with OmniKV's selection as row indices of each store
        (selected positions split by the position maps: one host read of their count per layer)."""
        raw, selected = self._fused
        self._fused = None
        self.ctx.rope.reach(self.seen)
        self.ctx.rope(raw.positions[0, 0, -1:])   # grow the cos/sin table to every stored position
        w, b = self._f_d_matrix()
        layer = kernels.CodedLayer(self.pool.stored(), self.pool.positions(), self.codes.packed_codes(),
                                   self.codes.nbr.view(), self.codes.valid.view(), self.codes.positions(),
                                   w, b, self.ctx.rope.cos, self.ctx.rope.sin)
        ref_sel = code_sel = None
        if selected is not None:
            ref_slot, code_slot = self.pool.slot(selected), self.codes.slot(selected)
            ref_sel, code_sel = ref_slot[ref_slot >= 0], code_slot[code_slot >= 0]
        _, h_q, _, d = query.shape
        out = kernels.restore_attend(query[0, :, 0], raw.keys[0], raw.values[0], layer, ref_sel, code_sel,
                                     softmax_scale=scaling, latent_v=self.press.latent_v)
        return out.view(1, h_q, 1, d)

    def attend(self, query, key, value, mask, scaling):
        """Latent V (``ResidualKVPress.latent_v``, beyond the paper) at a decode step: f_d is linear, so the
        restored rows' share of the output Σ_i a_i (W_V z̃_i + b_V + m_i) is computed as W_V (Σ_i a_i z̃_i) +
        Σ_i a_i (b_V + m_i): ``value`` holds b_V + m_i on those rows (:meth:`_restore`), the attention weights
        are applied to the codes [m, d_c] and W_V once per KV head, instead of decoding V for every restored
        token (m·d_c·d_v multiply-adds saved). Scores and softmax in float32; same result as SDPA over the
        decoded V up to rounding (tested). A kernel step (:meth:`_kernel_step`) runs the restore kernel, whose
        ``latent_v`` does the same in registers. Any other step: :meth:`StoreLayer.attend`."""
        if self._fused is not None:
            return self._attend_kernel(query, scaling)
        latent, self._latent = self._latent, None
        if latent is None:
            return super().attend(query, key, value, mask, scaling)
        if mask is not None or query.shape[2] != 1:   # value lacks W_V z̃ on the restored rows: SDPA would be wrong
            raise RuntimeError(f"layer {self.ctx.layer_idx}: latent V needs a one-token step without a mask, got "
                               f"{query.shape[2]} query tokens, mask {None if mask is None else tuple(mask.shape)}")
        z, start = latent
        _, h_q, _, d = query.shape
        h_kv = key.shape[1]
        q = query.view(h_kv, h_q // h_kv, d).float()
        scale = d ** -0.5 if scaling is None else scaling
        a = torch.softmax(torch.matmul(q, key[0].float().transpose(1, 2)) * scale, dim=-1)   # [H_kv, g, n]
        out = torch.matmul(a, value[0].float())                                               # [H_kv, g, D]
        lat = torch.matmul(a[:, :, start:start + len(z)], z)                                  # [H_kv, g, d_c]
        out += torch.matmul(lat, self._decoder()[2].transpose(1, 2))                          # W_V per KV head
        return out.to(query.dtype).view(1, h_q, 1, d)

    def read_bytes(self) -> int:
        """Bytes the latest step must read from this layer in its stored form (int; 0 when it read no stored
        token), as a fused restore kernel reads them (``kernels.restore_attend_bytes`` counts the same parts):
        the selected coded tokens' packed codes with their fp16 min/scale, their ``k`` reference indices and
        validity flags, the reference rows gathered (each coded token's ``k`` neighbours, invalid slots
        included, plus the selected references themselves) at the pool's stored width (FP8: 1 byte), f_d's
        weights once when a code is decoded, and the sinks, raw window and the step's own K/V at the model's
        width. Which selected tokens are references is read back here, after the step, not during it."""
        if self._read is None:
            return 0
        selected, n_pool, n_codes = self._read
        if selected is None:
            n_ref, n_coded = n_pool, n_codes
        else:
            n_ref = int((self.pool.slot(selected) >= 0).sum()) if n_pool else 0
            n_coded = len(selected) - n_ref
        k = self.cfg.k if self.cfg.references else 0
        bits = self.press.bits
        width = self.cfg.d_c if self.press.use_codec else self.cfg.d_kv   # use_codec=false stores kv − mean
        code_row = (math.ceil(width * bits / 8) + 2 * 2 * math.ceil(width / self.cfg.group) if bits < 16
                    else width * bits // 8)
        if self.press.mean_only:   # the zero codes are stored (and counted in KR) but never read back
            code_row = 0
        idx = torch.empty(0, dtype=index_dtype(n_pool)).element_size()
        ref_width = self.cfg.d_kv * (1 if self.press.ref_fp8 else self.pool.stored().element_size())
        decoder = 0
        if n_coded and not self.press.mean_only and self.press.use_codec:
            decoder = sum(p.numel() * p.element_size() for b in self.codec.branches for p in b.decoder.parameters())
        return (n_coded * (code_row + k * (idx + 1)) + (n_coded * k + n_ref) * ref_width + decoder
                + self._read_raw)

    def packed_bytes(self) -> StoredBytes:
        """Packed parts (:mod:`~kvbench.compress.accounting`): codes, scales and indices
        (:meth:`CodeStore.nbytes`), references as stored (FP8: 1 byte a value), raw window and sinks at FP16.
        Not counted here (resident only, :meth:`held_tensors`): unpacked code bytes, validity masks, int64
        token and reference positions and position maps, the raw tokens' extra bytes in a float32 model, the
        pre-norm window keys of a key-norm model (``raw_k_in``), and spare capacity."""
        payload, scales, indices = self.codes.nbytes()
        raw = lambda v: 0 if v is None else (v.keys.numel() + v.values.numel()) * 2  # noqa: E731  FP16
        ref = self.pool.stored()
        return StoredBytes(layer=self.ctx.layer_idx, codes=payload, scales=scales,
                           references=ref.numel() * ref.element_size(), indices=indices,
                           raw_window=raw(self.window), sinks=raw(self.sink))

    def kept_share(self) -> float:
        """Tokens held (sinks, raw window, references, coded tokens) / tokens written: below 1 only when the
        SnapKV selector dropped coded tokens."""
        if not self.seen:
            return 1.0
        held = (0 if self.sink is None else len(self.sink)) + len(self.raw)
        return (held + len(self.pool) + len(self.codes)) / self.seen

    def held_tensors(self):
        """Every storage held, each at its allocated capacity (the buffers keep up to an eighth spare, or 64
        rows): sinks, raw window, reference pool, code store, the step's k_proj rows."""
        yield from super().held_tensors()
        if self.sink is not None:
            yield from self.sink.tensors()
        yield from self.raw.tensors()
        yield from self.pool.tensors()
        yield from (self.raw_k_in.data, self._k_in)
        yield from self.codes.tensors()

    def reset(self) -> None:
        """Empty the layer for a new request (transformers' ``Cache.reset``): every store and step state, as built;
        the key norm found by :meth:`attach` (its hook stays registered) and a composed selector's ``after_commit``
        are kept."""
        k_norm, after = self.k_norm, self.after_commit
        self.__init__(self.ctx, self.cache, self.press)
        self.k_norm, self.after_commit = k_norm, after

    def drop_unselected(self, keep_positions: torch.Tensor) -> None:
        """``+snapkv``: keep only coded tokens at ``keep_positions`` (references stay)."""
        self.codes.keep(torch.isin(self.codes.positions(), keep_positions))


class QuantizedFullLayer(KIVILayer):
    """A ResidualKV full-attention layer stored KIVI-style at 2/4/8 bits (paper §V-A deployment: 4-bit full layers),
    in one of three forms (``form``):

    - ``after`` (the authors' engine, ``CURRENTF/Sparse-vLLM`` ``deltakv_less_memory.py``, its ``keep_positions``):
      the codec's ``n_sink`` sinks stay raw; after them the raw tokens (K and V alike) are quantised in whole
      blocks of ``group`` when ``window + group`` of them have accumulated, the oldest ``⌊(raw − window) /
      group⌋ · group`` at once, so ``window`` to ``window + group − 1`` (32-63) stay raw; quantisation happens
      after the chunk's attention, so a one-chunk prefill attends exact K/V and later steps read the rows
      dequantised.
    - ``before`` (the authors' HF reference, ``cache_pipeline.py``'s full-layer KIVI round trip): the same
      storage, but the chunk joins the raw tokens and the quantisation runs before the chunk's attention, so the
      prefill's own attention already reads the quantised rows dequantised.
    - ``kivi`` (jy-yuan/KIVI's rule, :class:`~kvbench.compress.presses.kivi.KIVILayer`; this project's form
      before issue #32): no raw sinks, ``T mod 32`` raw keys and the latest 32 raw values, quantised after the
      chunk's attention. Kept for the full-layer-form table (``results/residualkv/table_full_layer_form.csv``).

    Keys per channel over ``group`` tokens, values per token over ``min(group, head_dim)`` channels (KIVI's
    layout, :mod:`kvbench.kernels.quant`). Its packed bytes (codes, scales, raw residual, raw sinks) are
    reported as one ``full_layer`` part, the audit's category for full-attention layers; its resident bytes are
    KIVI's. The Triton decode kernel (:func:`kvbench.kernels.kivi_attend`) serves the ``kivi`` form only (its
    layout has no raw sinks, and ``before`` has already quantised the step's own rows); the others read the
    dequantised store.

    Args:
        bits: 2, 4 or 8.
        form: ``after``, ``before`` or ``kivi`` (above).
        sinks: raw sink tokens (the codec's ``n_sink``; ignored by ``kivi``).
        window: raw tokens kept after the sinks at least (32 in both authors' paths).
        group: KIVI's group G (:data:`FULL_KV_GROUP`).

    Raises ValueError for a form not in :data:`FULL_KV_FORMS`, and as
    :func:`~kvbench.compress.presses.kivi.check_config`.
    """

    def __init__(self, ctx: LayerContext, cache: PressCache, bits: int, form: str = "after", sinks: int = 0,
                 window: int = FULL_KV_GROUP, group: int = FULL_KV_GROUP):
        if form not in FULL_KV_FORMS:
            raise ValueError(f"full_kv_form must be one of {tuple(FULL_KV_FORMS)}, got {form!r}")
        super().__init__(ctx, cache, bits=bits, group=group, residual=window, sinks=0 if form == "kivi" else sinks)
        self.form = form

    def _flush(self) -> None:
        """``kivi``: KIVI's rule. Else the authors' block rule (class docstring), K and V together."""
        if self.form == "kivi":
            return super()._flush()
        raw = self.k_raw.shape[0]
        n = (raw - self.residual) // self.group * self.group if raw >= self.residual + self.group else 0
        if n:
            self._quantize_key_rows(n)
            self._quantize_value_rows(n)

    def _kernel_step(self, chunk: KVView) -> bool:
        return self.form == "kivi" and super()._kernel_step(chunk)

    def view_with(self, chunk: KVView) -> KVView:
        """``before``: stage the chunk, then quantise (the chunk's own rows included) and write the dequantised
        rows into the view this step's attention reads. Else KIVI's view (quantised rows written at the next read)."""
        view = super().view_with(chunk)
        if self.form == "before":
            self._take(chunk)
            self._flush()
            self._write_dequantised()
        return view

    def commit(self, chunk: KVView, query: torch.Tensor) -> None:
        if self.form != "before":
            return super().commit(chunk, query)
        StoreLayer.commit(self, chunk, query)   # taken and quantised in view_with; the store now counts it

    def packed_bytes(self) -> StoredBytes:
        return StoredBytes(layer=self.ctx.layer_idx, full_layer=super().packed_bytes().packed())


@dataclass
class ResidualKVPress(Press):
    """ResidualKV as a cache press, optionally composed with a token selector (module docstring): spec
    ``residualkv``, ``residualkv+omnikv`` or ``residualkv+snapkv`` (:mod:`kvbench.utils.spec`).

    Source: ResidualKV, "ResidualKV: Residual-Based KV Cache Compression for Efficient Long-Context
    Inference", arXiv 2602.08005v2, §IV (references, residual codes, restore, the OmniKV composition);
    defaults from §V-A and the authors' configs.

    Parameters:
        codec: name of the codec variant (recorded; the workflow maps it to ``codec_dir``).
        codec_dir: directory of a trained codec (``codec.safetensors`` + ``codec.json``, :class:`ResidualCodec`).
        selector: None (standalone, §IV-C), an :class:`OmniKVPress` (its ``keep``: share of candidate tokens
            restored at sparse layers, the authors' configs 0.11-0.185; its ``audit_steps``, ``sparse_prefill``
            and ``row_agg``: when and how it selects; sinks, window and filter layers are the storage's) or a :class:`SnapKVPress` (its ``keep``: share of coded
            tokens kept; its ``window``, ``kernel``, ``pooling``).
        full_layers: decoder layers kept as full KV (paper Table I; e.g. Llama-3.1-8B [0, 1, 2, 8, 18]).
            Required non-empty with OmniKV (a filter layer is a full layer followed by a sparse one).
        bits: residual-code bits (4 = paper text default, 2 = multimodal, 16 = unquantised fp16,
            32 = stored exactly in float32: for the identity-codec invariant only).
        ref_fp8: references stored FP8 e4m3 (paper §V-A deployment); False keeps them float32.
        full_kv_bits: the full-attention layers' storage: 16 = exact (FP16 in KR), 2/4/8 = KIVI-style (keys per
            channel, values per token, group 32; which tokens stay raw is ``full_kv_form``'s; the paper's
            deployment quantises them to 4 bits, §V-A). A filter layer scores with the dequantised keys.
        full_kv_form: how the 2/4/8-bit full layers are stored (:class:`QuantizedFullLayer`): ``after`` (default;
            the authors' engine: the codec's ``n_sink`` sinks raw, 32-63 raw tokens, quantised after the chunk's
            attention), ``before`` (the authors' HF reference: the same, quantised before it) or ``kivi``
            (jy-yuan/KIVI's rule: no raw sinks, ``T mod 32`` raw keys, 32 raw values). Basis for the default:
            docs/decisions/residualkv.md, "The 4-bit full layers".
        use_codec: False = the raw residual kv − mean stored at full width 2·d_k (quantised at ``bits``),
            restored as z̃ + mean: the authors' "origin" codec, Table III's ResidualKV† row. KR grows with it
            (at ``bits=16`` it is above the full cache's).
        mean_only: True = Table VIII "without f_c, f_d" as the authors ran it (``cache_pipeline.py``,
            ``REMOVE_COMP``): every coded token stores a zero code of width d_c at ``bits`` (counted, so KR
            equals ResidualKV's) and is restored as the mean of its references only; f_c and f_d are not
            used. Exclusive with ``use_codec=False``.
        alpha, stride: the reference schedule at inference (None: the codec's training values). Table VI
            and Fig. 5 vary them at inference with one trained codec.
        block: tokens coded at once (None: the codec's ``window``, the authors' 128-token flush with their
            128-token window, ``cache_pipeline.py``): nothing is coded until the raw window holds ``window +
            block`` tokens, then the oldest ``⌊(raw − window) / block⌋ · block`` at once, so it holds ``window``
            to ``window + block − 1`` raw tokens. 1 codes each token as it leaves a ``window``-token window.
            OmniKV's candidates are the coded tokens, so they end at the same block boundary.
        latent_v: at decode steps, apply f_d's V part after the attention sum (W_V Σ a_i z̃_i, f_d being
            linear) instead of decoding V for every restored token (:meth:`ResidualKVLayer.attend`). Beyond the
            paper, which restores K and V per token; the same result up to float rounding, a separate row of
            Fig. 8 (``residualkv-omnikv-latent-v``). Needs the codec (``use_codec``, not ``mean_only``) and a
            linear f_d (checked in :meth:`load`).
    """

    name = "residualkv"
    selectors = ("omnikv", "snapkv")
    #: selector fields the storage sets, so a composed spec may not: OmniKV's candidates are what the sparse
    #: layers hold coded (the codec's sinks and window are raw), its filter layers the full layers followed
    #: by a sparse one. When and how it selects (``keep``, ``sparse_prefill``, ``row_agg``) stays the selector's.
    storage_owns = {"omnikv": ("n_sink", "window", "filter_layers")}
    exact = {"bits": 32, "ref_fp8": False}  # standalone, with an identity codec (d_c = d_kv)
    codec_dir: str = ""
    selector: OmniKVPress | SnapKVPress | None = None
    full_layers: tuple[int, ...] = ()
    bits: int = 4
    use_codec: bool = True
    mean_only: bool = False
    ref_fp8: bool = True
    full_kv_bits: int = 16
    full_kv_form: str = "after"
    codec: str = "main"
    alpha: float | None = None
    stride: int | None = None
    block: int | None = None
    latent_v: bool = False

    def __post_init__(self):
        """Check the parameters (no codec is read: that happens in :meth:`load`, when the press meets a model).

        Raises:
            ValueError: naming the bad value and what is expected: also a selector other than OmniKV or
                SnapKV, an OmniKV selector without ``full_layers`` or with its own ``n_sink``, ``window`` or
                ``filter_layers`` (the storage's), ``full_kv_bits`` other than 16 without ``full_layers``
                (it would change nothing), ``stride`` or ``block`` not a positive int, ``alpha`` negative, a bad
                ``protocol``.
        """
        super().__post_init__()
        if self.selector is not None and not isinstance(self.selector, (OmniKVPress, SnapKVPress)):
            raise ValueError(f"selector must be an OmniKVPress or a SnapKVPress (residualkv+omnikv, "
                             f"residualkv+snapkv), got {self.selector!r}")
        if self.mean_only and not self.use_codec:
            raise ValueError("mean_only (zero code of width d_c, the reference mean restored) and use_codec=false "
                             "(the raw residual stored) are two different ablations; set one")
        if self.bits not in (2, 4, 8, 16, 32):
            raise ValueError(f"bits must be 2, 4, 8, 16 (unquantised) or 32 (exact), got {self.bits!r}")
        if self.full_kv_bits not in (2, 4, 8, 16):
            raise ValueError(f"full_kv_bits must be 2, 4, 8 (KIVI-style full layers) or 16 (exact), "
                             f"got {self.full_kv_bits!r}")
        if self.full_kv_form not in FULL_KV_FORMS:
            raise ValueError(f"full_kv_form must be one of {tuple(FULL_KV_FORMS)} (the authors' engine, their HF "
                             f"reference, jy-yuan/KIVI's rule), got {self.full_kv_form!r}")
        self.full_layers = layer_list("full_layers", self.full_layers)
        if isinstance(self.selector, OmniKVPress):
            if not self.full_layers:
                raise ValueError("residualkv+omnikv needs full_layers (the filter layers are full layers "
                                 "followed by a sparse one)")
            defaults = {f.name: f.default for f in dataclasses.fields(OmniKVPress)}
            own = [k for k in self.storage_owns["omnikv"] if getattr(self.selector, k) != defaults[k]]
            if own:
                raise ValueError(f"residualkv+omnikv takes {own} from the storage (the codec's sinks and raw "
                                 f"window; filter layers = full layers followed by a sparse one); drop them")
        if self.full_kv_bits != 16 and not self.full_layers:
            raise ValueError(f"full_kv_bits={self.full_kv_bits} quantises the full layers, but full_layers is empty; "
                             f"set full_layers (e.g. full_layers=0+1) or drop full_kv_bits")
        if self.full_kv_form != "after" and self.full_kv_bits == 16:
            raise ValueError(f"full_kv_form={self.full_kv_form} is how quantised full layers are stored, but "
                             f"full_kv_bits is 16 (exact); set full_kv_bits=2, 4 or 8 or drop full_kv_form")
        stride, alpha = self.stride, self.alpha
        if stride is not None and (not isinstance(stride, int) or isinstance(stride, bool) or stride < 1):
            raise ValueError(f"stride (reference stride s_0) must be an int >= 1, got {stride!r}")
        if alpha is not None and not alpha >= 0:
            raise ValueError(f"alpha (dynamic-stride growth) must be >= 0, got {alpha!r}")
        if self.latent_v and (self.mean_only or not self.use_codec):
            raise ValueError("latent_v applies f_d's V part after attention; it needs the codec (use_codec=true, "
                             "mean_only=false)")
        block = self.block
        if block is not None and (not isinstance(block, int) or isinstance(block, bool) or block < 1):
            raise ValueError(f"block (tokens coded at once) must be an int >= 1 or None (the codec's window), "
                             f"got {block!r}")

    def load(self) -> None:
        """Read the trained codec and check this press against it (the schedule's ``alpha``/``stride``, the
        code quantisation's group).

        Raises:
            ValueError: ``codec_dir`` holds no trained codec, or the press's settings do not fit it.
        """
        self.schedule()
        if self.bits != 32:
            quant.check_quant_config(self.codec_model.config.d_c, self.bits, self.codec_model.config.group)
        if self.latent_v and self.codec_model.config.decoder != "linear":
            raise ValueError(f"latent_v needs a linear f_d; codec {self.codec_dir!r} has decoder "
                             f"{self.codec_model.config.decoder!r}")

    def check_layers(self, n_layers: int) -> None:
        """Check ``full_layers`` against a model with ``n_layers`` decoder layers (also at DAG time).

        Raises:
            ValueError: an index outside the model; every layer full (nothing would be compressed); in
                ``residualkv+omnikv`` no full layer followed by a sparse one (no filter layer, so nothing
                selected).
        """
        layers = set(self.full_layers)
        bad = sorted(i for i in layers if not 0 <= i < n_layers)
        if bad:
            raise ValueError(f"full_layers {bad} outside the model's {n_layers} layers")
        if layers >= set(range(n_layers)):
            raise ValueError(f"full_layers {sorted(layers)} keep all {n_layers} layers full: nothing is compressed")
        if isinstance(self.selector, OmniKVPress) and not any(i + 1 < n_layers and i + 1 not in layers for i in layers):
            raise ValueError(f"residualkv+omnikv needs a full layer followed by a sparse one (the filter layer); "
                             f"full_layers {sorted(layers)} of {n_layers} layers have none")

    def schedule(self, codec: CodecConfig | None = None) -> CodecConfig:
        """``codec`` (default: the trained codec's config) with this press's inference-time ``alpha`` /
        ``stride`` applied: the reference schedule the cache runs.

        Raises:
            ValueError: the result is not a valid :class:`CodecConfig` (e.g. ``stride`` 0).
        """
        over = {k: v for k, v in (("alpha", self.alpha), ("stride", self.stride)) if v is not None}
        return dataclasses.replace(self.codec_model.config if codec is None else codec, **over)

    def coding_block(self) -> int:
        """Tokens coded at once: ``block``, or the codec's ``window`` (at least 1) when it is None."""
        return self.block if self.block is not None else max(1, self.window)

    def kr_formula(self, n_tokens: int, n_layers: int, d_kv: int, codec: CodecConfig | None = None) -> float:
        """The paper's KR (§V-A, :func:`~kvbench.compress.accounting.keep_ratio_formula`) of this press on a
        model of ``n_layers`` layers and K‖V width ``d_kv`` at ``n_tokens`` tokens, from its own fields and
        ``codec`` (the codec variant's config; default: the trained codec's).

        Terms: β = len(full_layers) / n_layers with or without a selector (a standalone cache keeps those
        layers full too), full layers at ``full_kv_bits``; references FP8 (FP16 when ``ref_fp8`` is False) at the
        measured density of the schedule (:meth:`schedule`), none when the codec has no references (Table
        VIII); codes at ``bits`` in groups of the codec's ``group``, or the raw residual (d_c = d_kv) when
        ``use_codec`` is False; quantised full layers in KIVI's groups of :data:`FULL_KV_GROUP` (before issue #13 the
        codes' group was used, 16 instead of 32 on a d_c = 16 codec).

        Against the packed measurement: see :func:`~kvbench.compress.accounting.keep_ratio_formula` for what the
        formula omits (indices, sinks, raw window, the full layers' raw residual) and charges too much (a code for
        every reference); on the parts it models it agrees within a point (tests/test_rkv_accounting.py), where
        the value group is 32 (head_dim >= 32; KIVI's value group is ``min(32, head_dim)``). ``block`` changes
        only how many tokens are raw (``window`` to ``window + block − 1``), a part the formula omits, so it
        does not enter the formula.
        """
        cfg = self.schedule(codec)
        n = int(n_tokens)
        density = references.reference_count(n, n_sink=cfg.n_sink, stride=cfg.stride, alpha=cfg.alpha) / n
        d_c = d_kv if not self.use_codec else cfg.d_c
        group = cfg.group if self.bits != 16 else 32
        return accounting.keep_ratio_formula(
            n_layers=n_layers, n_full=len(self.full_layers), ref_density=density if cfg.references else 0.0,
            d_c=d_c, d_kv=d_kv, bits=min(self.bits, 16), full_bits=self.full_kv_bits, group=math.gcd(d_c, group),
            ref_bits=8 if self.ref_fp8 else 16, full_group=FULL_KV_GROUP)

    @property
    def codec_model(self) -> ResidualCodec:
        """The trained codec (loaded once per directory).

        Raises:
            ValueError: ``codec_dir`` holds no ``codec.json`` (naming the ``codec/`` subfolder when that is it).
        """
        if not Path(self.codec_dir, "codec.json").is_file():
            # rkv_codec writes codecs/<profile>/<model>/<variant>/codec/: the variant folder is an easy slip
            hint = (f"; did you mean {str(Path(self.codec_dir, 'codec'))!r}?"
                    if Path(self.codec_dir, "codec", "codec.json").is_file() else "")
            raise ValueError(f"codec_dir {self.codec_dir!r} holds no trained codec (codec.json missing){hint}")
        return _load_codec(str(Path(self.codec_dir).resolve()))

    @property
    def n_sink(self) -> int:
        """Leading raw tokens of the sparse layers (the codec's), never selector candidates."""
        return self.codec_model.config.n_sink

    @property
    def window(self) -> int:
        """Recent raw tokens of the sparse layers (the codec's), never selector candidates."""
        return self.codec_model.config.window

    def new_cache(self, model) -> PressCache:
        self.load()
        cfg = model.config.get_text_config()
        n_layers, d_kv = model_kv_shape(model)
        got = (self.codec_model.config.n_layers, self.codec_model.config.d_kv)
        if got != (n_layers, d_kv):
            raise ValueError(f"codec {self.codec_dir!r} does not fit the model: codec (n_layers, d_kv) = {got}, "
                             f"model {(n_layers, d_kv)}")
        self.check_layers(cfg.num_hidden_layers)
        self.codec_model.to(model.device)
        return super().new_cache(model)

    def make_layer(self, ctx: LayerContext, cache: PressCache) -> StoreLayer:
        """Full layers: exact (:class:`StoreLayer`) or KIVI-style (:class:`QuantizedFullLayer`); with an
        OmniKV selector, one followed by a sparse layer runs the filter step after its commit (with the
        storage's sinks and window). Sparse layers: :class:`ResidualKVLayer`; with a SnapKV selector, it
        evicts coded tokens after the context chunk."""
        i = ctx.layer_idx
        if i in self.full_layers:
            layer = (QuantizedFullLayer(ctx, cache, bits=self.full_kv_bits, form=self.full_kv_form, sinks=self.n_sink)
                     if self.full_kv_bits < 16 else StoreLayer(ctx, cache))
            if isinstance(self.selector, OmniKVPress) and i + 1 < ctx.n_layers and i + 1 not in self.full_layers:
                layer.after_commit = self._filter.filter
            return layer
        layer = ResidualKVLayer(ctx, cache, self)
        if isinstance(self.selector, SnapKVPress):
            layer.after_commit = layer.snap
        return layer

    @functools.cached_property
    def _filter(self) -> OmniKVPress:
        """The OmniKV selector with the storage's sinks, raw window (read from the codec) and coding block,
        so its candidates are the tokens the sparse layers hold coded."""
        selector = dataclasses.replace(self.selector, n_sink=self.n_sink, window=self.window)
        selector.block = self.coding_block()
        return selector

    def compute_ratio(self, n_layers: int) -> float | None:
        """1.0 standalone (every coded token restored each step); measured only with a selector."""
        return 1.0 if self.selector is None else None
