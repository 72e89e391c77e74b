"""Training loop: determinism, exact resume after interruption, no pickle on disk, schedules, overrides."""
from __future__ import annotations

import math
from pathlib import Path
from dataclasses import replace

import pytest
import torch
import transformers

from kvbench.models.tiny import build_config, build_processor
from kvbench.train.batches import PROBE_CLASSES
from kvbench.train.loop import lr_at, run_phases, sequence_loss
from kvbench.train.recipes import Phase, apply_overrides, lm_recipe, vlm_recipe
from kvbench.utils.steps import SliceEnded

PHASES = [Phase("copy", "copy", steps=6, lr=3e-3, warmup=2, batch=4, seq_len=32, head_supervision=1.0)]


def _lm(tokenizer, seed=0):
    torch.manual_seed(seed)
    cfg = build_config("tiny-qwen2-lm", tokenizer)
    return transformers.Qwen2ForCausalLM(cfg)


def _weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_same_seed_same_weights(tokenizer, tmp_path):
    a, b = _lm(tokenizer), _lm(tokenizer)
    run_phases(a, tokenizer, PHASES, tmp_path / "a", seed=1)
    run_phases(b, tokenizer, PHASES, tmp_path / "b", seed=1)
    assert torch.equal(_weights(a), _weights(b))


def test_interrupted_run_resumes_exactly(tokenizer, tmp_path):
    ref = _lm(tokenizer)
    run_phases(ref, tokenizer, PHASES, tmp_path / "ref", seed=3)

    first = _lm(tokenizer)
    with pytest.raises(SliceEnded, match="after 4 of 6 steps.*rerun the same command"):
        run_phases(first, tokenizer, PHASES, tmp_path / "cut", seed=3, max_steps=4)
    resumed = _lm(tokenizer, seed=99)  # fresh process: weights come from the saved state only
    out = run_phases(resumed, tokenizer, PHASES, tmp_path / "cut", seed=3)
    assert out["steps"] == 6
    assert torch.equal(_weights(ref), _weights(resumed))
    import pandas as pd

    curves = pd.read_csv(tmp_path / "cut" / "curves.csv")
    assert curves["step"].is_monotonic_increasing and curves["step"].max() == 5


def test_wall_clock_slice_saves_and_fails(tokenizer, tmp_path):
    """A tiny slice ends the invocation after its first step, with state saved and the resume message."""
    with pytest.raises(SliceEnded, match=r"slice ended after 1 of 6 steps") as e:
        run_phases(_lm(tokenizer), tokenizer, PHASES, tmp_path, seed=0, slice_s=1e-9)
    assert e.value.done == 1 and (tmp_path / "state" / "meta.json").is_file()


def test_no_op_resume_keeps_the_last_loss(tokenizer, tmp_path):
    """Regression: a rerun on finished state reported last_loss NaN in summary.json."""
    first = run_phases(_lm(tokenizer), tokenizer, PHASES, tmp_path, seed=0)
    again = run_phases(_lm(tokenizer), tokenizer, PHASES, tmp_path, seed=0)
    assert math.isfinite(again["last_loss"]) and again["last_loss"] == first["last_loss"]
    assert again["last_acc"] == first["last_acc"]


def test_curves_hold_no_wall_clock(tokenizer, tmp_path):
    run_phases(_lm(tokenizer), tokenizer, PHASES, tmp_path, seed=0)
    import pandas as pd

    assert list(pd.read_csv(tmp_path / "curves.csv").columns) == ["step", "phase", "seq_len", "lr", "loss", "acc"]
    assert list(pd.read_csv(tmp_path / "curves.timing.csv").columns) == ["step", "wall_s"]


def test_state_on_disk_is_not_pickle(tokenizer, tmp_path):
    with pytest.raises(SliceEnded):
        run_phases(_lm(tokenizer), tokenizer, PHASES, tmp_path, seed=0, max_steps=2)
    names = sorted(p.name for p in (tmp_path / "state").iterdir())
    assert names == ["meta.json", "model.safetensors", "optimizer.json", "optimizer.safetensors"]


