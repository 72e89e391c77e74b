"""Paired comparisons of two table rows over the same records: the bootstrap CI both papers' tables carry.

Two rows of a table are runs of two methods on the same records, so their difference is paired by record id: per
record ``a − b``, pooled over a table's columns (each column's records once; not the average of the columns), and a
95% percentile-bootstrap CI of its mean. ``told_apart`` says the CI excludes 0. CONDUIT's Tables 1 and 5 carry this
(:mod:`kvbench.report.conduit.accuracy`); ResidualKV's tables carry it for every pair of rows (:func:`pair_rows`), on the
score and on the measured KR and CR, so ``kvbench report compare`` can judge each published ordering of the papers
instead of printing "no CI".

Units: scores in [0, 1] per record, reported x 100 (points); KR/CR fractions per record, reported x 100 (% points).
"""
from __future__ import annotations

import math
from itertools import combinations

import numpy as np

#: Bootstrap settings when a config gives none (the schema's defaults of ``conduit.gap`` / ``residualkv.bootstrap``).
DEFAULT_BOOTSTRAP = {"resamples": 2000, "seed": 0}

#: The kind a paired-difference row carries in a table's ``kind`` column (the score rows have ``score``).
KIND = "paired difference"

#: The kind of a row pooling one paired difference over a regime's training seeds (:func:`seed_pooled_stats`).
SEED_KIND = "seed-pooled difference"

#: Separator of ``a − b`` in a paired row's ``method`` and ``spec`` (``kvbench.report.compare`` splits on it).
MINUS = " − "


def paired_bootstrap(diff: np.ndarray, resamples: int, seed: int, strata: np.ndarray | None = None
                     ) -> tuple[float, float]:
    """95% percentile CI of the mean of ``diff`` (per-record values, e.g. paired differences) by bootstrap.

    Args:
        diff: ``(n,)`` float per-record values (score units, [0, 1] or differences of them).
        resamples: bootstrap resamples.
        seed: ``numpy.random.default_rng`` seed.
        strata: optional ``(n,)`` labels (a table's columns); records are then resampled within each
            stratum and the statistic is the unweighted mean of the stratum means (a table's ``avg``).

    Returns:
        ``(lo, hi)``: the 2.5th and 97.5th percentiles of the resampled statistic.
    """
    rng = np.random.default_rng(seed)
    if strata is None:
        idx = rng.integers(0, len(diff), size=(int(resamples), len(diff)))
        means = diff[idx].mean(axis=1)
    else:
        groups = [diff[strata == s] for s in dict.fromkeys(strata.tolist())]
        means = np.mean([g[rng.integers(0, len(g), size=(int(resamples), len(g)))].mean(axis=1) for g in groups],
                        axis=0)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def hierarchical_bootstrap(groups: list[np.ndarray], resamples: int, seed: int) -> tuple[float, float]:
    """95% percentile CI of the mean over training seeds of each seed's mean per-record value, by a two-level
    bootstrap: each resample draws ``len(groups)`` seeds with replacement, then each drawn seed's records with
    replacement (independently per draw), and averages the drawn seeds' means with equal weight. The CI so covers
    both model-to-model variation and the records (Davison & Hinkley 1997, §3.8, "strategy 1": resample at both
    stages).

    Args:
        groups: per training seed, ``(n_s,)`` float per-record values (paired differences, [0, 1] units).
        resamples: bootstrap resamples; seed: ``numpy.random.default_rng`` seed.

    Returns:
        ``(lo, hi)``: the 2.5th and 97.5th percentiles of the resampled statistic.

    Raises:
        ValueError: no group, or an empty group.
    """
    if not groups or any(len(g) == 0 for g in groups):
        raise ValueError(f"hierarchical bootstrap needs >= 1 seed, each with records; got sizes "
                         f"{[len(g) for g in groups]}")
    rng = np.random.default_rng(seed)
    S, B = len(groups), int(resamples)
    # record-level resampled means of every seed at every draw position: (S positions, S seeds, B)
    means = np.stack([np.stack([g[rng.integers(0, len(g), size=(B, len(g)))].mean(axis=1) for g in groups])
                      for _ in range(S)])
    pick = rng.integers(0, S, size=(B, S))  # the seed drawn at each position of each resample
    stat = means[np.arange(S)[None, :], pick, np.arange(B)[:, None]].mean(axis=1)
    return float(np.percentile(stat, 2.5)), float(np.percentile(stat, 97.5))


