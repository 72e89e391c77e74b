"""The smoke benchmark registry: on-the-fly sampling for training and materialised splits for evaluation.

- :data:`TASKS`: materialisable task name -> :class:`TaskSpec` (family, kind, params).
- :func:`sample`: one record of a task family, generated on the fly (VLM
  images as in-memory ``PIL.Image``); the trainer calls it directly.
- :func:`materialise`: ``kvbench data`` — write ``train.jsonl``, ``test.jsonl``,
  ``images/*.png`` (VLM tasks) and ``meta.json`` for one task, built with the
  very same :func:`sample`, so training and evaluation data cannot drift apart.

Record fields follow docs/architecture.md; generators and chance levels are
described in docs/data.md.
"""
from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from kvbench.data import chain, digitgrid, docpages, lcc, longctx, shared_context
from kvbench.utils import io


@dataclass(frozen=True)
class Family:
    """One generator: ``fn(rng, split, [tok,] **params) -> record``; ``kind`` is "text" or "vlm"."""

    fn: Callable[..., dict]
    kind: str
    module: str


FAMILIES: dict[str, Family] = {
    "docpages": Family(docpages.sample, "vlm", "kvbench.data.docpages"),
    "digitgrid": Family(digitgrid.sample, "vlm", "kvbench.data.digitgrid"),
    "niah": Family(longctx.sample_niah, "text", "kvbench.data.longctx"),
    "kv": Family(longctx.sample_kv, "text", "kvbench.data.longctx"),
    "vt": Family(longctx.sample_vt, "text", "kvbench.data.longctx"),
    "lcc": Family(lcc.sample, "text", "kvbench.data.lcc"),
    # several queries about one context (multi_turns), ResidualKV Table IV; evaluation only, never trained on
    "kv_mq": Family(shared_context.sample_kv_mq, "text", "kvbench.data.shared_context"),
    "niah_mq": Family(shared_context.sample_niah_mq, "text", "kvbench.data.shared_context"),
    "vt_mq": Family(shared_context.sample_vt_mq, "text", "kvbench.data.shared_context"),
    "chain": Family(chain.sample_chain, "text", "kvbench.data.chain"),
    "chain_pairs": Family(chain.sample_chain_pairs, "text", "kvbench.data.chain"),
}


@dataclass(frozen=True)
class TaskSpec:
    """A materialisable task: a family plus fixed generator parameters."""

    family: str
    kind: str
    params: dict[str, Any] = field(default_factory=dict)


def _tasks() -> dict[str, TaskSpec]:
    tasks = {"docpages": TaskSpec("docpages", "vlm"), "digitgrid": TaskSpec("digitgrid", "vlm")}
    for fam in ("niah", "kv", "vt"):
        for k in (1, 2, 4):
            tasks[f"{fam}_{k}k"] = TaskSpec(fam, "text", {"length_tokens": 1024 * k})
    tasks["lcc"] = TaskSpec("lcc", "text", {"length_tokens": 1000})
    # 4-token values, answered over 4 decode steps (issue #32, item 3); kv's values cannot all be distinct at 1k
    tasks["niah_1k_v4"] = TaskSpec("niah", "text", {"length_tokens": 1024, "value_tokens": 4})
    # variable tracking with value-code variables, two answer tokens (docs/data.md)
    tasks["vt_1k_values"] = TaskSpec("vt", "text", {"length_tokens": 1024, "variables": "values"})
    for fam, n in (("kv", 4), ("niah", 4), ("vt", 3)):  # the 1k retrieval tasks, several queries per context
        tasks[f"{fam}_1k_mq"] = TaskSpec(f"{fam}_mq", "text", {"length_tokens": 1024, "n_queries": n})
    # ResidualKV Table V's long generation: 128 generated hops over about 770 prompt tokens
    tasks["chain_128"] = TaskSpec("chain", "text", {"hops": 128, "n_distractors": 1})
    # ... and the variant whose final answer reads the generated trace far back: two chains of 64 written in
    # alternation (128 generated tokens), then which B stood beside an asked A
    tasks["chain_pairs_64"] = TaskSpec("chain_pairs", "text", {"hops": 64})
    return tasks


#: Every task ``kvbench data --task`` accepts.
TASKS: dict[str, TaskSpec] = _tasks()


