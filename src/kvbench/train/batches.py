"""Training batches: random-offset copy, smoke-task mixtures, vision-probe pages.

Every batch is a pure function of ``(seed, phase name, step)``: its generator
is ``random.Random(f"{seed}:{phase}:{step}")``, so a resumed run draws exactly
the batches an uninterrupted run would have drawn.
"""
from __future__ import annotations

import random
from typing import Any

import torch

from kvbench.data import digits, instructions, lexicon, smoke
from kvbench.data.docpages import FIELD_LETTERS, field_code
from kvbench.models.prompting import IGNORE_INDEX, encode_record, vlm_messages
from kvbench.train.readthrough import hidden_keys, stale_page_block
from kvbench.train.recipes import CELL_TARGETS, Phase


def step_rng(seed: int, phase: str, step: int) -> random.Random:
    """The batch generator of one step (string seeds hash deterministically)."""
    return random.Random(f"{seed}:{phase}:{step}")


def _lexicon_ids(tok: Any) -> list[int]:
    """Token ids of the lexicon's keys and values (each one token, with its leading space)."""
    ids = [tok(" " + w, add_special_tokens=False)["input_ids"] for w in lexicon.key_codes() + lexicon.value_codes()]
    return sorted({i[0] for i in ids if len(i) == 1})


