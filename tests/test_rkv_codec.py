"""ResidualKV codec (paper §IV-A/B): shapes, the residual identities, config checks, files, sizing."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from kvbench.compress.residualkv.codec import (
    CodecConfig,
    LayerCodec,
    ResidualCodec,
    model_kv_shape,
    separate_d_ff,
)


def _cfg(**kw) -> CodecConfig:
    base = {"n_layers": 2, "d_kv": 64, "d_c": 32, "d_ff": 96}
    return CodecConfig(**{**base, **kw})


def _qwen2_config(layers: int = 2, kv_heads: int = 2) -> transformers.Qwen2Config:
    return transformers.Qwen2Config(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                    num_key_value_heads=kv_heads, intermediate_size=128, vocab_size=100)


def test_shapes_and_swiglu_formula():
    torch.manual_seed(0)
    layer = LayerCodec(_cfg())
    kv = torch.randn(2, 5, 64)
    z = layer.encode(kv)
    assert z.shape == (2, 5, 32)
    assert layer.decode(z).shape == (2, 5, 64)
    enc = layer.branches[0].encoder
    manual = (F.silu(kv @ enc.w1.weight.T) * (kv @ enc.w2.weight.T)) @ enc.w3.weight.T
    torch.testing.assert_close(z, manual)
    # Paper default: no bias anywhere, so the linear decoder maps 0 to exactly 0.
    assert all(m.bias is None for m in layer.modules() if isinstance(m, torch.nn.Linear))
    assert torch.equal(layer.decode(torch.zeros(3, 32)), torch.zeros(3, 64))
    with pytest.raises(ValueError, match="last dim must be 64"):
        layer.encode(torch.randn(3, 65))


def test_residual_of_the_mean_itself_is_zero():
    torch.manual_seed(1)
    layer = LayerCodec(_cfg())
    x = torch.randn(7, 64)
    assert torch.equal(layer.residual_code(x, x), torch.zeros(7, 32))
    # restore(0, m) = m exactly: the decoder has no bias.
    assert torch.equal(layer.restore(torch.zeros(7, 32), x), x)


def test_residual_is_encode_of_mean_then_subtract():
    torch.manual_seed(2)
    layer = LayerCodec(_cfg())
    kv, refs = torch.randn(4, 64), torch.randn(4, 3, 64)
    mean = refs.mean(1)
    torch.testing.assert_close(layer.residual_code(kv, mean), layer.encode(kv) - layer.encode(mean))
    # Not the mean of encoded references (f_c is non-linear): the order matters.
    assert not torch.allclose(layer.residual_code(kv, mean), layer.encode(kv) - layer.encode(refs).mean(1), atol=1e-4)


def test_restore_inverts_residual_code_with_identity_maps():
    layer = LayerCodec(_cfg(d_c=64, encoder="linear", decoder="linear", bits=16))
    with torch.no_grad():
        layer.branches[0].encoder.weight.copy_(torch.eye(64))
        layer.branches[0].decoder.weight.copy_(torch.eye(64))
    torch.manual_seed(3)
    kv, m = torch.randn(6, 64), torch.randn(6, 64)
    torch.testing.assert_close(layer.residual_code(kv, m), kv - m)
    torch.testing.assert_close(layer.restore(layer.residual_code(kv, m), m), kv)


@pytest.mark.parametrize("kw, match", [
    ({"d_c": 48}, r"d_c=48.*group=32"),
    ({"bits": 3}, r"bits must be one of \(2, 4, 8, 16\), got 3"),
    ({"k": 0}, "k .* >= 1"),
    ({"d_ff": 0}, "d_ff must be a positive int"),
    ({"encoder": "gelu"}, "encoder must be one of"),
    ({"grid": "block"}, "grid must be one of"),
    ({"joint": False, "d_c": 33, "bits": 16}, "d_c=33 must be even"),
    ({"n_sink": -1}, "n_sink must be an int >= 0"),
])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_config_json_round_trip_and_unknown_key():
    cfg = _cfg(d_c=48, bits=16, alpha=0.001, joint=False, bias=True)
    assert CodecConfig.from_json(cfg.to_json()) == cfg
    assert CodecConfig.from_json(json.loads(cfg.to_json())) == cfg
    with pytest.raises(ValueError, match=r"unknown keys \['colour'\]"):
        CodecConfig.from_json({**json.loads(cfg.to_json()), "colour": 1})


def test_for_model_defaults_and_seed():
    cfg = _qwen2_config(layers=3)  # head_dim 16, 2 KV heads -> d_kv 64
    assert model_kv_shape(cfg) == (3, 64)
    state = torch.random.get_rng_state()
    a = ResidualCodec.for_model(cfg, seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is left alone
    b = ResidualCodec.for_model(cfg, seed=5)
    c = ResidualCodec.for_model(cfg, seed=6, k=2)
    assert (a.config.n_layers, a.config.d_kv, a.config.d_c, a.config.d_ff, a.config.group) == (3, 64, 16, 96, 16)
    assert len(a.layers) == 3 and c.config.k == 2
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.layers[0].branches[0].encoder.w1.weight, c.layers[0].branches[0].encoder.w1.weight)
    with pytest.raises(ValueError, match=r"unknown CodecConfig overrides \['dc'\]"):
        ResidualCodec.for_model(cfg, dc=8)
    # d_c >= 32 keeps the paper's group of 32: 48 is refused, not silently grouped by 16 (review finding)
    assert ResidualCodec.for_model(cfg, d_c=8).config.group == 8 and ResidualCodec.for_model(cfg, d_c=64).config.group == 32
    with pytest.raises(ValueError, match=r"d_c=48 must be a multiple of group=32"):
        ResidualCodec.for_model(cfg, d_c=48)


def test_save_load_round_trip_and_shape_check(tmp_path):
    codec = ResidualCodec.for_model(_qwen2_config(), seed=1)
    codec.save(tmp_path / "c")
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["codec.json", "codec.safetensors"]
    back = ResidualCodec.load(tmp_path / "c", model=_qwen2_config())
    assert back.config == codec.config
    x, m = torch.randn(5, 64), torch.randn(5, 64)
    for la, lb in zip(codec.layers, back.layers):
        assert torch.equal(la.restore(la.residual_code(x, m), m), lb.restore(lb.residual_code(x, m), m))
    with pytest.raises(ValueError, match=r"model has n_layers=2, d_kv=32; codec has n_layers=2, d_kv=64"):
        ResidualCodec.load(tmp_path / "c", model=_qwen2_config(kv_heads=1))
    with pytest.raises(ValueError, match=r"model has n_layers=4, d_kv=64"):
        ResidualCodec.load(tmp_path / "c", model=_qwen2_config(layers=4))
    with pytest.raises(FileNotFoundError, match="codec.safetensors"):
        ResidualCodec.load(tmp_path / "missing")


@pytest.mark.parametrize("d_kv, d_c, d_ff", [(64, 16, 96), (128, 32, 192), (1024, 384, 3072), (2048, 512, 3072)])
@pytest.mark.parametrize("bias", [False, True])
def test_separate_codec_matches_joint_params(d_kv, d_c, d_ff, bias):
    joint = CodecConfig(n_layers=1, d_kv=d_kv, d_c=d_c, d_ff=d_ff, bias=bias, bits=16)
    sep = CodecConfig(n_layers=1, d_kv=d_kv, d_c=d_c, d_ff=d_ff, bias=bias, joint=False, bits=16)
    with torch.device("meta"):  # counts only; no memory for the 8B-sized codecs
        n_joint, n_sep = ResidualCodec(joint).n_params(), ResidualCodec(sep).n_params()
    assert abs(n_sep - n_joint) / n_joint < 0.02
    assert separate_d_ff(sep) > d_ff  # the decoder halves, so the encoders widen


def test_separate_codec_codes_k_and_v_apart():
    torch.manual_seed(4)
    layer = LayerCodec(_cfg(joint=False))
    kv = torch.randn(3, 64)
    kv2 = kv.clone()
    kv2[:, 32:] += 1.0  # change V only
    z, z2 = layer.encode(kv), layer.encode(kv2)
    assert torch.equal(z[:, :16], z2[:, :16]) and not torch.allclose(z[:, 16:], z2[:, 16:])
    out, out2 = layer.decode(z), layer.decode(z2)
    assert torch.equal(out[:, :32], out2[:, :32])


def test_corrupt_codec_files_are_named(tmp_path):
    from kvbench.compress.residualkv.codec import CodecConfig, ResidualCodec

    codec = ResidualCodec(CodecConfig(n_layers=1, d_kv=64, d_c=32, d_ff=48))
    codec.save(tmp_path / "c")
    blob = (tmp_path / "c" / "codec.safetensors").read_bytes()
    (tmp_path / "c" / "codec.safetensors").write_bytes(blob[:100])
    with pytest.raises(ValueError, match="codec.safetensors is corrupt or truncated"):
        ResidualCodec.load(tmp_path / "c")
    codec.save(tmp_path / "c")
    (tmp_path / "c" / "codec.json").write_text('{"d_c": 32,')
    with pytest.raises(ValueError, match="codec.json is not valid JSON"):
        ResidualCodec.load(tmp_path / "c")
    codec.save(tmp_path / "c")
    cfg = (tmp_path / "c" / "codec.json").read_text().replace('"d_ff": 48', '"d_ff": 40')
    (tmp_path / "c" / "codec.json").write_text(cfg)
    with pytest.raises(ValueError, match="does not match"):
        ResidualCodec.load(tmp_path / "c")


def test_non_integer_d_c_is_a_clear_error():
    from kvbench.compress.residualkv.codec import ResidualCodec

    cfg = transformers.Qwen2Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, vocab_size=32)
    with pytest.raises(ValueError, match="d_c must be a positive int"):
        ResidualCodec.for_model(cfg, d_c=32.5)
