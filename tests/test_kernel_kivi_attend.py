"""kivi_attend (Triton) against its torch reference, and the reference against a KIVI layer's history."""
from __future__ import annotations

import pytest
import torch
from _kernel_fixtures import DEVICE, TOL, assert_within, interpreter  # noqa: F401

from kvbench.kernels import quant
from kvbench.kernels.flash_decode import sdpa_decode
from kvbench.kernels.group_quant import pack_levels
from kvbench.kernels.kivi_attend import KIVILayout, kivi_attend, kivi_attend_bytes, kivi_attend_ref

pytestmark = pytest.mark.usefixtures("interpreter")

H_KV, G, D = 2, 2, 16
C = H_KV * D


def _layout(k_blocks, v_chunks, k_raw, v_raw, bits, group, v_group) -> KIVILayout:
    """The packed layout of KIVI's stores: key blocks (``QuantizedCodes`` with levels [C, G], one per block of
    G tokens), value chunks (levels [n, C]), raw keys and values."""
    if k_blocks:
        k_codes = torch.stack([pack_levels(b.q, bits) for b in k_blocks])
        k_zmin, k_scale = (torch.stack([getattr(b, f)[:, 0] for b in k_blocks]) for f in ("zmin", "scale"))
    else:
        k_codes = torch.zeros(0, C, group * bits // 8, dtype=torch.uint8)
        k_zmin = k_scale = torch.zeros(0, C, dtype=torch.float16)
    if v_chunks:
        v_codes = pack_levels(torch.cat([c.q for c in v_chunks]), bits)
        v_zmin, v_scale = (torch.cat([getattr(c, f) for c in v_chunks]) for f in ("zmin", "scale"))
    else:
        v_codes = torch.zeros(0, C * bits // 8, dtype=torch.uint8)
        v_zmin = v_scale = torch.zeros(0, C // v_group, dtype=torch.float16)
    t = [x.to(DEVICE) for x in (k_codes, k_zmin, k_scale, k_raw, v_codes, v_zmin, v_scale, v_raw)]
    return KIVILayout(*t, bits=bits, group=group, v_group=v_group)


def _random_layout(n, n_kq, n_vq, bits, dtype=torch.float32, group=32, v_group=16, seed=0) -> KIVILayout:
    """n tokens of random K/V quantised as KIVILayer does: keys per channel over blocks of ``group`` tokens
    (the first n_kq), values per token in groups of ``v_group`` channels (the first n_vq)."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(n, C, generator=g), torch.randn(n, C, generator=g)
    blocks = [quant.quantize(k[s:s + group].T.contiguous(), bits, group) for s in range(0, n_kq, group)]
    chunks = [quant.quantize(v[:n_vq], bits, v_group)] if n_vq else []
    return _layout(blocks, chunks, k[n_kq:].to(dtype), v[n_vq:].to(dtype), bits, group, v_group)


def _q(dtype, seed=1):
    return torch.randn(H_KV * G, D, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", list(TOL), ids=str)
def test_kernel_kivi_attend_matches_reference(dtype, bits, record_property):
    lay = _random_layout(70, 64, 38, bits, dtype)      # KIVI's state after 70 tokens at R = G = 32
    q = _q(dtype)
    assert_within(f"kivi_attend {dtype} {bits}-bit", kivi_attend(q, lay, num_splits=2), kivi_attend_ref(q, lay),
                  TOL[dtype], record_property)


CASES = {   # name: (n, n_kq, n_vq, num_splits)
    "no quantised key yet": (20, 0, 0, None),
    "keys quantised, values raw": (32, 32, 0, None),
    "every key quantised": (96, 96, 64, 3),
    "more splits than blocks": (70, 64, 38, 11),
}


@pytest.mark.parametrize("case", CASES)
def test_kernel_kivi_attend_ragged_cases(case, record_property):
    n, n_kq, n_vq, splits = CASES[case]
    lay = _random_layout(n, n_kq, n_vq, 4)
    q = _q(torch.float32)
    assert_within(f"kivi_attend {case}", kivi_attend(q, lay, num_splits=splits), kivi_attend_ref(q, lay),
                  TOL[torch.float32], record_property)


def test_kernel_kivi_attend_equals_attention_over_the_layers_history(tiny_lm, record_property):
    """A KIVI-2 cache of the tiny LM after 70 tokens (2 key blocks + 6 raw keys, 38 quantised + 32 raw values):
    the kernel and the reference over its packed stores equal SDPA over ``KIVILayer.history()``."""
    from test_rkv_cache import _run

    from kvbench.compress.presses.kivi import KIVIPress

    ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(1))
    _, cache = _run(tiny_lm, KIVIPress(bits=2, group=32, residual=32), ids, [])
    layer = cache.layers[1]
    lay = _layout(layer.kq.codes, layer.vq.codes, layer.k_raw, layer.v_raw, 2, 32, min(32, layer.head_dim))
    assert (lay.k_codes.shape[0], lay.k_raw.shape[0], lay.v_codes.shape[0], lay.v_raw.shape[0]) == (2, 6, 38, 32)
    view = layer.history()
    q = _q(torch.float32)
    want = sdpa_decode(q, view.keys[0].to(DEVICE), view.values[0].to(DEVICE), None)
    assert_within("kivi_attend_ref vs KIVI history", kivi_attend_ref(q, lay), want, 2e-6, record_property)
    assert_within("kivi_attend vs KIVI history", kivi_attend(q, lay), want, TOL[torch.float32], record_property)


def test_kernel_kivi_attend_errors():
    lay = _random_layout(70, 64, 38, 2)
    q = _q(torch.float32)
    for fn in (kivi_attend, kivi_attend_ref):
        with pytest.raises(ValueError, match="but values 69"):
            fn(q, KIVILayout(**{**lay.__dict__, "v_raw": lay.v_raw[1:]}))
        with pytest.raises(ValueError, match="multiple of H_kv"):
            fn(q[:3], lay)
        with pytest.raises(ValueError, match="never spans two heads"):
            fn(q, KIVILayout(**{**lay.__dict__, "v_group": 32, "v_zmin": lay.v_zmin[:, :1], "v_scale": lay.v_scale[:, :1]}))
        with pytest.raises(ValueError, match="k_zmin must be"):
            fn(q, KIVILayout(**{**lay.__dict__, "k_zmin": lay.k_zmin.float()}))


def test_kernel_kivi_attend_bytes_hand_computed():
    lay = _random_layout(70, 64, 38, 2)
    q = _q(torch.float32)
    # q; keys: 2 blocks x 32 channels x 32 tokens at 2 bits + 2x32 (zmin, scale); 6 raw x 32 float32;
    # values: 38 x 32 at 2 bits + 38 x 2 groups x (zmin, scale); 32 raw x 32 float32
    want = 4 * D * 4 + (2 * 32 * 8 + 2 * 32 * 4 + 6 * 32 * 4) + (38 * 8 + 38 * 2 * 4 + 32 * 32 * 4)
    assert kivi_attend_bytes(q, lay) == want
