"""Storage of one ResidualKV sparse layer: its reference pool and its coded tokens, each one contiguous
store indexed by token position (the layer logic is in :mod:`kvbench.compress.residualkv.cache`).

A decode step restores the tokens OmniKV selected. With the codes held as a list of chunks that meant an
``isin`` and a host-side ``.any()`` per chunk, and a float32 copy of the whole FP8 reference pool three times
per layer per step. Here every array grows in place (:class:`~kvbench.compress.buffers.Growable`), and a
position → slot map (int64, -1 where a position holds no such token) turns a selection into index gathers;
only the rows a step reads are dequantised (codes, and the references they need).

Shapes: ``d_kv`` = K‖V width, ``d_c`` = code width, ``k`` = neighbours per token; positions int64.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvbench.compress.buffers import Growable
from kvbench.kernels import quant
from kvbench.kernels.group_quant import PackedCodes, pack_levels
from kvbench.kernels.reference_mean import mean_rows


def index_dtype(n_refs: int) -> torch.dtype:
    """The narrowest integer type that addresses ``n_refs`` references: int16 below 2^15, else int32 (KR counts
    the indices at this width)."""
    return torch.int16 if n_refs < 2 ** 15 else torch.int32


class PositionMap:
    """Slot of each absolute token position (int64, -1: the position holds no such token), grown by
    doubling as positions grow (the bound is a host int, so lookups never read a position back)."""

    def __init__(self):
        self.table = Growable(0, fill=-1)

    def set(self, positions: torch.Tensor, slots: torch.Tensor, end: int) -> None:
        """Map ``positions`` ``[n]`` (all below ``end``) to ``slots`` ``[n]``."""
        if end > len(self.table):
            self.table.reserve(positions, end)
            self.table.n = end          # fresh capacity holds -1
        self.table.data[positions] = slots

    def clear(self) -> None:
        """Map every position to -1 (before re-mapping the tokens kept by an eviction)."""
        if self.table.data is not None:
            self.table.data.fill_(-1)

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        """Slots ``[n]`` of ``positions`` (below the largest ``end`` given to :meth:`set`; -1 where none)."""
        if self.table.data is None:
            return torch.full_like(positions, -1)
        return self.table.data.index_select(0, positions)


class RefPool:
    """Reference tokens of one layer: pre-RoPE K‖V as stored (FP8 e4m3 with ``fp8``, else float32)
    ``[R, d_kv]``, their positions ``[R]`` and a position → index map.

    On CPU, torch converts FP8 one value at a time (measured ~7 ns a value, against ~0.2 ns from fp16), which
    made reading the rows a step restores cost more than the restore; a CPU pool of FP8 references therefore
    also holds them as float32 (exact: every e4m3 value is a float32 value) and reads that copy, which the
    k-reference mean then sums in one fused gather (:func:`restore_mean`, ``F.embedding_bag``; a float16 copy,
    half the bytes, would need a conversion per gathered row and embedding_bag sums fp16 in fp16). It is
    counted in the resident bytes, not in the packed ones (the stored form is FP8). Elsewhere the FP8 rows are
    gathered and converted.

    Parameters:
        d_kv: K‖V width. fp8: store FP8 (saturating cast, :func:`~kvbench.kernels.quant.cast_fp8`).
    """

    def __init__(self, d_kv: int, fp8: bool):
        self.d_kv, self.fp8 = d_kv, fp8
        self.kv, self.pos, self.slot = Growable(0), Growable(0), PositionMap()
        self.kv32 = Growable(0)                  # the float32 reading copy of a CPU FP8 pool (class docstring)
        self.saturated: int | torch.Tensor = 0   # values clamped to ±448, a device count read when asked

    def __len__(self) -> int:
        return len(self.pos)

    def add(self, kv: torch.Tensor, pos: torch.Tensor, end: int) -> None:
        """Store references ``kv`` float32 ``[r, d_kv]`` at positions ``pos`` ``[r]`` (all below ``end``)."""
        if self.fp8:
            kv, sat = quant.cast_fp8(kv)
            self.saturated = self.saturated + sat
            if kv.device.type == "cpu":
                self.kv32.append(kv.to(torch.float32))
        first = len(self)
        self.kv.append(kv)
        self.pos.append(pos)
        self.slot.set(pos, torch.arange(first, first + len(pos), device=pos.device), end)

    def positions(self) -> torch.Tensor:
        """Positions ``[R]`` int64, ascending."""
        return self.pos.view() if len(self) else torch.zeros(0, dtype=torch.long)

    def stored(self) -> torch.Tensor:
        """The references as stored ``[R, d_kv]`` (FP8 or float32)."""
        return self.kv.view() if len(self) else torch.zeros(0, self.d_kv)

    def readable(self) -> torch.Tensor:
        """The rows a step reads ``[R, d_kv]``: the float32 reading copy of a CPU FP8 pool, else as stored."""
        return self.kv32.view() if len(self.kv32) else self.stored()

    def all(self) -> torch.Tensor:
        """Every reference as read back, float32 ``[R, d_kv]`` (a view where the pool is read in float32, else a
        conversion of the whole pool: for coding a block, or a step that restores every token)."""
        return self.readable().to(torch.float32)

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """The references at indices ``idx`` (any shape, int64) as read back, float32 ``[*idx.shape, d_kv]``:
        gathered first, so only those rows are converted."""
        return self.readable().index_select(0, idx.reshape(-1)).to(torch.float32).view(*idx.shape, self.d_kv)

    def tensors(self):
        """Storages held (resident bytes): the stored K‖V, its float32 reading copy (CPU FP8 pools), the int64
        positions and the position map."""
        return self.kv.data, self.kv32.data, self.pos.data, self.slot.table.data


class CodeStore:
    """Coded tokens of one layer in one contiguous store: per token its code (``uint8`` levels ``[d_c]`` with
    fp16 ``zmin``/``scale`` per group at ``bits`` 2/4/8; fp16 codes at 16; float32 at 32), its ``k``
    reference indices (int16/int32, :func:`index_dtype`) with their validity, and its position; plus a
    position → slot map, so restoring a selection is one gather per array.

    Parameters:
        bits: 2, 4, 8, 16 or 32. group: coordinates per quantisation group (bits < 16).
    """

    def __init__(self, bits: int, group: int):
        self.bits, self.group = bits, group
        self.q, self.zmin, self.scale = Growable(0), Growable(0), Growable(0)
        self.nbr, self.valid, self.pos = Growable(0), Growable(0), Growable(0)
        self.slot = PositionMap()
        self._packed = Growable(0)   # bits-packed mirror of ``q`` for the restore kernel, made once asked for

    def __len__(self) -> int:
        return len(self.pos)

    def packed_codes(self) -> PackedCodes:
        """The codes as :func:`kvbench.kernels.restore_attend` reads them: levels packed 8/bits per byte
        (``kernels.group_quant`` layout) with their fp16 min/scale at bits 2/4/8, the fp16 codes at 16. The
        packed levels are a mirror of the unpacked store, kept from the first call on and extended with the
        rows added since (resident bytes count it). Raises ValueError at bits 32 (float32 codes, no kernel)."""
        if self.bits == 32:
            raise ValueError("bits 32 (float32 codes) has no packed form; the restore kernel reads 2/4/8/16-bit codes")
        q = self.q.view()
        if self.bits == 16:
            empty = q.new_zeros(len(q), 0)
            return PackedCodes(q, empty, empty, 16, q.shape[1])
        if len(self._packed) < len(q):
            self._packed.append(pack_levels(q[len(self._packed):], self.bits))
        return PackedCodes(self._packed.view(), self.zmin.view(), self.scale.view(), self.bits, self.group)

    def add(self, codes: quant.QuantizedCodes | torch.Tensor, nbr: torch.Tensor, valid: torch.Tensor,
            pos: torch.Tensor, n_refs: int, end: int) -> None:
        """Append coded tokens: ``codes`` (:func:`~kvbench.kernels.quant.quantize`'s output, or a
        float tensor ``[c, d_c]`` at bits 16/32), ``nbr``/``valid`` ``[c, k]``, positions ``pos`` ``[c]`` (all
        below ``end``); ``n_refs``: the pool's size, which sets the index width (the whole store widens to
        int32 once the pool reaches 2^15 references)."""
        dtype = index_dtype(n_refs)
        if self.nbr.data is not None and self.nbr.data.dtype != dtype:
            self.nbr.data = self.nbr.data.to(dtype)
        if isinstance(codes, quant.QuantizedCodes):
            self.q.append(codes.q)
            self.zmin.append(codes.zmin)
            self.scale.append(codes.scale)
        else:
            self.q.append(codes)
        first = len(self)
        self.nbr.append(nbr.to(dtype))
        self.valid.append(valid)
        self.pos.append(pos)
        self.slot.set(pos, torch.arange(first, first + len(pos), device=pos.device), end)

    def positions(self) -> torch.Tensor:
        """Positions ``[C]`` int64 of the coded tokens, in coding order (ascending)."""
        return self.pos.view() if len(self) else torch.zeros(0, dtype=torch.long)

    def rows(self, slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(z̃ [m, d_c] float32, nbr [m, k] int64, valid [m, k])`` of the tokens at ``slots`` ``[m]`` (all when
        None); only those codes are dequantised."""
        take = (lambda g: g.view()) if slots is None else (lambda g: g.view().index_select(0, slots))  # noqa: E731
        q = take(self.q)
        if self.bits < 16:
            z = quant.dequantize(quant.QuantizedCodes(q, take(self.zmin), take(self.scale), self.bits, self.group))
        else:
            z = q.to(torch.float32)
        return z, take(self.nbr).long(), take(self.valid)

    def dequantized(self, selected: torch.Tensor | None = None):
        """``(z̃, nbr, valid, positions)`` of the coded tokens at ``selected`` positions (every one when None;
        positions it does not hold are skipped), or four Nones when there is none. Reads the selection back
        (an audit and test helper; the decode path gathers by :attr:`slot`)."""
        if not len(self):
            return None, None, None, None
        slots = None
        if selected is not None:
            slots = self.slot(selected)
            slots = slots[slots >= 0]
            if not len(slots):
                return None, None, None, None
        z, nbr, valid = self.rows(slots)
        return z, nbr, valid, (self.positions() if slots is None else self.positions()[slots])

    def keep(self, mask: torch.Tensor) -> None:
        """Drop the coded tokens where ``mask`` (bool ``[C]``, coding order) is False (``+snapkv``, once per
        request): every array is rebuilt at the kept size and the map re-made."""
        for g in (self.q, self.zmin, self.scale, self.nbr, self.valid, self.pos):
            if g.data is not None:
                g.keep(mask)
        self._packed = Growable(0)   # re-packed from the kept rows when next asked for
        self.slot.clear()
        pos = self.positions()
        if len(pos):
            self.slot.set(pos, torch.arange(len(pos), device=pos.device), len(self.slot.table))

    def nbytes(self) -> tuple[int, int, int]:
        """``(payload, scales, indices)`` packed bytes: the payload at ``bits`` (``ceil(C · d_c · bits / 8)``;
        fp16/float32 codes at their width), two fp16 values per group, the indices at the width held (the
        paper's formula omits them)."""
        if not len(self):
            return 0, 0, 0
        q = self.q.view()
        if self.bits < 16:
            payload = math.ceil(q.numel() * self.bits / 8)
            scales = 2 * (self.zmin.view().numel() + self.scale.view().numel())
        else:
            payload, scales = q.numel() * q.element_size(), 0
        nbr = self.nbr.view()
        return payload, scales, nbr.numel() * nbr.element_size()

    def tensors(self):
        """Storages held (resident bytes, each at its allocated capacity): the unpacked ``uint8`` codes with
        their fp16 min/scale (or the fp16/float32 codes), the indices, the ``bool`` validity masks, the int64
        positions, the int64 position → slot map and the packed mirror the restore kernel reads (once made)."""
        return (self.q.data, self.zmin.data, self.scale.data, self.nbr.data, self.valid.data, self.pos.data,
                self.slot.table.data, self._packed.data)


