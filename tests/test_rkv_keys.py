"""The codec's key quantity (compress/residualkv/keys.py): training and inference code the same tensor on
every model class; on Qwen3 that is the k_proj output before k_norm, and k_norm acts after restore."""
from __future__ import annotations

import pytest
import torch
import transformers
from test_rkv_cache import CUTS, IDS, _identity_codec, _run

from kvbench.compress.cache import Press, decoder_layers
from kvbench.compress.residualkv import cache as rkv_cache
from kvbench.compress.residualkv.cache import ResidualKVPress
from kvbench.compress.residualkv.codec import ResidualCodec
from kvbench.compress.residualkv.keys import codec_keys
from kvbench.compress.residualkv.train import compressed_forward


@pytest.fixture(scope="module")
def tiny_qwen3():
    """A tiny random ``Qwen3ForCausalLM`` (3 layers, 4 query / 2 KV heads of 16), float32, with k_norm /
    q_norm weights away from 1 so that the norm changes the keys' directions, not only their scale."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, intermediate_size=128, vocab_size=256, attn_implementation="sdpa")
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in decoder_layers(model):
            for norm in (layer.self_attn.k_norm, layer.self_attn.q_norm):
                norm.weight.uniform_(0.5, 2.0)
    return model


@pytest.fixture(params=["qwen2", "qwen3"])
def model(request, tiny_lm, tiny_qwen3):
    return {"qwen2": tiny_lm, "qwen3": tiny_qwen3}[request.param]


def test_codec_keys_source_and_norm(tiny_lm, tiny_qwen3):
    a2, a3 = decoder_layers(tiny_lm)[0].self_attn, decoder_layers(tiny_qwen3)[0].self_attn
    assert codec_keys(a2).source is a2.k_proj and codec_keys(a2).norm is None
    assert codec_keys(a3).source is a3.k_proj and codec_keys(a3).norm is a3.k_norm
    with pytest.raises(TypeError, match="no k_proj"):
        codec_keys(torch.nn.Linear(2, 2))


def test_identity_codec_equals_vanilla_logits(model, tmp_path):
    """Multi-chunk prefill (30 + 15 tokens) then 14 decode steps: restored K gets k_norm then RoPE."""
    codec_dir = _identity_codec(model, tmp_path / "id", n_sink=2, window=4, stride=5)
    got, cache = _run(model, ResidualKVPress(codec_dir=str(codec_dir), bits=32, ref_fp8=False), IDS, CUTS)
    want, _ = _run(model, Press(), IDS, CUTS)
    with torch.no_grad():
        plain = model(input_ids=IDS).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got, plain, atol=2e-5, rtol=1e-4)
    assert len(cache.layers[1].codes.positions()) > 0      # tokens were coded and restored
    # press_attention removed the k_proj hooks on exit
    assert all(not layer.self_attn.k_proj._forward_hooks for layer in decoder_layers(model))


def test_training_compressed_pass_with_identity_codec_is_vanilla(model, tmp_path):
    """Training's compressed pass replaces k_proj outputs; the model's own k_norm and RoPE follow."""
    codec = ResidualCodec.load(_identity_codec(model, tmp_path / "id", n_sink=2, window=4, stride=5))
    with torch.no_grad():
        logits, hat, teacher = compressed_forward(model, codec, IDS)
        plain = model(input_ids=IDS).logits
    torch.testing.assert_close(logits, plain, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(hat[0], teacher[0], atol=1e-5, rtol=1e-5)


def test_training_and_inference_code_the_same_tensors(model, tmp_path, monkeypatch):
    """The K‖V the cache codes at inference (every token leaving the raw window, every layer) equals the
    teacher K‖V that training codes and regresses to, row for row at the same positions."""
    codec_dir = _identity_codec(model, tmp_path / "id", n_sink=2, window=4, stride=5)
    seen: dict[int, list] = {}
    kv_pre = rkv_cache.ResidualKVLayer._kv_pre

    def spy(self, view, k_in=None):
        kv = kv_pre(self, view, k_in)
        seen.setdefault(self.ctx.layer_idx, []).append((view.positions[0, 0].clone(), kv.clone()))
        return kv

    monkeypatch.setattr(rkv_cache.ResidualKVLayer, "_kv_pre", spy)
    _run(model, ResidualKVPress(codec_dir=str(codec_dir), bits=32, ref_fp8=False, block=1), IDS, CUTS)
    with torch.no_grad():
        _, _, teacher = compressed_forward(model, ResidualCodec.load(codec_dir), IDS)
    n_layers = len(decoder_layers(model))
    assert sorted(seen) == list(range(n_layers))
    for i in range(n_layers):
        pos = torch.cat([p for p, _ in seen[i]])
        kv = torch.cat([k for _, k in seen[i]])
        assert pos.tolist() == list(range(2, IDS.shape[1] - 4))   # all but 2 sinks and the 4-token window
        torch.testing.assert_close(kv, teacher[i][0, pos].float(), atol=1e-5, rtol=1e-5)
    attn = decoder_layers(model)[0].self_attn
    if codec_keys(attn).norm is not None:
        # the test tells the quantities apart: post-k_norm keys are far from the k_proj outputs
        d_k = teacher[0].shape[-1] // 2
        k = teacher[0][0, :, :d_k].view(IDS.shape[1], -1, attn.head_dim)
        with torch.no_grad():
            assert (attn.k_norm(k).flatten(1) - k.flatten(1)).abs().max() > 0.1
