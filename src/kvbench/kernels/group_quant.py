"""Per-token group quantisation with packed levels: Triton kernels and their torch references.

The quantiser is :func:`kvbench.kernels.quant.quantize` (ResidualKV §IV-A):
asymmetric min/max per group of ``group`` consecutive coordinates of one token, fp16 zmin rounded down
and fp16 step rounded up, levels round((z − zmin)/step) clamped to [0, 2^b − 1], constant groups step 0.
What is new here is the storage: levels **packed** 8 / bits to a byte.

Packing layout (:func:`pack_levels`): a token's levels stay in one row of ``d_c · bits / 8`` bytes; byte j
holds levels j·P .. j·P + P − 1 (P = 8 / bits), level i of the byte in bits [i·bits, (i+1)·bits), low bits
first. On a little-endian machine this is byte for byte KIVI's int32 packing (value i at bits i·bits of
each int32), which the ResidualKV authors reuse (``sparsevllm/triton_kernel/quant.py``). A group must hold
whole bytes (``group % P == 0``) so that each quantisation group packs on its own.

Exactness against :func:`quant.quantize`: zmin and the step are computed in float64 as there, so they are
bit-identical; the levels are computed in float32 (a GPU's native width), so a level can differ by one
where (z − zmin)/step lies within float32 rounding of a half-integer (a rounding tie in float64 and not
in float32, or the reverse). ``tests/test_kernel_group_quant.py`` counts those and checks each is such a tie.
"""
from dataclasses import dataclass

import torch

from kvbench.kernels import quant
from kvbench.kernels._triton import jit, next_pow2, reduce_max, reduce_min, reduce_sum, tl, unit_stride

PACK_BITS = (2, 4, 8)


