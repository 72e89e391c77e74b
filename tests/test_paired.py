"""Paired differences of table rows (kvbench.report.paired): every pair, pooled over columns, with a CI."""
from __future__ import annotations

import numpy as np
import pytest

from kvbench.report.paired import pair_rows, paired_bootstrap


def _row(label, a, b, kr=None):
    row = {"method": label, "spec": label.lower(), "values": {"t1": dict(enumerate(a)), "t2": dict(enumerate(b))}}
    row["kr"] = kr or {"t1": {}, "t2": {}}
    return row


def test_every_pair_in_table_order_pooled_over_columns():
    rows = [_row("A", [1, 1, 1], [1, 0]), _row("B", [0, 1, 0], [0, 0]), _row("C", [1, 1, 1], [1, 0])]
    out = pair_rows(rows, ["t1", "t2"], 500, 0)
    assert [r["method"] for r in out] == ["A − B", "A − C", "B − C"]
    ab = out[0]
    assert ab["kind"] == "paired difference" and ab["spec"] == "a − b"
    # per column its mean difference; pooled: the 5 records once each (3/5), not the mean of the columns (2/3 + 1/2)
    assert (ab["t1"], ab["t2"], ab["diff"], ab["n"]) == (66.67, 50.0, 60.0, 5)
    assert (ab["wins"], ab["losses"], ab["ties"]) == (3, 0, 2)
    lo, hi = paired_bootstrap(np.array([1, 0, 1, 1, 0], dtype=float), 500, 0)
    assert (ab["ci95_lo"], ab["ci95_hi"]) == (round(100 * lo, 2), round(100 * hi, 2))
    ac = out[1]   # identical rows: a zero-width CI at 0, not told apart
    assert (ac["diff"], ac["ci95_lo"], ac["ci95_hi"], ac["told_apart"], ac["ties"]) == (0, 0, 0, False, 5)


def test_metrics_pair_on_records_both_rows_have():
    kr_a = {"t1": {0: 0.2, 1: 0.2, 2: 0.2}, "t2": {0: 0.3}}        # record t2/1 failed: no audit row
    kr_b = {"t1": {0: 1.0, 1: 1.0, 2: 1.0}, "t2": {0: 1.0, 1: 1.0}}
    out = pair_rows([_row("A", [1, 1, 1], [1, 0], kr_a), _row("B", [1, 1, 1], [1, 0], kr_b)], ["t1", "t2"], 500, 0,
                    metrics={"KR_packed %": "kr"})
    assert out[0]["KR_packed % diff"] == -77.5 and out[0]["KR_packed % told_apart"] and out[0]["notes"] == ""
    empty = {"t1": {}, "t2": {}}
    out = pair_rows([_row("A", [1], [1], empty), _row("B", [1], [1], empty)], ["t1", "t2"], 500, 0,
                    metrics={"KR_packed %": "kr"})
    assert "KR_packed % diff" not in out[0] and out[0]["notes"] == "KR_packed %: no record has it in both rows"


def test_runs_over_different_records_are_not_paired():
    a, b = _row("A", [1, 1], [1]), _row("B", [1, 1, 0], [1])
    with pytest.raises(ValueError, match=r"column t1, rows 'A' and 'B'.*only in the second: \[2\]"):
        pair_rows([a, b], ["t1", "t2"], 500, 0)


def test_a_run_with_a_repeated_record_id_is_refused(tmp_path):
    from kvbench.report.residualkv.tables import bootstrap_settings, record_values
    from kvbench.utils.io import write_jsonl

    write_jsonl(tmp_path / "predictions.jsonl", [{"id": "r1", "score": 1.0, "status": "ok"},
                                                 {"id": "r1", "score": 0.0, "status": "ok"}])
    with pytest.raises(ValueError, match=r"record id\(s\) \['r1'\] appear more than once"):
        record_values(tmp_path)
    assert bootstrap_settings({}) == {"resamples": 2000, "seed": 0}
    with pytest.raises(ValueError, match="resamples must be >= 100"):
        bootstrap_settings({"bootstrap": {"resamples": 10}})


@pytest.mark.parametrize("score", [float("nan"), None, "1"])
def test_a_record_without_a_numeric_score_is_named(tmp_path, score):
    """Review: one NaN score made every pair with its row NaN and listed it as 'cannot be told apart'."""
    from kvbench.report.residualkv.tables import record_values
    from kvbench.utils.io import write_jsonl

    write_jsonl(tmp_path / "predictions.jsonl", [{"id": "ok", "score": 1.0, "status": "ok"},
                                                 {"id": "bad", "score": score, "status": "ok"}])
    with pytest.raises(ValueError, match=r"record\(s\) \['bad'\] have no numeric score"):
        record_values(tmp_path)


def test_hierarchical_bootstrap_covers_seed_to_seed_variation():
    """Issue #33, item 2: three seeds whose own differences disagree (+0.5, 0, -0.3, each tight over 200 records).
    Pooling the records as one sample gives a narrow CI that excludes 0; the two-level bootstrap over seeds and
    records gives one that includes it, and no seed-agreement is claimed."""
    from kvbench.report.paired import hierarchical_bootstrap, seed_pooled_stats

    rng = np.random.default_rng(1)
    groups = [rng.normal(m, 0.1, 200) for m in (0.5, 0.0, -0.3)]
    lo, hi = paired_bootstrap(np.concatenate(groups), 2000, 0)
    assert lo > 0
    lo, hi = hierarchical_bootstrap(groups, 2000, 0)
    assert lo < 0 < hi and lo > -0.31 and hi < 0.51  # within the range of the seed means
    s = seed_pooled_stats(groups, 2000, 0)
    assert (s["seeds"], s["seeds_above"], s["seeds_below"], s["every_seed"], s["n"]) == (3, 1, 2, "", 600)
    assert not s["told_apart"]
    agree = seed_pooled_stats([g + 0.6 for g in groups], 2000, 0)
    assert agree["every_seed"] == ">" and agree["told_apart"]
    # one seed: the two-level bootstrap is the record bootstrap's spread (same centre)
    one = hierarchical_bootstrap(groups[:1], 4000, 0)
    ref = paired_bootstrap(groups[0], 4000, 0)
    assert one == pytest.approx(ref, abs=0.005)
    with pytest.raises(ValueError, match=r"sizes \[200, 0\]"):
        hierarchical_bootstrap([groups[0], np.array([])], 10, 0)
