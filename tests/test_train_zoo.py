"""Zoo training end to end on a few steps: sliced = unsliced to the byte, floors gate the output."""
from __future__ import annotations

import json

import pytest

from kvbench.eval.methods import full_cache_score
from kvbench.train.floors import BelowFloor, validation_records
from kvbench.train.zoo import train_zoo_model
from kvbench.utils.steps import SliceEnded

# One or two steps per phase of the real LM recipe: every phase kind runs, in seconds.
TINY = {"steps_scale": 0.002}


def _train(tokenizer_dir, root, **kw):
    return train_zoo_model("tiny-qwen2-lm", tokenizer_dir=tokenizer_dir, out_dir=root / "model",
                           workdir=root / "work", seed=0, threads=1, overrides=TINY, score=full_cache_score, **kw)


def test_sliced_run_gives_the_same_bytes(tokenizer_dir, tmp_path):
    whole = _train(tokenizer_dir, tmp_path / "whole")
    total = whole["total_steps"]
    assert whole["steps"] == total > 3
    cut = tmp_path / "cut"
    with pytest.raises(SliceEnded, match=f"after 2 of {total} steps"):
        _train(tokenizer_dir, cut, max_steps=2)
    assert not (cut / "model").exists() and not (cut / "work" / "summary.json").exists()  # nothing final yet
    with pytest.raises(SliceEnded, match=f"after 3 of {total} steps"):
        _train(tokenizer_dir, cut, max_steps=1)
    _train(tokenizer_dir, cut)
    for name in ("model/model.safetensors", "model/config.json", "work/summary.json", "work/curves.csv"):
        assert (tmp_path / "whole" / name).read_bytes() == (cut / name).read_bytes(), name
    summary = json.loads((cut / "work" / "summary.json").read_text())
    assert "train_time_s" not in summary and "train_time_s" in json.loads((cut / "work" / "timing.json").read_text())


def test_below_floor_fails_and_writes_nothing(tokenizer_dir, tmp_path):
    with pytest.raises(BelowFloor, match=r"'tiny-qwen2-lm'.*niah_1k scored 0\.\d+ < floor 1\. It would feed zoo\.csv"):
        _train(tokenizer_dir, tmp_path, floors={"niah_1k": 1.0}, val_n=2, feeds="zoo.csv")
    assert not (tmp_path / "model").exists() and not (tmp_path / "work" / "summary.json").exists()
    assert json.loads((tmp_path / "work" / "validation.json").read_text())["scores"]["niah_1k"] < 1.0
    out = _train(tokenizer_dir, tmp_path, floors={"niah_1k": 0.0}, val_n=2)  # resumes: no step is redone
    assert out["validation"]["niah_1k"] >= 0.0 and (tmp_path / "model" / "config.json").is_file()


def test_floor_outside_unit_interval_is_refused(tokenizer_dir, tmp_path):
    with pytest.raises(ValueError, match=r"skill floor of 'niah_1k' must be a number in \[0, 1\], got 80"):
        _train(tokenizer_dir, tmp_path, floors={"niah_1k": 80}, val_n=1)


def test_validation_slice_is_not_the_test_split(tokenizer):
    from kvbench.data.smoke import TASKS, record_rng, sample

    val = validation_records("niah_1k", tokenizer, seed=0, n=3)
    test = [sample("niah", record_rng("niah_1k", "test", 0, i), "test", tokenizer, **TASKS["niah_1k"].params)
            for i in range(3)]
    assert [r["id"] for r in val] == ["niah_1k-val-00000", "niah_1k-val-00001", "niah_1k-val-00002"]
    assert {r["context"] for r in val}.isdisjoint({r["context"] for r in test})
    with pytest.raises(ValueError, match="floor task 'nope' is not a smoke task"):
        validation_records("nope", tokenizer, seed=0, n=1)