def seed_pooled_stats(groups: list[np.ndarray], resamples: int, seed: int) -> dict:
    """Summary of one paired difference measured on several training seeds (``groups``: per seed, ``(n_s,)``
    per-record differences in [0, 1] units), x 100, 2 decimals.

    Returns:
        ``diff`` (mean over seeds of the seed means: each seed weighs the same), ``ci95_lo``/``ci95_hi``
        (:func:`hierarchical_bootstrap`), ``told_apart`` (the CI excludes 0), ``seeds`` (count), ``seeds_above``/
        ``seeds_below`` (seeds whose mean difference is > 0 / < 0), ``every_seed`` (``">"`` or ``"<"`` when every
        seed's mean difference is on that side of 0, else ``""``), ``n`` (records over all seeds).

    Raises:
        ValueError: as :func:`hierarchical_bootstrap`.
    """
    lo, hi = hierarchical_bootstrap(groups, resamples, seed)
    per_seed = np.array([float(g.mean()) for g in groups])
    above, below = int((per_seed > 0).sum()), int((per_seed < 0).sum())
    return {"diff": round(100 * float(per_seed.mean()), 2), "ci95_lo": round(100 * lo, 2),
            "ci95_hi": round(100 * hi, 2), "told_apart": bool(lo > 0 or hi < 0), "seeds": len(groups),
            "seeds_above": above, "seeds_below": below,
            "every_seed": ">" if above == len(groups) else "<" if below == len(groups) else "",
            "n": int(sum(len(g) for g in groups))}


def paired_stats(d: np.ndarray, resamples: int, seed: int, prefix: str = "") -> dict:
    """Summary of per-record paired differences ``d`` (``(n,)`` float, [0, 1] units), x 100, 2 decimals.

    Returns:
        ``{prefix}diff`` (mean), ``{prefix}ci95_lo``/``{prefix}ci95_hi`` (:func:`paired_bootstrap`),
        ``{prefix}told_apart`` (the CI excludes 0); without a prefix also ``wins``/``losses``/``ties``
        (records where ``a`` is above/below/equal to ``b``) and ``n``.

    Raises:
        ValueError: ``d`` is empty.
    """
    if len(d) == 0:
        raise ValueError("no paired records: a paired difference needs at least one record both rows scored")
    lo, hi = paired_bootstrap(d, resamples, seed)
    out = {f"{prefix}diff": round(100 * float(d.mean()), 2), f"{prefix}ci95_lo": round(100 * lo, 2),
           f"{prefix}ci95_hi": round(100 * hi, 2), f"{prefix}told_apart": bool(lo > 0 or hi < 0)}
    if not prefix:
        out.update(wins=int((d > 0).sum()), losses=int((d < 0).sum()), ties=int((d == 0).sum()), n=len(d))
    return out


def differences(a: dict, b: dict, where: str) -> np.ndarray:
    """``a[i] − b[i]`` over the record ids ``i`` of two runs' per-record values, in sorted id order.

    Raises:
        ValueError: the two runs hold different record ids (they are not paired); ``where`` names them.
    """
    if set(a) != set(b):
        only_a, only_b = sorted(set(a) - set(b))[:3], sorted(set(b) - set(a))[:3]
        raise ValueError(f"{where}: the two runs hold different records (only in the first: {only_a}, only in the "
                         f"second: {only_b}); cannot pair them")
    return np.array([a[i] - b[i] for i in sorted(a)], dtype=float)


