"""The lmms-eval adapter: registration by name, request → record, and an offline evaluation through
lmms-eval's own entry point (``simple_evaluate``) on a local docpages task, checked against kvbench's paths."""
from __future__ import annotations

import json

import pytest
import torch

from kvbench.lmms import MODEL_ID, manifests, model_id
from kvbench.lmms.records import IMAGE_TOKEN, to_record
from kvbench.reuse import available_policies

torch.set_num_threads(1)
lmms_eval = pytest.importorskip("lmms_eval")


def test_every_policy_is_registered_by_name():
    from lmms_eval import models
    from lmms_eval.api.model import lmms

    names = set(models.list_available_models())
    assert {MODEL_ID, *(model_id(p) for p in available_policies())} <= names, "entry point missing: pip install -e ."
    cls = models.get_model("kvbench_kvshare_conduit")
    assert issubclass(cls, lmms) and cls.is_simple and cls.default_policy == "kvshare-conduit"
    assert models.get_model(MODEL_ID).default_policy == "conduit"
    from kvbench.compress.registry import PRESS

    assert len({m.model_id for m in manifests()}) == len(available_policies()) + 1 + len(PRESS.classes) + 1


def test_request_to_record_places_images():
    rec = to_record(f"Page 1:{IMAGE_TOKEN}Page 2:{IMAGE_TOKEN}Page 2, cell B", ["a.png", "b.png"],
                    {"system": "Add one.", "generic_system": "Read."})
    assert rec["content"] == [{"type": "text", "text": "Page 1:"}, {"type": "image", "image": "a.png"},
                              {"type": "text", "text": "Page 2:"}, {"type": "image", "image": "b.png"}]
    assert (rec["question"], rec["system"], rec["generic_system"]) == ("Page 2, cell B", "Add one.", "Read.")
    assert [p["type"] for p in to_record("What?", ["a", "b"])["content"]] == ["image", "image"]
    with pytest.raises(ValueError, match="placeholders"):
        to_record(f"{IMAGE_TOKEN} x", ["a", "b"])
    with pytest.raises(ValueError, match="no image"):
        to_record("x", [])


def test_model_args_are_read_by_the_spec_grammar():
    """The policy, r and each policy parameter, as lmms-eval passes them (typed or text), make one spec."""
    from kvbench.lmms.model import method_spec

    assert method_spec("conduit", 0.1, {"lam": 0.5}).canonical == "conduit@0.1:lam=0.5"
    assert method_spec("conduit", 0.1, {"lam": "0.5", "use_v_norm": "false"}).canonical == \
        "conduit@0.1:lam=0.5,use_v_norm=false"
    assert method_spec("reuse", 0.3, {}).canonical == "reuse" and method_spec("full", 0.1, {}).effective_r == 1.0
    with pytest.raises(ValueError, match="hold ',', '=' or ':'"):   # would be read as a second parameter
        method_spec("conduit", 0.1, {"lam": "0.5,use_v_norm=false"})
    with pytest.raises(ValueError, match=r"\['thread'\] \(neither the adapter's own nor the policy's\)"):
        method_spec("conduit", 0.1, {"thread": 2})


@pytest.mark.parametrize("bad, match", [
    (dict(policy="nope"), "unknown method 'nope'"), (dict(r=2), "ratio"), (dict(batch_size=2), "batch_size"),
    (dict(temperature=1), r"model arguments \['temperature'\].*unknown parameter 'temperature' for 'conduit'"),
    (dict(policy="prophetkv", lam=0.5), "unknown parameter 'lam' for 'prophetkv'"),
    (dict(use_v_norm="no"), "use_v_norm must be true or false")])
def test_bad_model_args_fail_before_loading(bad, match):
    from kvbench.lmms.model import KVBenchReuse

    with pytest.raises(ValueError, match=match):
        KVBenchReuse(pretrained="/nonexistent", **bad)


