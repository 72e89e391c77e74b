"""Codec training data for a VLM backbone: its own image records, visual tokens included (ResidualKV Table II).

The paper trains Qwen3-VL-8B's codec on LLaVA-OV's data stream with the vision encoder, projector and language model
frozen (§V-A); here the stand-in is the VLM's own task records (the smoke docpages/digitgrid train splits, or any
local JSONL in the benchmark record format). Each step is one record, encoded exactly as the VLM was trained and is
evaluated (:func:`kvbench.models.prompting.encode_record` with the answer): the model's forward gets its pixel values,
so the codec sees the pre-RoPE K/V of the visual tokens as the cache will. Labels are on the answer (and its EOS).
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Sequence

import torch

from kvbench.models.prompting import encode_record
from kvbench.utils.io import read_jsonl

#: One record in this many (every HOLD_OUT-th of the files' records, in order, from the first) is held out for the
#: validation windows ("test"), so even a small file has one.
HOLD_OUT = 10


class VLMRecordStream:
    """Records of local JSONL ``files`` in a seeded order, one per step (``train_codec``'s ``data="vlm"``).

    Args:
        processor: the VLM's processor (chat template, image processor, tokenizer).
        split: ``"train"`` (records outside the hold-out) or ``"test"`` (the 1 in :data:`HOLD_OUT`).
        seq_len: not used (a record is as long as its images make it); kept for the stream interface.
        seed: order of the records (per epoch: ``(seed, epoch)``).
        files: JSONL files of VLM records; image paths relative to each file.

    Raises:
        ValueError: no files, a record that is not ``kind: vlm``, or a split with no record.
    """

    def __init__(self, processor: Any, split: str, seq_len: int, seed: int, files: Sequence[str] | None = None,
                 text_field: str = "text") -> None:
        if not files:
            raise ValueError("data 'vlm' trains on VLM record files: give data_files (e.g. the tasks' train.jsonl)")
        if not hasattr(processor, "image_processor"):  # a text LM's tokenizer: its model never reads the images
            raise ValueError(f"data 'vlm' trains a VLM's codec on its image records, but the model's processor is "
                             f"{type(processor).__name__} (no image processor): use data 'text' or 'tasks' for an LM")
        self.proc, self.seed = processor, seed
        self.records: list[tuple[dict, Path]] = []
        n = 0
        for f in files:
            for r in read_jsonl(f):
                if r.get("kind") != "vlm":
                    raise ValueError(f"{f}: record {r.get('id')!r} is kind {r.get('kind')!r}, not a VLM record")
                if (n % HOLD_OUT == 0) == (split == "test"):
                    self.records.append((r, Path(f).parent))
                n += 1
        if not self.records:
            raise ValueError(f"the VLM record files {list(files)} hold no {split!r} record")

    def batch(self, i: int) -> tuple[dict, torch.Tensor]:
        """``(inputs, labels)`` of step ``i``: the model's input tensors (``input_ids`` ``[1, T]``, ``pixel_values``,
        ``image_grid_thw``, ``mm_token_type_ids``) and int64 labels ``[1, T]`` (-100 outside the answer)."""
        n = len(self.records)
        order = list(range(n))
        random.Random(f"{self.seed}:{i // n}").shuffle(order)
        record, base = self.records[order[i % n]]
        enc = encode_record(record, self.proc, base, with_answer=True)
        labels = enc.pop("labels")
        enc.pop("prompt_len")
        enc.pop("attention_mask", None)
        return enc, labels
