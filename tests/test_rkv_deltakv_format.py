"""The authors' compressor layout (DeltaKV) in and out: key/field maps, round trips, refusals, and the same
logits from an imported codec as from the codec it came from."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kvbench import cli
from kvbench.compress.cache import press_attention
from kvbench.compress.residualkv.cache import ResidualKVPress
from kvbench.compress.residualkv.codec import ResidualCodec
from kvbench.compress.residualkv.deltakv_format import (
    EXPORTED_FIELDS, PROVENANCE_FILE, export_deltakv, import_deltakv, plan_import, write_import,
)
from kvbench.utils.io import sha256_file

D_C, D_FF = 16, 32


def backbone(model) -> dict:
    return json.loads(model.config.to_json_string())


def write_theirs(path: Path, model, *, bias: bool, dtype=torch.bfloat16, seed: int = 0, fields=None,
                 drop=(), extra=None, rename=None, d_c: int = D_C, d_ff: int = D_FF) -> Path:
    """A compressor directory in the authors' layout, written independently of export_deltakv: random weights
    under their key names and a config.json = the backbone's fields (``model``: a model or a config dict) + theirs
    (the set export writes)."""
    cfg = dict(model) if isinstance(model, dict) else backbone(model)
    D_C, D_FF = d_c, d_ff  # noqa: N806 (the module's sizes, replaced for this checkpoint)
    n_layers = cfg["num_hidden_layers"]
    d_kv = 2 * cfg["num_key_value_heads"] * cfg["head_dim"]
    g = torch.Generator().manual_seed(seed)
    t = {}
    for i in range(n_layers):
        p = f"model.layers.{i}.self_attn."
        t[p + "compress_down.w12.weight"] = torch.randn(2 * D_FF, d_kv, generator=g)
        t[p + "compress_down.w3.weight"] = torch.randn(D_C, D_FF, generator=g)
        t[p + "compress_up.weight"] = torch.randn(d_kv, D_C, generator=g)
        if bias:
            t[p + "compress_down.w12.bias"] = torch.randn(2 * D_FF, generator=g)
            t[p + "compress_down.w3.bias"] = torch.randn(D_C, generator=g)
            t[p + "compress_up.bias"] = torch.randn(d_kv, generator=g)
    t = {k: v.to(dtype) for k, v in t.items() if k not in drop}
    t.update(extra or {})
    for old, new in (rename or {}).items():
        t[new] = t.pop(old)
    cfg.update({
        "kv_compressed_size": D_C, "compressor_down_type": "mlp_swiglu", "compressor_up_type": "linear",
        "use_nonlinear_compressor": True, "compressor_intermediate_size": D_FF,
        "compressor_down_intermediate_size": D_FF, "compressor_up_intermediate_size": -1,
        "compressor_linear_bias": bias, "split_kv": False, "collect_kv_before_rope": True, "use_compression": True,
        "use_cluster": True, "cluster_metric": "l2", "cluster_on_kv": True, "deltakv_neighbor_count": 4,
        "cluster_ratio": 0.1, "stride_alpha": 0.001, "num_sink_tokens": 8, "num_recent_tokens": 128,
        "tail_token_size": 128, "kv_quant_bits": 4, **(fields or {}),
    })
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("bias", [False, True])
def test_their_layout_round_trips_bit_exact(tiny_lm, tmp_path, bias):
    src = write_theirs(tmp_path / "src", tiny_lm, bias=bias)
    codec = import_deltakv(src, tiny_lm)
    c = codec.config
    assert (c.d_c, c.d_ff, c.bias, c.k, c.stride, c.alpha, c.n_sink, c.window, c.bits) == (
        D_C, D_FF, bias, 4, 10, 0.001, 8, 128, 4)
    assert codec.layers[0].dtype == torch.bfloat16
    export_deltakv(codec, tmp_path / "out", src)
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    want, got = json.loads((src / "config.json").read_text()), json.loads((tmp_path / "out" / "config.json").read_text())
    assert got == want and set(EXPORTED_FIELDS) <= set(got)


def test_gate_is_the_first_half_of_w12(tiny_lm, tmp_path):
    """Their SwiGLU: x1, x2 = w12(x).chunk(2); w3(silu(x1) * x2), computed here from the file alone."""
    src = write_theirs(tmp_path / "src", tiny_lm, bias=True, dtype=torch.float32)
    codec = import_deltakv(src)
    t = load_file(str(src / "model.safetensors"))
    p = "model.layers.1.self_attn."
    x = torch.randn(5, 64)
    h = F.linear(x, t[p + "compress_down.w12.weight"], t[p + "compress_down.w12.bias"])
    want = F.linear(F.silu(h[:, :D_FF]) * h[:, D_FF:], t[p + "compress_down.w3.weight"], t[p + "compress_down.w3.bias"])
    torch.testing.assert_close(codec.layers[1].encode(x), want, rtol=1e-6, atol=1e-6)
    z = torch.randn(5, D_C)
    torch.testing.assert_close(codec.layers[1].decode(z), F.linear(z, t[p + "compress_up.weight"], t[p + "compress_up.bias"]))


@pytest.mark.parametrize("bias", [False, True])
def test_our_codec_exports_and_imports_bit_exact(tiny_lm, tmp_path, bias):
    codec = ResidualCodec.for_model(tiny_lm, d_c=D_C, d_ff=D_FF, bias=bias, k=3, stride=7, alpha=0.02, n_sink=2,
                                    window=6, seed=3)
    export_deltakv(codec, tmp_path / "x", tiny_lm)
    back = import_deltakv(tmp_path / "x", tiny_lm)
    assert back.config == codec.config
    a, b = codec.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_linear_encoder_round_trips(tiny_lm, tmp_path):
    codec = ResidualCodec.for_model(tiny_lm, d_c=D_C, d_ff=D_FF, encoder="linear", seed=1)
    export_deltakv(codec, tmp_path / "x", tiny_lm)
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    assert cfg["compressor_down_type"] == "linear" and "model.layers.0.self_attn.compress_down.weight" in load_file(
        str(tmp_path / "x" / "model.safetensors"))
    back = import_deltakv(tmp_path / "x")
    assert back.config == codec.config and all(torch.equal(x, y) for x, y in zip(codec.parameters(), back.parameters()))


def _run(model, press, ids):
    cache = press.new_cache(model)
    outs, start = [], 0
    with torch.inference_mode(), press_attention(model, cache):
        for end in [30, *range(31, ids.shape[1] + 1)]:  # a context chunk, then one token at a time
            pos = torch.arange(start, end).view(1, -1)
            outs.append(model(input_ids=ids[:, start:end], position_ids=pos, cache=cache, use_cache=True).logits)
            start = end
    return torch.cat(outs, 1)


def test_imported_codec_gives_the_same_logits_as_the_codec_it_came_from(tiny_lm, tmp_path):
    """Acceptance (issue #16 item 2): a codec initialised here, exported to their layout and imported back runs
    ResidualKV to the same logits, bit for bit."""
    codec = ResidualCodec.for_model(tiny_lm, d_c=D_C, d_ff=D_FF, n_sink=2, window=4, stride=5, k=2, seed=7)
    codec.save(tmp_path / "here")
    export_deltakv(codec, tmp_path / "theirs", tiny_lm)
    write_import(tmp_path / "theirs", tmp_path / "imported", tiny_lm)
    ids = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(0))
    here = _run(tiny_lm, ResidualKVPress(codec_dir=str(tmp_path / "here"), bits=4), ids)
    imported = _run(tiny_lm, ResidualKVPress(codec_dir=str(tmp_path / "imported"), bits=4), ids)
    assert torch.equal(here, imported)
    # the codec is used: an imported checkpoint with other weights gives other logits
    other = ResidualCodec.for_model(tiny_lm, d_c=D_C, d_ff=D_FF, n_sink=2, window=4, stride=5, k=2, seed=8)
    export_deltakv(other, tmp_path / "other", tiny_lm)
    write_import(tmp_path / "other", tmp_path / "other_imported", tiny_lm)
    assert not torch.equal(here, _run(tiny_lm, ResidualKVPress(codec_dir=str(tmp_path / "other_imported"), bits=4), ids))


def test_sources_say_where_each_field_came_from(tiny_lm, tmp_path):
    src = write_theirs(tmp_path / "src", tiny_lm, bias=False, fields={"kv_quant_bits": 0})
    cfg = json.loads((src / "config.json").read_text())
    del cfg["num_recent_tokens"]
    (src / "config.json").write_text(json.dumps(cfg))
    plan = plan_import(src, tiny_lm, k=2, grid="code")
    s = plan.sources
    assert s["k"] == "override" and s["grid"] == "override" and plan.config.k == 2
    assert s["d_c"] == "checkpoint config.json: kv_compressed_size=16"
    assert s["stride"] == "checkpoint config.json: cluster_ratio=0.1"
    assert s["window"] == "their default: num_recent_tokens=128"
    assert s["bits"] == "kvbench default" and plan.config.bits == 4  # kv_quant_bits 0: not fixed by the checkpoint
    assert s["group"] == "kvbench default"


def test_legacy_k_neighbors_is_read(tiny_lm, tmp_path):
    src = write_theirs(tmp_path / "src", tiny_lm, bias=False)
    cfg = json.loads((src / "config.json").read_text())
    cfg["k_neighbors"] = cfg.pop("deltakv_neighbor_count") - 1
    (src / "config.json").write_text(json.dumps(cfg))
    assert import_deltakv(src).config.k == 3


def test_cli_import_writes_provenance_and_export_gives_the_source_back(tiny_lm, tmp_path, capsys):
    src = write_theirs(tmp_path / "src", tiny_lm, bias=True)
    model = tmp_path / "model"
    tiny_lm.config.save_pretrained(model)
    assert cli.main(["codec-import", "--from-deltakv", str(src), "--out", str(tmp_path / "codec"),
                     "--model", str(model), "--overrides", '{"window": 64}']) == 0
    rec = json.loads((tmp_path / "codec" / PROVENANCE_FILE).read_text())
    assert rec["weights_sha256"] == sha256_file(src / "model.safetensors") and rec["source_dir"] == str(src.resolve())
    assert rec["sources"]["window"] == "override" and rec["dtype"] == "torch.bfloat16"
    loaded = ResidualCodec.load(tmp_path / "codec", model=tiny_lm)
    assert loaded.config.window == 64 and loaded.config.d_c == D_C
    assert cli.main(["codec-export", "--codec", str(tmp_path / "codec"), "--model", str(src),
                     "--out", str(tmp_path / "back")]) == 0
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert all(a[k].dtype == b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_recent_tokens"] == 64
    capsys.readouterr()
    # a bad input ends with one line naming it, exit 2
    assert cli.main(["codec-import", "--from-deltakv", str(tmp_path / "nowhere"), "--out", str(tmp_path / "c2")]) == 2
    assert "does not exist" in capsys.readouterr().err


def _bad_config(tmp_path, tiny_lm, **fields):
    return write_theirs(tmp_path / "src", tiny_lm, bias=False, fields=fields)


@pytest.mark.parametrize("fields, match", [
    ({"compressor_down_type": "mlp_gelu"}, r"down-projection is 'mlp_gelu'.*no GELU"),
    ({"compressor_down_type": "auto", "use_nonlinear_compressor": True}, r"down-projection is 'mlp_gelu'"),
    ({"compressor_up_type": "swiglu"}, r"up-projection is 'mlp_swiglu'.*linear"),
    ({"compressor_down_type": "conv"}, r"compressor_down_type='conv' is not a DeltaKV compressor type"),
    ({"split_kv": True}, r"split_kv=True is not supported .*joint=False"),
    ({"cluster_metric": "dot"}, r"cluster_metric='dot' is not supported.*L2"),
    ({"cluster_on_kv": False}, r"cluster_on_kv=False"),
    ({"collect_kv_before_rope": False}, r"collect_kv_before_rope=False"),
    ({"use_compression": False}, r"use_compression=False"),
    ({"cluster_ratio": 0.3}, r"cluster_ratio=0.3: 1/cluster_ratio = 3.33.* not an integer stride .*truncates it to 3"),
    ({"cluster_ratio": 0}, r"cluster_ratio=0: expected a number in \(0, 1\]"),
    ({"kv_quant_bits": 3}, r"kv_quant_bits=3: expected 0"),
    ({"kv_compressed_size": 24}, r"tensor model.layers.0.self_attn.compress_down.w3.weight has shape \[16, 32\], "
                                 r"expected \[24, 32\]"),
    ({"compressor_linear_bias": True}, r"missing \['model.layers.0.self_attn.compress_down.w12.bias'"),
    ({"k_neighbors": 2}, r"k_neighbors=2 and deltakv_neighbor_count=4 differ"),
])
def test_bad_checkpoint_configs_are_refused(tiny_lm, tmp_path, fields, match):
    with pytest.raises(ValueError, match=match):
        import_deltakv(_bad_config(tmp_path, tiny_lm, **fields), tiny_lm)


def test_non_integer_ratio_passes_with_a_stride_override(tiny_lm, tmp_path):
    assert import_deltakv(_bad_config(tmp_path, tiny_lm, cluster_ratio=0.3), stride=3).config.stride == 3


@pytest.mark.parametrize("kw, match", [
    (dict(drop=("model.layers.2.self_attn.compress_up.weight",)), r"missing \['model.layers.2.self_attn.compress_up"),
    (dict(extra={"model.layers.0.self_attn.q_proj.weight": torch.zeros(2)}), r"unexpected \['model.layers.0.self_attn.q_proj"),
    (dict(extra={"model.layers.0.self_attn.compress_down.0.weight": torch.zeros(2)}), r"GELU MLP's"),
    (dict(extra={"model.layers.0.self_attn.k_compress_down.weight": torch.zeros(2)}), r"split_kv checkpoint's"),
    (dict(extra={"model.layers.3.self_attn.compress_up.weight": torch.zeros(2)}), r"unexpected \['model.layers.3"),
])
def test_missing_or_extra_tensors_are_refused(tiny_lm, tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        import_deltakv(write_theirs(tmp_path / "src", tiny_lm, bias=False, **kw))


def test_target_model_of_another_shape_is_refused(tiny_lm, tmp_path):
    src = write_theirs(tmp_path / "src", tiny_lm, bias=False)
    other = {**backbone(tiny_lm), "num_hidden_layers": 4}
    with pytest.raises(ValueError, match=r"\(n_layers, d_kv\) = \(3, 64\) \(its config.json\), the target model has \(4, 64\)"):
        import_deltakv(src, other)
    wide = {**backbone(tiny_lm), "num_key_value_heads": 4}
    with pytest.raises(ValueError, match=r"target model has \(3, 128\)"):
        import_deltakv(src, wide)
    vlm = {"model_type": "qwen2_5_vl", "text_config": backbone(tiny_lm)}  # VLMs: the text_config's shape
    assert import_deltakv(src, vlm).config.d_kv == 64
    codec = ResidualCodec.for_model(tiny_lm, d_c=D_C, d_ff=D_FF)
    with pytest.raises(ValueError, match=r"does not fit model_config \(4, 64\)"):
        export_deltakv(codec, tmp_path / "x", other)


def test_weights_of_the_wrong_shape_for_the_backbone_are_refused(tiny_lm, tmp_path):
    """Their config.json says 2 KV heads of 16 (d_kv 64) but the tensors were made for d_kv 32."""
    bad = {f"model.layers.{i}.self_attn.compress_up.weight": torch.zeros(32, D_C, dtype=torch.bfloat16) for i in range(3)}
    with pytest.raises(ValueError, match=r"compress_up.weight has shape \[32, 16\], expected \[64, 16\]"):
        import_deltakv(write_theirs(tmp_path / "src", tiny_lm, bias=False, extra=bad))


def test_pickle_and_shards_are_refused_unread(tiny_lm, tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not read")
    with pytest.raises(ValueError, match=r"only as pickle file\(s\) \['pytorch_model.bin'\].*never unpickles.*Convert"):
        import_deltakv(d)
    (d / "pytorch_model.bin").unlink()
    (d / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"reads model.safetensors only: merge the shards"):
        import_deltakv(d)
    src = write_theirs(tmp_path / "src", tiny_lm, bias=False)
    (src / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config.json not found"):
        import_deltakv(src)
    src = write_theirs(tmp_path / "src2", tiny_lm, bias=False)
    (src / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match=r"not a readable safetensors file"):
        import_deltakv(src)


@pytest.mark.parametrize("over, match", [
    ({"d_c": 32}, r"override d_c=32 contradicts the checkpoint .* d_c=16"),
    ({"bias": True}, r"override bias=True contradicts"),
    ({"joint": False}, r"override joint=False contradicts"),
    ({"n_layers": 2}, r"unknown CodecConfig override\(s\) \['n_layers'\]"),
    ({"group": 5}, r"not a valid codec: CodecConfig.d_c=16 must be a multiple of group=5"),
])
def test_bad_overrides_are_refused(tiny_lm, tmp_path, over, match):
    with pytest.raises(ValueError, match=match):
        import_deltakv(write_theirs(tmp_path / "src", tiny_lm, bias=False), **over)


def test_export_refuses_what_their_format_cannot_hold(tiny_lm, tmp_path):
    with pytest.raises(ValueError, match=r"joint=False codec has no DeltaKV equivalent"):
        export_deltakv(ResidualCodec.for_model(tiny_lm, d_c=D_C, d_ff=D_FF, joint=False), tmp_path / "x", tiny_lm)
    with pytest.raises(ValueError, match=r"linear f_d here; this codec's decoder is 'swiglu'"):
        export_deltakv(ResidualCodec.for_model(tiny_lm, d_c=D_C, d_ff=D_FF, encoder="linear", decoder="swiglu"),
                       tmp_path / "x", tiny_lm)
    out = export_deltakv(ResidualCodec.for_model(tiny_lm, d_c=D_C, d_ff=D_FF, grid="code"), tmp_path / "x", tiny_lm)
    assert out["not_carried"] == {"grid": "code", "group": 16, "references": True}


# --- the workflow's plan: codec: {import: DIR} in place of training the main codec -----------------------------

ZOO_SHAPE = {"num_hidden_layers": 8, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 32}   # (8, 128): the shape the report tests give the zoo LM's plan


def test_plan_imports_the_main_codec_and_tables_name_each_codec(tmp_path):
    from kvbench.report.residualkv import tables as residualkv
    from kvbench.plan.residualkv import RKVPlan
    from test_rkv_report import CODEC_KW, SECTION

    src = write_theirs(tmp_path / "ckpt", ZOO_SHAPE, bias=False, d_c=32, d_ff=96)
    section = {**SECTION, "codec": {**SECTION["codec"], "import": str(src), "d_ff": 96},
               "tableIII": [*SECTION["tableIII"], {"label": "ResidualKV (norefs)", "method": "residualkv:codec=norefs"}]}
    plan = RKVPlan(section, "smoke", (8, 128), **CODEC_KW)
    assert plan.codecs.names("imported") == {plan.codecs.name("main"): "main"}
    assert re.fullmatch(r"main-import-[0-9a-f]{8}", plan.codecs.name("main"))
    assert set(plan.codecs.names("trained").values()) == {"norefs"}
    # the imported codec's settings: structure from the checkpoint, the section's inference-time keys over it
    cfg = plan.codecs.config("main", (8, 128))
    assert (cfg.d_c, cfg.d_ff, cfg.n_sink, cfg.stride, cfg.window, cfg.k) == (32, 96, 8, 10, 32, 4)
    assert "import" not in plan.codecs.overrides("norefs") and plan.codecs.overrides("norefs")["d_ff"] == 96
    assert plan.codecs.import_files("main") == [f"{src}/config.json", f"{src}/model.safetensors"]
    write_import(src, tmp_path / plan.codecs.dir("main") / "codec", (8, 128))
    head = residualkv.codec_header(plan, "tableIII", tmp_path)
    sha = sha256_file(src / "model.safetensors")[:12]
    assert head[0] == (f"# codec main (ResidualKV): imported from {src} (kvbench codec-import; model.safetensors "
                       f"sha256 {sha}...)")
    assert re.fullmatch(r"# codec norefs \(ResidualKV \(norefs\)\): trained here \(norefs-[0-9a-f]{8}: objective joint, "
                        r"10 steps x 64 tokens, lr 0.001, data tasks, seed 0\)", head[1])


@pytest.mark.parametrize("change, match", [
    (lambda src: None, r"residualkv.codec.import '.*nowhere': DeltaKV compressor directory .* does not exist"),
    (lambda src: (src / "model.safetensors").unlink(), r"has no model.safetensors"),
    (lambda src: (src / "config.json").unlink(), r"config.json not found"),
])
def test_plan_checks_the_import_while_the_dag_is_built(tmp_path, change, match):
    from kvbench.plan.residualkv import RKVPlan
    from test_rkv_report import CODEC_KW, SECTION

    src = write_theirs(tmp_path / "ckpt", ZOO_SHAPE, bias=False, d_c=32, d_ff=96)
    change(src)
    where = tmp_path / "nowhere" if "nowhere" in match else src
    with pytest.raises(ValueError, match=match):
        RKVPlan({**SECTION, "codec": {"import": str(where)}}, "smoke", (8, 128), **CODEC_KW)


def test_plan_refuses_an_import_that_does_not_fit(tmp_path):
    from kvbench.plan.residualkv import RKVPlan
    from test_rkv_report import CODEC_KW, SECTION

    src = write_theirs(tmp_path / "ckpt", ZOO_SHAPE, bias=False, d_c=32, d_ff=96)
    with pytest.raises(ValueError, match=r"override d_ff=192 contradicts the checkpoint .* d_ff=96"):
        RKVPlan({**SECTION, "codec": {**SECTION["codec"], "import": str(src)}}, "smoke", (8, 128), **CODEC_KW)
    with pytest.raises(ValueError, match=r"target model has \(8, 256\)"):
        RKVPlan({**SECTION, "codec": {"import": str(src)}}, "smoke", (8, 256), **CODEC_KW)


def write_sparse_checkpoint(path: Path, backbone_cfg: dict, d_c: int, d_ff: int) -> Path:
    """A full-size checkpoint in their layout whose tensor data is a hole in a sparse file (zeros, no disk): the
    header is what the DAG-time check reads."""
    import struct

    n_layers, d_kv = backbone_cfg["num_hidden_layers"], 2 * backbone_cfg["num_key_value_heads"] * (
        backbone_cfg["hidden_size"] // backbone_cfg["num_attention_heads"])
    header, offset = {}, 0
    for i in range(n_layers):
        p = f"model.layers.{i}.self_attn."
        for k, shape in ((p + "compress_down.w12.weight", [2 * d_ff, d_kv]), (p + "compress_down.w3.weight", [d_c, d_ff]),
                         (p + "compress_up.weight", [d_kv, d_c])):
            n = 2 * shape[0] * shape[1]
            header[k] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
            offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    cfg = {**backbone_cfg, "kv_compressed_size": d_c, "compressor_down_type": "mlp_swiglu", "compressor_up_type": "linear",
           "compressor_intermediate_size": d_ff, "compressor_linear_bias": False, "use_compression": True,
           "deltakv_neighbor_count": 4, "cluster_ratio": 0.1}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.slow  # two dry runs of the paper profile, about 30 s
def test_paper_profile_with_an_imported_codec_dry_runs(tmp_path):
    """config/paper.yaml with `codec: {import: ...}`: the main codec comes from rkv_codec_import, the variants are
    still trained, the runs read the imported directory; a checkpoint of another size fails the DAG."""
    import yaml
    from test_workflow import PAPER_CONFIG, _fake_paper_root, planned_jobs, snakemake

    root = tmp_path / "kvbench-data"
    cfg = _fake_paper_root(root)
    llama = json.loads((root / cfg["models"]["llama-3.1-8b"]["checkpoint"] / "config.json").read_text())
    write_sparse_checkpoint(root / "compressors" / "llama", llama, d_c=512, d_ff=3072)
    cfg["residualkv"]["codec"]["import"] = "compressors/llama"
    (tmp_path / "paper.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    args = ("-n", "-p", "residualkv", "--configfile", str(tmp_path / "paper.yaml"), "--config", f"paths={{root: {root}}}")
    r = snakemake(tmp_path, *args)
    assert r.returncode == 0, r.stdout[-3000:]
    jobs = planned_jobs(r.stdout)
    # the variants, and Table V's backbone's own main codec (residualkv.long_generation: never the imported one)
    gen = 1 if "long_generation" in cfg["residualkv"] else 0
    assert jobs["rkv_codec_import"] == 1 and jobs["rkv_codec"] == len(cfg["residualkv"]["variants"]) + gen
    m = re.search(r"kvbench codec-import --from-deltakv (\S+) --out (codecs/paper/llama-3\.1-8b/main-import-[0-9a-f]{8}/codec) ",
                  r.stdout)
    assert m and m.group(1) == str(root / "compressors" / "llama")
    assert f'"codec_dir": "{m.group(2)}"' in r.stdout   # the runs read the imported codec
    write_sparse_checkpoint(root / "compressors" / "llama", llama, d_c=512, d_ff=6144)
    r = snakemake(tmp_path, *args)
    assert r.returncode != 0 and "override d_ff=3072 contradicts the checkpoint" in r.stdout, r.stdout[-2000:]


@pytest.mark.parametrize("fields, match", [
    ({"compressor_linear_bias": "false"}, "compressor_linear_bias='false': expected true or false"),  # was taken as true
    ({"num_recent_tokens": "abc"}, "num_recent_tokens='abc': expected an integer"),  # was "invalid literal for int()"
    ({"stride_alpha": float("nan")}, "stride_alpha=nan: expected a finite number"),  # was written as NaN to codec.json
    ({"deltakv_neighbor_count": 2.7}, "deltakv_neighbor_count=2.7: expected an integer"),  # was truncated to 2
    ({"deltakv_neighbor_count": "4"}, "deltakv_neighbor_count='4': expected an integer"),  # was read as 4
])
def test_mistyped_fields_are_named(tiny_lm, tmp_path, fields, match):
    """Review findings: config.json values of the wrong JSON type."""
    src = write_theirs(tmp_path / "theirs", tiny_lm, bias=False, fields=fields)
    with pytest.raises(ValueError, match=re.escape(match)):
        import_deltakv(src, tiny_lm)
