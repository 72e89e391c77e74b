"""One lmms-eval generation request → one kvbench VLM record (docs/architecture.md, "Benchmark records").

lmms-eval hands a simple model the prompt text (``doc_to_text``) and the images
(``doc_to_visual``) separately. Images are placed where the text holds
:data:`IMAGE_TOKEN` (LLaVA's convention); with no placeholder they all go
first. Everything after the last image is the record's ``question``, the text
before and between images becomes ``content`` text parts, so a docpages task
(:mod:`kvbench.lmms.task`) encodes to exactly the prompt ``kvbench eval`` builds.
The serving prefix (``system``) and the prefix images are cached under
(``generic_system``) come from the document's fields when present.
"""
from __future__ import annotations

from typing import Any

from kvbench.data.instructions import GENERIC_SYSTEM

#: Image placeholder in lmms-eval prompt text.
IMAGE_TOKEN = "<image>"


def to_record(context: str, visuals: list[Any], doc: dict | None = None, *, rid: str = "lmms",
              system_field: str = "system", generic_field: str = "generic_system", system: str = "",
              generic_system: str = GENERIC_SYSTEM, max_new_tokens: int = 16) -> dict:
    """A ``kind: "vlm"`` record from a prompt, its images (PIL images or paths) and its document.

    Raises:
        ValueError: the prompt has placeholders but not one per image, or no image at all
            (the reuse engine caches images; a text-only request has nothing to reuse).
    """
    if not visuals:
        raise ValueError(f"request {rid}: no image; kvbench reuse models need at least one image")
    doc = doc or {}
    pieces = context.split(IMAGE_TOKEN)
    if len(pieces) == 1:
        pieces = [""] * len(visuals) + pieces
    if len(pieces) != len(visuals) + 1:
        raise ValueError(f"request {rid}: {len(pieces) - 1} {IMAGE_TOKEN} placeholders for {len(visuals)} images")
    content: list[dict] = []
    for text, image in zip(pieces[:-1], visuals):
        if text:
            content.append({"type": "text", "text": text})
        content.append({"type": "image", "image": image})
    return {
        "id": rid, "kind": "vlm",
        "system": doc.get(system_field) or system,
        "generic_system": doc.get(generic_field) or generic_system,
        "content": content, "question": pieces[-1], "answer": "", "max_new_tokens": int(max_new_tokens),
    }


def cut_at_stop(text: str, until: list[str]) -> str:
    """``text`` cut at the first occurrence of the first ``until`` string it holds, stripped (lmms-eval's ``until``)."""
    for stop in until:
        if stop and stop in text:
            text = text[:text.index(stop)]
    return text.strip()


def generate_until(model: Any, requests: Any) -> list[str]:
    """lmms-eval's ``generate_until`` for the kvbench models (refresh policies, presses): each request becomes one
    record (:func:`to_record`, the model's ``opts`` and ``max_new_tokens``), answered by ``model.answer(record,
    until)``; the answers go to lmms-eval's cache hook. ``req.args`` = ``(context, gen_kwargs, doc_to_visual,
    doc_id, task, split)``."""
    out = []
    for req in requests:
        context, gen_kwargs, doc_to_visual, doc_id, task, split = req.args
        doc = model.task_dict[task][split][doc_id]
        visuals = doc_to_visual(doc)
        gen_kwargs = dict(gen_kwargs or {})
        until = gen_kwargs.get("until") or []
        record = to_record(context, visuals if isinstance(visuals, list) else [visuals], doc,
                           rid=f"{task}/{split}/{doc_id}",
                           max_new_tokens=gen_kwargs.get("max_new_tokens", model.max_new_tokens), **model.opts)
        text = model.answer(record, [until] if isinstance(until, str) else list(until))
        out.append(text)
        model.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
    return out