@pytest.fixture(scope="module")
def task(tokenizer_dir, tmp_path_factory):
    """A 3-record docpages JSONL on disk and its lmms-eval task directory."""
    from kvbench.data.smoke import materialise
    from kvbench.lmms.task import write_task

    root = tmp_path_factory.mktemp("lmms")
    materialise("docpages", root / "data", tokenizer_dir, n_train=1, n_test=3)
    write_task(root / "tasks", root / "data" / "test.jsonl")
    records = [json.loads(line) for line in (root / "data" / "test.jsonl").read_text().splitlines()]
    return root, records


def _evaluate(model, task_dir, **kw):
    from lmms_eval.evaluator import simple_evaluate
    from lmms_eval.tasks import TaskManager

    res = simple_evaluate(model=model, tasks=["kvbench_docpages"], task_manager=TaskManager(include_path=str(task_dir)),
                          log_samples=True, bootstrap_iters=0, **kw)
    samples = sorted(res["samples"]["kvbench_docpages"], key=lambda s: s["doc_id"])
    return res["results"]["kvbench_docpages"], [s["filtered_resps"][0] for s in samples]


def test_full_policy_by_name_matches_kvbench_eval(task, vlm_dir):
    """`--model kvbench_full` through lmms-eval answers exactly as `kvbench eval --method full` (model.generate):
    the lmms prompt (doc_to_text + images) encodes to the same tokens as encode_record."""
    from kvbench.eval.methods import FullCache
    from kvbench.models import load_model

    root, records = task
    metrics, preds = _evaluate("kvbench_full", root / "tasks", model_args=f"pretrained={vlm_dir}")
    model, proc = load_model(vlm_dir)
    want = [FullCache().predict(model, proc, r, root / "data") for r in records]
    assert preds == want
    assert metrics["exact_match,none"] == pytest.approx(sum(p == r["answer"] for p, r in zip(preds, records)) / 3)


def test_conduit_object_matches_the_reuse_engine(task, vlm_dir, tmp_path):
    from kvbench.lmms.model import KVBenchReuse
    from kvbench.reuse import ImageKVStore, greedy_decode, run_record

    root, records = task
    lm = KVBenchReuse(pretrained=str(vlm_dir), policy="conduit", r=0.1, lam=0.5, cache_dir=str(tmp_path / "c"))
    _, preds = _evaluate(lm, root / "tasks")
    assert lm.store(records[0]["generic_system"]).stats["built"] > 0  # images went through the KV cache
    ad = lm.adapter
    store = ImageKVStore(tmp_path / "direct", ad, records[0]["generic_system"])
    tok = ad.processor.tokenizer
    for rec, pred in zip(records, preds):
        res = run_record(ad, store, rec, "conduit", 0.1, root / "data", lam=0.5)
        ids = greedy_decode(ad, res.output, rec["max_new_tokens"])
        ids = ids[:ids.index(tok.eos_token_id)] if tok.eos_token_id in ids else ids
        assert pred == tok.decode(ids, skip_special_tokens=True).strip()



