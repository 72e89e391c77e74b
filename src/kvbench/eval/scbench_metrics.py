"""SCBench's per-query scorers (``microsoft/MInference`` ``scbench/compute_scores.py`` at 9987de6), as kvbench metrics.

Each maps ``(prediction: str, gold: str | list[str]) -> float`` in ``[0, 1]``; a string gold counts as a list of one
(SCBench's ``get_score_one_longdialogue_qa_eng`` iterates its label, which for a bare string would be its
characters; the SCBench files give lists there). Which task uses which (``get_score_one`` and
``Multiturnbench_to_Infinitebench`` in SCDQ mode):

- ``scb_substring``: ``kv_retrieval`` (scbench_kv, scbench_prefix_suffix): the gold string occurs in the prediction
  (case-sensitive; a list: any of them);
- ``scb_any_upper``: ``longdialogue_qa_eng`` (scbench_qa_eng "En.QA", scbench_many_shot): any gold, upper-cased,
  occurs in the upper-cased prediction;
- ``scb_all_lower``: ``string_match_all`` (scbench_vt): share of the golds that occur (lower-cased) in the
  prediction, rounded to 2 decimals as SCBench does;
- ``scb_first_int``: ``passkey`` (the needle turns of scbench_summary_with_needles): the first run of digits of the
  prediction equals the gold;
- ``scb_rouge_lsum``: ``longbook_sum_eng`` (scbench_summary and the summary turns of summary_with_needles): ROUGE-Lsum
  F1 as ``rouge_score`` computes it (lower-cased alphanumeric tokens, no stemmer: HF ``evaluate``'s default;
  sentences split at newlines; union LCS per reference sentence), written here so the package needs no extra
  dependency for one metric.
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable


def _golds(gold: str | list[str]) -> list[str]:
    return [gold] if isinstance(gold, str) else list(gold)


def substring(pred: str, gold: str | list[str]) -> float:
    """1.0 when a gold string occurs in ``pred`` (SCBench ``get_score_one_kv_retrieval``: ``label in pred``)."""
    return float(any(g in pred for g in _golds(gold)))


def any_upper(pred: str, gold: str | list[str]) -> float:
    """1.0 when a gold, upper-cased, occurs in the stripped, upper-cased ``pred`` (``get_score_one_longdialogue_qa_eng``)."""
    p = pred.strip().upper()
    return float(any(g.upper() in p for g in _golds(gold)))


def all_lower(pred: str, gold: str | list[str]) -> float:
    """Share of the golds occurring in ``pred``, lower-cased, rounded to 2 decimals (``string_match_all``)."""
    golds = _golds(gold)
    return round(sum(g.lower() in pred.lower() for g in golds) / len(golds), 2)


def first_int(pred: str, gold: str | list[str]) -> float:
    """1.0 when the first run of digits in ``pred`` equals the (first) gold (``get_score_one_passkey``)."""
    runs = [x for x in re.split("[^0-9]", pred) if x]
    return float(bool(runs) and runs[0] == _golds(gold)[0])


def _tokens(text: str) -> list[str]:
    """``rouge_score.tokenize``: lower-case, non-alphanumerics to spaces, split."""
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).split()


def _lcs_hits(ref: list[str], cand: list[str]) -> set[int]:
    """Indices into ``ref`` of one longest common subsequence with ``cand``."""
    n, m = len(ref), len(cand)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n):
        for j in range(m):
            table[i + 1][j + 1] = table[i][j] + 1 if ref[i] == cand[j] else max(table[i][j + 1], table[i + 1][j])
    hits, i, j = set(), n, m
    while i and j:
        if ref[i - 1] == cand[j - 1]:
            hits.add(i - 1)
            i, j = i - 1, j - 1
        elif table[i - 1][j] >= table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return hits


def rouge_lsum(pred: str, gold: str | list[str]) -> float:
    """ROUGE-Lsum F1 of ``pred`` against the best gold (``rouge_score.rouge_scorer._summary_level_lcs``): sentences are
    newline-separated; for each reference sentence the union of its LCS hits with every prediction sentence counts,
    each token at most as often as it occurs in both texts."""
    best = 0.0
    for g in _golds(gold):
        refs = [_tokens(s) for s in g.split("\n") if _tokens(s)]
        cands = [_tokens(s) for s in pred.split("\n") if _tokens(s)]
        n_ref, n_cand = sum(map(len, refs)), sum(map(len, cands))
        if not n_ref or not n_cand:
            continue
        ref_left = Counter(t for s in refs for t in s)
        cand_left = Counter(t for s in cands for t in s)
        hits = 0
        for r in refs:
            union = set().union(*(_lcs_hits(r, c) for c in cands))
            for t in (r[i] for i in sorted(union)):
                if ref_left[t] > 0 and cand_left[t] > 0:
                    hits += 1
                    ref_left[t] -= 1
                    cand_left[t] -= 1
        p, rc = hits / n_cand, hits / n_ref
        best = max(best, 0.0 if hits == 0 else 2 * p * rc / (p + rc))
    return best


#: SCBench's scorers by kvbench metric name (module doc); joined into :data:`kvbench.eval.metrics.METRICS`.
SCBENCH_METRICS: dict[str, Callable[[str, str | list[str]], float]] = {
    "scb_substring": substring,
    "scb_any_upper": any_upper,
    "scb_all_lower": all_lower,
    "scb_first_int": first_int,
    "scb_rouge_lsum": rouge_lsum,
}
