"""Rotation invariants: a cached pre-RoPE key rotated to a new position equals the key computed there."""
from __future__ import annotations

import pytest
import torch
import transformers
from _reuse_fixtures import record, tiny_vlm
from _tolerance import arith_atol

from kvbench.models import rope
from kvbench.reuse import ImageKVStore, adapter_for, prepare


@pytest.fixture(scope="module")
def vlm(tokenizer):
    model, proc = tiny_vlm(tokenizer)
    return adapter_for(model, proc)


@pytest.mark.parametrize("system", ["S.", "A longer serving prefix shifts every image by more tokens.",
                                    "Mid length prefix here."])
def test_mrope_rotated_cached_key_equals_key_at_new_position(vlm, tmp_path, system):
    """Layer-0 inputs of visual tokens are the vision features (prefix-independent), so the layer-0 key of a
    visual token in a full prefill of the serving request is exactly RoPE(cached pre-RoPE key, new 3-D
    position). Several prefixes = several shifts; the images' cache-time positions differ from all of them."""
    rec = record([1, 2], system=system)
    req = prepare(vlm, ImageKVStore(tmp_path, vlm, rec["generic_system"]), rec)
    out = vlm.full_forward(req.enc)
    k_full = out.cache.layers[0].keys
    vi = req.visual_index
    # the M-RoPE axes really differ over image tokens (otherwise this would only test 1-D RoPE)
    assert not torch.equal(req.position_ids[1, 0, vi], req.position_ids[2, 0, vi])
    # two paths to one key: the cache-time prefill and the serving prefill reduce k_proj's hidden dimension in
    # batches of different shapes (BLAS picks the order), then rotate (a multiply-add)
    depth = vlm.model.config.get_text_config().hidden_size + 2
    torch.testing.assert_close(req.stale_k[0][:, :, vi], k_full[:, :, vi], rtol=0, atol=arith_atol(k_full, depth))
    # and the comparison can fail: the un-rotated key, or a key rotated one position off, does not match
    pre = torch.cat([im.keys[0] for im in req.images], dim=1)[None]
    assert (pre - k_full[:, :, vi]).abs().max() > 1e-2
    shifted = req.position_ids.clone()
    shifted[:, :, vi] += 1
    cos, sin = vlm.cos_sin(shifted)
    off = rope.rotate(vlm.apply_rope, pre, cos[:, vi], sin[:, vi])
    assert (off - k_full[:, :, vi]).abs().max() > 1e-3


def test_hooked_pre_rope_keys_equal_inverted_post_rope_keys(vlm, tmp_path):
    """Cross-check of the capture: un-rotating the HF cache's post-RoPE keys of the cache-time prompt
    gives the k_proj-hooked keys stored on disk, at every layer."""
    rec = record([3])
    store = ImageKVStore(tmp_path, vlm, rec["generic_system"])
    entry = store.get(rec["content"][1]["image"])
    enc = store.encode_image(rec["content"][1]["image"])
    out = vlm.full_forward(enc)
    mask = vlm.image_token_mask(enc)
    cos, sin = vlm.cos_sin(vlm.position_ids(enc))
    for layer in range(vlm.n_layers):
        post = out.cache.layers[layer].keys
        pre = rope.unrotate(vlm.apply_rope, post, cos, sin)[:, :, mask]
        torch.testing.assert_close(pre[0], entry.keys[layer], rtol=0, atol=2e-5)
        torch.testing.assert_close(out.cache.layers[layer].values[0][:, mask], entry.values[layer], rtol=0, atol=0)


@pytest.mark.parametrize("shift", [1, 7, 300])
def test_1d_rope_rotation_matches_key_computed_at_shifted_position(tokenizer, shift):
    """1-D RoPE (Qwen2 LM): keys of a token span computed at offset 0, stored pre-RoPE and rotated to
    offset ``shift`` equal the layer-0 keys of the same span placed at that offset."""
    from kvbench.models.tiny import build_config

    cfg = build_config("tiny-qwen2-lm", tokenizer)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    attn = model.model.layers[0].self_attn
    apply = rope.rotation_fn(attn)
    ids = torch.tensor([tokenizer("def f(x): return x + 1", add_special_tokens=False)["input_ids"]])
    n = ids.shape[1]
    grab = {}
    h = attn.k_proj.register_forward_hook(lambda m, a, o: grab.__setitem__("k", o))
    with torch.no_grad():
        model(input_ids=ids)
    h.remove()
    pre = grab["k"].view(1, n, cfg.num_key_value_heads, -1).transpose(1, 2)
    # same tokens placed at positions shift..shift+n-1 (layer-0 keys depend only on token and position)
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=torch.arange(shift, shift + n)[None], use_cache=True)
    cos, sin = rope.cos_sin(model.model.rotary_emb, torch.arange(shift, shift + n)[None], torch.float32)
    want = out.cache.layers[0].keys  # k_proj of the same tokens in another call, then a multiply-add rotation
    torch.testing.assert_close(rope.rotate(apply, pre, cos, sin), want, rtol=0, atol=arith_atol(want, cfg.hidden_size + 2))
    cos0, sin0 = rope.cos_sin(model.model.rotary_emb, torch.arange(n)[None], torch.float32)
    assert (rope.rotate(apply, pre, cos0, sin0) - out.cache.layers[0].keys).abs().max() > 1e-3


def test_unrotate_inverts_rotate():
    torch.manual_seed(0)
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    k = torch.randn(1, 2, 5, 8)
    theta = torch.randn(1, 5, 4)
    cos, sin = torch.cat([theta.cos()] * 2, -1), torch.cat([theta.sin()] * 2, -1)
    back = rope.unrotate(apply_rotary_pos_emb, rope.rotate(apply_rotary_pos_emb, k, cos, sin), cos, sin)
    # rotate then unrotate: two rotations of three roundings each
    torch.testing.assert_close(back, k, rtol=0, atol=arith_atol(k, 6))