def pair_rows(rows: list[dict], columns: list[str], resamples: int, seed: int,
              metrics: dict[str, str] | None = None) -> list[dict]:
    """Paired-difference rows for every pair of ``rows`` (``a`` above ``b`` in table order).

    Args:
        rows: per table row ``{"method": label, "spec": spec, "values": {column: {record id: score}},
            <metric column>: {column: {record id: value}} ...}``; every row has every column.
        columns: the table's score columns (tasks), in order.
        resamples, seed: :func:`paired_bootstrap` settings.
        metrics: further per-record quantities compared the same way, pooled over the columns: ``{table column
            (e.g. "KR_packed %"): key of the rows' per-record values}``. Records are paired where both rows have a
            value (a failed sample has no audit row).

    Returns:
        One dict per pair: ``kind = "paired difference"``, ``method = "<a> − <b>"``, ``spec``; per score column the
        column's mean difference (points); ``diff``/``ci95_lo``/``ci95_hi``/``told_apart``/``wins``/``losses``/
        ``ties``/``n`` of the score pooled over the columns (:func:`paired_stats`); per metric column ``<col>
        diff``/``<col> ci95_lo``/``<col> ci95_hi``/``<col> told_apart`` (% points), empty with a note where no
        record has the value in both rows.

    Raises:
        ValueError: two runs of a column hold different record ids.
    """
    out = []
    for a, b in combinations(rows, 2):
        rec = {"kind": KIND, "method": f"{a['method']}{MINUS}{b['method']}", "spec": f"{a['spec']}{MINUS}{b['spec']}"}
        pooled, notes = [], []
        for c in columns:
            d = differences(a["values"][c], b["values"][c], f"column {c}, rows {a['method']!r} and {b['method']!r}")
            rec[c] = round(100 * float(d.mean()), 2) if len(d) else math.nan
            pooled.append(d)
        rec.update(paired_stats(np.concatenate(pooled), resamples, seed))
        for col, key in (metrics or {}).items():
            d = np.concatenate([_common(a[key][c], b[key][c]) for c in columns])
            if len(d):
                rec.update(paired_stats(d, resamples, seed, prefix=f"{col} "))
            else:
                notes.append(f"{col}: no record has it in both rows")
        rec["notes"] = "; ".join(notes)
        out.append(rec)
    return out


def _common(a: dict, b: dict) -> np.ndarray:
    return np.array([a[i] - b[i] for i in sorted(set(a) & set(b))], dtype=float)


def difference_header(rows: list[dict], what: str, resamples: int, seed: int) -> list[str]:
    """``#`` header lines of a table's paired-difference rows: how they are computed, and which pairs are (not)
    told apart on the pooled score (``what``: which pairs the rows hold, e.g. "every pair of rows")."""
    def name(sel: list[dict]) -> str:
        return "; ".join(f"{d['method']} ({d['diff']:+.2f} [{d['ci95_lo']:+.2f}, {d['ci95_hi']:+.2f}])"
                         for d in sel) or "none"

    return [
        (f"# paired differences (rows with kind = '{KIND}', below the scores): {what}. Per record a - b, paired by "
         "record id within each column, x 100; a column cell is that column's mean difference; diff = mean over all "
         "records pooled across the columns (each column's records once: not the avg of the columns), n records; "
         "'KR_packed % diff'/'CR % diff' the same for the per-record KR/CR (% points); 95% CIs: paired bootstrap "
         f"over the pooled records, percentile method, {resamples} resamples, seed {seed}; wins/losses/ties = records "
         "where a scores above/below/equal to b; told_apart = the CI excludes 0"),
        f"# score told apart (95% CI excludes 0): {name([d for d in rows if d['told_apart']])}",
        f"# score CANNOT be told apart (95% CI includes 0): {name([d for d in rows if not d['told_apart']])}",
    ]
