"""restore_attend (Triton) against its torch reference, the reference against the ResidualKV cache."""
from __future__ import annotations

import pytest
import torch
from _kernel_fixtures import DEVICE, TOL, assert_within, interpreter  # noqa: F401
from _tolerance import arith_atol
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import (
    Qwen2RotaryEmbedding,
    apply_rotary_pos_emb,
)

from kvbench.compress.residualkv.codec import ResidualCodec, codec_config_for_shape
from kvbench.kernels.flash_decode import sdpa_decode
from kvbench.kernels.group_quant import PackedCodes, group_quant_ref
from kvbench.kernels.restore_attend import (CodedLayer, knn_mean, linear_decoder, restore_attend, restore_attend_bytes,
                                            restore_attend_ref, rope_rotate)

pytestmark = pytest.mark.usefixtures("interpreter")

H_KV, G, D = 2, 2, 32
D_KV = 2 * H_KV * D


def _rope_table(n_pos: int, d: int = D) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.outer(torch.arange(n_pos).float(), inv).repeat(1, 2)
    return emb.cos(), emb.sin()


def _layer(*, n_refs=12, n_codes=40, k=4, d_c=32, bits=4, group=16, ref_dtype=torch.float8_e4m3fn, bias=True,
           seed=0) -> CodedLayer:
    """A synthetic sparse layer: references every 5 positions, coded tokens in between, random neighbours
    (the first token's all invalid: a zero mean), a random decoder."""
    g = torch.Generator().manual_seed(seed)
    refs = torch.randn(n_refs, D_KV, generator=g)
    nbr = torch.randint(0, max(n_refs, 1), (n_codes, k), generator=g)
    valid = torch.rand(n_codes, k, generator=g) > 0.3
    if n_codes:
        valid[0] = False
    z = torch.randn(n_codes, d_c, generator=g)
    codes = PackedCodes.from_quantized(z.half()) if bits == 16 else group_quant_ref(z, bits, group)
    cos, sin = _rope_table(5 * n_refs + n_codes + 8)
    layer = CodedLayer(refs.to(ref_dtype), torch.arange(n_refs) * 5 + 2, codes, nbr.to(torch.int16), valid,
                       torch.arange(n_codes) + 3, torch.randn(D_KV, d_c, generator=g) * d_c**-0.5,
                       torch.randn(D_KV, generator=g) * 0.1 if bias else None, cos, sin)
    return _to(layer, DEVICE)


def _to(layer: CodedLayer, device) -> CodedLayer:
    c = layer.codes
    codes = PackedCodes(c.packed.to(device), c.zmin.to(device), c.scale.to(device), c.bits, c.group)
    move = {f: getattr(layer, f) for f in ("refs", "ref_pos", "nbr", "valid", "code_pos", "w_d", "b_d", "cos", "sin")}
    return CodedLayer(codes=codes, **{f: None if t is None else t.to(device) for f, t in move.items()})


def _query(dtype, n_raw=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=g).to(dtype).to(DEVICE)
               for shape in ((H_KV * G, D), (H_KV, n_raw, D), (H_KV, n_raw, D)))
    return q, k, v


def _sel(rows):
    return None if rows is None else torch.tensor(rows, dtype=torch.long, device=DEVICE)


RAGGED = ([3, 0, 7, 11], [39, 0, 5, 5, 20, 21, 22, 30, 1, 2, 3, 4, 6, 8, 9, 10, 12, 33])   # 18 codes: 2 blocks


@pytest.mark.parametrize("refs", ["fp8", "float32"])
@pytest.mark.parametrize("dtype", list(TOL), ids=str)
def test_kernel_restore_attend_matches_reference(dtype, refs, record_property):
    layer = _layer(ref_dtype=torch.float8_e4m3fn if refs == "fp8" else torch.float32)
    q, k_raw, v_raw = _query(dtype)
    for name, (rsel, csel) in {"all": (None, None), "ragged": RAGGED}.items():
        got = restore_attend(q, k_raw, v_raw, layer, _sel(rsel), _sel(csel), num_splits=3)
        want = restore_attend_ref(q, k_raw, v_raw, layer, _sel(rsel), _sel(csel))
        assert_within(f"restore_attend {dtype} refs {refs} selection {name}", got, want, TOL[dtype], record_property)


