"""KIVI (2/4-bit KV quantisation with a raw residual) and Palu (low-rank KV from SVD of the projections)."""
from __future__ import annotations

import pytest
import torch
from test_press_dynamic import chunked_logits, ids_of

from kvbench.compress.cache import Press
from kvbench.compress.generate import greedy_generate
from kvbench.compress.presses.kivi import KIVIPress
from kvbench.compress.presses.palu import PaluPress, input_grams, low_rank_basis, whitening_factor
from kvbench.kernels import quant


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
    # the first key block [32 tokens, 32 ch] and the quantised values [38 tokens, 32 ch], dequantised
    k, v = quant.dequantize(layer.kq.codes[0]).T, quant.dequantize(layer.vq.codes[0])
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


def calib(n: int = 4, length: int = 64, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(seed))


def test_palu_bytes_kept_rank_and_cache(tiny_lm):
    press = PaluPress(rank_ratio=0.5, calib_ids=calib())
    _, cache = chunked_logits(tiny_lm, press, ids_of(20), cuts=(12,))
    # 2 KV heads < 4: one group of 2 heads x 16 = 32 dims, rank 16, for K and V: 32 fp16 values per token
    assert cache.layers[0].stored_bytes().codes == 20 * 32 * 2
    assert cache.layers[0].stored_bytes().packed() / (20 * 2 * 2 * 32) == 0.5   # KR vs the FP16 cache
    assert press.bases(tiny_lm) is PaluPress(rank_ratio=0.5, calib_ids=calib()).bases(tiny_lm)  # cached per model
    assert press.bases(tiny_lm) is not PaluPress(rank_ratio=0.5, calib_ids=calib(seed=4)).bases(tiny_lm)
    new, _ = greedy_generate(tiny_lm, press, ids_of(3), 2, max_new_tokens=2, eos=set())
    assert len(new) == 2
    for kwargs in ({"rank_ratio": 0.0}, {"rank_ratio": 1.5}, {"group_heads": 0}, {"calib_tokens": 0}, {"calib_len": 0}):
        with pytest.raises(ValueError):
            PaluPress(**kwargs)
    with pytest.raises(ValueError, match="multiple of group_heads"):
        low_rank_basis(torch.nn.Linear(8, 32), n_heads=2, head_dim=16, group_heads=3, rank_ratio=0.5)


# -- Palu whitening (SVD-LLM style, as Palu's decomposition) ---------------------------------------------
@pytest.fixture(scope="module")
def outlier_lm():
    """The tiny LM with per-channel input norm scales spread over two decades, as real LLMs' hidden states have
    outlier channels (whitening has nothing to exploit on isotropic inputs)."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, intermediate_size=128, vocab_size=256, attn_implementation="sdpa")
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    scales = torch.logspace(-1, 1, 64)[torch.randperm(64, generator=torch.Generator().manual_seed(1))]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight.copy_(scales)
    return model


def _kv_io(model, ids):
    """Per layer (X, K, V): k_proj inputs and k_proj / v_proj outputs over ``ids`` ``[n, L]``."""
    got = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        for name in ("k_proj", "v_proj"):
            def keep(mod, args, out, i=i, name=name):
                if name == "k_proj":
                    got.setdefault((i, "x"), []).append(args[0].reshape(-1, args[0].shape[-1]))
                got.setdefault((i, name), []).append(out.reshape(-1, out.shape[-1]))
            hooks.append(getattr(layer.self_attn, name).register_forward_hook(keep))
    with torch.no_grad():
        for row in ids:
            model(input_ids=row.view(1, -1), use_cache=False)
    for h in hooks:
        h.remove()
    n = len(model.model.layers)
    return [tuple(torch.cat(got[(i, k)]) for k in ("x", "k_proj", "v_proj")) for i in range(n)]


def test_whitening_lowers_the_kv_error_on_held_out_text(outlier_lm):
    """Same rank (0.5), same model: the whitened bases reconstruct held-out K and V with less error than plain SVD,
    at every layer (a wrong side for S, or S from the wrong activations, would not)."""
    held_out = calib(n=4, length=64, seed=11)
    whitened = PaluPress(rank_ratio=0.5, calib_ids=calib(n=8, length=64)).bases(outlier_lm)
    plain = PaluPress(rank_ratio=0.5, whiten=False).bases(outlier_lm)
    for i, (_, k, v) in enumerate(_kv_io(outlier_lm, held_out)):
        for j, y in enumerate((k, v)):
            err_w = (whitened[i][j].decode(whitened[i][j].encode(y)) - y).pow(2).sum()
            err_p = (plain[i][j].decode(plain[i][j].encode(y)) - y).pow(2).sum()
            assert err_w < 0.8 * err_p, (i, j, float(err_w), float(err_p))


def test_whitened_basis_is_optimal_on_the_calibration_text(outlier_lm):
    """Eckart-Young in the whitened norm: the calibration error of U_r is the tail of the singular values of W_g S."""
    ids = calib(n=4, length=64)
    grams = input_grams(outlier_lm, ids)
    x, k, _ = _kv_io(outlier_lm, ids)[1]
    torch.testing.assert_close(grams[1], x.double().T @ x.double(), rtol=1e-6, atol=1e-6)
    s = whitening_factor(grams[1])
    torch.testing.assert_close(s @ s.T, grams[1], rtol=1e-9, atol=1e-6)
    proj = outlier_lm.model.layers[1].self_attn.k_proj
    basis = low_rank_basis(proj, n_heads=2, head_dim=16, group_heads=2, rank_ratio=0.5, whitening=s)
    err = (basis.decode(basis.encode(k)) - k).double().pow(2).sum()
    tail = torch.linalg.svdvals(proj.weight.detach().double() @ s)[16:].pow(2).sum()
    assert float(err) == pytest.approx(float(tail), rel=1e-3)


def test_whitening_factor_ridge_and_determinism(outlier_lm):
    """A rank-deficient C (fewer tokens than channels) gets Palu's ridge and still factors; two calibration passes
    over the same windows give identical bases."""
    x = torch.randn(10, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    s = whitening_factor(x.T @ x)
    lam = torch.linalg.eigvalsh(x.T @ x)[0]
    torch.testing.assert_close(s @ s.T, x.T @ x + (-lam + 1e-3) * torch.eye(64, dtype=torch.float64))
    a = [whitening_factor(c) for c in input_grams(outlier_lm, calib(n=2))]
    b = [whitening_factor(c) for c in input_grams(outlier_lm, calib(n=2))]
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_corpus_calibration_windows_are_seeded():
    """Without ``calib_ids`` the windows come from the packed corpus, ``ceil(calib_tokens / calib_len)`` of them,
    the same for one seed and different for another."""
    class Tok:
        eos_token_id = 0

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [1 + ord(c) % 255 for c in text]}

    ids = PaluPress(calib_tokens=100, calib_len=32, tokenizer=Tok()).calibration_ids(None)
    assert ids.shape == (4, 32) and ids.dtype == torch.long
    assert torch.equal(ids, PaluPress(calib_tokens=100, calib_len=32, tokenizer=Tok()).calibration_ids(None))
    assert not torch.equal(ids, PaluPress(calib_tokens=100, calib_len=32, seed=1, tokenizer=Tok()).calibration_ids(None))
