"""ResidualKV Table I (kvbench.report.residualkv.table_i): checkpoint config.json + the main codec's codec.json + Table III's
ResidualKV row, beside the published values, on a fake checkpoint and codec."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from kvbench.report import tables
from kvbench.report.residualkv import table_i as rkv_table1
from kvbench.plan.residualkv import RKVPlan

REPO = Path(__file__).resolve().parents[1]
PUBLISHED = REPO / "config" / "published" / "residualkv.yaml"
# Llama-3.1-8B's KV fields (32 layers, 8 KV heads of 128: 2 d_k = 2048); Qwen2.5-7B's (28 layers, 4 KV heads of 128)
LLAMA = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8}
QWEN7B = {"num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4}


def _paper_spec(root: Path, codec: dict, qwen: dict) -> dict:
    cfg = yaml.safe_load((REPO / "config" / "paper.yaml").read_text())
    models = {"llama-3.1-8b": LLAMA, "qwen2.5-7b-1m": qwen,
              # a VLM's KV fields sit in text_config
              "qwen3-vl-8b": {"text_config": {"num_hidden_layers": 36, "hidden_size": 4096, "num_attention_heads": 32,
                                              "num_key_value_heads": 8, "head_dim": 128}}}
    rows = []
    for name, fields in models.items():
        d = root / cfg["models"][name]["checkpoint"]
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(fields))
        rows.append({"name": name, "dir": str(d), "codec": cfg["models"][name]["codec"]})
    spec = {"profile": "paper", "residualkv": cfg["residualkv"], "zoo": False, "seed": 0,
            "model_dir": rows[0]["dir"], "models": rows, "published": str(PUBLISHED)}
    codec_dir = root / RKVPlan.from_spec(spec).codecs.dir("main") / "codec"
    codec_dir.mkdir(parents=True)
    (codec_dir / "codec.json").write_text(json.dumps({"n_layers": 32, "d_kv": 2048, **codec}))
    return spec


def test_paper_rows_match_or_flag_the_published_values(tmp_path):
    spec = _paper_spec(tmp_path, {"d_c": 512, "d_ff": 3072}, QWEN7B)
    df = tables.write("residualkv/tableI", spec, tmp_path / "tableI.csv", root=tmp_path).set_index("model")
    llama = df.loc["llama-3.1-8b"]
    assert (llama["n_layers"], llama["2d_k"], llama["d_c"], llama["d_ff"]) == (32, 2048, 512, 3072)
    assert llama["full_attention_layers"] == "0+1+2+8+18" and llama["paper backbone"] == "Llama-3.1-8B"
    assert {c: llama[f"{c} mismatch"] for c in rkv_table1.COMPARED} == dict.fromkeys(rkv_table1.COMPARED, "no")
    assert "Table III row 'ResidualKV'" in llama["source"]
    qwen = df.loc["qwen2.5-7b-1m"]
    assert qwen["2d_k"] == 1024 and qwen["2d_k mismatch"] == "no" and pd.isna(qwen["d_c"])
    assert qwen["d_c mismatch"] == "" or pd.isna(qwen["d_c mismatch"])
    assert "no codec is built for this model" in qwen["notes"]
    assert df.loc["qwen3-vl-8b", "2d_k"] == 2048 and df.loc["qwen3-vl-8b", "n_layers"] == 36
    head = (tmp_path / "tableI.csv").read_text().splitlines()
    assert head[0].startswith("# kvbench ResidualKV Table I") and "local checkpoint" in head[0]


def test_a_codec_or_checkpoint_unlike_the_papers_is_flagged(tmp_path):
    # the wrong checkpoint under qwen2.5-7b-1m (Llama's KV shape) and a codec trained with d_c 256
    spec = _paper_spec(tmp_path, {"d_c": 256, "d_ff": 3072}, LLAMA)
    df = rkv_table1.table_i(spec, tmp_path).set_index("model")
    assert df.loc["llama-3.1-8b", "d_c mismatch"] == "yes" and df.loc["llama-3.1-8b", "published d_c"] == 512
    assert df.loc["llama-3.1-8b", "d_c/2d_k mismatch"] == "yes" and df.loc["llama-3.1-8b", "d_ff mismatch"] == "no"
    assert "differs from the paper in d_c, d_c/2d_k" in df.loc["llama-3.1-8b", "notes"]
    assert df.loc["qwen2.5-7b-1m", "2d_k mismatch"] == "yes" and df.loc["qwen2.5-7b-1m", "published 2d_k"] == 1024


def test_missing_codec_is_named(tmp_path):
    spec = _paper_spec(tmp_path, {"d_c": 512, "d_ff": 3072}, QWEN7B)
    codec = tmp_path / RKVPlan.from_spec(spec).codecs.dir("main") / "codec" / "codec.json"
    codec.unlink()
    with pytest.raises(FileNotFoundError, match="main codec's .*codec.json, which is missing"):
        rkv_table1.table_i(spec, tmp_path)


def test_smoke_row_has_ratios_and_no_published_values(tmp_path):
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    d = tmp_path / "zoo" / "smoke" / "tiny-qwen2-lm-x"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "hidden_size": 128, "num_attention_heads": 4,
                                               "num_key_value_heads": 2, "head_dim": 32}))
    spec = {"profile": "smoke", "residualkv": cfg["residualkv"], "zoo": True, "seed": 0, "model_dir": str(d),
            "models": [{"name": "tiny-qwen2-lm", "dir": str(d), "codec": None}], "published": str(PUBLISHED)}
    codec = tmp_path / RKVPlan.from_spec(spec).codecs.dir("main") / "codec"
    codec.mkdir(parents=True)
    (codec / "codec.json").write_text(json.dumps({"n_layers": 8, "d_kv": 128, "d_c": 32, "d_ff": 192}))
    row = rkv_table1.table_i(spec, tmp_path).iloc[0]
    assert (row["2d_k"], row["d_c/2d_k"], row["d_ff/2d_k"], row["full_attention_layers"]) == (128, 0.25, 1.5, "0+1")
    assert row["paper backbone"] == "" and pd.isna(row["published d_c"]) and row["d_c mismatch"] == ""
    assert "the tiny zoo LM" in row["notes"] and "Llama-3.1-8B 0.25/1.5" in row["notes"]


def test_compare_sets_each_width_beside_the_published_one(tmp_path):
    from kvbench.report import compare

    spec = _paper_spec(tmp_path, {"d_c": 256, "d_ff": 3072}, QWEN7B)
    tables.write("residualkv/tableI", spec, tmp_path / "tableI.csv", root=tmp_path)
    df = compare.compare(tmp_path / "tableI.csv", PUBLISHED, tmp_path / "c.csv", name="residualkv/tableI")
    cells = df[df["part"] == "cell"].set_index(["backbone", "metric"])
    assert cells.loc[("llama-3.1-8b", "d_c"), "diff"] == -256 and cells.loc[("llama-3.1-8b", "d_ff"), "diff"] == 0
    assert cells.loc[("qwen2.5-7b-1m", "2d_k"), "paper_backbone"] == "Qwen2.5-7B"
    assert bool(cells.loc[("qwen2.5-7b-1m", "2d_k"), "comparable"])
