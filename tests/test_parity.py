"""Parity with kvpress (results/parity/kvpress.csv): the parameter mapping, the comparison and its CSV, the
target's DAG, and (slow, needs the parity venv) the real comparison."""
from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest
from test_workflow import REPO, planned_jobs, snakemake

from kvbench.bench.parity import byte_tokenizer, kvpress_params
from kvbench.compress.presses.eviction import budget
from kvbench.compress.presses.kvzip import KVzipPress
from kvbench.compress.presses.pyramidkv import PyramidKVPress
from kvbench.compress.presses.snapkv import SnapKVPress
from kvbench.report.parity import (
    COLUMNS,
    jaccard,
    parity_rows,
    relation,
    summary,
    write_parity_csv,
)

PARITY_PYTHON = REPO / "envs" / ".parity-venv" / "bin" / "python"


# -- the mapping -----------------------------------------------------------------------------------
@pytest.mark.parametrize("keep, window", [(0.3, 16), (0.1, 32), (0.77, 8)])
def test_snapkv_ratio_keeps_kvbenchs_count_after_kvpress_truncation(keep, window):
    press = SnapKVPress(keep=keep, window=window)
    for n in range(window + 1, 700):
        cr = kvpress_params(press, n, 4, 2)["compression_ratio"]
        assert 0 <= cr < 1                                                          # kvpress's range
        kept = n if cr == 0 else max(1, int(n * (1 - cr)))                          # kvpress's compute_n_kept
        assert kept == budget(keep, n - window) + window


def test_pyramidkv_ratio_gives_the_same_mean_per_layer():
    p = kvpress_params(PyramidKVPress(keep=0.3, window=16, beta=4), 301, 4, 2)
    assert p["beta"] == 4 and p["window_size"] == 16
    assert 301 * (1 - p["compression_ratio"]) == pytest.approx(0.3 * 285 + 16)


def test_kvzip_ratio_prunes_the_complement_and_has_no_sinks():
    for n in (5, 224, 301, 387, 1999):
        total = 4 * 2 * n
        p = kvpress_params(KVzipPress(ratio=0.3), n, 4, 2)
        assert int(total * p["compression_ratio"]) == total - round(0.3 * total)   # kvpress prunes int(N·cr)
        assert (p["n_sink"], p["layerwise"], p["chunk_size"]) == (0, False, 2000)


@pytest.mark.parametrize("press, match", [(SnapKVPress(pooling="max"), "avg"), (KVzipPress(level="pair-uniform"), "pair"),
                                          (PyramidKVPress(beta=2.5), "integer beta")])
def test_mappings_without_a_counterpart_are_refused(press, match):
    with pytest.raises(ValueError, match=match):
        kvpress_params(press, 100, 4, 2)
    with pytest.raises(ValueError, match="window"):
        kvpress_params(SnapKVPress(window=16), 16, 4, 2)


def test_byte_tokenizer_encodes_bytes_and_has_no_chat_template():
    tok = byte_tokenizer()
    assert tok.encode("\nAb", add_special_tokens=False) == [10, 65, 98]
    assert tok.chat_template is None


# -- the comparison ----------------------------------------------------------------------------------
def _sides():
    plan = {"contexts": {"c": [1, 2, 3, 4]}, "presses": [
        {"name": "snapkv", "kvbench_spec": "snapkv:keep=0.5", "kvpress_params": {"c": {"compression_ratio": 0.4}}},
        {"name": "pyramidkv", "kvbench_spec": "pyramidkv:keep=0.5", "kvpress_params": {"c": {"compression_ratio": 0.4}}}]}
    kvbench = {"runs": [{"press": "snapkv", "context": "c", "kept": [[[0, 3], [1, 3]]], "logits": [0.0, 1.0]},
                        {"press": "pyramidkv", "context": "c", "kept": [[[0, 3], [1, 3]]], "logits": [0.0, 1.0]}]}
    kvpress = {"runs": [{"press": "snapkv", "context": "c", "kept": [[[0, 3], [2, 3]]], "logits": [0.5, 0.75],
                         "match_distance": 0.0},
                        {"press": "pyramidkv", "context": "c", "kept": [[[0, 1, 3], [3]]], "logits": [0.0, 1.0]}]}
    return plan, kvbench, kvpress


def test_jaccard_and_relation():
    assert jaccard([0, 1, 2], [1, 2, 3]) == 0.5 and jaccard([], []) == 1.0
    assert relation({1}, {1, 2}) == "nested: kvpress ⊂ kvbench" and relation({1, 2}, {2}) == "nested: kvbench ⊂ kvpress"
    assert relation({1}, {2}) == "cross" and relation({1}, {1}) == "identical"


