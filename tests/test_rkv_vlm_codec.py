"""A ResidualKV codec trained on a VLM's own image records (visual tokens included), then run on VLM records."""
from __future__ import annotations

import json

import pytest
import torch

from kvbench.compress.residualkv.vlm_data import VLMRecordStream


@pytest.fixture(scope="module")
def docpages(tokenizer_dir, tmp_path_factory):
    from kvbench.data.smoke import materialise

    root = tmp_path_factory.mktemp("vlmcodec")
    materialise("docpages", root, tokenizer_dir, n_train=12, n_test=2)
    return root


def test_stream_encodes_records_with_their_images_and_answer_labels(docpages, vlm_dir):
    from kvbench.models import load_model

    _, proc = load_model(vlm_dir)
    train = VLMRecordStream(proc, "train", 0, seed=0, files=[str(docpages / "train.jsonl")])
    test = VLMRecordStream(proc, "test", 0, seed=0, files=[str(docpages / "train.jsonl")])
    assert {r["id"] for r, _ in train.records}.isdisjoint({r["id"] for r, _ in test.records})
    assert len(train.records) + len(test.records) == 12
    inputs, labels = train.batch(0)
    assert {"input_ids", "pixel_values", "image_grid_thw", "mm_token_type_ids"} <= set(inputs)
    answer = labels[labels != -100]   # the answers (training records carry extra queries) and their EOS
    assert labels.shape == inputs["input_ids"].shape and 0 < len(answer) < labels.numel() / 4
    assert proc.tokenizer.eos_token_id in answer.tolist()
    assert torch.equal(train.batch(3)[0]["input_ids"], VLMRecordStream(proc, "train", 0, 0, [str(docpages / "train.jsonl")]).batch(3)[0]["input_ids"])
    with pytest.raises(ValueError, match="data_files"):
        VLMRecordStream(proc, "train", 0, 0, None)
    # review of the merge: a text LM's tokenizer trained a codec on VLM records without complaint
    with pytest.raises(ValueError, match="no image processor"):
        VLMRecordStream(proc.tokenizer, "train", 0, 0, [str(docpages / "train.jsonl")])


def test_codec_train_on_vlm_records_then_residualkv_answers_vlm_records(docpages, vlm_dir, tmp_path, capsys):
    """`kvbench codec-train --data vlm` trains on the VLM's language model with its visual tokens; the codec then
    serves a ResidualKV press on the VLM's image records (M-RoPE restore, kvbench.compress.generate_vlm)."""
    from kvbench.cli import main
    from kvbench.eval.compress import CompressMethod
    from kvbench.models import load_model
    from kvbench.utils.io import read_jsonl

    torch.set_num_threads(1)
    out = tmp_path / "codec"
    main(["codec-train", "--model", str(vlm_dir), "--out", str(out), "--steps", "2", "--data", "vlm",
          "--data-files", str(docpages / "train.jsonl"), "--overrides", json.dumps({"d_c": 32, "d_ff": 32, "window": 4, "n_sink": 2, "stride": 5})])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["data"] == "vlm" and summary["eval_final"]["eval_rec"] > 0
    model, proc = load_model(vlm_dir)
    method = CompressMethod(spec="residualkv:full_layers=0,protocol=shared_context", codec_dir=str(out / "codec"))
    method.start(0)
    record = read_jsonl(docpages / "test.jsonl")[0]
    assert isinstance(method.predict(model, proc, record, docpages), str)
    assert method.audit()["kr_packed"] < 1.0
    capsys.readouterr()
    assert main(["codec-train", "--model", str(vlm_dir), "--out", str(tmp_path / "x"), "--steps", "1", "--data", "vlm"]) == 2
    assert "--data vlm trains on VLM record files" in capsys.readouterr().err