def test_state_of_another_recipe_is_refused(tokenizer, tmp_path):
    with pytest.raises(SliceEnded):
        run_phases(_lm(tokenizer), tokenizer, PHASES, tmp_path, seed=0, max_steps=2)
    other = [Phase("copy", "copy", steps=6, lr=1e-3, warmup=2, batch=4, seq_len=32, head_supervision=1.0)]
    with pytest.raises(ValueError, match=r"was trained with another recipe \(phases differing: \['copy'\]\)"):
        run_phases(_lm(tokenizer), tokenizer, other, tmp_path, seed=0)


def test_state_of_another_model_is_refused(tokenizer, tmp_path):
    with pytest.raises(SliceEnded):
        run_phases(_lm(tokenizer), tokenizer, PHASES, tmp_path, seed=0, max_steps=2)
    cfg = build_config("tiny-qwen2.5-vl", tokenizer)
    vlm = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    with pytest.raises(ValueError, match="does not match the model"):
        run_phases(vlm, build_processor(tokenizer), PHASES, tmp_path, seed=0)
    # the same names at another width (a zoo entry whose d changed): named, not a RuntimeError from torch
    narrow = _lm(tokenizer)
    wide = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**narrow.config.to_dict(), "hidden_size": 64,
                                                                       "head_dim": 16}))
    with pytest.raises(ValueError, match="saved shape"):
        run_phases(wide, tokenizer, PHASES, tmp_path, seed=0)


def test_vision_probe_phase_learns_digits(tokenizer, tmp_path):
    torch.manual_seed(0)
    cfg = build_config("tiny-qwen2.5-vl", tokenizer)
    vlm = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    probe = torch.nn.Linear(cfg.vision_config.out_hidden_size, sum(PROBE_CLASSES.values()))
    phases = [Phase("vision_probe", "vision_probe", steps=80, lr=3e-3, warmup=5, batch=8)]
    out = run_phases(vlm, build_processor(tokenizer), phases, tmp_path, seed=0,
                     extra_modules={"probe": probe})
    # chance: ln 10 + ln 16 + ln 7 = 7.0 summed over the digit, letter and page heads; digit accuracy 0.1
    assert out["last_loss"] < 4.0 and out["last_acc"] > 0.2, (out["last_loss"], out["last_acc"])


def test_lr_schedule():
    p = Phase("p", "copy", steps=110, lr=1e-3, warmup=10)
    assert lr_at(p, 0) == pytest.approx(1e-4)
    assert lr_at(p, 9) == pytest.approx(1e-3)
    assert lr_at(p, 10) == pytest.approx(1e-3)
    assert lr_at(p, 60) == pytest.approx(1e-3 * (0.1 + 0.45))
    assert lr_at(p, 110) == pytest.approx(1e-4)


def test_sequence_loss_normalises_per_sequence():
    V = 4
    logits = torch.zeros(2, 4, V)
    logits[0, 0, 1] = 10.0  # sequence 0 predicts its single label perfectly
    labels = torch.tensor([[-100, 1, -100, -100], [-100, 2, 3, 3]])  # argmax of zero logits is 0: never a label
    loss, acc = sequence_loss(logits, labels)
    ce_perfect = -torch.log_softmax(torch.tensor([0.0, 10.0, 0.0, 0.0]), 0)[1].item()
    expected = (ce_perfect + math.log(V)) / 2  # mean of per-sequence means
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert acc == pytest.approx(1 / 4)


def test_overrides():
    scaled = apply_overrides(lm_recipe(), {"steps_scale": 0.1})
    assert [p.steps for p in scaled] == [max(1, round(p.steps * 0.1)) for p in lm_recipe()]
    changed = apply_overrides(vlm_recipe(), {"phases": {"tasks": {"lr": 1e-4}}, "drop_phases": ["vision_probe"]})
    assert [p.name for p in changed] == ["grid", "tasks"] and changed[1].lr == 1e-4
    with pytest.raises(ValueError, match="unknown training override"):
        apply_overrides(lm_recipe(), {"step_scale": 2})
    with pytest.raises(ValueError, match="unknown phase 'nope'"):
        apply_overrides(lm_recipe(), {"phases": {"nope": {}}})
    with pytest.raises(ValueError, match="steps_scale must be a positive number"):
        apply_overrides(lm_recipe(), {"steps_scale": -1})