def loglikelihood(model: Any, requests: Any, tokenizer: Any) -> list[tuple[float, bool]]:
    """lmms-eval's ``loglikelihood`` for the kvbench models: ``(loss, is_greedy)`` per request, scored by
    ``model.continuation_logprob(record, ids) -> (sum of log-probabilities in nats, is_greedy)``.

    ``loss`` is the mean negative log-likelihood per continuation token (nats), as lmms-eval's own wrappers return it
    (the HF ``loss``; its ``multiple_choice`` scoring takes the argmin, EvolvingLMMs-Lab/lmms-eval#370). ``req.args``
    = ``(context, continuation or doc_to_target, doc_to_visual, doc_id, task, split)``; the continuation is tokenised
    on its own by ``tokenizer`` and appended after the generation prompt. Note: lmms-eval 0.7.3's evaluator turns a
    non-string response into ``str(...)`` (``unwrap_generation_output``), so its ``multiple_choice`` tasks fail for
    every model in that version; call this method directly.

    Raises:
        ValueError: an empty or non-string continuation (naming the request), request args of another shape.
    """
    out = []
    for req in requests:
        if len(req.args) != 6:   # e.g. lmms-eval's 2-tuple (context, continuation) of a text-only task
            raise ValueError(f"loglikelihood request args must be (context, continuation or doc_to_target, "
                             f"doc_to_visual, doc_id, task, split), got {len(req.args)} values")
        context, target, doc_to_visual, doc_id, task, split = req.args
        doc = model.task_dict[task][split][doc_id]
        continuation = target if isinstance(target, str) else target(doc)
        if not isinstance(continuation, str):
            raise ValueError(f"{task}/{split}/{doc_id}: the continuation must be a string, got "
                             f"{type(continuation).__name__} {continuation!r}")
        visuals = doc_to_visual(doc)
        record = to_record(context, visuals if isinstance(visuals, list) else [visuals], doc,
                           rid=f"{task}/{split}/{doc_id}", max_new_tokens=1, **model.opts)
        ids = tokenizer(continuation, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError(f"{record['id']}: empty continuation {continuation!r}")
        logprob, greedy = model.continuation_logprob(record, ids)
        out.append((-logprob / len(ids), greedy))
        model.cache_hook.add_partial("loglikelihood", (context, continuation), out[-1])
    return out


def generate_until_multi_round(model: Any, requests: Any) -> list[tuple[str, ...]]:
    """Multi-round requests, lmms-eval's protocol (as its ``llava_onevision`` wrapper, batch 1), answered by
    ``model.answer(record, until)`` round by round (the reuse engine's and the press models' shared loop).

    ``req.args`` = ``(context, gen_kwargs, doc_to_visual, doc_to_text, doc_id, task, split)``. Round 0
    answers ``context`` with ``doc_to_visual(doc)``; round i >= 1 calls ``doc_to_text(doc,
    previous_output=<answers so far>, round_idx=i, previous_round_info=<its last info>)``, which returns
    ``(visuals, context, terminal, round_res, info)``; ``terminal`` ends the request and its
    ``round_res`` is the result. Every round is a new request to ``model``. ``until`` strings are ignored, as
    lmms-eval's wrappers do for multi-round tasks.

    Returns: per request, the tuple of answers (one per round).

    Raises:
        ValueError: ``doc_to_text`` does not return the 5-tuple above, or a round's visuals are None
            (naming the task, doc and round).
    """
    out = []
    for req in requests:
        context, gen_kwargs, doc_to_visual, doc_to_text, doc_id, task, split = req.args
        doc = model.task_dict[task][split][doc_id]
        gen_kwargs = dict(gen_kwargs or {})
        visuals, answers, info, round_idx = doc_to_visual(doc), [], None, 0
        while True:
            if round_idx:
                step = doc_to_text(doc, previous_output=list(answers), round_idx=round_idx, previous_round_info=info)
                if not isinstance(step, (tuple, list)) or len(step) != 5:
                    raise ValueError(f"{task}/{split}/{doc_id}: doc_to_text of a multi-round task must return "
                                     f"(visuals, context, terminal, round_res, info), got {type(step).__name__}")
                visuals, context, terminal, round_res, info = step
                if terminal:
                    answers = list(round_res)
                    break
            if visuals is None:  # would reach the processor as an image [None] and fail far from here
                raise ValueError(f"{task}/{split}/{doc_id}: round {round_idx} has no visuals (None); each round of "
                                 f"a multi-round request must give its images (a list, possibly empty)")
            record = to_record(context, visuals if isinstance(visuals, list) else [visuals], doc,
                               rid=f"{task}/{split}/{doc_id}/round{round_idx}",
                               max_new_tokens=gen_kwargs.get("max_new_tokens", model.max_new_tokens), **model.opts)
            answers.append(model.answer(record, []))
            round_idx += 1
        out.append(tuple(answers))
        model.cache_hook.add_partial("generate_until_multi_round", (context, gen_kwargs), out[-1])
    return out