CASES = {   # name: (layer kwargs, n_raw, ref_sel, code_sel, num_splits)
    "no raw tokens": ({}, 0, *RAGGED, None),
    "no reference selected": ({}, 10, [], RAGGED[1], 2),
    "no coded token selected": ({}, 10, RAGGED[0], [], 2),
    "only raw tokens": ({}, 10, [], [], 1),
    "more splits than blocks": ({}, 10, *RAGGED, 9),
    "2-bit codes, group 32": ({"bits": 2, "group": 32}, 5, *RAGGED, None),
    "8-bit codes": ({"bits": 8}, 5, *RAGGED, None),
    "fp16 codes (bits 16)": ({"bits": 16}, 5, *RAGGED, None),
    "no bias, d_c 16": ({"bias": False, "d_c": 16}, 5, *RAGGED, None),
    "no references (k = 0)": ({"n_refs": 0, "k": 0}, 5, None, RAGGED[1], None),
    "int32 selection": ({}, 5, *RAGGED, "int32"),
}


@pytest.mark.parametrize("case", CASES)
def test_kernel_restore_attend_ragged_cases(case, record_property):
    kw, n_raw, rsel, csel, splits = CASES[case]
    layer = _layer(**kw)
    q, k_raw, v_raw = _query(torch.float32, n_raw)
    rsel, csel = _sel(rsel), _sel(csel)
    if splits == "int32":
        rsel, csel, splits = rsel.int(), csel.int(), None
    got = restore_attend(q, k_raw, v_raw, layer, rsel, csel, num_splits=splits)
    want = restore_attend_ref(q, k_raw, v_raw, layer, rsel, csel)
    assert_within(f"restore_attend {case}", got, want, TOL[torch.float32], record_property)


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
def test_kernel_latent_v_equals_restoring_v(dtype, record_property):
    """W_V applied to the attention-weighted codes once equals decoding V per token (f_d is linear)."""
    layer = _layer()
    q, k_raw, v_raw = _query(dtype)
    restored = restore_attend(q, k_raw, v_raw, layer, *map(_sel, RAGGED), num_splits=2)
    latent = restore_attend(q, k_raw, v_raw, layer, *map(_sel, RAGGED), num_splits=2, latent_v=True)
    # both compute in float32; they differ by summation order only, then one rounding to dtype
    tol = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert_within(f"latent V vs restored V {dtype}", latent, restored, tol, record_property)
    assert_within(f"latent V vs reference {dtype}", latent, restore_attend_ref(q, k_raw, v_raw, layer, *map(_sel, RAGGED)),
                  TOL[dtype], record_property)


# -- the reference's pieces against the cache's ---------------------------------------------------------
def test_kernel_rope_is_the_models_rotation():
    rot = Qwen2RotaryEmbedding(Qwen2Config(hidden_size=128, num_attention_heads=4, head_dim=D, rope_theta=10000.0))
    pos = torch.tensor([[0, 3, 17, 40]])
    cos, sin = rot(torch.empty(0), pos)
    k = torch.randn(1, H_KV, 4, D)
    _, want = apply_rotary_pos_emb(k, k, cos, sin)
    tab_cos, tab_sin = _rope_table(41)
    # a rotation is two products and a sum per element (depth 3); the tables round the angle pos x inv_freq (up to
    # |pos|) before the cosine, whose slope is at most 1 (depth 2 on the angle's magnitude)
    torch.testing.assert_close(rope_rotate(k, tab_cos[pos[0]], tab_sin[pos[0]]), want, rtol=0, atol=arith_atol(want, 3))
    torch.testing.assert_close(tab_cos[pos[0]], cos[0], rtol=0, atol=arith_atol(pos.float(), 2))


def test_kernel_knn_mean_is_mean_reference_and_zero_without_a_valid_reference():
    refs, nbr = torch.randn(9, 8), torch.randint(0, 9, (20, 4))
    valid = torch.rand(20, 4) > 0.4
    valid[:, 0] = True
    valid[3] = False     # no valid neighbour: a zero mean (mean_reference refuses such a row)
    got = knn_mean(refs, nbr, valid)
    assert torch.equal(got[3], torch.zeros(8))
    # the other rows by hand: sum of the valid neighbours over their count
    want = (refs[nbr] * valid[..., None]).sum(1) / valid.sum(1, keepdim=True).clamp(min=1)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("joint", [True, False])
def test_kernel_linear_decoder_is_the_codecs_decode(joint):
    codec = ResidualCodec(codec_config_for_shape(1, D_KV, d_c=32, bias=True, joint=joint, bits=4)).layers[0]
    w, b = linear_decoder(codec)
    z = torch.randn(5, 32)
    assert w.shape == (D_KV, 32)
    torch.testing.assert_close(z @ w.T + b, codec.decode(z))
    reverse = ResidualCodec(codec_config_for_shape(1, D_KV, encoder="linear", decoder="swiglu")).layers[0]
    with pytest.raises(ValueError, match="linear decoder"):
        linear_decoder(reverse)