def test_restricted_softmax_copy_batch_indexes_into_its_vocabulary(tokenizer):
    from kvbench.train.batches import copy_batch, step_rng

    phase = Phase("c", "copy", steps=1, lr=1e-3, batch=4, seq_len=32, copy_vocab=64, restrict_softmax=True)
    b = copy_batch(step_rng(0, "c", 0), phase, tokenizer)
    plain = copy_batch(step_rng(0, "c", 0), Phase("c", "copy", steps=1, lr=1e-3, batch=4, seq_len=32, copy_vocab=64), tokenizer)
    assert b["output_ids"].shape == (64,) and torch.equal(b["input_ids"], plain["input_ids"])
    mask = plain["labels"] != -100
    assert torch.equal(b["labels"] == -100, ~mask)
    assert torch.equal(b["output_ids"][b["labels"][mask]], plain["labels"][mask])  # same targets, re-indexed
    with pytest.raises(ValueError, match="copy_vocab > 0"):
        copy_batch(step_rng(0, "c", 0), Phase("c", "copy", steps=1, lr=1e-3, seq_len=32, restrict_softmax=True), tokenizer)


def test_freeze_vision_phase_leaves_the_tower_untouched(tokenizer, tmp_path):
    torch.manual_seed(0)
    vlm = transformers.Qwen2_5_VLForConditionalGeneration(build_config("tiny-qwen2.5-vl", tokenizer))
    visual = {k: v.clone() for k, v in vlm.model.visual.state_dict().items()}
    text = {k: v.clone() for k, v in vlm.model.language_model.state_dict().items()}
    mix = (("digitgrid", 1.0, {"n_queries": 2}),)
    phases = [Phase("grid", "tasks", steps=2, lr=1e-3, warmup=1, batch=2, mixture=mix, freeze_vision=True)]
    run_phases(vlm, build_processor(tokenizer), phases, tmp_path, seed=0)
    assert all(torch.equal(v, visual[k]) for k, v in vlm.model.visual.state_dict().items())
    assert any(not torch.equal(v, text[k]) for k, v in vlm.model.language_model.state_dict().items())


@pytest.mark.parametrize("restrict", [False, True])
def test_task_loss_equals_full_logits_loss(tokenizer, restrict):
    from kvbench.train.batches import copy_batch, step_rng
    from kvbench.train.loop import task_loss

    model = _lm(tokenizer)
    phase = Phase("c", "copy", steps=1, lr=1e-3, batch=3, seq_len=32, copy_vocab=64, restrict_softmax=restrict)
    batch = copy_batch(step_rng(0, "c", 0), phase, tokenizer)
    labels, output_ids = batch.pop("labels"), batch.pop("output_ids", None)
    labels[1] = -100  # a sequence without labels is left out of the mean, as in sequence_loss
    logits = model(**batch).logits
    if output_ids is not None:
        logits = logits[..., output_ids]
    ref, ref_acc = sequence_loss(logits, labels)
    got, acc = task_loss(model, batch, labels, phase, output_ids)
    assert got.item() == pytest.approx(ref.item(), rel=1e-5) and acc == pytest.approx(ref_acc)


def test_task_loss_on_a_vlm_task_batch(tokenizer):
    from kvbench.train.batches import step_rng, task_batch
    from kvbench.train.loop import task_loss

    torch.manual_seed(0)
    vlm = transformers.Qwen2_5_VLForConditionalGeneration(build_config("tiny-qwen2.5-vl", tokenizer))
    proc = build_processor(tokenizer)
    phase = Phase("g", "tasks", steps=1, lr=1e-3, batch=2, mixture=(("digitgrid", 1.0, {"n_queries": 2}),))
    batch = task_batch(step_rng(0, "g", 0), phase, proc)
    labels = batch.pop("labels")
    ref, _ = sequence_loss(vlm(**batch).logits, labels)
    got, _ = task_loss(vlm, batch, labels, phase)
    assert got.item() == pytest.approx(ref.item(), rel=1e-5)


