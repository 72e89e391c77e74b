"""Multi-query records through ``kvbench eval`` (kvbench.eval.multiquery, the runner, CompressMethod), the smoke
generators of shared-context tasks (kvbench.data.shared_context) and SCBench's scorers (kvbench.eval.scbench_metrics)."""
from __future__ import annotations

import random

import pytest
import transformers
from _zoo_fixtures import text_record, write_split

from kvbench.data import shared_context, smoke
from kvbench.eval import scbench_metrics as scb
from kvbench.eval.compress import query_ids
from kvbench.eval.metrics import METRICS
from kvbench.eval.runner import run_eval, validate_records
from kvbench.utils.io import read_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")


def mq_record(i: int, n: int = 3, **kw) -> dict:
    """A multi-query record ``m<i>``: ``n`` queries about one context."""
    r = {"id": f"m{i}", "task": "toymq", "split": "test", "kind": "text",
         "context": "".join(f"key {k} is {k * 7}. " for k in range(6)),
         "multi_turns": [{"input": f" What is key {k}? Answer:", "answer": f" {k * 7}"} for k in range(n)],
         "max_new_tokens": 3, "metric": "exact_match", "chance": 0.1, "meta": {}}
    r.update(kw)
    return r


def single(rec: dict) -> list[dict]:
    """The queries of a multi-query record as single-query records on the same context."""
    return [{**{k: v for k, v in rec.items() if k != "multi_turns"}, "id": f"{rec['id']}-{j}",
             "question": t["input"], "answer": t["answer"]} for j, t in enumerate(rec["multi_turns"])]


@pytest.mark.parametrize("method", ["fullkv", "snapkv:keep=0.3,window=4"])
def test_n_queries_equal_n_single_query_runs_on_the_same_context(lm_dir, tmp_path, method):
    recs = [mq_record(0), mq_record(1, n=2)]
    multi = write_split(tmp_path / "mq" / "test.jsonl", recs)
    one = write_split(tmp_path / "one" / "test.jsonl", [s for r in recs for s in single(r)])
    m = run_eval(lm_dir, multi, method=method, out_dir=tmp_path / "run_mq", threads=1)
    run_eval(lm_dir, one, method=method, out_dir=tmp_path / "run_one", threads=1)
    rows, ones = read_jsonl(tmp_path / "run_mq" / "predictions.jsonl"), read_jsonl(tmp_path / "run_one" / "predictions.jsonl")
    assert [p for r in rows for p in r["prediction"]] == [r["prediction"] for r in ones]
    assert [s for r in rows for s in r["scores"]] == [r["score"] for r in ones]
    assert [r["gold"] for r in rows] == [[t["answer"] for t in r["multi_turns"]] for r in recs]
    for r in rows:   # the record's score is the mean of its queries'; its audit has one entry per query
        assert r["score"] == pytest.approx(sum(r["scores"]) / len(r["scores"]))
        assert len(r["plan"]["queries"]) == len(r["scores"]) and 0 < r["plan"]["kr_packed"] <= 1.0
        assert r["plan"]["cr"] is not None and r["plan"]["n_context"] > 0
    assert m["n"] == 2
    if method == "fullkv":
        assert all(q["kr_packed"] == 1.0 and q["cr"] == 1.0 for r in rows for q in r["plan"]["queries"])


def test_a_one_pass_press_on_multi_query_records_records_what_ran(lm_dir, tmp_path):
    """Review finding (issue #32): a one_pass press on multi-query records recorded "one chunk: context + question"
    beside the multi-request form it ran; the run's config.yaml says what ran, and the answers are the
    shared-context run's."""
    split = write_split(tmp_path / "mq" / "test.jsonl", [mq_record(0, n=2)])
    for protocol in ("one_pass", "shared_context"):
        run_eval(lm_dir, split, method=f"snapkv:keep=0.3,window=4,protocol={protocol}", out_dir=tmp_path / protocol,
                 threads=1)
    recorded = (tmp_path / "one_pass" / "config.yaml").read_text()
    assert "one chunk: context + question" not in recorded and "one_pass protocol does not apply" in recorded
    got = [read_jsonl(tmp_path / p / "predictions.jsonl")[0]["prediction"] for p in ("one_pass", "shared_context")]
    assert got[0] == got[1]


def test_one_query_method_refuses_a_multi_query_split_before_loading(tmp_path, monkeypatch):
    from kvbench.eval.methods import FullCache

    monkeypatch.setattr(FullCache, "multi_query", False)
    split = write_split(tmp_path / "test.jsonl", [mq_record(0)])
    with pytest.raises(ValueError, match="'m0' holds several queries .*method 'full'"):
        run_eval("/nonexistent/model", split, method="full", out_dir=tmp_path / "run")


def test_full_method_answers_each_query_as_its_own_request(lm_dir, tmp_path):
    rec = mq_record(0)
    run_eval(lm_dir, write_split(tmp_path / "mq" / "test.jsonl", [rec]), method="full", out_dir=tmp_path / "a", threads=1)
    run_eval(lm_dir, write_split(tmp_path / "one" / "test.jsonl", single(rec)), method="full", out_dir=tmp_path / "b",
             threads=1)
    row, ones = read_jsonl(tmp_path / "a" / "predictions.jsonl")[0], read_jsonl(tmp_path / "b" / "predictions.jsonl")
    assert row["prediction"] == [r["prediction"] for r in ones] and row["scores"] == [r["score"] for r in ones]