def test_parity_rows_and_csv_layout(tmp_path):
    plan, kvbench, kvpress = _sides()
    rows = parity_rows(plan, kvbench, kvpress)
    assert [(r["press"], r["layer"], r["head"]) for r in rows] == [("snapkv", 0, 0), ("snapkv", 0, 1),
                                                                   ("pyramidkv", 0, 0), ("pyramidkv", 0, 1)]
    assert [r["jaccard"] for r in rows] == [1.0, 1 / 3, 2 / 3, 0.5]
    assert [(r["n_kept_kvpress"], r["n_kept_kvbench"]) for r in rows] == [(2, 2), (2, 2), (3, 2), (1, 2)]
    assert [r["max_logit_diff"] for r in rows] == [0.5, 0.5, 0.0, 0.0]
    assert rows[0]["note"] == "identical" and rows[1]["note"] == "cross"
    assert rows[2]["note"].startswith("nested: kvbench ⊂ kvpress; kvpress counts the observation window inside")
    assert rows[0]["kvpress_params"] == '{"compression_ratio": 0.4}' and rows[0]["kvbench_spec"] == "snapkv:keep=0.5"
    paths = []
    for name, obj in zip(("plan", "kvbench", "kvpress"), (plan, kvbench, kvpress)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(pd.io.json.ujson_dumps(obj))
    write_parity_csv(*paths, tmp_path / "out" / "kvpress.csv")
    table = pd.read_csv(tmp_path / "out" / "kvpress.csv")
    assert list(table.columns) == COLUMNS and len(table) == 4
    s = summary(table)
    assert s.loc["snapkv", "identical"] == 1 and s.loc["pyramidkv", "jaccard_min"] == 0.5


def test_parity_rows_refuse_missing_runs_and_inexact_matches():
    plan, kvbench, kvpress = _sides()
    with pytest.raises(ValueError, match="pyramidkv on c: no run on the kvpress side"):
        parity_rows(plan, kvbench, {"runs": kvpress["runs"][:1]})
    kvpress["runs"][0]["match_distance"] = 1e-7
    with pytest.raises(ValueError, match="not certain"):
        parity_rows(plan, kvbench, kvpress)


# -- the workflow ----------------------------------------------------------------------------------
def test_parity_target_resolves_outside_all(tmp_path):
    r = snakemake(tmp_path, "-n", "results/parity/kvpress.csv")
    assert r.returncode == 0, r.stdout[-3000:]
    assert planned_jobs(r.stdout) == {"parity_env": 1, "parity_kvbench": 1, "parity_kvpress": 1, "parity_csv": 1}
    r = snakemake(tmp_path, "-n")   # not part of `all` (the report lists it only once built)
    assert r.returncode == 0 and not any(k.startswith("parity") for k in planned_jobs(r.stdout)), r.stdout[-3000:]


# -- the real thing ----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not PARITY_PYTHON.exists(), reason="no parity venv: build it with scripts/parity_env.sh "
                    "(kvpress 0.5.5 and its pinned transformers from PyPI, minutes)")
def test_kvpress_parity_csv(tmp_path):
    """The steps of workflow/rules/parity.smk, with the repository's parity venv, then the CSV they give."""
    work, out = tmp_path / "work", tmp_path / "kvpress.csv"
    kvbench = [sys.executable, "-m", "kvbench.cli", "parity"]
    subprocess.run([*kvbench, "prepare", "--workdir", str(work)], check=True)
    subprocess.run([str(PARITY_PYTHON), str(REPO / "scripts" / "parity_kvpress.py"), "--plan", str(work / "plan.json"),
                    "--out", str(work / "kvpress.json")], check=True)
    subprocess.run([*kvbench, "compare", "--workdir", str(work), "--out", str(out)], check=True)
    table = pd.read_csv(out)
    assert list(table.columns) == COLUMNS
    exact = table[table.press.isin(["fullkv", "snapkv", "kvzip"])]
    assert (exact.note == "identical").all() and (exact.jaccard == 1.0).all()
    assert (exact.max_logit_diff < 1e-4).all()
    pyramid = table[table.press == "pyramidkv"]
    assert (pyramid.jaccard < 1).any() and pyramid.note.str.startswith("nested").all()
    assert pyramid.note.str.contains("window inside each layer's pyramid budget").all()