def test_cell_reading_labels_put_each_cells_answer_at_its_visual_token(tokenizer):
    import random

    from kvbench.data import digits, docpages, instructions
    from kvbench.models.prompting import IGNORE_INDEX, encode_record
    from kvbench.train.batches import cell_reading_labels

    proc = build_processor(tokenizer)
    record = docpages.sample(random.Random(5), "train", n_queries=2, K=3, instruction="plus_five")
    enc = encode_record(record, proc, with_answer=True)
    cells = cell_reading_labels(record, enc, proc)
    visual = enc["input_ids"][0] == tokenizer.convert_tokens_to_ids(proc.image_token)
    assert visual.sum() == 12 and torch.equal(cells[0] != IGNORE_INDEX, visual)
    want = [str((int(digits.labels()[i]) + 5) % 10) for page in record["meta"]["digit_indices"] for i in page]
    assert tokenizer.convert_ids_to_tokens(cells[0][visual].tolist()) == want
    # the queried cell's target is the record's answer
    m = record["meta"]
    q = (m["page"] - 1) * 4 + (m["row"] - 1) * 2 + (m["col"] - 1)
    assert want[q] == record["answer"] == str(instructions.apply("plus_five", m["digit"]))


def test_content_cell_target_reads_the_digit_as_written(tokenizer):
    """The mild regime's reading term: each visual token's target is its cell's digit, whatever the instruction."""
    import random

    from kvbench.data import digits, docpages
    from kvbench.models.prompting import encode_record
    from kvbench.train.batches import cell_reading_labels

    proc = build_processor(tokenizer)
    record = docpages.sample(random.Random(5), "train", n_queries=2, K=3, instruction="plus_five")
    enc = encode_record(record, proc, with_answer=True)
    cells = cell_reading_labels(record, enc, proc, target="content")
    visual = enc["input_ids"][0] == tokenizer.convert_tokens_to_ids(proc.image_token)
    want = [str(int(digits.labels()[i])) for page in record["meta"]["digit_indices"] for i in page]
    assert tokenizer.convert_ids_to_tokens(cells[0][visual].tolist()) == want
    with pytest.raises(ValueError, match=r"target must be one of \('instruction', 'content'\), got 'digit'"):
        cell_reading_labels(record, enc, proc, target="digit")


def test_mild_recipe_differs_from_the_strong_one_only_in_where_the_instruction_is_applied():
    from kvbench.train.recipes import vlm_mild_recipe

    strong, mild = vlm_recipe(), vlm_mild_recipe()
    assert [p.name for p in mild] == [p.name for p in strong]
    for s, m in zip(strong, mild):
        if s.kind == "tasks":
            assert (s.cell_target, s.hide_prompt, s.stale_pages) == ("instruction", "text", 0.5)
            assert (m.cell_target, m.hide_prompt, m.stale_pages) == ("content", "", 0.0)
            assert replace(m, cell_target=s.cell_target, hide_prompt=s.hide_prompt, stale_pages=s.stale_pages) == s
        else:
            assert m == s
    with pytest.raises(ValueError, match="cell_target must be one of"):
        apply_overrides(vlm_recipe(), {"phases": {"tasks": {"cell_target": "answer"}}})


@pytest.mark.parametrize("stale_pages", [0.1, 0.25, 0.5])
def test_the_dial_screen_trains_the_dial_recipe(stale_pages):
    """The staleness-dial screen (scripts/conduit_dial_screen.py) trains tiny-qwen2.5-vl with overrides; the regime
    chosen from it is the recipe vlm_dial_recipe: the two resolve to the same phases, so the screened model is the
    regime's."""
    import importlib.util

    from kvbench.train.recipes import vlm_dial_recipe

    path = Path(__file__).resolve().parents[1] / "scripts" / "conduit_dial_screen.py"
    spec = importlib.util.spec_from_file_location("conduit_dial_screen", path)
    screen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(screen)
    assert apply_overrides(vlm_recipe(), screen.overrides(stale_pages)) == vlm_dial_recipe(stale_pages)
    strong = vlm_recipe()
    assert [p.stale_pages for p in vlm_dial_recipe(stale_pages) if p.kind == "tasks"] == [stale_pages] * 2
    assert [p for p in vlm_dial_recipe(stale_pages) if p.kind != "tasks"] == [p for p in strong if p.kind != "tasks"]


