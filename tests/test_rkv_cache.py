"""The ResidualKV cache: identity codec == vanilla cache; storage, RoPE and OmniKV invariants; bad input."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from kvbench.compress.cache import Press, press_attention
from kvbench.compress.presses.kivi import KIVIPress
from kvbench.compress.presses.omnikv import OmniKVPress
from kvbench.compress.presses.snapkv import SnapKVPress
from kvbench.compress.residualkv.cache import ResidualKVLayer, ResidualKVPress
from kvbench.compress.residualkv.codec import ResidualCodec
from kvbench.kernels.reference_mean import mean_reference


def _identity_codec(model, path, **overrides):
    """Linear f_c and f_d set to the identity (d_c = d_kv): z = kv - mean_ref, restore = z + mean_ref."""
    codec = ResidualCodec.for_model(model, d_c=64, d_ff=64, encoder="linear", decoder="linear", bits=16, **overrides)
    with torch.no_grad():
        for layer in codec.layers:
            for p in layer.parameters():
                p.copy_(torch.eye(p.shape[0], p.shape[1]) if p.dim() == 2 else torch.zeros_like(p))
    codec.save(path)
    return path


def _run(model, press, ids, cuts, cache=None):
    """Run ``ids`` through ``model`` in chunks ending at ``cuts`` on ``cache`` (default: a new one of ``press``)."""
    cache = press.new_cache(model) if cache is None else cache
    outs, start = [], 0
    with torch.inference_mode(), press_attention(model, cache):
        for end in [*cuts, ids.shape[1]]:
            pos = torch.arange(start, end).view(1, -1)
            outs.append(model(input_ids=ids[:, start:end], position_ids=pos, cache=cache, use_cache=True).logits)
            start = end
    return torch.cat(outs, 1), cache


IDS = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(0))
CUTS = [30, 45, *range(46, 60)]   # context chunk, question chunk, then one token at a time (decode)


def test_identity_codec_equals_vanilla_cache(tiny_lm, tmp_path):
    codec_dir = _identity_codec(tiny_lm, tmp_path / "id", n_sink=2, window=4, stride=5)
    press = ResidualKVPress(codec_dir=str(codec_dir), bits=32, ref_fp8=False)
    got, cache = _run(tiny_lm, press, IDS, CUTS)
    want, _ = _run(tiny_lm, Press(), IDS, CUTS)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    layer = cache.layers[1]
    assert isinstance(layer, ResidualKVLayer)
    # 60 tokens: 2 sinks, then blocks of 4 (the window) coded once 8 are raw: 52 flushed (2..53), 6 raw;
    # references at 2, 7, 12, ... (paper grid, stride 5)
    assert layer.ref_pos.tolist() == list(range(2, 54, 5))
    assert len(layer.codes.positions()) == 52 - len(layer.ref_pos) and len(layer.window) == 6


def test_restored_keys_get_rope_at_their_own_positions(tiny_lm, tmp_path):
    codec_dir = _identity_codec(tiny_lm, tmp_path / "id", n_sink=2, window=4, stride=5)
    press = ResidualKVPress(codec_dir=str(codec_dir), bits=32, ref_fp8=False)
    _, cache = _run(tiny_lm, press, IDS[:, :40], [30])
    _, full = _run(tiny_lm, Press(), IDS[:, :40], [30])
    for i in range(3):
        view = cache.layers[i].history()
        ref = full.layers[i].history()
        order = view.positions[0, 0].argsort()
        assert view.positions[0, 0][order].tolist() == list(range(40))
        torch.testing.assert_close(view.keys[..., order, :], ref.keys, atol=2e-5, rtol=1e-4)


def test_quantised_codes_change_little_and_store_fewer_bytes(tiny_lm, tmp_path):
    codec_dir = _identity_codec(tiny_lm, tmp_path / "id", n_sink=2, window=4, stride=5)
    exact, _ = _run(tiny_lm, ResidualKVPress(codec_dir=str(codec_dir), bits=32, ref_fp8=False), IDS, [30])
    q4, c4 = _run(tiny_lm, ResidualKVPress(codec_dir=str(codec_dir), bits=4, block=1), IDS, [30])
    assert not torch.equal(exact, q4)
    b4 = c4.layers[1].stored_bytes()
    # 60 tokens: 11 refs FP8 (64 bytes each), 43 codes at 4 bits (32 bytes) + 2 groups x 2 fp16 (8 bytes)
    assert b4.references == 11 * 64 and b4.codes == 43 * 32 and b4.scales == 43 * 8
    assert b4.sinks == 2 * 64 * 2 and b4.raw_window == 4 * 64 * 2
    assert b4.indices == 43 * 4 * 2       # int16 indices, k = 4


def test_codec_of_another_model_is_refused(tiny_lm, tmp_path):
    other = Qwen2ForCausalLM(Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=256))
    codec_dir = _identity_codec(other, tmp_path / "other")
    with pytest.raises(ValueError, match="does not fit the model"):
        ResidualKVPress(codec_dir=str(codec_dir)).new_cache(tiny_lm)


@pytest.mark.parametrize("kw, match", [
    ({"selector": "omnikv"}, "selector must be an OmniKVPress or a SnapKVPress"),
    ({"selector": KIVIPress()}, "selector must be"),
    ({"selector": OmniKVPress()}, "needs full_layers"),
    ({"selector": OmniKVPress(window=4), "full_layers": (0, 1)}, r"takes \['window'\] from the storage"),
    ({"selector": OmniKVPress(filter_layers=(1,)), "full_layers": (0, 1)}, "filter_layers"),
    ({"bits": 3}, "bits"), ({"full_kv_bits": 4}, "full_layers is empty"), ({"stride": 0}, "stride"),
    ({"alpha": -0.5}, "alpha .* >= 0"), ({"mean_only": True, "use_codec": False}, "two different ablations")])
def test_bad_press_parameters(tiny_lm, tmp_path, kw, match):
    codec_dir = _identity_codec(tiny_lm, tmp_path / "id")
    with pytest.raises(ValueError, match=match):
        ResidualKVPress(codec_dir=str(codec_dir), **kw)


def test_missing_codec_dir_is_named(tiny_lm, tmp_path):
    press = ResidualKVPress(codec_dir=str(tmp_path / "nowhere"))  # resources load later
    with pytest.raises(ValueError, match="holds no trained codec"):
        press.load()
    # the variant folder instead of its codec/ subfolder: the error points at the right one
    _identity_codec(tiny_lm, tmp_path / "variant" / "codec")
    with pytest.raises(ValueError, match=r"did you mean '.*variant/codec'\?"):
        ResidualKVPress(codec_dir=str(tmp_path / "variant")).load()


def test_snapkv_selector_keeps_the_keep_share_of_codes_and_every_reference(tiny_lm, tmp_path):
    codec_dir = _identity_codec(tiny_lm, tmp_path / "id", n_sink=2, window=4, stride=5)
    press = ResidualKVPress(codec_dir=str(codec_dir), selector=SnapKVPress(keep=0.5, kernel=7, pooling="max"), block=1)
    _, cache = _run(tiny_lm, press, IDS, [50])
    layer = cache.layers[1]
    # context chunk of 50: 2 sinks, 4 raw, 44 flushed = 9 refs (2, 7, ..., 42) + 35 codes -> ceil(17.5) = 18 kept,
    # all from the observation window (positions 18..49 score +inf); the next chunk's 10 tokens flush
    # 46..55 uncut: refs 47, 52 and 8 codes
    assert layer.ref_pos.tolist() == list(range(2, 56, 5))
    codes = layer.codes.positions()
    assert (codes < 46).sum().item() == 18 and (codes[codes < 46] >= 18).all()
    assert (codes >= 46).sum().item() == 8


def test_without_references_every_token_is_coded_and_identity_stays_exact(tiny_lm, tmp_path):
    codec_dir = _identity_codec(tiny_lm, tmp_path / "noref", n_sink=2, window=4, references=False)
    press = ResidualKVPress(codec_dir=str(codec_dir), bits=32, ref_fp8=False, block=1)
    got, cache = _run(tiny_lm, press, IDS, CUTS)
    want, _ = _run(tiny_lm, Press(), IDS, CUTS)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    layer = cache.layers[0]
    assert len(layer.ref_pos) == 0 and len(layer.codes.positions()) == 54 and layer.stored_bytes().indices == 0


def test_full_kv_bits_store_full_layers_kivi_style(tiny_lm, tmp_path):
    from kvbench.compress.accounting import StoredBytes
    from kvbench.compress.cache import StoreLayer
    from kvbench.compress.presses.kivi import KIVIPress
    from kvbench.compress.residualkv.cache import QuantizedFullLayer

    codec_dir = _identity_codec(tiny_lm, tmp_path / "id", n_sink=2, window=4, stride=5)
    base = dict(codec_dir=str(codec_dir), selector=OmniKVPress(keep=0.5), full_layers=(0, 1))
    _, c16 = _run(tiny_lm, ResidualKVPress(**base), IDS, CUTS)
    _, c4 = _run(tiny_lm, ResidualKVPress(**base, full_kv_bits=4, full_kv_form="kivi"), IDS, CUTS)
    _, kivi = _run(tiny_lm, KIVIPress(bits=4), IDS, CUTS)
    assert [type(x) for x in c16.layers[:2]] == [StoreLayer, StoreLayer]
    assert [type(x) for x in c4.layers[:2]] == [QuantizedFullLayer, QuantizedFullLayer]
    assert [x.after_commit is not None for x in c4.layers[:3]] == [False, True, False]   # layer 1 filters
    # FP16 full layer: 60 tokens x d_kv 64 x 2 bytes; 4-bit in KIVI's form: exactly KIVI-4's bytes, reported as the
    # full_layer part
    assert c16.layers[0].packed_bytes() == StoredBytes(layer=0, full_layer=60 * 64 * 2)
    for i in (0, 1):
        assert c4.layers[i].packed_bytes() == StoredBytes(layer=i, full_layer=kivi.layers[i].stored_bytes().packed())
        assert c4.layers[i].stored_bytes().resident == kivi.layers[i].stored_bytes().resident
        assert c4.layers[i].stored_bytes().full_layer < 60 * 64 * 2
    # the quantised filter layer still selects keep = 0.5 of its candidates every step
    assert len(c4.selections) == len(c16.selections) > 0
    assert [len(s) for s in c4.selections] == [len(s) for s in c16.selections]
    for sel in c4.selections:  # sorted, distinct candidates: never a sink (n_sink 2)
        assert sel == sorted(set(sel)) and min(sel) >= 2
    # and it scores with the 4-bit keys: some step's choice differs from the exact filter layer's
    # (fails if the quantised layer silently scored with exact keys)
    assert c4.selections != c16.selections
    with pytest.raises(ValueError, match="full_kv_bits must be 2, 4, 8 .* got 3"):
        ResidualKVPress(**base, full_kv_bits=3)
    with pytest.raises(ValueError, match="full_kv_form must be one of .* got 'engine'"):
        ResidualKVPress(**base, full_kv_bits=4, full_kv_form="engine")
    with pytest.raises(ValueError, match="full_kv_form=before .* full_kv_bits is 16"):
        ResidualKVPress(**base, full_kv_form="before")


IDS_LONG = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(1))
CUTS_LONG = [100, 120, *range(121, 150)]   # context, question, then decode steps


def test_full_layer_authors_form_keeps_sinks_raw_and_32_to_63_raw_tokens(tiny_lm, tmp_path):
    """The authors' full-layer form (CURRENTF/Sparse-vLLM: engine and HF reference): the codec's n_sink sinks
    stay exact, and K and V alike keep 32-63 raw tokens, the oldest quantised in blocks of 32 once 64 are raw."""
    from kvbench.compress.accounting import StoredBytes

    codec_dir = _identity_codec(tiny_lm, tmp_path / "id", n_sink=2, window=4, stride=5)
    base = dict(codec_dir=str(codec_dir), selector=OmniKVPress(keep=0.5), full_layers=(0, 1), full_kv_bits=4)
    _, full = _run(tiny_lm, Press(), IDS_LONG, CUTS_LONG)
    caches = {}
    for form in ("after", "before"):
        press = ResidualKVPress(**base, full_kv_form=form)
        for end, want in ((100, (64, 34)), (129, (64, 63)), (130, (96, 32))):   # quantised, raw after `end` tokens
            _, cache = _run(tiny_lm, press, IDS_LONG[:, :end], [c for c in CUTS_LONG if c < end])
            assert (len(cache.layers[0].kq), cache.layers[0].k_raw.shape[0]) == want
        _, cache = _run(tiny_lm, press, IDS_LONG, CUTS_LONG)
        caches[form] = cache
        for i in (0, 1):
            layer = cache.layers[i]
            # 150 = 2 sinks + 96 quantised (3 blocks of 32) + 52 raw, K and V alike
            assert (layer.n_sinks, len(layer.kq), layer.k_raw.shape[0], len(layer.vq), layer.v_raw.shape[0]) == \
                (2, 96, 52, 96, 52)
            stored, exact = layer.history(), full.layers[i]._stored
            if i == 0:   # layer 0's K/V do not depend on how the cache stores them: sinks and raw tail exact
                torch.testing.assert_close(stored.keys[:, :, :2], exact.keys[:, :, :2], rtol=0, atol=0)
                torch.testing.assert_close(stored.values[:, :, 98:], exact.values[:, :, 98:], rtol=0, atol=0)
                assert not torch.equal(stored.keys[:, :, 2:98], exact.keys[:, :, 2:98])
            # hand count (C = 2 KV heads x 16 = 32 channels each for K and V, 4 bits): codes 96 x 32 x 0.5 B each;
            # key scales one fp16 (min, scale) pair per channel and 32-token block; value scales per token and
            # 16-channel group; sinks and raw tail at FP16
            codes, k_scales, v_scales = 2 * 96 * 32 // 2, 3 * 32 * 4, 96 * 2 * 4
            raw = (2 + 52) * 32 * 2 * 2
            assert layer.packed_bytes() == StoredBytes(layer=i, full_layer=codes + k_scales + v_scales + raw)
    # the two forms store layer 0 alike; they differ in when: the engine's prefill attends exact K/V (its
    # first chunk's logits equal the full cache's), the HF reference's prefill reads its own rows quantised
    for a, b in zip(caches["after"].layers[0].kq.codes, caches["before"].layers[0].kq.codes):
        assert torch.equal(a.q, b.q)
    first = {form: _run(tiny_lm, ResidualKVPress(**base, full_kv_form=form), IDS_LONG[:, :100], [])[0]
             for form in ("after", "before")}
    want = _run(tiny_lm, Press(), IDS_LONG[:, :100], [])[0]
    torch.testing.assert_close(first["after"], want, atol=2e-5, rtol=1e-4)
    assert (first["before"] - want).abs().max() > 1e-3


def test_kivi_raw_sinks(tiny_lm):
    """KIVIPress(sinks=s): the first s tokens stay exact, the key groups start at token s."""
    from kvbench.compress.presses.kivi import KIVIPress

    _, full = _run(tiny_lm, Press(), IDS_LONG, [100])
    _, plain = _run(tiny_lm, KIVIPress(bits=2), IDS_LONG, [100])
    _, sunk = _run(tiny_lm, KIVIPress(bits=2, sinks=4), IDS_LONG, [100])
    layer, exact = sunk.layers[0], full.layers[0]._stored
    assert (layer.n_sinks, len(layer.kq), layer.k_raw.shape[0]) == (4, 128, 18)   # 150 - 4 = 4 blocks of 32 + 18
    torch.testing.assert_close(layer.history().keys[:, :, :4], exact.keys[:, :, :4], rtol=0, atol=0)
    assert not torch.equal(plain.layers[0].history().keys[:, :, :4], exact.keys[:, :, :4])
    assert layer.packed_bytes().sinks == 2 * 4 * 32 * 2
    with pytest.raises(ValueError, match="sinks .* got -1"):
        KIVIPress(sinks=-1)


def test_mean_only_stores_a_zero_code_and_restores_the_reference_mean(tiny_lm, tmp_path):
    """Table VIII "without f_c, f_d" as the authors ran it (REMOVE_COMP): the bytes of ResidualKV's codes are
    held (KR unchanged), and a coded token is read back as the mean of its references."""
    from kvbench.compress.cache import KVView

    codec_dir = _identity_codec(tiny_lm, tmp_path / "id", n_sink=2, window=4, stride=5)
    _, coded = _run(tiny_lm, ResidualKVPress(codec_dir=str(codec_dir), bits=4), IDS, [50])
    _, ablated = _run(tiny_lm, ResidualKVPress(codec_dir=str(codec_dir), bits=4, mean_only=True), IDS, [50])
    assert [x.stored_bytes() for x in ablated.layers] == [x.stored_bytes() for x in coded.layers]
    layer = ablated.layers[-1]
    z, nbr, valid, pos = layer.codes.dequantized()
    assert len(pos) > 0 and torch.count_nonzero(z) == 0
    view = layer.history()
    m = torch.isin(view.positions[0, 0], pos)
    got = layer._kv_pre(KVView(view.keys[..., m, :], view.values[..., m, :], view.positions[..., m]))
    want = mean_reference(layer.refs(), nbr, valid)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # and ResidualKV itself restores something else (the identity codec gives the exact K/V back)
    cview = coded.layers[-1].history()
    assert not torch.allclose(cview.keys[..., m, :], view.keys[..., m, :])


def test_no_sinks_still_reads_the_history(tiny_lm, tmp_path):
    """n_sink = 0 (a valid codec setting): history() returned None while no sink was held, so attention
    never read a past token (the identity codec then differed from the vanilla cache)."""
    codec_dir = _identity_codec(tiny_lm, tmp_path / "id", n_sink=0, window=4, stride=5)
    got, _ = _run(tiny_lm, ResidualKVPress(codec_dir=str(codec_dir), bits=32, ref_fp8=False), IDS, CUTS)
    want, _ = _run(tiny_lm, Press(), IDS, CUTS)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