@dataclass(frozen=True)
class PackedCodes:
    """Residual codes of T tokens as stored packed (module docstring for the layout).

    Fields
    ------
    packed : torch.uint8 [T, d_c · bits / 8] — levels, P = 8 / bits per byte, low bits first; for bits = 16
        the float16 codes themselves [T, d_c] (no quantisation; zmin and scale then have 0 columns).
    zmin : torch.float16 [T, d_c / group] — per-group offset.
    scale : torch.float16 [T, d_c / group] — per-group step (0 for a constant group).
    bits : int — 2, 4, 8 or 16.
    group : int — coordinates per group (a multiple of P).
    """

    packed: torch.Tensor
    zmin: torch.Tensor
    scale: torch.Tensor
    bits: int
    group: int

    @property
    def d_c(self) -> int:
        """Code width: unpacked coordinates per token."""
        return self.packed.shape[1] if self.bits == 16 else self.packed.shape[1] * 8 // self.bits

    def __len__(self) -> int:
        return self.packed.shape[0]

    def nbytes(self) -> int:
        """Bytes held: packed payload plus two fp16 values per group (as :meth:`quant.QuantizedCodes.nbytes`)."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.zmin, self.scale))

    def take(self, rows: torch.Tensor) -> "PackedCodes":
        """The codes of tokens ``rows`` ([n] int64 or [T] bool)."""
        return PackedCodes(self.packed[rows], self.zmin[rows], self.scale[rows], self.bits, self.group)

    @classmethod
    def from_quantized(cls, codes: "quant.QuantizedCodes | torch.Tensor") -> "PackedCodes":
        """Pack :func:`quant.quantize`'s output (a float16 tensor for bits = 16 is kept as is).

        Raises ValueError as :func:`pack_levels` (bits 2/4/8) or for a non-fp16 tensor.
        """
        if isinstance(codes, torch.Tensor):
            if codes.dtype != torch.float16 or codes.dim() != 2:
                raise ValueError(f"unquantised codes must be float16 [T, d_c] (bits = 16), got {codes.dtype} "
                                 f"{tuple(codes.shape)}")
            empty = codes.new_zeros(codes.shape[0], 0)
            return cls(codes, empty, empty, 16, codes.shape[1])
        check_pack(codes.q.shape[1], codes.bits, codes.group)
        return cls(pack_levels(codes.q, codes.bits), codes.zmin, codes.scale, codes.bits, codes.group)


def check_pack(d_c: int, bits: int, group: int) -> None:
    """Raise ValueError unless bits is 2, 4 or 8, group divides d_c and group holds whole bytes (a multiple
    of 8 / bits)."""
    if bits not in PACK_BITS:
        raise ValueError(f"packed codes need bits in {PACK_BITS}, got {bits}")
    quant.check_quant_config(d_c, bits, group)
    if group % (8 // bits):
        raise ValueError(f"group = {group} must be a multiple of {8 // bits} ({bits}-bit levels per byte) so that "
                         f"every quantisation group packs into whole bytes")


def pack_levels(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack levels ``q`` uint8 [T, d] (each < 2^bits; higher bits are not checked) into uint8
    [T, d · bits / 8], P = 8 / bits per byte, level i of a byte at bits i·bits (module docstring).

    Raises ValueError for bits not in (2, 4, 8), a non-uint8 or non-2-D ``q``, or d not a multiple of P.
    """
    if bits not in PACK_BITS:
        raise ValueError(f"bits must be one of {PACK_BITS}, got {bits}")
    if q.dtype != torch.uint8 or q.dim() != 2:
        raise ValueError(f"levels must be a uint8 [T, d] tensor, got {q.dtype} {tuple(q.shape)}")
    per = 8 // bits
    if q.shape[1] % per:
        raise ValueError(f"d = {q.shape[1]} levels per token must be a multiple of {per} to pack at {bits} bits")
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=q.device)
    # disjoint bit ranges: the sum is the bitwise or
    return (q.view(q.shape[0], q.shape[1] // per, per) << shifts).sum(-1, dtype=torch.uint8)


def unpack_levels(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_levels`: uint8 [T, B] -> levels uint8 [T, B · 8 / bits].

    Raises ValueError for bits not in (2, 4, 8) or a non-uint8 / non-2-D input.
    """
    if bits not in PACK_BITS:
        raise ValueError(f"bits must be one of {PACK_BITS}, got {bits}")
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed levels must be a uint8 [T, B] tensor, got {packed.dtype} {tuple(packed.shape)}")
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed[..., None] >> shifts) & (2**bits - 1)).reshape(packed.shape[0], packed.shape[1] * (8 // bits))


# -- quantise ------------------------------------------------------------------------------------------
def _check_z(z: torch.Tensor, bits: int, group: int) -> None:
    if z.dim() != 2 or z.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"z must be a float32/float16/bfloat16 [T, d_c] tensor, got {z.dtype} {tuple(z.shape)}")
    check_pack(z.shape[1], bits, group)


def group_quant_ref(z: torch.Tensor, bits: int, group: int = 32) -> PackedCodes:
    """Torch reference of :func:`group_quant`: ``quant.quantize`` then :func:`pack_levels`.

    Raises ValueError for a bad shape/dtype/config (:func:`check_pack`) and, as ``quant.quantize``, for
    NaN/inf or |z| > 65504.
    """
    _check_z(z, bits, group)
    return PackedCodes.from_quantized(quant.quantize(z, bits, group))


@jit
def _fp16_step(h, up: tl.constexpr):
    """The fp16 neighbour of fp16 ``h`` towards +inf (``up``) or −inf, by its bit pattern (sign-magnitude)."""
    b = h.to(tl.int16, bitcast=True)
    neg = b < 0                                   # sign bit set (−0 included)
    if up:
        b = tl.where(neg, tl.where(b == -32768, 1, b - 1), b + 1)
    else:
        b = tl.where(neg, b + 1, tl.where(b == 0, -32767, b - 1))
    return b.to(tl.float16, bitcast=True)


@jit
def _group_quant_kernel(z_ptr, pk_ptr, zmin_ptr, scale_ptr, n_tok, s_z, s_pk, s_sc,
                        BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr):
    """One program per (block of BLOCK_T tokens, group): stats, fp16 side information, levels, packed bytes."""
    pid_t = tl.program_id(0)
    g = tl.program_id(1)
    PER: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    rows = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.arange(0, BLOCK_G)
    mask_t = rows < n_tok
    mask = mask_t[:, None] & (cols[None, :] < GROUP)
    z = tl.load(z_ptr + rows[:, None] * s_z + g * GROUP + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    lo = reduce_min(tl.where(mask, z, float("inf")), 1)
    hi = reduce_max(tl.where(mask, z, float("-inf")), 1)
    lo = tl.where(mask_t, lo, 0.0)               # rows past the end: a finite (constant) group, never stored
    hi = tl.where(mask_t, hi, 0.0)
    const = hi == lo
    # zmin: lo (exact in float32) rounded down to fp16; a constant group keeps the nearest fp16 value
    near = lo.to(tl.float16)
    zmin = tl.where(const | (near.to(tl.float32) <= lo), near, _fp16_step(near, False))
    # step: (hi − zmin)/L in float64 (as quant.quantize; a float64 division is IEEE-rounded, there is no
    # approximate one), rounded up to fp16
    exact = (hi.to(tl.float64) - zmin.to(tl.float64)) / LEVELS
    near_s = exact.to(tl.float16)
    step = tl.where(near_s.to(tl.float64) >= exact, near_s, _fp16_step(near_s, True))
    step = tl.where(const, 0.0, step.to(tl.float32)).to(tl.float16)
    # levels in float32 (div_rn: IEEE division; a plain float32 `/` may be approximate on the GPU):
    # round half to even as torch.round, clamped; constant groups level 0
    safe = tl.where(const, 1.0, step.to(tl.float32))
    x = tl.div_rn(z - zmin.to(tl.float32)[:, None], safe[:, None])
    f = tl.floor(x)
    r = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    q = f + tl.where((r > 0.5) | ((r == 0.5) & odd), 1.0, 0.0)
    q = tl.minimum(tl.maximum(q, 0.0), LEVELS)
    q = tl.where(const[:, None], 0.0, q).to(tl.int32)
    # P levels of one token per byte, level i at bits i·BITS
    q3 = tl.reshape(q, [BLOCK_T, BLOCK_G // PER, PER])
    shifts = (tl.arange(0, PER) * BITS)[None, None, :]
    byte = reduce_sum(q3 << shifts, 2).to(tl.uint8)
    bcols = tl.arange(0, BLOCK_G // PER)
    tl.store(pk_ptr + rows[:, None] * s_pk + g * (GROUP // PER) + bcols[None, :], byte,
             mask=mask_t[:, None] & (bcols[None, :] < GROUP // PER))
    tl.store(zmin_ptr + rows * s_sc + g, zmin, mask=mask_t)
    tl.store(scale_ptr + rows * s_sc + g, step, mask=mask_t)


def group_quant(z: torch.Tensor, bits: int, group: int = 32) -> PackedCodes:
    """Quantise residual codes ``z`` [T, d_c] (float32/float16/bfloat16) per token in groups of ``group``
    coordinates and pack the levels (Triton; module docstring for the quantiser, layout and exactness).

    Values are not checked (a check would synchronise the host on the GPU): z must be finite with
    |z| <= 65504, as :func:`quant.quantize` requires; :func:`group_quant_ref` checks them.

    Returns :class:`PackedCodes` (packed uint8 [T, d_c·bits/8], fp16 zmin/scale [T, d_c/group]).
    Raises ValueError for a bad shape, dtype, bits (2, 4, 8) or group (:func:`check_pack`).
    """
    _check_z(z, bits, group)
    n_tok, d_c = z.shape
    z = unit_stride(z)
    packed = torch.empty(n_tok, d_c * bits // 8, dtype=torch.uint8, device=z.device)
    zmin = torch.empty(n_tok, d_c // group, dtype=torch.float16, device=z.device)
    scale = torch.empty_like(zmin)
    if n_tok:
        block_t = 16
        _group_quant_kernel[(-(-n_tok // block_t), d_c // group)](
            z, packed, zmin, scale, n_tok, z.stride(0), packed.stride(0), zmin.stride(0),
            BITS=bits, GROUP=group, BLOCK_T=block_t, BLOCK_G=next_pow2(group, 8 // bits))
    return PackedCodes(packed, zmin, scale, bits, group)


# -- dequantise ----------------------------------------------------------------------------------------
def check_codes(codes: PackedCodes, rows: torch.Tensor | None) -> None:
    """Raise ValueError unless ``codes`` is well-formed :class:`PackedCodes` (shapes, dtypes, packing config)
    and ``rows`` None or int32/int64 [n]."""
    if not isinstance(codes, PackedCodes):
        # ValueError, not TypeError: the project reports every bad input as ValueError (as quant.dequantize)
        raise ValueError(f"codes must be PackedCodes, got {type(codes).__name__}")  # noqa: TRY004
    if codes.bits == 16:
        if codes.packed.dtype != torch.float16:
            raise ValueError(f"bits = 16 codes must be float16, got {codes.packed.dtype}")
    else:
        check_pack(codes.d_c, codes.bits, codes.group)
        n_groups = codes.d_c // codes.group
        want = (len(codes), n_groups)
        if codes.packed.dtype != torch.uint8 or tuple(codes.zmin.shape) != want or tuple(codes.scale.shape) != want \
                or codes.zmin.dtype != torch.float16 or codes.scale.dtype != torch.float16:
            raise ValueError(f"packed codes must be uint8 [T, d_c·bits/8] with float16 zmin/scale {list(want)}; got "
                             f"{codes.packed.dtype} {tuple(codes.packed.shape)}, {codes.zmin.dtype} "
                             f"{tuple(codes.zmin.shape)}, {codes.scale.dtype} {tuple(codes.scale.shape)}")
    if rows is not None and (rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"rows must be int32/int64 [n] token indices, got {rows.dtype} {tuple(rows.shape)}")


def group_dequant_ref(codes: PackedCodes, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`group_dequant`: :func:`unpack_levels` then ``quant.dequantize``."""
    check_codes(codes, rows)
    if rows is not None:
        codes = codes.take(rows.long())
    if codes.bits == 16:
        return quant.dequantize(codes.packed)
    q = quant.QuantizedCodes(unpack_levels(codes.packed, codes.bits), codes.zmin, codes.scale, codes.bits, codes.group)
    return quant.dequantize(q)


@jit
def dequant_tile(pk_ptr, zmin_ptr, scale_ptr, rows, mask_n, s_pk, s_sc, cols,
                  D_C: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr):
    """z̃ [N, C] float32 of tokens ``rows`` [N] (int64) at code coordinates ``cols`` [C]: level·step + zmin
    (q·step is exact in float32; one rounding in the addition, as ``quant.dequantize``); 0 where masked."""
    mask = mask_n[:, None] & (cols[None, :] < D_C)
    if BITS == 16:
        z = tl.load(pk_ptr + rows[:, None] * s_pk + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        PER: tl.constexpr = 8 // BITS
        byte = tl.load(pk_ptr + rows[:, None] * s_pk + (cols // PER)[None, :], mask=mask, other=0).to(tl.int32)
        level = (byte >> ((cols % PER) * BITS)[None, :]) & ((1 << BITS) - 1)
        side = rows[:, None] * s_sc + (cols // GROUP)[None, :]
        zmin = tl.load(zmin_ptr + side, mask=mask, other=0.0).to(tl.float32)
        step = tl.load(scale_ptr + side, mask=mask, other=0.0).to(tl.float32)
        z = level.to(tl.float32) * step + zmin
    return z


@jit
def _group_dequant_kernel(pk_ptr, zmin_ptr, scale_ptr, rows_ptr, out_ptr, n, s_pk, s_sc, s_out,
                          D_C: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ROWS: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    offs = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_n = offs < n
    rows = tl.load(rows_ptr + offs, mask=mask_n, other=0).to(tl.int64) if HAS_ROWS else offs
    cols = tl.arange(0, BLOCK_C)
    z = dequant_tile(pk_ptr, zmin_ptr, scale_ptr, rows, mask_n, s_pk, s_sc, cols, D_C, BITS, GROUP)
    tl.store(out_ptr + offs[:, None] * s_out + cols[None, :], z, mask=mask_n[:, None] & (cols[None, :] < D_C))


def group_dequant(codes: PackedCodes, rows: torch.Tensor | None = None) -> torch.Tensor:
    """z̃ = level·step + zmin of the tokens ``rows`` (int64/int32 [n], any order, repeats allowed; None: all)
    as float32 [n, d_c] (Triton; ResidualKV §IV-B: only the tokens sparse attention reads are dequantised).
    bits = 16 codes are returned as float32.

    Row indices are not range-checked (a check would synchronise the host on the GPU).
    Raises ValueError for malformed :class:`PackedCodes` or ``rows``.
    """
    check_codes(codes, rows)
    codes = PackedCodes(*map(unit_stride, (codes.packed, codes.zmin, codes.scale)), codes.bits, codes.group)
    n = len(codes) if rows is None else rows.shape[0]
    out = torch.empty(n, codes.d_c, dtype=torch.float32, device=codes.packed.device)
    if n:
        block_n = 16
        # unused pointers (bits 16: no side information; no rows) point at the codes rather than at empty tensors
        fp16 = codes.bits == 16
        _group_dequant_kernel[(-(-n // block_n),)](
            codes.packed, codes.packed if fp16 else codes.zmin, codes.packed if fp16 else codes.scale,
            codes.packed if rows is None else rows, out, n, codes.packed.stride(0),
            0 if fp16 else codes.zmin.stride(0), out.stride(0),
            D_C=codes.d_c, BITS=codes.bits, GROUP=codes.group, HAS_ROWS=rows is not None,
            BLOCK_N=block_n, BLOCK_C=next_pow2(codes.d_c))
    return out


def group_quant_bytes(z: torch.Tensor) -> int:
    """Bytes :func:`group_quant` reads: the codes ``z`` once (it writes the packed levels and side information)."""
    return z.numel() * z.element_size()


def group_dequant_bytes(codes: PackedCodes, rows: torch.Tensor | None = None) -> int:
    """Bytes :func:`group_dequant` reads: each selected token's packed row and its fp16 zmin/scale, plus the
    row indices. Distinct bytes (what memory must deliver at least), not cache traffic."""
    n = len(codes) if rows is None else rows.shape[0]
    per_row = sum(t.shape[1] * t.element_size() for t in (codes.packed, codes.zmin, codes.scale))
    return n * per_row + (0 if rows is None else rows.numel() * rows.element_size())
