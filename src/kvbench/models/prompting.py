"""Turn a benchmark record into model inputs: the one place prompts are formatted.

Training and evaluation both call :func:`encode_record` (evaluation through
:func:`model_inputs`), so the format a zoo model learned is exactly the format
it is evaluated on. Record fields are
specified in ``docs/architecture.md``.

- text records: raw ``context + question`` (base-model style, as RULER and
  LongBench prompt base models); the answer is the continuation.
- VLM records: the processor's chat template over
  ``[system, user(content + question)]`` with the generation prompt; the answer
  is the assistant turn, closed by the tokenizer's EOS (``<|im_end|>``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from PIL import Image

IGNORE_INDEX = -100


def _tokenizer(proc: Any) -> Any:
    return getattr(proc, "tokenizer", proc)


def _ids(tok: Any, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def load_image(img: Any, base_dir: str | Path | None) -> Image.Image:
    """One record image as an RGB PIL image.

    Args:
        img: a PIL image (converted to RGB) or a path; a relative path is resolved against ``base_dir``.
        base_dir: directory of the record file (None: relative paths are taken from the working directory).

    Returns:
        The image in mode ``"RGB"``, read fully so the file is closed.

    Raises:
        FileNotFoundError: ``img`` is a path and no file is there.
    """
    if isinstance(img, Image.Image):
        return img.convert("RGB")
    path = Path(img)
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if not path.is_file():
        raise FileNotFoundError(f"image {img!r} not found (looked at {path})")
    with Image.open(path) as im:
        return im.convert("RGB")


def vlm_messages(record: dict, system_key: str = "system") -> list[dict]:
    """Chat messages of a VLM record; ``system_key="generic_system"`` gives the cache-time prefix."""
    user = [dict(p) for p in record["content"]] + [{"type": "text", "text": record["question"]}]
    for p in user:
        if p["type"] == "image":
            p.pop("image", None)  # the processor receives images separately, in order
    return [{"role": "system", "content": record[system_key]}, {"role": "user", "content": user}]


def _answer_turns(record: dict, kind: str, proc: Any) -> list[tuple[str, bool]]:
    """(text, is_label) segments after the prompt: the answer, then any extra queries.

    For VLM records the glue between turns is rendered by the processor's own
    chat template (a follow-up user turn holding only the question), so the
    zoo's base-model template and a real checkpoint's chat template are both
    honoured; the answer and the EOS that closes it are the labels.
    """
    extra = record.get("meta", {}).get("extra_queries", [])
    if kind == "text":
        segs = [(record["answer"], True)]
        final = record.get("final")
        if final:   # a final question after the generated answer (kvbench.data.chain.sample_chain_pairs)
            tail = final["question"] + final["answer"]
            if not record["answer"].endswith(tail):
                raise ValueError(f"record {record.get('id')!r}: answer does not end with its final question and "
                                 f"answer {tail!r}")
            segs = [(record["answer"][:-len(tail)], True), (final["question"], False), (final["answer"], True)]
        for q in extra:
            segs += [(q["question"], False), (q["answer"], True)]
        return segs
    eos = _tokenizer(proc).eos_token or ""

    def render(msgs: list[dict], gen: bool) -> str:
        return proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    msgs = vlm_messages(record)
    prompt = render(msgs, True)
    segs: list[tuple[str, bool]] = []
    turns = [(record["answer"], None)] + [(q["answer"], q["question"]) for q in extra]
    for k, (answer, _) in enumerate(turns):
        msgs = msgs + [{"role": "assistant", "content": answer}]
        convo = render(msgs, False)
        if not convo.startswith(prompt + answer):
            raise ValueError("the chat template does not render the conversation as prompt + answer; "
                             "cannot place answer labels")
        closing = convo[len(prompt) + len(answer):]
        labelled = eos if closing.startswith(eos) else ""
        segs += [(answer + labelled, True)]
        if closing[len(labelled):]:
            segs.append((closing[len(labelled):], False))
        if k + 1 < len(turns):
            msgs = msgs + [{"role": "user", "content": [{"type": "text", "text": turns[k + 1][1]}]}]
            prompt = render(msgs, True)
            segs.append((prompt[len(convo):], False))
    return segs


def encode_record(record: dict, proc: Any, base_dir: str | Path | None = None, with_answer: bool = False) -> dict:
    """Encode one record (batch size 1).

    Args:
        record: a benchmark record (``kind`` ``"text"`` or ``"vlm"``).
        proc: tokenizer (text) or processor (VLM).
        base_dir: directory that relative image paths are resolved against.
        with_answer: append the gold answer (and ``meta.extra_queries``) with labels.

    Returns:
        dict with ``input_ids`` and ``attention_mask`` (int64, ``[1, T]``),
        ``prompt_len`` (int, tokens before the first answer token), for VLM
        records also ``pixel_values`` (float32, ``[n_patches, C*t*p*p]``),
        ``image_grid_thw`` (int64, ``[n_images, 3]``) and ``mm_token_type_ids``
        (``[1, T]``; without it transformers >= 5 silently falls back to 1-D
        positions instead of M-RoPE), and with ``with_answer`` ``labels``
        (int64 ``[1, T]``, -100 outside answer tokens).

    Raises:
        ValueError: unknown ``kind``.
        FileNotFoundError: an image path does not exist.
    """
    kind = record.get("kind")
    tok = _tokenizer(proc)
    if kind == "text":
        enc = {"input_ids": torch.tensor([_ids(tok, record["context"] + record["question"])])}
    elif kind == "vlm":
        images = [load_image(p["image"], base_dir) for p in record["content"] if p["type"] == "image"]
        text = proc.apply_chat_template(vlm_messages(record), tokenize=False, add_generation_prompt=True)
        enc = dict(proc(text=[text], images=images or None, return_tensors="pt"))
        enc.pop("attention_mask", None)
    else:
        raise ValueError(f"record {record.get('id')!r}: kind must be 'text' or 'vlm', got {kind!r}")
    prompt_len = enc["input_ids"].shape[1]
    labels = [IGNORE_INDEX] * prompt_len
    if with_answer:
        extra_ids: list[int] = []
        for text, is_label in _answer_turns(record, kind, proc):
            ids = _ids(tok, text)
            extra_ids += ids
            labels += ids if is_label else [IGNORE_INDEX] * len(ids)
        tail = torch.tensor([extra_ids], dtype=enc["input_ids"].dtype)
        enc["input_ids"] = torch.cat([enc["input_ids"], tail], dim=1)
        if "mm_token_type_ids" in enc:
            enc["mm_token_type_ids"] = torch.cat(
                [enc["mm_token_type_ids"], torch.zeros_like(tail, dtype=enc["mm_token_type_ids"].dtype)], dim=1)
        enc["labels"] = torch.tensor([labels])
    enc["attention_mask"] = torch.ones_like(enc["input_ids"])
    enc["prompt_len"] = prompt_len
    return enc


def model_inputs(model: Any, proc: Any, record: dict, base_dir: str | Path | None) -> tuple[dict, int]:
    """A record's prompt (:func:`encode_record`, no answer) on the model's device, for generation.

    Returns ``(inputs, prompt_len)``: ``inputs`` holds ``input_ids`` and ``attention_mask`` (int64 ``[1, T]``) and,
    for VLM records, ``pixel_values`` (``[n_patches, C*t*p*p]``, cast to the model's dtype), ``image_grid_thw`` and
    ``mm_token_type_ids``; ``prompt_len`` is the prompt length in tokens (T).
    """
    enc = encode_record(record, proc, base_dir, with_answer=False)
    prompt_len = int(enc.pop("prompt_len"))
    dtype = getattr(model, "dtype", None)
    inputs = {}
    for k, v in enc.items():
        if isinstance(v, torch.Tensor):
            v = v.to(model.device)
            if v.is_floating_point() and dtype is not None:
                v = v.to(dtype)
        inputs[k] = v
    return inputs, prompt_len