def sample(task_family: str, rng: random.Random, split: str, tokenizer=None, **params) -> dict:
    """Generate one record of ``task_family`` (images in memory).

    Args:
        task_family: one of :data:`FAMILIES` (``docpages``, ``digitgrid``, ``niah``, ``kv``, ``vt``, ``lcc``).
        rng: the record's random generator; the record is a pure function of its state.
        split: ``"train"`` or ``"test"`` (disjoint source pools).
        tokenizer: required by text families (lengths are measured in its tokens).
        **params: text families: ``length_tokens``, ``n_queries`` (vt also ``hops``,
            ``n_distractors``); VLM families: ``n_queries``, ``K``, ``instruction``.

    Raises:
        ValueError: unknown family, missing tokenizer, or a bad parameter (named).
    """
    fam = FAMILIES.get(task_family)
    if fam is None:
        raise ValueError(f"unknown task family {task_family!r}; valid: {sorted(FAMILIES)}")
    if fam.kind == "vlm":
        return fam.fn(rng, split, **params)
    if tokenizer is None:
        raise ValueError(f"task family {task_family!r} measures lengths in tokens: pass tokenizer=")
    return fam.fn(rng, split, tokenizer, **params)


def record_rng(task: str, split: str, seed: int, index: int) -> random.Random:
    """The generator of record ``index``: independent per record, so a prefix of a split is stable in ``n``."""
    return random.Random(f"kvbench/{task}/{split}/{seed}/{index}")


def _save_image(img: Image.Image, out_dir: Path) -> str:
    """Write ``img`` as ``images/<sha256 of mode, size, pixels>.png`` (once); returns the relative path."""
    h = hashlib.sha256(f"{img.mode}{img.size}".encode() + img.tobytes()).hexdigest()[:32]
    rel = f"images/{h}.png"
    if not (out_dir / rel).exists():
        with io.atomic_path(out_dir / rel) as tmp:
            img.save(tmp, format="PNG")
    return rel


def materialise(task: str, out_dir: str | Path, tokenizer_dir: str | Path | None, seed: int = 0,
                n_train: int = 256, n_test: int = 200) -> dict:
    """Write one smoke task to ``out_dir``: ``train.jsonl``, ``test.jsonl``, ``images/``, ``meta.json``.

    Records follow docs/architecture.md; ids are ``<task>-<split>-<index:05d>``;
    image paths are relative to ``out_dir``. Output is a deterministic function
    of ``(task, seed, n_train, n_test, tokenizer, Python stdlib)``; every file
    is written atomically.

    Args:
        task: a key of :data:`TASKS`.
        out_dir: output directory (created).
        tokenizer_dir: tokenizer directory (``save_pretrained`` layout); needed by text tasks.
        seed: base seed.
        n_train, n_test: number of records per split (n_train >= 0, n_test >= 1).

    Returns:
        The ``meta.json`` content (task, generator, seed, n, params, mean chance, sha256 per file).

    Raises:
        ValueError: unknown task (the message lists the valid names), negative sizes,
            or a text task without ``tokenizer_dir``.
    """
    spec = TASKS.get(task)
    if spec is None:
        raise ValueError(f"unknown smoke task {task!r}; valid tasks: {', '.join(TASKS)}")
    if n_train < 0 or n_test < 1:
        raise ValueError(f"need n_train >= 0 and n_test >= 1, got n_train={n_train}, n_test={n_test}")
    tok = None
    if spec.kind == "text":
        if tokenizer_dir is None:
            raise ValueError(f"task {task!r} needs tokenizer_dir (lengths are measured in tokens)")
        # here, not with the module: it imports transformers, and the workflow reads TASKS at DAG time
        from kvbench.data.tokenizer import load_tokenizer_dir

        tok = load_tokenizer_dir(tokenizer_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {
        "task": task, "family": spec.family, "kind": spec.kind, "generator": FAMILIES[spec.family].module,
        "seed": seed, "params": spec.params, "n": {}, "mean_chance": {}, "sha256": {},
    }
    for split, n in (("train", n_train), ("test", n_test)):
        rows = []
        for i in range(n):
            rec = sample(spec.family, record_rng(task, split, seed, i), split, tok, **spec.params)
            rec["id"], rec["task"] = f"{task}-{split}-{i:05d}", task
            if spec.kind == "vlm":
                rec["content"] = [dict(p, image=_save_image(p["image"], out)) if p["type"] == "image" else p
                                  for p in rec["content"]]
            rows.append(rec)
        path = out / f"{split}.jsonl"
        io.write_jsonl(path, rows)
        meta["n"][split] = n
        meta["mean_chance"][split] = sum(r["chance"] for r in rows) / n if n else None
        meta["sha256"][f"{split}.jsonl"] = io.sha256_file(path)
    if tok is not None:
        meta["tokenizer_sha256"] = io.sha256_file(Path(tokenizer_dir) / "tokenizer.json")
    if spec.kind == "vlm":
        meta["n_images"] = len(list((out / "images").glob("*.png")))
    io.write_json(out / "meta.json", meta)
    return meta
