"""The chain-pairs task (ResidualKV Table V: a final answer that reads the generated trace far back), its final
question in both decoding paths, the skip head's supervision and the recipe field that turns it on."""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from kvbench.data.chain import ASK, sample_chain_pairs
from kvbench.models.prompting import IGNORE_INDEX, encode_record
from kvbench.train import heads

pytestmark = pytest.mark.usefixtures("one_thread")


def _record(tokenizer, seed=0, split="test", **kw):
    return sample_chain_pairs(random.Random(seed), split, tokenizer, **kw)


def test_generator_is_a_function_of_its_seed(tokenizer):
    assert _record(tokenizer, 5, hops=12) == _record(tokenizer, 5, hops=12)
    assert _record(tokenizer, 5, hops=12)["context"] != _record(tokenizer, 6, hops=12)["context"]
    assert _record(tokenizer, 5, "train", hops=12) == _record(tokenizer, 5, "train", hops=12)


def test_trace_walks_both_chains_in_alternation(tokenizer):
    r = _record(tokenizer, 1, hops=20)
    stmts = [s.split() for s in r["context"][len("Chains:"):].split(".") if s.strip()]
    nxt = {a: b for a, b in stmts}
    a, b = r["meta"]["nums"]
    walked = []
    for _ in range(20):
        a, b = nxt[a], nxt[b]
        walked += [a, b]
    trace = r["answer"][:-len(r["final"]["question"] + r["final"]["answer"])]
    assert trace.split() == walked and r["max_new_tokens"] == 40 == len(walked)
    assert r["question"] == "\nPairs: " + " ".join(r["meta"]["nums"]) and r["metric"] == "final_answer"


@pytest.mark.parametrize("seed", range(8))
def test_asked_pairing_is_only_in_the_generated_trace(tokenizer, seed):
    r = _record(tokenizer, seed, hops=32)
    m, final = r["meta"], r["final"]
    asked, value = m["asked"], m["final"]
    prompt = r["context"] + r["question"]
    trace = r["answer"][:-len(final["question"] + final["answer"])]
    assert final == {"question": f"{ASK} {asked}", "answer": f" {value}", "max_new_tokens": 1}
    # the pairing (asked A, its B) is written only in the trace: in the prompt the two never meet
    assert f" {asked} {value}" in trace and f" {asked} {value}" not in prompt
    assert not any(asked in s.split() and value in s.split() for s in prompt.split("."))
    # the asked step is in the trace's first half, so the final answer reads at least `hops` tokens back
    assert 1 <= m["ask"] <= 16 and trace.split()[2 * (m["ask"] - 1)] == asked
    assert m["distance"] >= 32 and r["answer"].split()[-1] == value and r["chance"] == 1 / 32


def test_each_step_is_a_two_back_lookup_and_the_final_one_an_induction_on_the_trace(tokenizer):
    """The task is solvable by the supervised heads' rules: every trace token is the one after the latest earlier
    occurrence of the token two back (heads.skip_targets), and the final answer is the one after the latest earlier
    occurrence of the asked token (heads.induction_targets), which is in the generated trace."""
    r = _record(tokenizer, 2, hops=24)
    enc = encode_record(r, tokenizer, with_answer=True)
    ids, n_prompt = enc["input_ids"], enc["prompt_len"]
    trace_end = n_prompt + 48
    skip = heads.skip_targets(ids)[0]
    for t in range(n_prompt - 1, trace_end - 1):   # the position before each trace token predicts it
        assert ids[0, skip[t]] == ids[0, t + 1], t
    last = ids.shape[1] - 2                          # the asked token, which predicts the final answer
    target = heads.induction_targets(ids)[0, last]
    assert n_prompt <= target < trace_end and ids[0, target] == ids[0, -1]


def test_training_encoding_labels_trace_and_answers_not_the_question(tokenizer):
    r = _record(tokenizer, 3, "train", hops=8, n_asks=3)
    enc = encode_record(r, tokenizer, with_answer=True)
    ids, labels, n = enc["input_ids"][0], enc["labels"][0], enc["prompt_len"]
    labelled = [int(i) for i, lab in zip(ids[n:], labels[n:]) if lab != IGNORE_INDEX]
    ask = tokenizer(ASK, add_special_tokens=False)["input_ids"]
    want = tokenizer(r["answer"][:-len(r["final"]["question"] + r["final"]["answer"])])["input_ids"]
    for q in [r["final"]] + r["meta"]["extra_queries"]:
        want += tokenizer(q["answer"])["input_ids"]
    assert labelled == want and not set(ask) & set(labelled)
    assert len(r["meta"]["extra_queries"]) == 2


def test_an_answer_without_its_final_question_is_refused(tokenizer):
    r = _record(tokenizer, 3, hops=8)
    r["answer"] = r["answer"][:-1]
    with pytest.raises(ValueError, match="does not end with its final question"):
        encode_record(r, tokenizer, with_answer=True)


@pytest.mark.parametrize("kw, match", [({"hops": 0}, "hops"), ({"hops": 8, "min_hops": 9}, "min_hops"),
                                       ({"n_asks": 0}, "n_asks"), ({"hops": 1000}, "lexicon has")])
def test_bad_parameters_raise(tokenizer, kw, match):
    with pytest.raises(ValueError, match=match):
        _record(tokenizer, **kw)
    with pytest.raises(ValueError, match="exceeds"):
        _record(tokenizer, split="train", hops=4, n_asks=5)


