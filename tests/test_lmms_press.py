"""Compression presses as lmms-eval models (kvbench.lmms.press; ResidualKV Table II through lmms-eval's tasks)."""
from __future__ import annotations

import pytest
import torch

lmms_eval = pytest.importorskip("lmms_eval")
from test_lmms_adapter import _evaluate, task  # noqa: E402,F401  (the offline docpages task fixture)

torch.set_num_threads(1)


def test_every_press_is_registered_by_name():
    from lmms_eval import models

    from kvbench.compress.registry import PRESS
    from kvbench.lmms.press import PRESS_MODEL_ID, press_model_id

    names = set(models.list_available_models())
    assert {PRESS_MODEL_ID, *(press_model_id(p) for p in PRESS.classes)} <= names
    assert models.get_model("kvbench_press_snapkv").default_press == "snapkv"


def test_model_args_make_one_press_spec():
    from kvbench.lmms.press import press_spec

    assert press_spec("snapkv", {"keep": "0.1", "window": 8}).canonical == "snapkv:keep=0.1,window=8"
    with pytest.raises(ValueError, match="hold ',', '=' or ':'"):
        press_spec("snapkv", {"keep": "0.1,window=8"})


@pytest.mark.parametrize("bad, match", [
    (dict(press="nope"), "unknown method 'nope'"), (dict(batch_size=2), "batch_size"),
    (dict(press="snapkv", temperature=1), "unknown parameter 'temperature' for 'snapkv'")])
def test_bad_model_args_fail_before_loading(bad, match):
    from kvbench.lmms.press import KVBenchPress

    with pytest.raises(ValueError, match=match):
        KVBenchPress(pretrained="/nonexistent", **bad)


def test_a_text_lm_is_refused_when_loaded(lm_dir):
    """A text LM as a press model read the image placeholders as text and scored image requests without the images."""
    from kvbench.lmms.press import KVBenchPress

    with pytest.raises(ValueError, match="with no vision tower; lmms-eval's requests carry images"):
        KVBenchPress(pretrained=str(lm_dir), press="fullkv")


def test_fullkv_by_name_matches_the_full_eval_and_snapkv_matches_kvbench_eval(task, vlm_dir):  # noqa: F811
    """`--model kvbench_press_fullkv` answers as `kvbench eval --method full`; a SnapKV object as CompressMethod."""
    from kvbench.eval.compress import CompressMethod
    from kvbench.eval.methods import FullCache
    from kvbench.lmms.press import KVBenchPress
    from kvbench.models import load_model

    root, records = task
    _, preds = _evaluate("kvbench_press_fullkv", root / "tasks", model_args=f"pretrained={vlm_dir}")
    model, proc = load_model(vlm_dir)
    assert preds == [FullCache().predict(model, proc, r, root / "data") for r in records]
    lm = KVBenchPress(pretrained=str(vlm_dir), press="snapkv", keep=0.1, window=4)
    _, preds = _evaluate(lm, root / "tasks")
    method = CompressMethod(spec="snapkv:keep=0.1,window=4")
    assert preds == [method.predict(model, proc, r, root / "data") for r in records]


def test_a_press_answers_multi_round_requests_one_compressed_request_per_round(task, vlm_dir):  # noqa: F811
    """The press model had no multi-round path (NotImplementedError); it now shares the reuse model's loop, each
    round a new request whose prompt goes through the press."""
    from lmms_eval.api.instance import Instance

    from kvbench.lmms.press import KVBenchPress
    from kvbench.lmms.records import to_record as rec_of
    from kvbench.lmms.task import doc_to_text, doc_to_visual

    root, records = task
    lm = KVBenchPress(pretrained=str(vlm_dir), press="snapkv", keep=0.5, window=4)
    lm.task_dict = {"t": {"test": records}}
    visual = lambda doc: doc_to_visual(doc, root / "data")  # noqa: E731

    def rounds(doc, previous_output, round_idx, previous_round_info):
        if round_idx == 2:
            return None, None, True, list(previous_output), None
        return visual(doc), doc_to_text(doc) + " again", False, previous_output, None

    req = Instance("generate_until_multi_round", (doc_to_text(records[0]), {"max_new_tokens": 2}, visual, rounds, 0,
                                                  "t", "test"), idx=0, metadata={"task": "t", "doc_id": 0, "repeats": 1})
    (got,) = lm.generate_until_multi_round([req])
    answer = lambda text: lm.answer(rec_of(text, visual(records[0]), records[0], max_new_tokens=2, **lm.opts), [])  # noqa: E731
    assert got == (answer(doc_to_text(records[0])), answer(doc_to_text(records[0]) + " again"))


