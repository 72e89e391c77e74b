"""Small benchmark records and splits for eval/report tests (checkpoints come from conftest.py)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image


def text_record(i: int, metric: str = "exact_match", **kw) -> dict:
    """A text record ``t<i>`` of task ``toy``; ``kw`` overrides fields."""
    r = {
        "id": f"t{i}", "task": "toy", "split": "test", "kind": "text",
        "context": f"key {i} is {i * 7}. " * 5, "question": f"What is key {i}? Answer:",
        "answer": f" {i * 7}", "max_new_tokens": 3, "metric": metric, "chance": 0.1, "meta": {},
    }
    r.update(kw)
    return r


def vlm_record(i: int, image: str, **kw) -> dict:
    """A VLM record ``v<i>`` of task ``toyvl`` with one image (path relative to the split)."""
    r = {
        "id": f"v{i}", "task": "toyvl", "split": "test", "kind": "vlm",
        "system": "Answer with one digit.", "generic_system": "You are a helpful assistant.",
        "content": [{"type": "text", "text": "Page:"}, {"type": "image", "image": image}],
        "question": "Which digit is shown?", "answer": str(i), "max_new_tokens": 2,
        "metric": "exact_match", "chance": 0.1, "meta": {},
    }
    r.update(kw)
    return r


def write_split(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_png(path: Path, seed: int, size: int = 84) -> str:
    """Write a random ``size`` x ``size`` RGB PNG; returns its file name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(arr, "RGB").save(path)
    return path.name