def test_zoo_recipe_covers_the_architecture(monkeypatch):
    """Two zoo entries with the same recipe but another depth get other directories (the hash once omitted the
    architecture, so a deeper model would have been taken for the trained shallower one)."""
    from kvbench.models import tiny
    from kvbench.train.recipes import zoo_recipe
    from kvbench.utils.recipe import recipe_hash

    spec = tiny.ZOO["tiny-qwen2.5-vl"]
    deeper = replace(spec, name="tiny-deeper", text={**spec.text, "num_hidden_layers": spec.text["num_hidden_layers"] + 6})
    monkeypatch.setitem(tiny.ZOO, "tiny-deeper", deeper)
    h = lambda name: recipe_hash({**zoo_recipe(name, "vlm", {}, seed=0, threads=2, tokenizer="t"), "model": ""})  # noqa: E731
    assert h("tiny-deeper") != h("tiny-qwen2.5-vl")
    assert h("tiny-qwen2.5-vl-mild") != h("tiny-qwen2.5-vl")   # same architecture, another recipe
    with pytest.raises(ValueError, match="is a 'vlm' model, not 'lm'"):
        zoo_recipe("tiny-qwen2.5-vl", "lm", {}, seed=0, threads=2, tokenizer="t")


def test_cell_reading_refuses_a_record_without_cells(tokenizer):
    from kvbench.train.batches import cell_reading_labels

    proc = build_processor(tokenizer)
    with pytest.raises(ValueError, match="needs a grid record"):
        cell_reading_labels({"id": "x", "task": "niah_1k", "meta": {}}, {"input_ids": torch.zeros(1, 3)}, proc)


def test_task_loss_adds_the_cell_reading_term(tokenizer):
    from kvbench.train.batches import step_rng, task_batch
    from kvbench.train.loop import head_loss, task_loss

    torch.manual_seed(0)
    vlm = transformers.Qwen2_5_VLForConditionalGeneration(build_config("tiny-qwen2.5-vl", tokenizer))
    proc = build_processor(tokenizer)
    phase = Phase("g", "tasks", steps=1, lr=1e-3, batch=2, cell_reading=0.5,
                  mixture=(("digitgrid", 1.0, {"n_queries": 2}),))
    batch = task_batch(step_rng(0, "g", 0), phase, proc)
    labels, cells = batch.pop("labels"), batch.pop("cell_labels")
    assert cells.shape == labels.shape and (cells != -100).sum() == 32  # 16 cells per digitgrid page
    answers, _ = task_loss(vlm, batch, labels, replace(phase, cell_reading=0.0))
    reading, _ = head_loss(vlm, vlm.model(**batch).last_hidden_state, cells)
    got, _ = task_loss(vlm, batch, labels, phase, cell_labels=cells)
    assert got.item() == pytest.approx(answers.item() + 0.5 * reading.item(), rel=1e-5)
    with pytest.raises(ValueError, match="cell_labels"):
        task_loss(vlm, batch, labels, phase)


def test_task_batch_draws_mixture_entries_so_one_family_can_appear_twice(tokenizer, monkeypatch):
    """The zoo LM's mixture holds niah twice (one- and four-token values): each entry's own parameters reach the
    generator (keyed by family, the second entry's replaced the first's), and a mixture of distinct families draws
    the same records as drawing families did (the trained models' batches are unchanged)."""
    import random

    from kvbench.data import smoke
    from kvbench.train.batches import step_rng, task_batch

    seen = []
    real = smoke.sample
    monkeypatch.setattr(smoke, "sample", lambda fam, rng, split, tokenizer=None, **p: seen.append((fam, p))
                        or real(fam, rng, split, tokenizer=tokenizer, **p))
    niah = {"length_tokens": 64, "n_queries": 1}
    mix = (("niah", 1.0, niah), ("niah", 1.0, niah | {"value_tokens": 4}))
    task_batch(step_rng(0, "t", 0), Phase("t", "tasks", steps=1, lr=1e-3, batch=16, mixture=mix), tokenizer)
    assert {p.get("value_tokens", 1) for _, p in seen} == {1, 4}

    seen.clear()
    kv = {"length_tokens": 64, "n_queries": 2}
    mix = (("niah", 1.0, niah), ("kv", 2.0, kv))
    task_batch(step_rng(0, "t", 0), Phase("t", "tasks", steps=1, lr=1e-3, batch=8, mixture=mix), tokenizer)
    rng, want = step_rng(0, "t", 0), []   # the order of drawing families: rng.choices(families, weights), then the record
    for _ in range(8):
        want.append(rng.choices(["niah", "kv"], [1.0, 2.0])[0])
        real(want[-1], rng, "train", tokenizer=tokenizer, **(niah if want[-1] == "niah" else kv))
    assert [f for f, _ in seen] == want and len(set(want)) == 2
