"""group_quant / group_dequant (Triton) against quant.quantize / quant.dequantize + packing (torch)."""
from __future__ import annotations

import pytest
import torch
from _kernel_fixtures import DEVICE, assert_within, interpreter  # noqa: F401

from kvbench.kernels import quant
from kvbench.kernels.group_quant import (PackedCodes, check_pack, group_dequant, group_dequant_bytes, group_dequant_ref,
                                         group_quant, group_quant_bytes, group_quant_ref, pack_levels, unpack_levels)

pytestmark = pytest.mark.usefixtures("interpreter")


def _codes(n=37, d_c=64, dtype=torch.float32, seed=0):
    """Residual-like codes with the awkward groups: a constant one, an all-zero one, tiny values (subnormal
    fp16 zmin), a large common offset."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, d_c, generator=g) * 3
    z[1, :16] = 1.5
    z[2, 16:32] = 0.0
    z[3] *= 1e-6
    z[4] += 300.0
    return z.to(dtype).to(DEVICE)


# -- packing -------------------------------------------------------------------------------------------
def test_kernel_pack_layout_hand_computed():
    two = torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8)
    assert pack_levels(two, 2).tolist() == [[0b00111001]]          # level i at bits 2i, low first
    four = torch.tensor([[0xA, 0x5, 0xF, 0x0]], dtype=torch.uint8)
    assert pack_levels(four, 4).tolist() == [[0x5A, 0x0F]]
    eight = torch.tensor([[7, 200]], dtype=torch.uint8)
    assert torch.equal(pack_levels(eight, 8), eight)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_kernel_pack_round_trip_and_kivi_int32_layout(bits):
    q = torch.randint(0, 2**bits, (5, 32), dtype=torch.uint8)
    packed = pack_levels(q, bits)
    assert packed.shape == (5, 32 * bits // 8)
    assert torch.equal(unpack_levels(packed, bits), q)
    # KIVI / the authors pack 32 / bits values per int32, value i at bits i·bits: the same bytes (little-endian)
    per_int = 32 // bits
    as_int32 = sum(q.view(5, -1, per_int)[..., i].long() << (i * bits) for i in range(per_int))
    assert torch.equal(packed.view(torch.int32).long() & 0xFFFFFFFF, as_int32)


def test_kernel_pack_errors():
    with pytest.raises(ValueError, match="bits must be one of"):
        pack_levels(torch.zeros(2, 4, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="uint8"):
        pack_levels(torch.zeros(2, 4), 4)
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_levels(torch.zeros(2, 6, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="whole bytes"):
        check_pack(12, 2, 6)                 # 2-bit levels: 4 per byte, a group of 6 splits a byte
    with pytest.raises(ValueError, match="multiple of group"):
        check_pack(40, 4, 32)


# -- quantise ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_group_quant_matches_quantize(dtype, bits, record_property):
    """zmin and step bit-identical (float64 in both); levels may differ by one only at float32-vs-float64
    rounding ties of (z − zmin)/step, i.e. where the float64 quotient lies within float32 rounding error of a
    half-integer. The count of such levels is printed (0 on these codes)."""
    z = _codes(dtype=dtype)
    got, want = group_quant(z, bits, 16), group_quant_ref(z.cpu(), bits, 16)
    assert torch.equal(got.zmin.cpu(), want.zmin) and torch.equal(got.scale.cpu(), want.scale)
    lg, lw = unpack_levels(got.packed.cpu(), bits).int(), unpack_levels(want.packed, bits).int()
    differ = lg != lw
    # the float64 quotient of every coordinate, as quant.quantize computes it
    zg = z.cpu().double().view(z.shape[0], -1, 16)
    step = want.scale.double()[..., None]
    x = ((zg - want.zmin.double()[..., None]) / torch.where(step > 0, step, 1.0)).view_as(differ)
    near_tie = (x - x.floor() - 0.5).abs() <= 2.0**-21 * x.abs().clamp(min=1)
    print(f"group_quant {dtype} {bits}-bit: {int(differ.sum())} of {differ.numel()} levels differ from quant.quantize")
    record_property("levels_differing", int(differ.sum()))
    assert ((lg - lw).abs() <= 1).all() and not (differ & ~near_tie).any()


def test_kernel_group_quant_rounds_half_to_even_and_keeps_constant_groups():
    # range 15 at 4 bits: step exactly 1, zmin 0, so the quotients are the values: 7.5 -> 8, 2.5 -> 2, 3.5 -> 4
    z = torch.tensor([[0.0, 15.0, 7.5, 2.5, 3.5, 1.0, 14.5, 0.5], [2.0] * 8], device=DEVICE)
    got = group_quant(z, 4, 8)
    assert unpack_levels(got.packed.cpu(), 4).tolist() == [[0, 15, 8, 2, 4, 1, 14, 0], [0] * 8]
    assert got.scale.tolist() == [[1.0], [0.0]] and got.zmin.tolist() == [[0.0], [2.0]]
    assert torch.equal(group_dequant(got).cpu(), quant.dequantize(quant.quantize(z.cpu(), 4, 8)))


def test_kernel_group_quant_errors():
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        group_quant(torch.zeros(2, 16, dtype=torch.float64), 4, 16)
    with pytest.raises(ValueError, match="packed codes need bits"):
        group_quant(torch.zeros(2, 16), 16, 16)
    with pytest.raises(ValueError, match="finite"):
        group_quant_ref(torch.full((2, 16), float("nan")), 4, 16)


# -- dequantise ----------------------------------------------------------------------------------------
ROWS = {"all": None, "ragged": [5, 0, 36, 5, 17], "empty": [], "one": [36]}


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bits", [2, 4, 8, 16])
def test_kernel_group_dequant_matches_reference(bits, rows, record_property):
    """Exact: level·step is exact in float32 and both add zmin with one rounding (tolerance 0)."""
    z = _codes()
    codes = (PackedCodes.from_quantized(z.cpu().half()) if bits == 16 else group_quant_ref(z.cpu(), bits, 16))
    codes = PackedCodes(*(t.to(DEVICE) for t in (codes.packed, codes.zmin, codes.scale)), codes.bits, codes.group)
    sel = None if ROWS[rows] is None else torch.tensor(ROWS[rows], dtype=torch.long, device=DEVICE)
    got = group_dequant(codes, sel)
    want = group_dequant_ref(codes, sel)
    assert got.shape == (len(codes) if sel is None else len(sel), 64)
    assert_within(f"group_dequant {bits}-bit rows={rows}", got, want, 0.0, record_property)


def test_kernel_group_dequant_int32_rows_and_errors():
    codes = group_quant_ref(_codes().cpu(), 4, 16)
    codes = PackedCodes(*(t.to(DEVICE) for t in (codes.packed, codes.zmin, codes.scale)), 4, 16)
    rows = torch.tensor([3, 1], dtype=torch.int32, device=DEVICE)
    assert torch.equal(group_dequant(codes, rows), group_dequant_ref(codes, rows.long()))
    with pytest.raises(ValueError, match="rows must be int32/int64"):
        group_dequant(codes, rows.float())
    with pytest.raises(ValueError, match="float16 zmin/scale"):
        group_dequant(PackedCodes(codes.packed, codes.zmin[:, :1], codes.scale, 4, 16))


def test_kernel_group_dequant_bytes_hand_computed():
    codes = group_quant_ref(torch.randn(10, 64), 4, 32)
    # per token: 64 levels at 4 bits = 32 bytes, 2 groups x (zmin, scale) fp16 = 8 bytes
    assert group_dequant_bytes(codes) == 10 * 40
    assert group_dequant_bytes(codes, torch.tensor([1, 2, 3])) == 3 * 40 + 3 * 8
    assert codes.nbytes() == quant.quantize(torch.randn(10, 64), 4, 32).nbytes()
    assert group_quant_bytes(torch.zeros(10, 64, dtype=torch.bfloat16)) == 10 * 64 * 2
