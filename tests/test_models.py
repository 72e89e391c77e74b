"""Model loading: zoo checkpoints go through the same path as real ones; bad checkpoints fail clearly."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from kvbench.data import lexicon
from kvbench.models import CheckpointError, check_checkpoint, load_model
from kvbench.models.prompting import encode_record


def test_zoo_lm_loads_like_a_checkpoint(lm_dir):
    model, tok = load_model(lm_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    cfg = model.config
    assert cfg.num_hidden_layers >= 8
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert not model.training
    assert tok.eos_token == "<|im_end|>"


def test_zoo_vlm_loads_like_a_checkpoint(vlm_dir):
    model, proc = load_model(vlm_dir)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    tc = model.config.text_config
    assert tc.num_key_value_heads < tc.num_attention_heads
    assert type(proc).__name__ == "Qwen2_5_VLProcessor"
    assert sum(p.numel() for p in model.model.visual.parameters()) > 0


def test_zoo_name_resolves_under_zoo_root(lm_dir, monkeypatch):
    monkeypatch.setenv("KVBENCH_ZOO", str(lm_dir.parent))
    model, _ = load_model("tiny-qwen2-lm")
    assert type(model).__name__ == "Qwen2ForCausalLM"
    model, _ = load_model("zoo:tiny-qwen2-lm")


def test_zoo_name_finds_the_profile_and_hash_directory(lm_dir, tmp_path, monkeypatch):
    """Regression: trained models live in zoo/<profile>/<name>-<hash>/, and the bare name stopped resolving."""
    from kvbench.models.loader import CheckpointError, resolve_spec

    (tmp_path / "smoke").mkdir()
    (tmp_path / "smoke" / "tiny-qwen2-lm-0123abcd").symlink_to(lm_dir, target_is_directory=True)
    monkeypatch.setenv("KVBENCH_ZOO", str(tmp_path))
    assert resolve_spec("tiny-qwen2-lm") == tmp_path / "smoke" / "tiny-qwen2-lm-0123abcd"
    (tmp_path / "ci").mkdir()
    (tmp_path / "ci" / "tiny-qwen2-lm-89abcdef").symlink_to(lm_dir, target_is_directory=True)
    with pytest.raises(CheckpointError, match="names 2 trained zoo checkpoints"):
        resolve_spec("tiny-qwen2-lm")
    with pytest.raises(CheckpointError, match="trains them into zoo/<profile>/<name>-<hash>/"):
        resolve_spec("tiny-qwen2.5-vl")


def test_tokenizer_saved_beside_model_tokenizes_identically(tokenizer, lm_dir):
    # AutoTokenizer picks Qwen2Tokenizer from config.json's model_type and rebuilds
    # the pre-tokenizer; our tokenizer must survive that unchanged.
    reloaded = AutoTokenizer.from_pretrained(lm_dir)
    text = " " + lexicon.key_codes()[7] + " " + lexicon.value_codes()[3] + " x = 12345\n    return f(x)"
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_lexicon_entries_are_single_tokens(tokenizer):
    for w in lexicon.key_codes() + lexicon.value_codes():
        assert len(tokenizer(" " + w)["input_ids"]) == 1, w


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")


@pytest.mark.parametrize("remove,match", [
    ("config.json", "missing config.json"),
    ("model.safetensors", "missing weights"),
    ("tokenizer.json", None),
])
def test_partial_checkpoint_names_missing_file(lm_dir, tmp_path, remove, match):
    d = _copy(lm_dir, tmp_path)
    (d / remove).unlink()
    if remove == "tokenizer.json":
        (d / "tokenizer_config.json").unlink()
        match = "missing tokenizer"
    with pytest.raises(CheckpointError, match=match) as e:
        check_checkpoint(d)
    assert str(d) in str(e.value)


def test_truncated_weights_are_detected(lm_dir, tmp_path):
    d = _copy(lm_dir, tmp_path)
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated safetensors data"):
        load_model(d)


def test_garbage_weights_are_detected(lm_dir, tmp_path):
    d = _copy(lm_dir, tmp_path)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        check_checkpoint(d)


def test_missing_shard_named(lm_dir, tmp_path):
    d = _copy(lm_dir, tmp_path)
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors"):
        check_checkpoint(d)


def test_pickle_only_checkpoint_refused(lm_dir, tmp_path):
    d = _copy(lm_dir, tmp_path)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="pickle"):
        check_checkpoint(d)


def test_corrupt_config_json(lm_dir, tmp_path):
    d = _copy(lm_dir, tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: corrupt JSON"):
        check_checkpoint(d)


def test_remote_code_architecture_needs_opt_in(lm_dir, tmp_path):
    d = _copy(lm_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MyCustomForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_model(d)


def _vlm_record():
    rng = np.random.default_rng(0)
    img = Image.fromarray((rng.random((84, 112, 3)) * 255).astype("uint8"))
    return {"id": "r0", "kind": "vlm", "system": "Report each digit plus one.", "generic_system": "Read.",
            "content": [{"type": "text", "text": "Page 1:"}, {"type": "image", "image": img}],
            "question": "Page 1, row 2, column 3?", "answer": "4", "max_new_tokens": 1}


def test_vlm_prompt_uses_mrope_positions(vlm_dir):
    """Without mm_token_type_ids transformers 5 silently falls back to 1-D positions."""
    model, proc = load_model(vlm_dir)
    enc = encode_record(_vlm_record(), proc)
    assert "mm_token_type_ids" in enc
    image_id = model.config.image_token_id
    is_image = enc["input_ids"][0] == image_id
    assert int(is_image.sum()) == 12  # 84x112 px -> 3x4 cells of 28 px -> 12 visual tokens
    assert torch.equal(enc["mm_token_type_ids"][0].bool(), is_image)
    pos, _ = model.model.get_rope_index(enc["input_ids"], enc["mm_token_type_ids"], enc["image_grid_thw"],
                                        attention_mask=enc["attention_mask"])
    img_pos = pos[:, 0, is_image]  # [3 axes, 12]
    assert img_pos[0].unique().numel() == 1  # temporal axis constant over one image
    assert img_pos[1].unique().numel() == 3 and img_pos[2].unique().numel() == 4  # rows, columns
    with torch.no_grad():
        a = model(**{k: v for k, v in enc.items() if k != "prompt_len"}).logits
        # Text positions after the image are compressed by M-RoPE: 1-D positions would differ.
        n_text_after = int((~is_image).sum())
        assert pos[0, 0, -1].item() < enc["input_ids"].shape[1] - 1
    assert torch.isfinite(a).all() and n_text_after > 0


def test_encode_record_labels_cover_answers_only(tokenizer):
    rec = {"id": "t", "kind": "text", "context": "Pairs: " + " ".join(lexicon.key_codes()[:3]),
           "question": "\nQuery: " + lexicon.key_codes()[1], "answer": " " + lexicon.value_codes()[0],
           "meta": {"extra_queries": [{"question": "\nQuery: " + lexicon.key_codes()[2],
                                       "answer": " " + lexicon.value_codes()[1]}]}}
    enc = encode_record(rec, tokenizer, with_answer=True)
    labelled = [t for t in enc["labels"][0].tolist() if t >= 0]
    assert tokenizer.decode(labelled) == " " + lexicon.value_codes()[0] + " " + lexicon.value_codes()[1]
    assert enc["prompt_len"] == len(tokenizer(rec["context"] + rec["question"])["input_ids"])


def test_unknown_record_kind(tokenizer):
    with pytest.raises(ValueError, match="kind must be"):
        encode_record({"id": "x", "kind": "audio"}, tokenizer)


def test_checkpoint_directory_is_readable_by_others(lm_dir):
    assert lm_dir.stat().st_mode & 0o755 == 0o755  # mkdtemp's 0700 kept other cluster users out