def copy_batch(rng: random.Random, phase: Phase, tok: Any) -> dict:
    """Random-offset copy: a random token span reappears later; loss on the repeat.

    A fixed repeat offset is learned by position and does not transfer to
    retrieval (docs/decisions/zoo.md, "The LM recipe"), so the span (``L/8..L/4``
    tokens), its start and the repeat distance (uniform in ``[m, L - m]``)
    are all random.
    Returns ``input_ids``/``labels`` (int64, ``[batch, seq_len]``); with
    ``phase.restrict_softmax`` also ``output_ids`` (int64 ``[copy_vocab]``,
    the vocabulary the loss's softmax runs over) and ``labels`` given as
    indices into it.
    """
    L = phase.seq_len
    if phase.copy_vocab:
        vocab = _lexicon_ids(tok)[: phase.copy_vocab]
    else:
        special = set(tok.all_special_ids)
        vocab = [i for i in range(len(tok)) if i not in special]
    ids = torch.empty(phase.batch, L, dtype=torch.long)
    labels = torch.full((phase.batch, L), IGNORE_INDEX, dtype=torch.long)
    for b in range(phase.batch):
        x = [rng.choice(vocab) for _ in range(L)]
        # The repeat distance is drawn uniformly and independently of the span: when it
        # followed from the span's placement, a model copied from the commonest distance
        # (40% right there, 0-7% elsewhere, measured) instead of matching content.
        m = rng.randint(max(2, L // 8), L // 4)
        d = rng.randint(m, L - m)
        i = rng.randint(0, L - m - d)
        j = i + d
        x[j:j + m] = x[i:i + m]
        ids[b] = torch.tensor(x)
        labels[b, j + 1:j + m] = ids[b, j + 1:j + m]
    out = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    if phase.restrict_softmax:
        if not phase.copy_vocab:
            raise ValueError(f"phase {phase.name!r}: restrict_softmax needs copy_vocab > 0")
        out_ids = torch.tensor(vocab)
        index = torch.full((int(out_ids.max()) + 1,), IGNORE_INDEX, dtype=torch.long)
        index[out_ids] = torch.arange(len(vocab))
        out["labels"] = torch.where(labels == IGNORE_INDEX, labels, index[labels.clamp(min=0)])
        out["output_ids"] = out_ids
    return out


def _collate(encs: list[dict], pad_id: int) -> dict:
    """Right-pad a list of batch-1 encodings into one batch (images concatenated in order)."""
    T = max(e["input_ids"].shape[1] for e in encs)
    out: dict[str, Any] = {}

    def pad(key: str, value: int) -> torch.Tensor:
        rows = [torch.nn.functional.pad(e[key][0], (0, T - e[key].shape[1]), value=value) for e in encs]
        return torch.stack(rows)

    out["input_ids"] = pad("input_ids", pad_id)
    out["attention_mask"] = pad("attention_mask", 0)
    out["labels"] = pad("labels", IGNORE_INDEX)
    if "mm_token_type_ids" in encs[0]:
        out["mm_token_type_ids"] = pad("mm_token_type_ids", 0)
    if "hide_block" in encs[0]:
        out["hide_block"] = torch.stack([torch.nn.functional.pad(e["hide_block"], (0, T - e["hide_block"].shape[1],
                                                                                    0, T - e["hide_block"].shape[0]))
                                         for e in encs])
    if any("cell_labels" in e for e in encs):
        for e in encs:
            e.setdefault("cell_labels", torch.full_like(e["input_ids"], IGNORE_INDEX))
        out["cell_labels"] = pad("cell_labels", IGNORE_INDEX)
    if any("pixel_values" in e for e in encs):
        out["pixel_values"] = torch.cat([e["pixel_values"] for e in encs if "pixel_values" in e])
        out["image_grid_thw"] = torch.cat([e["image_grid_thw"] for e in encs if "image_grid_thw" in e])
    return out


def cell_reading_labels(record: dict, enc: dict, proc: Any, target: str = "instruction") -> torch.Tensor:
    """Per-position targets of the cell-reading term (``Phase.cell_reading``).

    Each visual token of a docpages/digitgrid page covers one 28x28 cell, in
    row-major order (:mod:`kvbench.data.digits`); its target is the first token of
    that cell's answer under the record's instruction, which is what the record's
    question would get for that cell (``target="instruction"``), or of the digit as
    written (``target="content"``: the instruction is not applied, ``Phase.cell_target``). Unlike ``labels`` these are not shifted: the
    hidden state *at* position t is trained to predict ``cell_labels[t]``.

    Args:
        record: a grid record (``meta.digit_indices``, ``meta.instruction``).
        enc: its :func:`~kvbench.models.prompting.encode_record` output (``input_ids`` ``[1, T]``).
        proc: the VLM processor (``image_token``, ``tokenizer``).

    Returns:
        int64 ``[1, T]``: answer-token ids at visual tokens, -100 elsewhere.

    Raises:
        ValueError: the record has no cell digits, or its visual-token count is
            not one per cell (pages rendered at another resolution).
    """
    meta = record.get("meta", {})
    if "digit_indices" not in meta or "instruction" not in meta:
        raise ValueError(f"record {record.get('id')!r} ({record.get('task')}): cell_reading needs a grid "
                         "record with meta.digit_indices and meta.instruction")
    tok = getattr(proc, "tokenizer", proc)
    labels = digits.labels()

    if target not in CELL_TARGETS:
        raise ValueError(f"target must be one of {CELL_TARGETS}, got {target!r}")
    name = meta["instruction"] if target == "instruction" else "identity"
    targets = [tok(str(instructions.apply(name, int(labels[i]))), add_special_tokens=False)
               ["input_ids"][0] for page in meta["digit_indices"] for i in page]
    ids = enc["input_ids"][0]
    where = (ids == tok.convert_tokens_to_ids(proc.image_token)).nonzero()[:, 0]
    if len(where) != len(targets):
        raise ValueError(f"record {record.get('id')!r}: {len(where)} visual tokens for {len(targets)} cells; "
                         "cell_reading needs one visual token per cell (28x28 px cells)")
    out = torch.full_like(enc["input_ids"], IGNORE_INDEX)
    out[0, where] = torch.tensor(targets, dtype=out.dtype)
    return out


def decoy_tokens(record: dict, enc: dict, proc: Any) -> torch.Tensor:
    """Bool ``[T]``: the tokens of ``enc`` (the encoding of a :func:`stale_page_record`) that carry its decoy
    instruction, found by character offsets in the rendered prompt (a token is the decoy's when its characters
    overlap the decoy text, so a token merged across the boundary counts as the decoy's).

    Raises:
        ValueError: the record has no decoy, or the prompt's tokens before the first image differ from the
            processor's (a template the offsets cannot be mapped onto).
    """
    tok = getattr(proc, "tokenizer", proc)
    true_system, decoy = record["meta"].get("true_system"), record["meta"].get("decoy_system")
    if not true_system or not decoy:
        raise ValueError(f"record {record.get('id')!r} is not a stale-page record (no meta.decoy_system)")
    text = proc.apply_chat_template(vlm_messages(record), tokenize=False, add_generation_prompt=True)
    c0 = text.index(record["system"]) + len(true_system)
    c1 = c0 + len(" " + decoy)
    plain = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"][0]
    first = int((ids == tok.convert_tokens_to_ids(proc.image_token)).nonzero()[0])
    if plain["input_ids"][:first] != ids[:first].tolist():
        raise ValueError(f"record {record.get('id')!r}: the prompt's text tokens differ from the processor's; "
                         "cannot locate the decoy instruction")
    out = torch.zeros(len(ids), dtype=torch.bool)
    for i, (a, b) in enumerate(plain["offset_mapping"][:first]):
        out[i] = a < c1 and b > c0
    return out


def stale_page_record(rng: random.Random, record: dict) -> dict:
    """``record`` with a decoy serving instruction appended to its system prompt (``meta.decoy_instruction``).

    The decoy is another instruction than the record's (its header drawn too, as a serving prefix is); the
    answer and the per-cell targets stay the record's own instruction's, and :func:`task_batch` hides the decoy
    from the pages and the true instruction from the question side (:func:`kvbench.train.readthrough.stale_page_block`).
    """
    true = record["meta"]["instruction"]
    name, text = instructions.sample_system(rng, rng.choice([n for n in sorted(instructions.INSTRUCTIONS)
                                                               if n != true]))
    meta = dict(record["meta"], decoy_instruction=name, true_system=record["system"], decoy_system=text)
    return dict(record, system=record["system"] + " " + text, meta=meta)


def check_mixtures(phases: list[Phase], proc: Any) -> None:
    """Draw one record of every ``tasks`` phase's every mixture entry, so a bad entry fails before training, not when
    its phase starts (possibly many minutes in).

    Raises:
        ValueError: naming the phase, the entry and the generator's own error (an unknown family, a bad parameter).
    """
    tok = getattr(proc, "tokenizer", proc)
    for phase in phases:
        if phase.kind != "tasks":
            continue
        for i, entry in enumerate(phase.mixture):
            try:
                fam, weight, params = entry
                params = {k: v for k, v in dict(params).items() if k != "full_loss"}
                if not (isinstance(weight, (int, float)) and not isinstance(weight, bool) and weight > 0):
                    raise ValueError(f"weight must be a number > 0, got {weight!r}")
                smoke.sample(fam, random.Random(0), "train", tokenizer=tok, **params)
            except (ValueError, TypeError) as e:
                raise ValueError(f"phase {phase.name!r}: mixture entry {i} {entry!r}: {e}") from None


def task_batch(rng: random.Random, phase: Phase, proc: Any) -> dict:
    """A batch of smoke-task records drawn from the train pools by mixture weight.

    A mixture entry with ``full_loss: True`` (code) trains on every token
    (language modelling); the others only on answer tokens. With
    ``phase.cell_reading`` the batch also holds ``cell_labels`` (int64
    ``[B, T]``, see :func:`cell_reading_labels`); with ``phase.hide_prompt``
    ``hide_block`` (bool ``[B, T, T]``, :func:`kvbench.train.readthrough.hide_prompt`), where a share
    ``phase.stale_pages`` of the VLM records are stale-page records (:func:`stale_page_record`).
    """
    tok = getattr(proc, "tokenizer", proc)
    # entries, not families, are drawn: one family may appear twice with other parameters (kv with one- and
    # four-token values); the draws are those of drawing the families when every family appears once
    weights = [m[1] for m in phase.mixture]
    encs = []
    for _ in range(phase.batch):
        fam, _, p = phase.mixture[rng.choices(range(len(weights)), weights)[0]]
        p = dict(p)
        full_loss = p.pop("full_loss", False)
        record = smoke.sample(fam, rng, "train", tokenizer=tok, **p)
        # drawn only when the phase has stale pages, so other recipes' batches are unchanged
        stale = (phase.stale_pages > 0 and record.get("kind") == "vlm" and rng.random() < phase.stale_pages)
        if stale:
            record = stale_page_record(rng, record)
        enc = encode_record(record, proc, with_answer=True)
        if full_loss:
            enc["labels"] = enc["input_ids"].clone()
        if phase.cell_reading and record.get("kind") == "vlm":
            enc["cell_labels"] = cell_reading_labels(record, enc, proc, phase.cell_target)
        if phase.hide_prompt:
            img = tok.convert_tokens_to_ids(proc.image_token)
            ids = enc["input_ids"][0]
            if stale:
                enc["hide_block"] = stale_page_block(ids, img, phase.hide_prompt, decoy_tokens(record, enc, proc))
            else:
                q, k = hidden_keys(ids, img, phase.hide_prompt)
                enc["hide_block"] = q[:, None] & k[None, :]
        encs.append(enc)
    return _collate(encs, tok.pad_token_id)


#: Output layout of the vision probe's linear head: digit, printed cell letter, printed page (0 = none).
PROBE_CLASSES = {"digit": 10, "letter": 24, "page": 7}


def vision_probe_batch(rng: random.Random, phase: Phase, proc: Any) -> dict:
    """Labelled pages of train-pool digit scans and the classes of each visual token.

    Pages are drawn like the VLM tasks' pages: 2x2 grids printed with page
    numbers 1..6 and their field codes (docpages) or 4x4 grids printed with
    codes A-P only (digitgrid); cells are 28x28 px, so visual token ``i`` of a
    page is cell ``i`` in row-major order. Returns ``pixel_values``,
    ``image_grid_thw`` and int64 ``[n_tokens]`` targets ``digit_labels``,
    ``letter_labels`` (index into ``FIELD_LETTERS``, 0..23),
    ``page_labels`` (0 = no page printed, else 1..6); see :data:`PROBE_CLASSES`.
    """
    pool, labels = digits.pool("train"), digits.labels()
    images, ys, letters, pages = [], [], [], []
    for _ in range(phase.batch):
        n = rng.choice((2, 4))
        page = rng.randint(1, 6) if n == 2 else 0
        idx = [rng.choice(pool) for _ in range(n * n)]
        codes = [field_code(max(page, 1), i // n + 1, i % n + 1, n, n) for i in range(n * n)]
        images.append(digits.render_page(idx, n, n, labels=[f"{page or ' '}{c}" for c in codes]))
        ys += [int(labels[i]) for i in idx]
        letters += [FIELD_LETTERS.index(c) for c in codes]
        pages += [page] * (n * n)
    enc = proc.image_processor(images=images, return_tensors="pt")
    return {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"],
            "digit_labels": torch.tensor(ys), "letter_labels": torch.tensor(letters),
            "page_labels": torch.tensor(pages)}


BATCHES = {"copy": lambda rng, ph, proc: copy_batch(rng, ph, getattr(proc, "tokenizer", proc)),
           "tasks": task_batch, "vision_probe": vision_probe_batch}
