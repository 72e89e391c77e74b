"""Skill floors: a trained zoo model must reach a minimum score before anything reads it.

A zoo model that trained its full recipe can still end without the skill the
later tables need (a changed recipe, a numerical accident); every table built
on it would then be noise. :func:`check_floors` scores the model on a
*validation slice* of each floored task (:func:`validation_scores`) and
:func:`check_floors` raises :class:`BelowFloor` naming
the task, the score, the floor and the targets the model feeds, before the
checkpoint is written.

The validation slice is drawn from the task's *training* source pool
(:func:`kvbench.data.smoke.sample` with ``split="train"``) under its own record
seeds (``record_rng(task, "val", seed, i)``), so it is never the test split the
tables report, and it is not one of the training batches either (those come
from :func:`kvbench.train.batches.step_rng`). Scoring is the caller's :data:`Scorer`: the CLI passes
:func:`kvbench.eval.methods.full_cache_score` (greedy decoding with the full KV cache, scored by the task's own
metric), so training does not import the evaluation methods.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvbench.data.smoke import TASKS, record_rng, sample

#: ``score(model, proc, record) -> float`` in [0, 1]: one validation record's score (the caller's evaluation).
Scorer = Callable[[Any, Any, dict], float]


class BelowFloor(ValueError):
    """A trained model scored below a configured skill floor on its validation slice."""


def validation_records(task: str, tokenizer: Any, seed: int, n: int) -> list[dict]:
    """The ``n`` validation records of smoke ``task`` (in memory; VLM images as PIL).

    Raises:
        ValueError: ``task`` is not a smoke task, or ``n < 1``.
    """
    spec = TASKS.get(task)
    if spec is None:
        raise ValueError(f"floor task {task!r} is not a smoke task; expected one of {sorted(TASKS)}")
    if n < 1:
        raise ValueError(f"validation slice size must be >= 1 record, got {n}")
    records = []
    for i in range(n):
        rec = sample(spec.family, record_rng(task, "val", seed, i), "train",
                     tokenizer if spec.kind == "text" else None, **spec.params)
        rec["id"], rec["task"] = f"{task}-val-{i:05d}", task
        records.append(rec)
    return records


def score_task(model: Any, proc: Any, records: list[dict], score: Scorer) -> float:
    """Mean of ``score(model, proc, r)`` over ``records``, in [0, 1]."""
    total = 0.0
    for r in records:
        total += float(score(model, proc, r))
    return total / len(records)


def validation_scores(model: Any, proc: Any, tasks: list[str], *, seed: int, n: int,
                      score: Scorer) -> dict[str, float]:
    """task -> mean ``score`` in [0, 1] of ``model`` on the ``n``-record validation slice of each of ``tasks``."""
    tok = getattr(proc, "tokenizer", proc)
    return {t: score_task(model, proc, validation_records(t, tok, seed, n), score) for t in sorted(tasks)}


def check_floors(scores: dict[str, float], floors: dict[str, float], *, n: int, model_name: str,
                 feeds: str = "") -> None:
    """Raise :class:`BelowFloor` if any validation score is below its floor.

    Args:
        scores: task -> validation score (:func:`validation_scores`).
        floors: task -> minimum score in [0, 1].
        n: records per task (named in the message).
        model_name: named in the message.
        feeds: the targets that read this model, named in the message (e.g.
            ``"results/smoke/zoo.csv, the ResidualKV tables"``).

    Raises:
        ValueError: a floor outside [0, 1], or a floored task without a score.
        BelowFloor: one or more scores below their floor (all are listed).
    """
    check_floor_values(floors)
    missing = sorted(set(floors) - set(scores))
    if missing:
        raise ValueError(f"no validation score for floored task(s) {missing}")
    low = [f"{t} scored {scores[t]:.3f} < floor {floors[t]:g}" for t in sorted(floors) if scores[t] < floors[t]]
    if low:
        raise BelowFloor(
            f"zoo model {model_name!r} finished training below its skill floor on the validation slice "
            f"({n} records per task): {'; '.join(low)}. It would feed {feeds or 'later tables'}; "
            "nothing was written. Fix the recipe (or the floor in models.<name>.zoo.floors) and rerun")


def check_floor_values(floors: dict[str, float]) -> None:
    """Refuse a floor that is not a number in [0, 1] (named), before any training.

    Raises:
        ValueError: naming the task and the bad value.
    """
    for task, floor in floors.items():
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0.0 <= float(floor) <= 1.0:
            raise ValueError(f"skill floor of {task!r} must be a number in [0, 1], got {floor!r}")
        if task not in TASKS:
            raise ValueError(f"floor task {task!r} is not a smoke task; expected one of {sorted(TASKS)}")
