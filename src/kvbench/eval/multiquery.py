"""Multi-query records: one context, several queries (SCBench's layout), and their per-query scores.

A multi-query record is a text record whose ``question``/``answer`` are replaced by ``multi_turns``, a list of
``{"input": str, "answer": str | [str, ...]}`` (SCBench's field names, ``microsoft/MInference`` ``scbench/``).
A turn may carry its own ``metric`` (a key of :data:`kvbench.eval.metrics.METRICS`; SCBench's
summary-with-needles mixes a summary and a passkey turn) and ``max_new_tokens``; otherwise the record's apply.

How a method answers one: the context once, then each query from the cache after the context, independently
(SCBench's multi-request mode, "SCDQ", which ResidualKV's Table IV uses; :mod:`kvbench.compress.multiquery`).
The runner (:mod:`kvbench.eval.runner`) scores each query with its metric; the record's ``score`` is
:func:`record_score` (the mean over its queries; with several metrics, the mean of each metric's mean) and the row
keeps the per-query ``scores``. A split whose records hold the same number of queries of each metric (every smoke
split and SCBench's files) then has a run score equal to SCBench's one number per dataset: the mean over every query
of the task (``compute_scores.get_score``), and for summary-with-needles the mean of its two accuracies (ROUGE-Lsum
of the summary turns, the passkey turns' first integer), as SCBench's result summary averages a dataset's
comma-separated ``processed_results``.
"""
from __future__ import annotations

from collections.abc import Callable

from kvbench.data.scbench import TURNS
from kvbench.eval.scbench_metrics import SCBENCH_METRICS


def is_multi(record: dict) -> bool:
    """Whether ``record`` is a multi-query record (it has ``multi_turns``)."""
    return TURNS in record


def check_turns(record: dict, where: str, metrics: dict[str, Callable]) -> None:
    """Check a multi-query record's ``multi_turns`` (the runner's :func:`~kvbench.eval.runner.validate_records`).

    Raises:
        ValueError: naming ``where`` and the turn: not a non-empty list of objects; an ``input`` that is not a
            non-empty string; an ``answer`` that is not a string or a non-empty list of strings; an unknown
            turn ``metric``; a list of answers under a metric that takes one string (not an SCBench scorer); a turn
            ``max_new_tokens`` that is not a positive int; or a record that also has
            ``question``/``answer`` (which would be ambiguous) or is not a text record.
    """
    turns = record.get(TURNS)
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: field {TURNS!r} must be a non-empty list of {{'input', 'answer'}} objects, "
                         f"got {type(turns).__name__}")
    both = [f for f in ("question", "answer") if f in record]
    if both:
        raise ValueError(f"{where}: a multi-query record holds its queries in {TURNS!r}; it must not also have "
                         f"{both} (which would be ambiguous)")
    if record.get("kind") != "text":
        raise ValueError(f"{where}: multi-query records are text records, got kind {record.get('kind')!r}")
    for i, t in enumerate(turns):
        at = f"{where}: {TURNS}[{i}]"
        if not isinstance(t, dict):
            raise ValueError(f"{at} must be an object with 'input' and 'answer', got {type(t).__name__}")
        if not isinstance(t.get("input"), str) or not t["input"]:
            raise ValueError(f"{at}: 'input' must be a non-empty string (the query), got {t.get('input')!r}")
        a = t.get("answer")
        if not (isinstance(a, str) or (isinstance(a, list) and a and all(isinstance(x, str) for x in a))):
            raise ValueError(f"{at}: 'answer' must be a string or a non-empty list of strings, got {a!r}")
        if "metric" in t and t["metric"] not in metrics:
            raise ValueError(f"{at}: 'metric' must be one of {sorted(metrics)}, got {t['metric']!r}")
        metric = t.get("metric", record.get("metric"))
        if isinstance(a, list) and metric not in SCBENCH_METRICS:
            raise ValueError(f"{at}: a list of answers needs a metric that takes one ({sorted(SCBENCH_METRICS)}), "
                             f"got metric {metric!r}")
        m = t.get("max_new_tokens", 1)
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"{at}: 'max_new_tokens' must be a positive int, got {m!r}")


def turn_budgets(record: dict) -> list[int]:
    """Decode budget of each query: the turn's ``max_new_tokens``, else the record's."""
    return [int(t.get("max_new_tokens", record["max_new_tokens"])) for t in record[TURNS]]


def score_turns(record: dict, predictions: list[str], metrics: dict[str, Callable]) -> list[float]:
    """Score of each query: its metric (the turn's, else the record's) on its prediction and answer.

    Raises:
        ValueError: not one prediction per query.
    """
    turns = record[TURNS]
    if not isinstance(predictions, list) or len(predictions) != len(turns):
        raise ValueError(f"record {record.get('id')!r}: {len(turns)} queries but "
                         f"{len(predictions) if isinstance(predictions, list) else type(predictions).__name__} predictions")
    return [float(metrics[t.get("metric", record["metric"])](p, t["answer"])) for p, t in zip(predictions, turns)]


def record_score(record: dict, scores: list[float]) -> float:
    """One record's score from its per-query ``scores`` (in turn order): the mean over the queries of each metric
    (the turn's, else the record's), then the mean over the metrics. One metric: the mean over the queries.

    Raises:
        ValueError: not one score per query.
    """
    turns = record[TURNS]
    if len(scores) != len(turns):
        raise ValueError(f"record {record.get('id')!r}: {len(turns)} queries but {len(scores)} scores")
    by_metric: dict[str, list[float]] = {}
    for t, s in zip(turns, scores):
        by_metric.setdefault(t.get("metric", record["metric"]), []).append(s)
    return sum(sum(v) / len(v) for v in by_metric.values()) / len(by_metric)
