"""KR / CR accounting (kvbench.compress.accounting)."""

import pytest

from kvbench.compress.accounting import (
    StoredBytes,
    compute_ratio_formula,
    compute_ratio_measured,
    keep_ratio_formula,
    keep_ratio_measured,
    q_bits,
)
from kvbench.compress.residualkv.quant import quantize


def test_q_bits():
    assert q_bits(4) == 0.3125
    assert q_bits(2) == 0.1875
    assert q_bits(8) == 0.5 + 2 / 32
    assert q_bits(4, group=128) == 0.25 + 2 / 128
    assert q_bits(16) == 1.0


def test_q_bits_agrees_with_stored_codes():
    import torch

    codes = quantize(torch.randn(10, 64), 4, 32)
    fp16_bytes = 10 * 64 * 2
    assert codes.nbytes() / fp16_bytes == q_bits(4, 32)


def test_keep_ratio_llama_paper_setting():
    kr = keep_ratio_formula(n_layers=32, n_full=5, ref_density=0.10, d_c=512, d_kv=2048, bits=4, full_bits=4)
    by_hand = 5 / 32 * 0.3125 + 27 / 32 * (0.05 + 0.3125 * 0.25)
    assert kr == pytest.approx(by_hand, rel=1e-15)
    assert kr == pytest.approx(0.156933594, abs=1e-9)
    assert round(100 * kr, 2) == 15.69


def test_keep_ratio_variants():
    # FP16 everywhere, no references, codes as wide as K||V: the cache is full size.
    assert keep_ratio_formula(n_layers=4, n_full=1, ref_density=0.0, d_c=64, d_kv=64, bits=16,
                              full_bits=16) == 1.0
    # All layers full: only q_full counts.
    assert keep_ratio_formula(n_layers=8, n_full=8, ref_density=0.5, d_c=1, d_kv=64) == 0.3125
    # FP16 references cost rho instead of rho/2.
    assert keep_ratio_formula(n_layers=2, n_full=0, ref_density=0.1, d_c=32, d_kv=128, bits=2,
                              ref_bits=16) == pytest.approx(0.1 + 0.1875 / 4)


def test_compute_ratio_formula():
    assert compute_ratio_formula(n_layers=32, n_full=5, r=0.17) == pytest.approx(5 / 32 + 27 / 32 * 0.17)
    assert compute_ratio_formula(n_layers=36, n_full=7, r=0.0) == pytest.approx(7 / 36)  # CR >= beta
    assert compute_ratio_formula(n_layers=10, n_full=0, r=0.3) == pytest.approx(0.3)
    assert compute_ratio_formula(n_layers=10, n_full=10, r=0.3) == 1.0


def test_stored_bytes_and_measured_keep_ratio():
    parts = [
        StoredBytes(layer=0, full_layer=1000),
        StoredBytes(layer=1, codes=300, scales=40, references=120, indices=80, raw_window=256, sinks=64),
    ]
    assert parts[1].total() == 860
    # full FP16 cache: 2 bytes * 2 (K, V) * 2 layers * 10 tokens * 2 heads * 8 dims = 1280 bytes
    assert keep_ratio_measured(parts, n_tokens=10, n_layers=2, n_kv_heads=2, head_dim=8) == 1860 / 1280
    with pytest.raises(ValueError, match="layers 0..2"):
        keep_ratio_measured(parts, n_tokens=10, n_layers=3, n_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="once each"):
        keep_ratio_measured(parts + [StoredBytes(layer=1)], n_tokens=10, n_layers=2, n_kv_heads=2,
                            head_dim=8)
    with pytest.raises(ValueError, match="n_tokens"):
        keep_ratio_measured(parts, n_tokens=0, n_layers=2, n_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="codes"):
        StoredBytes(layer=0, codes=-1)


def test_compute_ratio_measured():
    assert compute_ratio_measured([100, 30, 30, 40], 100) == pytest.approx(0.5)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        compute_ratio_measured([101], 100)
    with pytest.raises(ValueError, match="empty"):
        compute_ratio_measured([], 100)
    with pytest.raises(ValueError, match="n_tokens"):
        compute_ratio_measured([0], 0)


@pytest.mark.parametrize("kw", [{"n_full": 33}, {"n_full": -1}, {"ref_density": 1.5}, {"ref_density": -0.1},
                                {"bits": 3}, {"full_bits": 5}, {"n_layers": 0}, {"d_c": 0}, {"ref_bits": 4}])
def test_keep_ratio_errors(kw):
    args = {"n_layers": 32, "n_full": 5, "ref_density": 0.1, "d_c": 512, "d_kv": 2048} | kw
    with pytest.raises(ValueError):
        keep_ratio_formula(**args)


@pytest.mark.parametrize("kw", [{"n_full": 11}, {"r": 1.01}, {"r": -0.01}])
def test_compute_ratio_errors(kw):
    with pytest.raises(ValueError):
        compute_ratio_formula(**({"n_layers": 10, "n_full": 2, "r": 0.3} | kw))


def test_q_bits_errors():
    with pytest.raises(ValueError, match="bits"):
        q_bits(3)
    with pytest.raises(ValueError, match="group"):
        q_bits(4, group=0)