def restore_mean(pool: RefPool, nbr: torch.Tensor, valid: torch.Tensor, extra: torch.Tensor | None = None):
    """Mean of each token's valid neighbours (as :func:`~kvbench.kernels.reference_mean.mean_rows`):
    ``nbr``/``valid`` ``[m, k]``; ``extra`` (int64 ``[e]``, optional) more pool rows to read. Returns ``(mean
    [m, d_kv] float32, extra rows [e, d_kv] float32 or None)``.

    Where the pool is read in float32 the sum is one ``F.embedding_bag`` (gather and weighted sum fused, no
    ``[m, k, d_kv]`` copy): weights 0/1 make each product exact, so adding the k slots in order from zero and
    dividing by the count rounds as ``mean_rows`` does (bitwise equal, tested). Otherwise (an FP8 pool off the
    CPU) the rows are gathered, converted and summed by ``mean_rows``."""
    m, k = nbr.shape
    table = pool.readable()
    if table.dtype == torch.float32:
        weight = valid.to(torch.float32)
        total = F.embedding_bag(nbr, table, mode="sum", per_sample_weights=weight)
        mean = total.div_(weight.sum(1, keepdim=True))
        return mean, (None if extra is None else table.index_select(0, extra))
    idx = nbr.reshape(-1) if extra is None else torch.cat([nbr.reshape(-1), extra])
    rows = pool.rows(idx)
    mean = mean_rows(rows[:m * k].view(m, k, -1), valid)
    return mean, (None if extra is None else rows[m * k:])
