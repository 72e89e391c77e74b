"""Per-token group quantisation and the FP8 cast (kvbench.kernels.quant)."""

import math

import pytest
import torch

from kvbench.kernels.quant import (
    FP8_MAX,
    QuantizedCodes,
    check_quant_config,
    dequantize,
    from_fp8,
    quant_error_bound,
    quantize,
    to_fp8,
)


def _random_codes(seed):
    """Codes at many magnitudes: normal, tiny (fp16 subnormal range), large, shifted, sparse."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(16, 64, generator=g)
    return [
        base,
        base * 1e-6,
        base * 1e-9,
        base * 3000.0,
        torch.rand(16, 64, generator=g) * 60000.0 - 30000.0,
        base + 100.0,
        base * (torch.rand(16, 64, generator=g) < 0.1),
        torch.randn(16, 64, generator=g, dtype=torch.float64) * 7.3,
        base.to(torch.bfloat16),
    ]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [8, 32, 64])
def test_round_trip_within_bounds(bits, group):
    levels = 2**bits - 1
    for seed in range(3):
        for z in _random_codes(seed):
            codes = quantize(z, bits, group)
            err = (dequantize(codes).double() - z.double()).norm(dim=1)
            bound = quant_error_bound(z, bits, group).double()
            assert (err <= bound).all(), (bits, group, float((err - bound).max()))
            paper = quant_error_bound(z, bits, group, slack=False).double()
            # Looser form of §2.8: sqrt(g/2)/(2^b−1)·||z|| >= the paper's first form (exact maths).
            loose = math.sqrt(group / 2) / levels * z.double().norm(dim=1)
            assert (paper <= loose * (1 + 1e-6)).all()
            assert (err <= loose * (1 + 2**-8) + 2**-20).all()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_slack_is_small_for_centred_codes(bits):
    # For zero-centred codes of ordinary magnitude the fp16 slack adds well under 1% to the paper's
    # bound; it grows only where fp16 spacing of |zmin| rivals the range (large offsets, |z| < 1e-4).
    z = torch.randn(64, 64, generator=torch.Generator().manual_seed(5))
    for scale in (1e-2, 1.0, 3000.0):
        paper = quant_error_bound(z * scale, bits, slack=False)
        assert (quant_error_bound(z * scale, bits) <= paper * 1.01).all()


def test_levels_and_layout():
    z = torch.tensor([[0.0, 1.0, 2.0, 3.0, -1.0, -1.0, -1.0, -1.0]])
    codes = quantize(z, 2, group=4)
    assert codes.q.dtype == torch.uint8 and codes.q.shape == (1, 8)
    assert codes.zmin.dtype == torch.float16 and codes.zmin.shape == (1, 2)
    assert codes.scale.dtype == torch.float16 and codes.scale.shape == (1, 2)
    # group 1: range 3 over 3 levels -> step exactly 1, levels 0..3, exact round trip.
    assert codes.q[0, :4].tolist() == [0, 1, 2, 3]
    assert codes.zmin.tolist() == [[0.0, -1.0]] and codes.scale.tolist() == [[1.0, 0.0]]
    assert torch.equal(dequantize(codes), z)


def test_groups_never_cross_tokens():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(6, 32, generator=g)
    whole = dequantize(quantize(z, 4, 32))
    one_by_one = torch.cat([dequantize(quantize(z[i:i + 1], 4, 32)) for i in range(6)])
    assert torch.equal(whole, one_by_one)
    # One outlier token changes nothing in the others.
    z2 = z.clone()
    z2[3] *= 1000
    assert torch.equal(dequantize(quantize(z2, 4, 32))[[0, 1, 2, 4, 5]], whole[[0, 1, 2, 4, 5]])


def test_constant_group_exact_and_no_nan():
    z = torch.tensor([[0.5] * 32 + [0.0] * 32, [-7.25] * 32 + [1e-3] * 32])
    codes = quantize(z, 4)
    out = dequantize(codes)
    assert not torch.isnan(out).any()
    assert torch.equal(codes.scale, torch.zeros_like(codes.scale))
    assert torch.equal(out[:, :32], z[:, :32])  # fp16-representable constants come back exactly
    assert out[1, 32:].eq(torch.tensor(1e-3, dtype=torch.float16).float()).all()  # nearest fp16 otherwise
    assert (out - z).norm(dim=1).le(quant_error_bound(z, 4)).all()


def test_extremes_reach_extreme_levels():
    z = torch.randn(10, 32, generator=torch.Generator().manual_seed(3))
    codes = quantize(z, 4)
    q = codes.q.view(10, 1, 32)
    assert q.amin(2).eq(0).all() and q.amax(2).eq(15).all()


def test_bits16_is_fp16_passthrough():
    z = torch.randn(3, 40)
    out = quantize(z, 16, group=32)  # no groups at 16 bits: 40 % 32 is fine
    assert out.dtype == torch.float16 and torch.equal(out, z.half())
    assert dequantize(out).dtype == torch.float32 and torch.equal(dequantize(out), z.half().float())
    assert (dequantize(out) - z).norm(dim=1).le(quant_error_bound(z, 16)).all()
    assert quant_error_bound(z, 16, slack=False).eq(0).all()


def test_nbytes_and_take():
    z = torch.randn(5, 64)
    assert quantize(z, 4, 32).nbytes() == 5 * 64 * 4 // 8 + 5 * 2 * 4
    assert quantize(torch.randn(3, 32), 2, 32).nbytes() == 3 * 32 * 2 // 8 + 3 * 4
    assert quantize(torch.randn(1, 3), 2, 3).nbytes() == math.ceil(3 * 2 / 8) + 4  # partial byte counts
    codes = quantize(z, 4, 32)
    sub = codes.take(torch.tensor([4, 1]))
    assert isinstance(sub, QuantizedCodes)
    assert torch.equal(dequantize(sub), dequantize(codes)[[4, 1]])


@pytest.mark.parametrize("args", [(64, 3, 32), (64, 1, 32), (64, 4, 24), (0, 4, 32), (64, 4, 0)])
def test_config_errors(args):
    with pytest.raises(ValueError):
        check_quant_config(*args)


def test_quantize_input_errors():
    with pytest.raises(ValueError, match="bits"):
        quantize(torch.randn(2, 32), 3)
    with pytest.raises(ValueError, match="multiple"):
        quantize(torch.randn(2, 48), 4, 32)
    with pytest.raises(ValueError, match="finite"):
        quantize(torch.tensor([[float("nan")] * 32]), 4)
    with pytest.raises(ValueError, match="65504"):
        quantize(torch.full((1, 32), 7e4), 4)
    with pytest.raises(ValueError, match="float"):
        quantize(torch.zeros(2, 32, dtype=torch.long), 4)
    with pytest.raises(ValueError):
        dequantize(torch.zeros(2, 2))


def test_fp8_saturation_policy():
    x = torch.tensor([1e6, -1e6, 448.0, -448.0, 449.0, 1.0])
    y, n_sat = to_fp8(x)
    assert y.dtype == torch.float8_e4m3fn and n_sat == 3
    assert from_fp8(y).tolist() == [448.0, -448.0, 448.0, -448.0, 448.0, 1.0]
    assert not torch.isnan(from_fp8(y)).any()
    with pytest.raises(ValueError, match=r"max \|x\| = 1000000"):
        to_fp8(x, overflow="error")
    assert to_fp8(x[2:4], overflow="error")[1] == 0
    with pytest.raises(ValueError, match="NaN/inf"):
        to_fp8(torch.tensor([1.0, float("inf")]))
    with pytest.raises(ValueError, match="NaN/inf"):
        to_fp8(torch.tensor([float("nan")]))
    with pytest.raises(ValueError, match="overflow"):
        to_fp8(x, overflow="wrap")
    with pytest.raises(ValueError, match="float8"):
        from_fp8(x)


def test_fp8_exact_round_trip_of_representable_values():
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    vals = every.float()
    vals = vals[torch.isfinite(vals)]  # 0x7f / 0xff are NaN in e4m3fn
    assert vals.numel() == 254 and float(vals.abs().max()) == FP8_MAX
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        y, n_sat = to_fp8(vals.to(dtype))
        assert n_sat == 0 and torch.equal(from_fp8(y), vals)
