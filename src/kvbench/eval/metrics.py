"""Per-sample metrics and their aggregation over a run.

- :func:`exact_match`: whitespace-stripped string equality (RULER/needle-style
  retrieval, one-digit VLM answers).
- :func:`~kvbench.data.lcc.edit_sim`: LongBench's ``code_sim_score`` (LCC / RepoBench-P): the first
  prediction line that contains no backtick, ``#`` or ``//``, compared to the gold
  line with ``fuzz.ratio / 100`` (normalised Indel similarity,
  ``2 * LCS / (len(a) + len(b))``); defined with the LCC records, whose chance level it scores.
- :func:`final_answer`: equality of the final answers only (last ``\\boxed{}`` or last word): long chains and
  reasoning traces (ResidualKV Table V).
- :func:`aggregate`: mean score with a 95% confidence interval (Wilson for
  binary scores, normal approximation otherwise) and mean chance level.

Every metric maps ``(prediction: str, gold: str) -> float`` in ``[0, 1]``; SCBench's scorers
(:mod:`kvbench.eval.scbench_metrics`, ``scb_*``) also take a list of golds.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from kvbench.data.lcc import edit_sim
from kvbench.eval.scbench_metrics import SCBENCH_METRICS

#: z quantile of a two-sided 95% interval.
Z95 = 1.959963984540054


def exact_match(pred: str, gold: str) -> float:
    """1.0 when ``pred`` equals ``gold`` after stripping surrounding whitespace, else 0.0."""
    return float(pred.strip() == gold.strip())


def _final(text: str) -> str:
    """A text's final answer: the content of its last ``\\boxed{...}`` (a reasoning model's convention: AIME runs of
    Qwen3-Thinking), else its last whitespace-separated word ("" for an empty text)."""
    at = text.rfind("\\boxed{")
    if at >= 0:
        depth, start = 0, at + len("\\boxed{")
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth < 0:
                return text[start:i].strip()
    words = text.split()
    return words[-1] if words else ""


def final_answer(pred: str, gold: str) -> float:
    """1.0 when the final answers of ``pred`` and ``gold`` (:func:`_final`) are equal and not empty, else 0.0: a long
    chain or reasoning trace is scored by its final answer only (ResidualKV Table V; the smoke chain task)."""
    p = _final(pred)
    return float(bool(p) and p == _final(gold))


#: Metric registry: the record field ``metric`` names one of these.
METRICS: dict[str, Callable[[str, str], float]] = {
    "exact_match": exact_match,
    "edit_sim": edit_sim,
    "final_answer": final_answer,
    **SCBENCH_METRICS,   # SCBench's scorers (ResidualKV Table IV); golds may be lists there
}


def get_metric(name: str) -> Callable[[str, str], float]:
    """Look up a metric; raises ``ValueError`` naming the valid ones."""
    if name not in METRICS:
        raise ValueError(f"unknown metric {name!r}; expected one of {sorted(METRICS)}")
    return METRICS[name]


def wilson_interval(k: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for ``k`` successes in ``n`` Bernoulli trials."""
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    lo = 0.0 if k <= 0 else max(0.0, centre - half)
    hi = 1.0 if k >= n else min(1.0, centre + half)
    return (lo, hi)


def normal_interval(xs: list[float], z: float = Z95) -> tuple[float, float]:
    """Mean ± z · s/√n (sample standard deviation, ddof=1), clipped to [0, 1]."""
    n = len(xs)
    if n == 0:
        return (math.nan, math.nan)
    mean = sum(xs) / n
    if n == 1:
        return (mean, mean)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = z * sd / math.sqrt(n)
    return (max(0.0, mean - half), min(1.0, mean + half))


def aggregate(rows: Iterable[dict]) -> dict:
    """Aggregate prediction rows (``score``, ``status``, ``chance``) of one run.

    Failed samples (``status == "error"``) count with score 0 in the mean.

    Returns:
        dict with ``score`` (mean over all rows), ``ci95`` (``[lo, hi]``),
        ``ci95_method`` (``"wilson"`` when every score is 0 or 1, else
        ``"normal"``), ``n``, ``n_ok``, ``n_error`` and ``chance`` (mean of the
        rows' chance levels, ``None`` if no row has one).
    """
    rows = list(rows)
    scores = [float(r.get("score") or 0.0) for r in rows]
    n = len(scores)
    n_error = sum(1 for r in rows if r.get("status") == "error")
    binary = all(s in (0.0, 1.0) for s in scores)
    lo, hi = wilson_interval(sum(scores), n) if binary else normal_interval(scores)
    chances = [float(r["chance"]) for r in rows if r.get("chance") is not None]
    return {
        "score": sum(scores) / n if n else math.nan,
        "ci95": [lo, hi],
        "ci95_method": "wilson" if binary else "normal",
        "n": n,
        "n_ok": n - n_error,
        "n_error": n_error,
        "chance": sum(chances) / len(chances) if chances else None,
    }
