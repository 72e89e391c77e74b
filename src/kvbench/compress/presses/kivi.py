"""KIVI: asymmetric 2/4-bit KV quantisation, keys per channel and values per token.

Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024 (arXiv 2402.02750,
`jy-yuan/KIVI`). Keys (post-RoPE, as KIVI's code caches them) are quantised per channel: each channel
over a group of ``group`` consecutive tokens shares one min/scale. Values are quantised per token in
groups of ``group`` consecutive channels of one head. Min/max asymmetric quantisation
(:func:`kvbench.kernels.quant.quantize`: zmin, scale in fp16).

Full-precision residual, as KIVI's code does it:

- keys: tokens stay raw until ``residual`` of them accumulate, then that block is quantised (groups of
  ``group`` tokens); after a chunk of T tokens, ``T mod residual`` raw keys remain. Decode tokens are
  therefore quantised too once the residual fills (a known bug in some ports: never quantised);
- values: the latest ``residual`` tokens stay raw; older tokens are quantised as they leave.

Every token is attended (CR 100%); KR ≈ bits/16 + 2/group plus the raw residual.

Decode attention: the torch path reads the dequantised rows (decoded once, kept in the layer's store). Where
``kernels.use_triton`` says so for the device (CUDA with Triton; ``KVBENCH_KERNELS``), a one-token step at 2/4/8
bits runs :func:`kvbench.kernels.kivi_attend` instead, which dequantises the packed codes in registers
(``KIVILayer.attend``); ``KVBENCH_KERNELS=torch`` switches back for comparison.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench import kernels
from kvbench.compress import checks
from kvbench.compress.accounting import StoredBytes
from kvbench.compress.buffers import Growable
from kvbench.compress.cache import KVView, LayerContext, PressCache, Press, StoreLayer
from kvbench.kernels import KIVILayout, pack_levels, quant

BITS = (2, 4, 8, 16)
FP16_BYTES = 2   # raw tensors are counted as FP16, the full cache's precision (accounting.py)


class _Quantized:
    """Quantised rows of one tensor: the codes as stored (for bytes) and how many rows they hold. Their
    dequantised rows live in the layer's store, where attention reads them (decoded once)."""

    def __init__(self):
        self.codes: list[quant.QuantizedCodes | torch.Tensor] = []
        self.n = 0

    def add(self, codes: quant.QuantizedCodes | torch.Tensor, n_rows: int) -> None:
        self.codes.append(codes)
        self.n += n_rows

    def __len__(self) -> int:
        return self.n

    def bytes(self) -> tuple[int, int]:
        """``(payload, scales)``: packed ``ceil(numel · bits / 8)`` per code tensor, 2 fp16 values per
        group; unquantised (bits 16) rows count FP16 payload."""
        payload = scales = 0
        for c in self.codes:
            if isinstance(c, torch.Tensor):
                payload += c.numel() * FP16_BYTES
            else:
                side = FP16_BYTES * (c.zmin.numel() + c.scale.numel())
                scales += side
                payload += c.nbytes() - side
        return payload, scales