def test_a_seed_replica_trains_the_entry_from_its_own_seed(tokenizer_dir, tmp_path):
    """``<entry>-s<k>`` (config/confirm.yaml's tiny-qwen2.5-vl-s0/s1/s2) is the entry's architecture and recipe; its
    seed gives other weights, and its summary keeps the replica's name (the zoo report's key)."""
    from kvbench.models.tiny import seed_replica, zoo_spec

    assert zoo_spec("tiny-qwen2.5-vl-s2") is zoo_spec("tiny-qwen2.5-vl") and seed_replica("tiny-qwen2.5-vl-s2") == (
        "tiny-qwen2.5-vl", 2)
    assert seed_replica("tiny-qwen2.5-vl") is None and seed_replica("nothing-s1") is None
    with pytest.raises(KeyError, match="or a seed replica"):
        zoo_spec("tiny-qwen2.5-vl-x1")
    base = _train(tokenizer_dir, tmp_path / "s0")
    replica = train_zoo_model("tiny-qwen2-lm-s1", tokenizer_dir=tokenizer_dir, out_dir=tmp_path / "s1" / "model",
                              workdir=tmp_path / "s1" / "work", seed=1, threads=1, overrides=TINY)
    assert replica["model"] == "tiny-qwen2-lm-s1" and replica["seed"] == 1
    assert replica["architecture"] == base["architecture"] and replica["total_steps"] == base["total_steps"]
    assert ((tmp_path / "s1" / "model" / "model.safetensors").read_bytes()
            != (tmp_path / "s0" / "model" / "model.safetensors").read_bytes())


def test_a_seed_replica_starts_from_its_entry_s_warm_up_state(tokenizer_dir, tmp_path):
    """The VLM recipes' seed replicas share the vision probe and grid phases with their entry (SHARED_WARMUP,
    issue #33 item 2): the entry keeps its state at the end of the grid phase, and a replica started there with the
    entry's own seed ends on the entry's bytes (the fork is exact), with another seed on other weights; a bad warm
    start is refused naming what was expected."""
    from kvbench.train.recipes import RECIPES, apply_overrides, warmup_steps
    from kvbench.utils.recipe import cpu_kernels

    def vlm(name, root, seed, **kw):
        return train_zoo_model(name, tokenizer_dir=tokenizer_dir, out_dir=tmp_path / root / "model",
                               workdir=tmp_path / root / "work", seed=seed, threads=1, overrides=TINY, **kw)

    shared = warmup_steps("vlm", apply_overrides(RECIPES["vlm"](), TINY))
    entry = vlm("tiny-qwen2.5-vl", "s0", 0)
    warm = tmp_path / "s0" / "work" / "warmup"
    assert json.loads((warm / "meta.json").read_text())["global_step"] == shared < entry["total_steps"]
    same = vlm("tiny-qwen2.5-vl-s1", "fork0", 0, warm_start=warm)
    other = vlm("tiny-qwen2.5-vl-s1", "fork1", 1, warm_start=warm)
    weights = {r: (tmp_path / r / "model" / "model.safetensors").read_bytes() for r in ("s0", "fork0", "fork1")}
    assert weights["fork0"] == weights["s0"] != weights["fork1"]
    assert same["warm_start"] == other["warm_start"] == {"steps": shared} and "warm_start" not in entry
    assert entry["cpu"] == cpu_kernels()  # the summary records the kernels that trained it
    curves = __import__("pandas").read_csv(tmp_path / "fork1" / "work" / "curves.csv")
    assert curves["step"].min() == shared  # the replica's own steps only
    assert not (tmp_path / "fork1" / "work" / "warmup").exists()  # a replica keeps no warm-up state of its own
    with pytest.raises(ValueError, match="--warm-start is for a seed replica <entry>-s<k>; 'tiny-qwen2.5-vl' is not one"):
        vlm("tiny-qwen2.5-vl", "bad1", 0, warm_start=warm)
    with pytest.raises(FileNotFoundError, match="nowhere: no such directory"):
        vlm("tiny-qwen2.5-vl-s2", "bad2", 2, warm_start=tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"is not a saved training state \(missing \['meta.json', "):
        vlm("tiny-qwen2.5-vl-s2", "bad2", 2, warm_start=tmp_path / "empty")
    import shutil

    shutil.copytree(warm, tmp_path / "garbled")
    (tmp_path / "garbled" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="garbled: an unreadable training state"):
        vlm("tiny-qwen2.5-vl-s2", "bad2", 2, warm_start=tmp_path / "garbled")
    assert not (tmp_path / "bad2").exists()  # a refused start leaves no work directory behind
    shutil.copytree(warm, tmp_path / "other")
    with pytest.raises(ValueError, match=r"holds a replica started from .*/s0/work/warmup, not from --warm-start"):
        vlm("tiny-qwen2.5-vl-s1", "fork1", 1, warm_start=tmp_path / "other")  # resumed from another state
    assert vlm("tiny-qwen2.5-vl-s1", "fork1", 1, warm_start=warm)["steps"] == entry["total_steps"]  # resumes
    with pytest.raises(ValueError, match=f"saved at step {entry['total_steps']}, but 'tiny-qwen2.5-vl-s2' shares the "
                                         f"first {shared} steps"):
        vlm("tiny-qwen2.5-vl-s2", "bad3", 2, warm_start=tmp_path / "s0" / "work" / "state")