@pytest.mark.parametrize("change, match", [
    ({"multi_turns": []}, "non-empty list"),
    ({"multi_turns": "q"}, "non-empty list"),
    ({"question": "q?"}, "must not also have \\['question'\\]"),
    ({"multi_turns": [{"input": "", "answer": "a"}]}, r"multi_turns\[0\]: 'input' must be a non-empty string"),
    ({"multi_turns": [{"input": "q", "answer": 3}]}, r"'answer' must be a string or a non-empty list"),
    ({"multi_turns": [{"input": "q", "answer": "a", "metric": "bleu"}]}, r"'metric' must be one of"),
    ({"multi_turns": [{"input": "q", "answer": "a", "max_new_tokens": 0}]}, r"'max_new_tokens' must be a positive"),
    ({"multi_turns": ["q"]}, r"multi_turns\[0\] must be an object"),
    ({"multi_turns": [{"input": "q", "answer": ["a", "b"]}]}, r"a list of answers needs a metric that takes one"),
])
def test_bad_multi_query_records_are_named(tmp_path, change, match):
    with pytest.raises(ValueError, match=match):
        validate_records([mq_record(0, **change)], "split.jsonl")


def test_a_single_query_record_still_needs_its_question():
    rec = text_record(0)
    del rec["question"]
    with pytest.raises(ValueError, match="missing required field 'question'"):
        validate_records([rec])


def test_per_turn_metric_and_budget(lm_dir, tmp_path):
    rec = mq_record(0, n=2)
    rec["multi_turns"][1].update(metric="scb_substring", max_new_tokens=1)
    split = write_split(tmp_path / "test.jsonl", [rec])
    run_eval(lm_dir, split, method="fullkv", out_dir=tmp_path / "run", threads=1)
    row = read_jsonl(tmp_path / "run" / "predictions.jsonl")[0]
    assert row["status"] == "ok" and len(row["scores"]) == 2
    tok = transformers.AutoTokenizer.from_pretrained(lm_dir)
    context, queries = query_ids(tok, rec)
    # a one-token budget: the cache after the query holds the context and the query chunk only (no decode step)
    assert row["plan"]["n_context"] == context.shape[1]
    assert row["plan"]["queries"][1]["n_tokens"] == context.shape[1] + queries[1].shape[1]


# -- smoke generators ------------------------------------------------------------------------------
@pytest.mark.parametrize("task", ["kv_1k_mq", "niah_1k_mq", "vt_1k_mq"])
def test_smoke_multi_query_tasks_hold_the_single_query_question_form(tokenizer, task):
    spec = smoke.TASKS[task]
    rec = smoke.sample(spec.family, smoke.record_rng(task, "test", 0, 0), "test", tokenizer, **spec.params)
    validate_records([{**rec, "id": "x", "task": task}])
    turns = rec["multi_turns"]
    assert len(turns) == spec.params["n_queries"] and len({t["input"] for t in turns}) == len(turns)
    prefix = "\nChain: " if task.startswith("vt") else "\nQuery: "
    assert all(t["input"].startswith(prefix) for t in turns) and "extra_queries" not in rec["meta"]
    # each query alone is a record of the family's own form: one context token budget, answers of one token (vt: hops)
    assert rec["meta"]["n_tokens"] <= spec.params["length_tokens"]
    assert all(len(t["answer"].split()) == rec["max_new_tokens"] for t in turns)


def test_smoke_multi_query_generators_refuse_a_single_query(tokenizer):
    with pytest.raises(ValueError, match="n_queries must be an int >= 2"):
        shared_context.sample_kv_mq(random.Random(0), "test", tokenizer, 256, n_queries=1)


# -- SCBench scorers (compute_scores.py) -------------------------------------------------------------
def test_scbench_scorers():
    assert METRICS["scb_substring"] is scb.substring
    assert scb.substring("the value is abc-123.", "abc-123") == 1.0 and scb.substring("ABC-123", "abc-123") == 0.0
    assert scb.any_upper(" paris, france", ["Paris"]) == 1.0 and scb.any_upper("rome", ["Paris", "Lyon"]) == 0.0
    assert scb.all_lower("X1 and x2", ["x1", "X2", "x3"]) == 0.67
    assert scb.first_int("The pass key is 71432. ok 9", "71432") == 1.0 and scb.first_int("none", "1") == 0.0
    assert scb.rouge_lsum("the cat sat", "the cat sat") == 1.0 and scb.rouge_lsum("", "a b") == 0.0
    # rouge_score's rougeLsum of "a b c d" vs "a c e": LCS "a c", P 2/4, R 2/3 -> F 4/7
    assert scb.rouge_lsum("a b c d", "a c e") == pytest.approx(4 / 7)
    # summary level: union of LCS hits over prediction sentences ("a b" and "c d" against reference "a c d")
    assert scb.rouge_lsum("a b\nc d", "a c d") == pytest.approx(2 * (3 / 4) * 1 / (3 / 4 + 1))


def test_a_record_mixing_metrics_scores_the_mean_of_each_metrics_mean():
    """SCBench's summary-with-needles is one number, the mean of its two accuracies (summary ROUGE, passkey); the
    mean over the turns weighted the passkey turns by their count (review of the merge, issue #17)."""
    from kvbench.eval.multiquery import record_score

    rec = {"id": "r", "metric": "scb_first_int",
           "multi_turns": [{"input": "q", "answer": "1"}] * 3 + [{"input": "s", "answer": "x", "metric": "scb_rouge_lsum"}]}
    assert record_score(rec, [1.0, 1.0, 1.0, 0.0]) == 0.5            # (mean of 1, 1, 1 + 0) / 2, not 3/4
    assert record_score({**rec, "multi_turns": rec["multi_turns"][:3]}, [1.0, 0.0, 0.5]) == 0.5   # one metric: the mean
    with pytest.raises(ValueError, match="4 queries but 3 scores"):
        record_score(rec, [1.0, 1.0, 1.0])