def _full_logprob(model, proc, record, base_dir, continuation):
    """Reference: one plain forward of prompt + continuation (the model's own positions), summed log-probs."""
    from kvbench.compress.generate_vlm import encode_vlm

    inputs = encode_vlm(model, proc, record, base_dir)
    n = inputs["input_ids"].shape[1]
    cont = torch.tensor([continuation])
    full = dict(inputs, input_ids=torch.cat([inputs["input_ids"], cont], 1))
    for k, fill in (("attention_mask", 1), ("mm_token_type_ids", 0)):
        if k in full:
            full[k] = torch.cat([full[k], torch.full_like(cont, fill)], 1)
    with torch.no_grad():
        logits = model(**full).logits[0, n - 1:-1].float()
    lp = torch.log_softmax(logits, -1)
    return float(lp.gather(1, cont[0][:, None]).sum()), bool((lp.argmax(-1) == cont[0]).all())


def test_a_press_scores_loglikelihood_requests_through_its_compressed_cache(task, vlm_dir):  # noqa: F811
    """The press model's loglikelihood raised NotImplementedError, so lmms-eval's multiple-choice tasks could not run
    through a press. Now: fullkv's loss equals a plain forward of prompt + continuation; SnapKV's equals
    CompressMethod's on the same record and differs from full; an empty continuation is refused."""
    from lmms_eval.api.instance import Instance

    from kvbench.eval.compress import CompressMethod
    from kvbench.lmms.press import KVBenchPress
    from kvbench.lmms.records import to_record as rec_of
    from kvbench.lmms.task import doc_to_text, doc_to_visual

    root, records = task
    visual = lambda doc: doc_to_visual(doc, root / "data")  # noqa: E731
    conts = ["3", "45 1"]
    meta = lambda i: {"task": "t", "doc_id": i, "repeats": 1}  # noqa: E731
    reqs = [Instance("loglikelihood", (doc_to_text(d), c, visual, i, "t", "test"), idx=0, metadata=meta(i))
            for i, d in enumerate(records[:2]) for c in conts]
    full = KVBenchPress(pretrained=str(vlm_dir), press="fullkv")
    snap = KVBenchPress(pretrained=str(vlm_dir), press="snapkv", keep=0.1, window=4)
    for lm in (full, snap):
        lm.task_dict = {"t": {"test": records}}
    got_full, got_snap = full.loglikelihood(reqs), snap.loglikelihood(reqs)
    tok = full.processor.tokenizer
    method = CompressMethod(spec="snapkv:keep=0.1,window=4")
    for k, req in enumerate(reqs):
        context, c, _, i, _, _ = req.args
        ids = tok(c, add_special_tokens=False)["input_ids"]
        rec = rec_of(context, visual(records[i]), records[i], rid=f"t/test/{i}", max_new_tokens=1, **full.opts)
        want, greedy = _full_logprob(full.model, full.processor, rec, None, ids)
        assert got_full[k][0] == pytest.approx(-want / len(ids), abs=1e-4) and got_full[k][1] == greedy
        lp, g = method.continuation_logprob(snap.model, snap.processor, rec, None, ids)
        assert got_snap[k] == (pytest.approx(-lp / len(ids), abs=1e-6), g)
    assert any(abs(a[0] - b[0]) > 1e-4 for a, b in zip(got_full, got_snap)), "SnapKV at keep 0.1 read the full cache"
    with pytest.raises(ValueError, match="empty continuation"):
        full.loglikelihood([Instance("loglikelihood", (doc_to_text(records[0]), "", visual, 0, "t", "test"), idx=0,
                                     metadata=meta(0))])
    with pytest.raises(ValueError, match=r"t/test/0: the continuation must be a string, got int 3"):
        full.loglikelihood([Instance("loglikelihood", (doc_to_text(records[0]), lambda d: 3, visual, 0, "t", "test"),
                                     idx=0, metadata=meta(0))])
    with pytest.raises(ValueError, match="got 2 values"):
        full.loglikelihood([Instance("loglikelihood", ("", "3"), idx=0, metadata=meta(0))])
