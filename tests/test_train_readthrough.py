"""Training-time prompt hiding (kvbench.train.readthrough): what is hidden, and that nothing else changes."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
import transformers

from kvbench.data import instructions
from kvbench.models.tiny import build_config, build_processor
from kvbench.train.readthrough import hidden_keys, hide_prompt, stale_page_block
from kvbench.train.recipes import Phase

IMG = 7


def test_prefix_mode_hides_the_prompt_before_the_first_page_from_the_question():
    ids = torch.tensor([1, 2, 3, IMG, IMG, 4, IMG, 5, 6])
    q, k = hidden_keys(ids, IMG, "prefix")
    assert q.tolist() == [False] * 7 + [True, True]
    assert k.tolist() == [False, True, True] + [False] * 6


def test_text_mode_also_hides_the_text_between_pages():
    ids = torch.tensor([1, 2, 3, IMG, IMG, 4, IMG, 5, 6])
    q, k = hidden_keys(ids, IMG, "text")
    assert q.tolist() == [False] * 7 + [True, True]
    assert k.tolist() == [False, True, True, False, False, True, False, False, False]


def test_no_mode_hides_nothing_and_bad_input_is_named():
    ids = torch.tensor([1, IMG, 2])
    q, k = hidden_keys(ids, IMG, "")
    assert not q.any() and not k.any()
    with pytest.raises(ValueError, match="'all'"):
        hidden_keys(ids, IMG, "all")
    with pytest.raises(ValueError, match="visual tokens"):
        hidden_keys(torch.tensor([1, 2, 3]), IMG, "text")


def test_hiding_changes_only_the_question_side(tokenizer):
    from kvbench.train.batches import step_rng, task_batch

    torch.manual_seed(0)
    vlm = transformers.Qwen2_5_VLForConditionalGeneration(build_config("tiny-qwen2.5-vl", tokenizer)).eval()
    proc = build_processor(tokenizer)
    phase = Phase("g", "tasks", steps=1, lr=1e-3, batch=3, hide_prompt="text",
                  mixture=(("docpages", 1.0, {"n_queries": 2}),))
    batch = task_batch(step_rng(0, "g", 0), phase, proc)
    block = batch.pop("hide_block")
    q = block.any(-1)
    batch.pop("labels")
    with torch.no_grad():
        plain = vlm.model(**batch).last_hidden_state
        with hide_prompt(vlm, block, batch["attention_mask"]):
            hidden = vlm.model(**batch).last_hidden_state
    assert vlm.config._attn_implementation == "sdpa"  # restored
    real = batch["attention_mask"].bool()
    diff = (plain - hidden).abs().amax(-1)
    assert diff[real & ~q].max() == 0  # pages and prompt: same causal attention as before
    assert (diff[q] > 1e-4).all()      # question side: the prompt text is gone


def test_stale_page_block_shows_the_decoy_to_the_question_side_only():
    # 0 | true instruction 1 2 | decoy 3 | page IMG IMG, text 4, page IMG | question 5 6
    ids = torch.tensor([0, 1, 2, 3, IMG, IMG, 4, IMG, 5, 6])
    decoy = torch.zeros(10, dtype=torch.bool)
    decoy[3] = True
    block = stale_page_block(ids, IMG, "text", decoy)
    hidden = {(int(t), int(s)) for t, s in block.nonzero()}
    pages, question = range(4, 8), (8, 9)
    expected = {(t, 3) for t in pages} | {(t, s) for t in question for s in (1, 2, 6)}
    assert hidden == expected


def test_stale_page_block_names_bad_input():
    ids = torch.tensor([0, 1, IMG, 2])
    decoy = torch.tensor([False, True, False, False])
    with pytest.raises(ValueError, match="hide_prompt"):
        stale_page_block(ids, IMG, "", decoy)
    with pytest.raises(ValueError, match="non-empty"):
        stale_page_block(ids, IMG, "text", torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="before the first visual token"):
        stale_page_block(ids, IMG, "text", torch.tensor([False, False, False, True]))


def test_stale_page_records_carry_a_decoy_the_pages_cannot_see(tokenizer):
    from kvbench.train.batches import decoy_tokens, step_rng, task_batch

    proc = build_processor(tokenizer)
    img = tokenizer.convert_tokens_to_ids(proc.image_token)
    phase = Phase("g", "tasks", steps=1, lr=1e-3, batch=4, hide_prompt="text", stale_pages=1.0, cell_reading=1.0,
                  mixture=(("docpages", 1.0, {"n_queries": 2}),))
    batch = task_batch(step_rng(0, "g", 0), phase, proc)
    plain = task_batch(step_rng(0, "g", 0), replace(phase, stale_pages=0.0), proc)
    for b in range(4):
        ids = batch["input_ids"][b][batch["attention_mask"][b].bool()]
        visual = (ids == img).nonzero()[:, 0]
        block = batch["hide_block"][b][:len(ids), :len(ids)]  # right padding
        decoy = block[visual[0]]  # what the first page may not see: the decoy alone
        assert decoy.any() and int(decoy.nonzero()[-1]) < int(visual[0])
        decoy_text = tokenizer.decode(ids[decoy]).strip()
        header, instruction = decoy_text.split(". ", 1)
        assert header + "." in instructions.HEADERS
        assert instruction.rstrip(".") + "." in {i.text for i in instructions.INSTRUCTIONS.values()}
        # the question side sees the decoy and nothing else of the prompt text after position 0
        last = int(visual[-1])
        seen = ~block[last + 1, :last + 1]
        assert (seen == (decoy[:last + 1] | (ids[:last + 1] == img) | (torch.arange(last + 1) == 0))).all()
    # the answers and the per-cell targets are the plain record's: the true instruction's (one record per batch,
    # since the stale draws move the generator for the records after it)
    one, plain = (task_batch(step_rng(0, "g", 1), replace(phase, batch=1, stale_pages=share), proc) for share in (1.0, 0))
    for key in ("labels", "cell_labels"):
        assert one[key][one[key] != -100].tolist() == plain[key][plain[key] != -100].tolist()
    assert one["input_ids"].shape[1] > plain["input_ids"].shape[1]
    with pytest.raises(ValueError, match="not a stale-page record"):
        decoy_tokens({"id": "x", "meta": {}}, {}, proc)


def test_a_zero_stale_share_leaves_the_recipe_hash_alone():
    from kvbench.train.recipes import zoo_recipe
    from kvbench.utils.recipe import recipe_hash

    kw = dict(seed=0, threads=2, tokenizer="t")
    lm = zoo_recipe("tiny-qwen2-lm", "lm", {}, **kw)
    assert all("stale_pages" not in p for p in lm["phases"])  # the LM's directory name is unchanged
    strong = zoo_recipe("tiny-qwen2.5-vl", "vlm", {}, **kw)
    assert [p.get("stale_pages") for p in strong["phases"]] == [None, 0.5, 0.5]
    none = zoo_recipe("tiny-qwen2.5-vl", "vlm", {"phases": {"grid": {"stale_pages": 0}, "tasks": {"stale_pages": 0}}},
                      **kw)
    assert all("stale_pages" not in p for p in none["phases"]) and recipe_hash(none) != recipe_hash(strong)
    with pytest.raises(ValueError, match="stale_pages"):
        zoo_recipe("tiny-qwen2.5-vl", "vlm", {"phases": {"tasks": {"stale_pages": 1.5}}}, **kw)
    with pytest.raises(ValueError, match="needs hide_prompt"):
        zoo_recipe("tiny-qwen2.5-vl", "vlm", {"phases": {"tasks": {"hide_prompt": ""}}}, **kw)
