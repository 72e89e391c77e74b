"""Training-time prompt hiding (kvbench.train.readthrough): what is hidden, and that nothing else changes."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
import transformers

from kvbench.models.tiny import build_config, build_processor
from kvbench.train.readthrough import hidden_keys, hide_prompt
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
    q, k = batch.pop("hide_queries"), batch.pop("hide_keys")
    batch.pop("labels")
    with torch.no_grad():
        plain = vlm.model(**batch).last_hidden_state
        with hide_prompt(vlm, q, k, batch["attention_mask"]):
            hidden = vlm.model(**batch).last_hidden_state
    assert vlm.config._attn_implementation == "sdpa"  # restored
    real = batch["attention_mask"].bool()
    diff = (plain - hidden).abs().amax(-1)
    assert diff[real & ~q].max() == 0  # pages and prompt: same causal attention as before
    assert (diff[q] > 1e-4).all()      # question side: the prompt text is gone