def test_final_question_is_asked_after_the_trace_in_both_decoding_paths(tokenizer, lm_dir):
    """The full-cache method (HF generate) and the exact press (decode steps through the press cache) append the
    final question to the generated trace and decode the final answer: the same ids."""
    from kvbench.compress.generate import final_question_ids
    from kvbench.eval.compress import CompressMethod
    from kvbench.eval.methods import FullCache
    from kvbench.models import load_model

    model, tok = load_model(str(lm_dir))
    r = _record(tokenizer, 4, hops=6)
    full = FullCache().predict(model, tok, r, None)
    pressed = CompressMethod(spec="fullkv").predict(model, tok, r, None)
    assert full == pressed
    assert full.count(ASK) == 1 and full.split(ASK)[1].split()[0] == r["meta"]["asked"]
    from kvbench.compress.generate import greedy_generate
    from kvbench.compress.registry import PRESS
    from kvbench.compress.generate import split_prompt
    from kvbench.utils.spec import parse

    question, budget = final_question_ids(tok, r)
    prompt, _ = split_prompt(tok, r)
    new, _ = greedy_generate(model, parse("fullkv", PRESS).build(), prompt, prompt.shape[1], 12, eos=set(),
                             then=(question, budget))
    assert budget == 1 and len(new) == 12 + len(question) + 1 and new[12:-1] == question


def test_skip_targets_and_supervision(tokenizer):
    ids = torch.tensor([[5, 7, 9, 5, 8, 7]])
    # position 4 (after a 5) -> the 5 at 0 was followed by position 1; position 5 (after an 8): none
    assert heads.skip_targets(ids).tolist() == [[-1, -1, -1, -1, 1, -1]]
    from kvbench.models.tiny import build_config

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(build_config("tiny-qwen2-lm", tokenizer)).eval()
    x = torch.randint(10, 200, (1, 16))
    x[:, 8:] = x[:, :8]
    mask = torch.ones_like(x)
    with heads.supervise_heads(model, skip=True):
        model(input_ids=x, attention_mask=mask)
        loss = heads.skip_supervision_loss(x, mask) + heads.head_supervision_loss(x, mask)
    assert torch.isfinite(loss) and loss.item() > 0 and model.config._attn_implementation == "sdpa"
    with heads.supervise_heads(model):
        model(input_ids=x, attention_mask=mask)
        with pytest.raises(RuntimeError, match="skip=True"):
            heads.skip_supervision_loss(x, mask)


def test_skip_supervision_recipe_field():
    from kvbench.train.recipes import apply_overrides, chain_recipe, lm_recipe, phase_fields

    # a field added later: models trained before it keep their recipe hash
    assert all("skip_supervision" not in phase_fields(p) for p in lm_recipe())
    assert any(p.skip_supervision > 0 for p in chain_recipe())
    with pytest.raises(ValueError, match="skip_supervision must be a weight"):
        apply_overrides(lm_recipe(), {"phases": {"copy32": {"skip_supervision": -1.0}}})
    with pytest.raises(ValueError, match="needs head_supervision"):
        apply_overrides(lm_recipe(), {"phases": {"copy32": {"skip_supervision": 1.0, "head_supervision": 0.0}}})


def test_a_final_question_on_a_multi_query_record_is_refused():
    from kvbench.eval.compress import CompressMethod

    rec = {"id": "r0", "kind": "text", "context": "c", "multi_turns": [{"input": "q", "answer": "a"}],
           "final": {"question": "\nAsk: X", "answer": " Y", "max_new_tokens": 1}}
    with pytest.raises(ValueError, match="r0.*final question"):
        CompressMethod(spec="fullkv").check_records([rec])


def test_chain_codec_stream_draws_both_chain_tasks(tokenizer):
    """Table V's codec trains on what its backbone was trained on: plain chains and chain pairs (with their asks)."""
    from kvbench.compress.residualkv.train import ChainStream

    stream = ChainStream(tokenizer, "train", 128, seed=0)
    assert [m[0] for m in stream.mixture] == ["chain", "chain_pairs"]
    for i in range(6):
        ids, labels = stream.batch(i)
        assert ids.shape == labels.shape and (labels != IGNORE_INDEX).sum() > 0


def test_a_state_saved_before_skip_supervision_existed_resumes(tmp_path, tokenizer):
    """A training state whose saved recipe predates the field (no ``skip_supervision`` key) is the same recipe."""
    import json

    from kvbench.models.tiny import build_config
    from kvbench.train.loop import run_phases
    from kvbench.train.recipes import Phase

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(build_config("tiny-qwen2-lm", tokenizer))
    phases = [Phase("copy", "copy", steps=2, lr=1e-3, warmup=1, batch=2, seq_len=16)]
    from kvbench.utils.steps import SliceEnded

    with pytest.raises(SliceEnded):
        run_phases(model, tokenizer, phases, tmp_path, seed=0, max_steps=1)
    meta_path = tmp_path / "state" / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["recipe"][0].pop("skip_supervision") == 0.0
    meta_path.write_text(json.dumps(meta))
    assert run_phases(model, tokenizer, phases, tmp_path, seed=0)["steps"] == 2
    meta["recipe"][0]["lr"] = 2e-3   # a real difference is still refused
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="another recipe"):
        run_phases(model, tokenizer, phases, tmp_path, seed=0)
