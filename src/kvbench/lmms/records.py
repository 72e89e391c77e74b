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
