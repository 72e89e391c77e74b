"""KIVI (2/4-bit KV quantisation with a raw residual) and Palu (low-rank KV from SVD of the projections)."""
from __future__ import annotations

import pytest
import torch
from test_press_dynamic import chunked_logits, ids_of

from kvbench.compress.cache import Press
from kvbench.compress.generate import greedy_generate
from kvbench.compress.presses.kivi import KIVIPress
from kvbench.compress.presses.palu import PaluPress, low_rank_basis


# -- KIVI ------------------------------------------------------------------------------------------------
def test_kivi_unquantised_equals_full(tiny_lm):
    ids = ids_of(120)
    ref, _ = chunked_logits(tiny_lm, Press(), ids)
    got, _ = chunked_logits(tiny_lm, KIVIPress(bits=16), ids)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_kivi_context_shorter_than_residual_is_exact(tiny_lm):
    new, cache = greedy_generate(tiny_lm, KIVIPress(bits=2), ids_of(3), 2, max_new_tokens=4, eos=set())
    full, _ = greedy_generate(tiny_lm, Press(), ids_of(3), 2, max_new_tokens=4, eos=set())
    assert new == full and len(cache.layers[0].kq) == 0


def test_kivi_residual_and_decode_quantisation(tiny_lm):
    press = KIVIPress(bits=2, group=32, residual=32)
    _, cache = chunked_logits(tiny_lm, press, ids_of(70), cuts=())
    layer = cache.layers[1]
    assert (len(layer.kq), layer.k_raw.shape[0]) == (64, 6)       # 70 = 2 key blocks of 32 + 6 raw
    assert (len(layer.vq), layer.v_raw.shape[0]) == (38, 32)      # the latest 32 values raw
    # hand-computed bytes (C = 2 heads x 16 = 32 channels): keys 2x32x32 values at 2 bits = 512 B, one
    # (min, scale) fp16 pair per channel and group = 2x32x4 B; values 38 tokens x 32 ch at 2 bits = 304 B,
    # groups of 16 channels: 38x2x4 B; raw (6 + 32) x 32 at FP16
    sb = layer.stored_bytes()
    assert (sb.codes, sb.scales, sb.raw_window) == (512 + 304, 256 + 304, (6 + 32) * 32 * 2)
    # decode tokens are quantised once the key residual fills: 95 tokens -> 31 raw keys, 96 -> 0
    cuts = (70, *range(71, 96))
    _, cache = chunked_logits(tiny_lm, press, ids_of(96), cuts=cuts)
    assert (len(cache.layers[1].kq), cache.layers[1].k_raw.shape[0]) == (96, 0)
    _, cache = chunked_logits(tiny_lm, press, ids_of(95), cuts=cuts[:-1])
    assert (len(cache.layers[1].kq), cache.layers[1].k_raw.shape[0]) == (64, 31)


def test_kivi_groups_per_channel_keys_per_token_values(tiny_lm):
    """2 bits: at most 4 levels per key channel over 32 tokens, and per value token over 16 channels."""
    _, cache = chunked_logits(tiny_lm, KIVIPress(bits=2), ids_of(70), cuts=())
    layer = cache.layers[2]
    k, v = layer.kq.rows[0], layer.vq.rows[0]                       # [32 tokens, 32 ch], [38 tokens, 32 ch]
    assert max(len(k[:, c].unique()) for c in range(32)) <= 4
    assert max(len(v[t, g * 16:(g + 1) * 16].unique()) for t in range(38) for g in range(2)) <= 4
    # per-token key groups would not hold this: a key token varies over more than 4 levels
    assert max(len(k[t].unique()) for t in range(32)) > 4
    _, full = chunked_logits(tiny_lm, Press(), ids_of(70), cuts=())
    k_true = full.layers[2]._stored.keys[0, :, :32].transpose(0, 1).reshape(32, 32)
    step = (k_true.amax(0) - k_true.amin(0)) / 3                    # per-channel 2-bit step
    assert ((k - k_true).abs() <= step / 2 * 1.01 + 1e-4).all()


def test_kivi_errors():
    for kwargs, match in [({"bits": 3}, "bits"), ({"group": 0}, "group"), ({"residual": 48}, "residual")]:
        with pytest.raises(ValueError, match=match):
            KIVIPress(**kwargs)


# -- Palu ------------------------------------------------------------------------------------------------
def test_palu_full_rank_equals_full(tiny_lm):
    ids = ids_of(120)
    ref, _ = chunked_logits(tiny_lm, Press(), ids)
    got, _ = chunked_logits(tiny_lm, PaluPress(rank_ratio=1.0), ids)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_low_rank_basis_is_the_truncated_svd():
    torch.manual_seed(0)
    proj = torch.nn.Linear(64, 32, bias=True)
    basis = low_rank_basis(proj, n_heads=2, head_dim=16, group_heads=1, rank_ratio=0.5)
    assert [tuple(u.shape) for u in basis.up] == [(16, 8), (16, 8)]
    x = torch.randn(5, 64)
    y = proj(x).detach()
    y_hat = basis.decode(basis.encode(y))
    w = proj.weight.detach().double()
    for g, u in enumerate(basis.up):
        rows = slice(16 * g, 16 * (g + 1))
        proj_y = (y[:, rows] - proj.bias[rows].detach()) @ u @ u.T + proj.bias[rows].detach()
        torch.testing.assert_close(y_hat[:, rows], proj_y, atol=1e-5, rtol=1e-5)
        # Eckart-Young: the residual of W_g is the tail of its singular values
        s = torch.linalg.svdvals(w[rows])
        resid = w[rows] - u.double() @ (u.double().T @ w[rows])
        assert resid.norm() ** 2 == pytest.approx(float((s[8:] ** 2).sum()), rel=1e-5)


def test_palu_bytes_kept_rank_and_cache(tiny_lm):
    press = PaluPress(rank_ratio=0.5)
    _, cache = chunked_logits(tiny_lm, press, ids_of(20), cuts=(12,))
    # 2 KV heads < 4: one group of 2 heads x 16 = 32 dims, rank 16, for K and V: 32 fp16 values per token
    assert cache.layers[0].stored_bytes().codes == 20 * 32 * 2
    assert cache.layers[0].stored_bytes().packed() / (20 * 2 * 2 * 32) == 0.5   # KR vs the FP16 cache
    assert press.bases(tiny_lm) is PaluPress(rank_ratio=0.5).bases(tiny_lm)     # SVD cached per model
    new, _ = greedy_generate(tiny_lm, press, ids_of(3), 2, max_new_tokens=2, eos=set())
    assert len(new) == 2
    for kwargs in ({"rank_ratio": 0.0}, {"rank_ratio": 1.5}, {"group_heads": 0}):
        with pytest.raises(ValueError):
            PaluPress(**kwargs)
    with pytest.raises(ValueError, match="multiple of group_heads"):
        low_rank_basis(torch.nn.Linear(8, 32), n_heads=2, head_dim=16, group_heads=3, rank_ratio=0.5)