def test_kernel_restore_attend_errors():
    layer = _layer()
    q, k_raw, v_raw = _query(torch.float32)
    for fn in (restore_attend, restore_attend_ref):
        with pytest.raises(ValueError, match="key norm"):
            fn(q, k_raw, v_raw, layer, key_norm=torch.nn.Identity())
        with pytest.raises(ValueError, match="multiple of H_kv"):
            fn(q[:3], k_raw, v_raw, layer)
        with pytest.raises(ValueError, match="q's dtype"):
            fn(q, k_raw.half(), v_raw.half(), layer)
        with pytest.raises(ValueError, match="d_kv = 128"):
            fn(q, k_raw, v_raw, CodedLayer(**{**layer.__dict__, "refs": layer.refs[:, :64]}))
        with pytest.raises(ValueError, match="code_sel must be"):
            fn(q, k_raw, v_raw, layer, None, torch.tensor([0.5], device=DEVICE))
        with pytest.raises(ValueError, match="nothing to attend"):
            fn(q, k_raw[:, :0], v_raw[:, :0], layer, _sel([]), _sel([]))


def test_kernel_restore_attend_bytes_hand_computed():
    layer = _layer(n_refs=12, n_codes=40, k=4, d_c=32, bits=4, group=16)
    q, k_raw, v_raw = _query(torch.float32, n_raw=10)
    rsel, csel = map(_sel, ([0, 1], [5, 6, 7]))
    rope = 2 * D * 4                                       # cos + sin rows, float32
    per_ref = D_KV * 1 + 8 + rope                          # fp8 K‖V row, int64 position
    per_code = 16 + 2 * 2 + 2 * 2 + 8 + 4 * 2 + 4 + 4 * D_KV + rope   # codes, zmin, scale, pos, int16 nbr, valid, refs
    want = (4 * D * 4 + 2 * 2 * 10 * D * 4 + 2 * per_ref + 3 * per_code + 2 * 8 + 3 * 8 + D_KV * 32 * 4 + D_KV * 4)
    assert restore_attend_bytes(q, k_raw, v_raw, layer, rsel, csel) == want


# -- against the cache ----------------------------------------------------------------------------------
def test_kernel_restore_attend_equals_attention_over_the_caches_history(tiny_lm, tmp_path, record_property):
    """A ResidualKV layer (random linear codec, 4-bit codes, FP8 references) after 60 tokens: the kernel and the
    reference over its stores (the contiguous reference pool and code store) equal SDPA over the K/V its
    ``history()`` restores."""
    from test_rkv_cache import IDS, _run

    from kvbench.compress.residualkv.cache import ResidualKVPress
    from kvbench.compress.cache import KVView
    from kvbench.kernels.quant import QuantizedCodes
    from kvbench.models import rope

    codec = ResidualCodec.for_model(tiny_lm, seed=3, d_c=32, d_ff=64, encoder="linear", n_sink=2, window=4, stride=5)
    codec.save(tmp_path / "codec")
    _, cache = _run(tiny_lm, ResidualKVPress(codec_dir=str(tmp_path / "codec"), bits=4, block=1), IDS, [30, 45])
    store = cache.layers[1]
    view = store.history()
    h_kv, d = view.keys.shape[1], view.keys.shape[-1]
    cos, sin = rope.cos_sin(tiny_lm.model.rotary_emb, torch.arange(60).view(1, -1), torch.float32)
    w, b = linear_decoder(store.codec)
    c = store.codes
    codes = PackedCodes.from_quantized(QuantizedCodes(c.q.view(), c.zmin.view(), c.scale.view(), c.bits, c.group))
    layer = _to(CodedLayer(store.pool.stored(), store.pool.positions(), codes, c.nbr.view(), c.valid.view(),
                           c.positions(), w, b, cos[0], sin[0]), DEVICE)
    raw = [store.sink, KVView(*store.raw.view())]
    k_raw = torch.cat([v.keys[0] for v in raw], 1).to(DEVICE)
    v_raw = torch.cat([v.values[0] for v in raw], 1).to(DEVICE)
    q = torch.randn(4, d, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    want = sdpa_decode(q, view.keys[0].to(DEVICE), view.values[0].to(DEVICE), None)
    assert len(layer.ref_pos) == 11 and len(layer.codes) == 43 and h_kv == 2
    assert_within("restore_attend_ref vs cache history", restore_attend_ref(q, k_raw, v_raw, layer), want, 2e-6,
                  record_property)
    assert_within("restore_attend vs cache history", restore_attend(q, k_raw, v_raw, layer), want, TOL[torch.float32],
                  record_property)