def test_loglikelihood_scores_continuations_over_the_refreshed_cache(task, vlm_dir, tmp_path):
    """lmms-eval loglikelihood requests get (mean NLL per continuation token, is_greedy), lmms-eval's own
    convention (its multiple_choice scoring takes the argmin; EvolvingLMMs-Lab/lmms-eval#370), computed
    over the policy's refreshed K/V: equal to continuation_logprob on the same record."""
    from lmms_eval.api.instance import Instance

    from kvbench.lmms.model import KVBenchReuse
    from kvbench.lmms.task import doc_to_text, doc_to_visual
    from kvbench.reuse import ImageKVStore, continuation_logprob, run_record

    root, records = task
    lm = KVBenchReuse(pretrained=str(vlm_dir), policy="conduit", r=0.1, cache_dir=str(tmp_path / "c"))
    docs = records
    lm.task_dict = {"t": {"test": docs}}
    visual = lambda doc: doc_to_visual(doc, root / "data")  # noqa: E731
    conts = ["3", "45"]
    meta = lambda i: {"task": "t", "doc_id": i, "repeats": 1}  # noqa: E731
    reqs = [Instance("loglikelihood", (doc_to_text(d), c, visual, i, "t", "test"), idx=0, metadata=meta(i))
            for i, d in enumerate(docs) for c in conts]
    got = lm.loglikelihood(reqs)
    ad, tok = lm.adapter, lm.adapter.processor.tokenizer
    store = ImageKVStore(tmp_path / "direct", ad, records[0]["generic_system"])
    for i, rec in enumerate(records):
        out = run_record(ad, store, rec, "conduit", 0.1, root / "data").output
        for j, c in enumerate(conts):
            ids = tok(c, add_special_tokens=False)["input_ids"]
            lp, greedy = continuation_logprob(ad, out, ids)
            assert got[2 * i + j][0] == pytest.approx(-lp / len(ids), abs=1e-5)
            assert got[2 * i + j][1] == greedy
    with pytest.raises(ValueError, match="empty continuation"):
        lm.loglikelihood([Instance("loglikelihood", (doc_to_text(docs[0]), "", visual, 0, "t", "test"), idx=0,
                                   metadata=meta(0))])


def test_multi_round_requests_answer_each_round_through_the_engine(task, vlm_dir, tmp_path):
    """lmms-eval's multi-round protocol: round 0 from the request, later rounds from doc_to_text until it
    signals the end; each round is a reuse request (its answer equals ``answer`` on the same record)."""
    from lmms_eval.api.instance import Instance

    from kvbench.lmms.model import KVBenchReuse
    from kvbench.lmms.records import to_record as rec_of
    from kvbench.lmms.task import doc_to_text, doc_to_visual

    root, records = task
    lm = KVBenchReuse(pretrained=str(vlm_dir), policy="conduit", r=0.1, cache_dir=str(tmp_path / "c"))
    lm.task_dict = {"t": {"test": records}}
    visual = lambda doc: doc_to_visual(doc, root / "data")  # noqa: E731
    seen = []

    def rounds(doc, previous_output, round_idx, previous_round_info):
        seen.append((round_idx, list(previous_output), previous_round_info))
        if round_idx == 2:
            return None, None, True, [a.upper() or "-" for a in previous_output], None
        return visual(doc), doc_to_text(doc) + " again", False, previous_output, {"round": round_idx}

    req = Instance("generate_until_multi_round", (doc_to_text(records[0]), {"max_new_tokens": 2}, visual, rounds, 0,
                                                  "t", "test"), idx=0, metadata={"task": "t", "doc_id": 0, "repeats": 1})
    (got,) = lm.generate_until_multi_round([req])
    first = lm.answer(rec_of(doc_to_text(records[0]), visual(records[0]), records[0], max_new_tokens=2, **lm.opts), [])
    second = lm.answer(rec_of(doc_to_text(records[0]) + " again", visual(records[0]), records[0], max_new_tokens=2,
                              **lm.opts), [])
    assert seen == [(1, [first], None), (2, [first, second], {"round": 1})]
    assert got == (first.upper() or "-", second.upper() or "-")
    bad = Instance("generate_until_multi_round", (doc_to_text(records[0]), {}, visual, lambda doc, **kw: "x", 0, "t",
                                                  "test"), idx=0, metadata={"task": "t", "doc_id": 0, "repeats": 1})
    with pytest.raises(ValueError, match="t/test/0: doc_to_text of a multi-round task must return"):
        lm.generate_until_multi_round([bad])
    no_visuals = Instance("generate_until_multi_round",
                          (doc_to_text(records[0]), {}, visual, lambda doc, **kw: (None, "x", False, [], None), 0, "t",
                           "test"), idx=0, metadata={"task": "t", "doc_id": 0, "repeats": 1})
    with pytest.raises(ValueError, match=r"t/test/0: round 1 has no visuals \(None\)"):
        lm.generate_until_multi_round([no_visuals])