class KIVILayer(StoreLayer):
    """One decoder layer of a KIVI cache (module docstring); usable on its own, e.g. as the 4-bit
    full-layer store of ResidualKV (paper §V-A: full layers KIVI-style 4-bit).

    The base store (:class:`~kvbench.compress.cache.StoreLayer`'s preallocated buffer) holds what attention
    reads: each token's dequantised K/V once quantised, its exact K/V before, in the model dtype; the rows a
    commit quantises are overwritten in place at the next step (not at the commit, so an ``after_commit``
    selector scores the keys this step's attention read). So a step reads one view, as the full cache does,
    instead of concatenating every dequantised row per step. The codes and the raw residual are kept for the
    bytes.

    Args:
        bits: 2, 4, 8 or 16 (16 = unquantised, stored exactly in the model dtype).
        group: tokens per key group (per channel) and channels per value group (per token; ``min(group,
            head_dim)`` when the head is narrower, so a group never spans two heads).
        residual: the full-precision residual length R (a multiple of ``group``).
        sinks: leading tokens kept raw for the whole request (attention sinks), never quantised; 0 = KIVI's
            form (jy-yuan/KIVI quantises the first tokens with their group). The tokens after them are
            quantised as above, their key groups starting at token ``sinks``.

    Raises ValueError as :func:`check_config`, or (at the first commit) for a head_dim not a multiple of the
    value group.
    """

    def __init__(self, ctx: LayerContext, cache: PressCache, bits: int = 4, group: int = 32, residual: int = 32,
                 sinks: int = 0):
        super().__init__(ctx, cache)
        check_config(bits, group, residual, sinks)
        self.bits, self.group, self.residual, self.sinks = bits, group, residual, sinks
        self.n_sinks = 0   # leading tokens held raw so far (at most ``sinks``), before the first quantised row
        self.kq, self.vq = _Quantized(), _Quantized()
        self.k_raw: torch.Tensor | None = None   # [n, C] raw keys not yet quantised (C = H_kv · D)
        self.v_raw: torch.Tensor | None = None   # [n, C] latest raw values
        self.heads = self.head_dim = 0
        #: dequantised rows ``(keys?, first token, rows [n, C])`` quantised at the last commit, written into the
        #: store at the next read (:meth:`history`, :meth:`view_with`)
        self._dequantised: list[tuple[bool, int, torch.Tensor]] = []
        #: packed mirror of the codes for the attention kernel (:meth:`_layout`), made at the first kernel step
        self._mirror: dict[str, Growable] | None = None
        self._mirrored = (0, 0)   # key blocks and value code tensors copied into the mirror
        self._kernel_chunk: KVView | None = None   # this step's chunk when it runs the kernel

    def _write_dequantised(self) -> None:
        """Overwrite the rows quantised at the last commit with their dequantised values, in place."""
        for is_key, start, rows in self._dequantised:
            n = rows.shape[0]
            store = self._buf.keys.data if is_key else self._buf.values.data
            # the store was made under the model's inference mode; a read after it (history()) must be too
            with torch.inference_mode(store.is_inference()):
                store[:, :, start:start + n] = rows.view(n, self.heads, self.head_dim).transpose(0, 1).unsqueeze(0)
        self._dequantised = []

    def history(self) -> KVView | None:
        """The stored tokens as the next step's attention reads them: dequantised once quantised, exact before."""
        self._write_dequantised()
        return self._stored

    def view_with(self, chunk: KVView) -> KVView:
        """One view of the base store, the chunk written in place after it (no concatenation per step)."""
        self._write_dequantised()
        self._kernel_chunk = chunk if self._kernel_step(chunk) else None
        return self._stage(chunk)

    def _kernel_step(self, chunk: KVView) -> bool:
        """Whether this step runs :func:`kvbench.kernels.kivi_attend`: a one-token step after the first commit, codes
        at 2/4/8 bits, no raw sinks, and Triton chosen for the device by ``KVBENCH_KERNELS`` (``auto``: CUDA tensors; ``triton``
        also on the CPU under ``TRITON_INTERPRET=1``)."""
        if len(chunk) != 1 or self.bits == 16 or not self.heads or self.n_sinks:
            return False   # raw sinks: the kernel's layout (codes, then the raw residual) has no place for them
        return kernels.use_triton(chunk.keys.device)

    def _layout(self, chunk: KVView):
        """The layer's K/V with this step's chunk as :class:`kvbench.kernels.KIVILayout` reads them: the packed
        mirror of every key block and value code (extended with the codes added since the last kernel step; the
        resident bytes count it) and the raw residual followed by the chunk."""
        if self._mirror is None:
            self._mirror = {name: Growable(0) for name in ("kc", "kz", "ks", "vc", "vz", "vs")}
        m, (nk, nv) = self._mirror, self._mirrored
        c = self.heads * self.head_dim
        for codes in self.kq.codes[nk:]:   # levels [C, G] per block: one group per channel
            m["kc"].append(pack_levels(codes.q, self.bits).unsqueeze(0))
            m["kz"].append(codes.zmin.view(1, c))
            m["ks"].append(codes.scale.view(1, c))
        for codes in self.vq.codes[nv:]:   # levels [n, C] per token
            m["vc"].append(pack_levels(codes.q, self.bits))
            m["vz"].append(codes.zmin)
            m["vs"].append(codes.scale)
        self._mirrored = (len(self.kq.codes), len(self.vq.codes))
        empty = lambda *shape, dtype=torch.uint8: torch.empty(shape, dtype=dtype, device=chunk.keys.device)  # noqa: E731
        vg = min(self.group, self.head_dim)
        view = lambda name, *shape, dtype=torch.uint8: (m[name].view() if len(m[name])  # noqa: E731
                                                        else empty(*shape, dtype=dtype))
        flat = chunk.keys[0].transpose(0, 1).reshape(1, c), chunk.values[0].transpose(0, 1).reshape(1, c)
        return KIVILayout(view("kc", 0, c, self.group * self.bits // 8), view("kz", 0, c, dtype=torch.float16),
                          view("ks", 0, c, dtype=torch.float16), torch.cat([self.k_raw, flat[0]]),
                          view("vc", 0, c * self.bits // 8), view("vz", 0, c // vg, dtype=torch.float16),
                          view("vs", 0, c // vg, dtype=torch.float16), torch.cat([self.v_raw, flat[1]]),
                          self.bits, self.group, vg)

    def attend(self, query, key, value, mask, scaling):
        """At a kernel step (:meth:`_kernel_step`, no mask) the attention output comes from
        :func:`kvbench.kernels.kivi_attend` over the packed codes (:meth:`_layout`), not from the dequantised store;
        same result up to float32 summation order (tested). Any other step: :meth:`StoreLayer.attend`."""
        chunk, self._kernel_chunk = self._kernel_chunk, None
        if chunk is None or mask is not None or query.shape[2] != 1:
            return super().attend(query, key, value, mask, scaling)
        _, h_q, _, d = query.shape
        return kernels.kivi_attend(query[0, :, 0], self._layout(chunk), softmax_scale=scaling).view(1, h_q, 1, d)

    def commit(self, chunk: KVView, query: torch.Tensor) -> None:
        super().commit(chunk, query)   # the store holds the chunk's exact K/V until they are quantised
        self._take(chunk)
        self._flush()

    def _take(self, chunk: KVView) -> None:
        """Append ``chunk``'s K/V to the raw residual, after the first ``sinks`` tokens (which stay raw)."""
        _, h, t, d = chunk.keys.shape
        self.heads, self.head_dim = h, d
        flat = lambda x: x[0].transpose(0, 1).reshape(x.shape[-2], h * d)  # noqa: E731  [1,H,n,D] -> [n, H·D]
        skip = min(self.sinks - self.n_sinks, t)
        self.n_sinks += skip
        self.k_raw = _cat(self.k_raw, flat(chunk.keys)[skip:])
        self.v_raw = _cat(self.v_raw, flat(chunk.values)[skip:])

    def _flush(self) -> None:
        """KIVI's residual rule (module docstring): keys in whole blocks of ``residual`` tokens, leaving
        ``T mod residual`` raw; values all but the latest ``residual``."""
        n_k = (self.k_raw.shape[0] // self.residual) * self.residual
        if n_k:
            self._quantize_key_rows(n_k)
        n_v = self.v_raw.shape[0] - self.residual
        if n_v > 0:
            self._quantize_value_rows(n_v)

    def _quantize_key_rows(self, n: int) -> None:
        """Quantise the ``n`` oldest raw keys (a multiple of ``group``) and drop them from the raw residual."""
        assert n % self.group == 0, (n, self.group)
        for start in range(0, n, self.group):
            self._quantize_keys(self.k_raw[start:start + self.group])
        self.k_raw = self.k_raw[n:].clone()   # a copy: a view would keep the quantised rows' storage

    def _quantize_value_rows(self, n: int) -> None:
        """Quantise the ``n`` oldest raw values and drop them from the raw residual."""
        self._quantize_values(self.v_raw[:n])
        self.v_raw = self.v_raw[n:].clone()

    def _quantize_keys(self, block: torch.Tensor) -> None:
        """Per-channel: one group = one channel over ``group`` tokens (``block`` ``[group, C]``)."""
        if self.bits == 16:
            self.kq.add(block.clone(), len(block))   # stored exactly: the store's rows are already these
            return
        codes = quant.quantize(block.float().T.contiguous(), self.bits, block.shape[0],   # rows = channels
                               check=checks.ENABLED)
        self._dequantised.append((True, self.n_sinks + len(self.kq), quant.dequantize(codes).T))
        self.kq.add(codes, len(block))

    def _quantize_values(self, rows: torch.Tensor) -> None:
        """Per-token: groups of ``min(group, head_dim)`` consecutive channels of one head."""
        if self.bits == 16:
            self.vq.add(rows.clone(), len(rows))
            return
        vg = min(self.group, self.head_dim)
        if self.head_dim % vg:
            raise ValueError(f"head_dim {self.head_dim} must be a multiple of the value group {vg}")
        codes = quant.quantize(rows.float(), self.bits, vg, check=checks.ENABLED)
        self._dequantised.append((False, self.n_sinks + len(self.vq), quant.dequantize(codes)))
        self.vq.add(codes, len(rows))

    def reset(self) -> None:
        """Empty the layer for a new request (transformers' ``Cache.reset``): the base store, the codes, the raw
        residual and the rows waiting to be written; a composed selector's ``after_commit`` is kept."""
        after = self.after_commit
        KIVILayer.__init__(self, self.ctx, self.cache, self.bits, self.group, self.residual, self.sinks)
        self.after_commit = after

    def packed_bytes(self) -> StoredBytes:
        """Packed codes, fp16 min/scale per group, the raw residual keys and values and the raw sinks at FP16."""
        kp, ks = self.kq.bytes()
        vp, vs = self.vq.bytes()
        raw = sum(0 if x is None else x.numel() * FP16_BYTES for x in (self.k_raw, self.v_raw))
        return StoredBytes(layer=self.ctx.layer_idx, codes=kp + vp, scales=ks + vs, raw_window=raw,
                           sinks=self._sink_values() * FP16_BYTES)

    def read_bytes(self) -> int:
        """Bytes a decode step must read from this layer in its packed form (int): the packed codes and fp16
        min/scale of every quantised key and value, and the raw sinks and residual keys and values at the width held,
        as a dequantising attention kernel (``kernels.kivi_attend``) reads them; after the latest commit.
        The torch path here reads the dequantised store instead (:meth:`StoreLayer.read_bytes`'s view), which
        the bench's achieved bandwidth therefore understates. At bits 16 nothing is packed: the view, as the
        full cache."""
        if self.bits == 16:
            return super().read_bytes()
        kp, ks = self.kq.bytes()
        vp, vs = self.vq.bytes()
        raw = sum(0 if x is None else x.numel() * x.element_size() for x in (self.k_raw, self.v_raw))
        if self.n_sinks:   # raw sinks: read from the store at the model's width
            raw += self._sink_values() * self._buf.keys.data.element_size()
        return kp + ks + vp + vs + raw

    def _sink_values(self) -> int:
        """K and V values of the raw sinks (their bytes: times the width they are counted or read at)."""
        return 2 * self.n_sinks * self.heads * self.head_dim

    def held_tensors(self):
        """Resident: the store attention reads (dequantised and raw K/V in the model dtype, at its capacity,
        with int64 positions), the unpacked ``uint8`` codes and fp16 min/scale of every block, and the raw
        residual in the model's dtype."""
        yield from super().held_tensors()
        for q in (self.kq, self.vq):
            for c in q.codes:
                yield from ((c,) if isinstance(c, torch.Tensor) else (c.q, c.zmin, c.scale))
        yield self.k_raw
        yield self.v_raw
        yield from (rows for _, _, rows in self._dequantised)
        if self._mirror is not None:
            for g in self._mirror.values():
                yield g.data


def _cat(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else torch.cat([a, b])


def check_config(bits: int, group: int, residual: int, sinks: int = 0) -> None:
    """Raise ValueError for bits not in {2, 4, 8, 16}, group < 1, residual not a positive multiple
    of group (KIVI quantises the residual in whole key groups), or sinks not an int >= 0."""
    if not isinstance(sinks, int) or isinstance(sinks, bool) or sinks < 0:
        raise ValueError(f"sinks (leading tokens kept raw) must be an int >= 0, got {sinks!r}")
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    if residual < 1 or residual % group:
        raise ValueError(f"residual must be a positive multiple of group = {group}, got {residual}")


@dataclass
class KIVIPress(Press):
    """KIVI (Liu et al., ICML 2024, arXiv 2402.02750): per-channel keys, per-token values, full-precision residual.

    Parameters
    ----------
    bits : int, 2 — 2 (KIVI-2, the paper's headline) or 4 (KIVI-4); 8 and 16 (exact) for checks.
    group : int, 32 — G, quantisation group (tokens for keys, channels for values).
    residual : int, 32 — R, the full-precision residual (ResidualKV authors' KIVI config; the KIVI
        paper uses 128).
    sinks : int, 0 — leading tokens kept raw (:class:`KIVILayer`); 0 is KIVI's own form (the baseline's).
        Beyond KIVI: the full-layer-form table (``kvbench.report.residualkv.full_layer_form``) sets 8 to
        measure what raw sinks change.

    Raises ValueError as :func:`check_config`.
    """

    name = "kivi"
    exact = {"residual": 1024}  # every token of a context up to 1024 stays in the raw window
    bits: int = 2
    group: int = 32
    residual: int = 32
    sinks: int = 0

    def __post_init__(self):
        super().__post_init__()
        check_config(self.bits, self.group, self.residual, self.sinks)

    def make_layer(self, ctx: LayerContext, cache: PressCache) -> StoreLayer:
        return KIVILayer(ctx, cache, self.bits, self.group, self.residual, self.sinks)

    def compute_ratio(self, n_layers: int) -> float | None:
        """1.0: every token is attended (dequantised)."""
        return 1.0
