"""CONDUIT refresh runs and accuracy tables: method specs, refresh eval methods, audit replay, table
builders on synthetic runs, and the Snakemake targets (dry runs; one slow real run)."""
from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from _zoo_fixtures import write_png, write_split
from test_workflow import (
    CI_CONFIG,
    PAPER_CONFIG,
    REPO,
    _fake_paper_root,
    load,
    planned_jobs,
    snakemake,
    write_config,
)

from kvbench.cli import main
from kvbench.eval.audit import ReplayPolicy, plan_audit
from kvbench.eval.refresh import MissingCacheEntry, RefreshMethod
from kvbench.eval.runconfig import read_config
from kvbench.eval.runner import run_eval
from kvbench.eval.registry import canonical, get_method, parse_method_spec, run_slugs, slug, with_budget
from kvbench.models.loader import load_model
from kvbench.report import tables
from kvbench.plan.conduit import ConduitPlan
from kvbench.report.conduit.accuracy import Runs, report_fig3, staleness_gap
from kvbench.report.paired import paired_bootstrap
from kvbench.reuse import refresh
from kvbench.utils.io import read_jsonl

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]


# --- method specs ------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, want", [
    ("reuse", "reuse"), ("full", "full"), ("conduit@0.1", "conduit@0.1"), ("conduit@0.10", "conduit@0.1"),
    ("conduit@0.1:lam=1", "conduit@0.1"),  # λ = 1 is the default: same run
    ("conduit@0.1:lam=0.5", "conduit@0.1:lam=0.5"), ("conduit@1", "conduit@1.0"),
    ("kvshare@0.05", "kvshare-conduit@0.05"),  # alias resolved
    ("conduit@0.1:use_v_norm=false,lam=0", "conduit@0.1:lam=0.0,use_v_norm=false"),  # sorted
    ("conduit@0.1:layers=2+3", "conduit@0.1:layers=2+3"), ("mpic@0.2:k=3", "mpic@0.2:k=3"),
])
def test_spec_canonical_form(spec, want):
    assert canonical(spec) == want


def test_spec_fields_and_slugs():
    s = parse_method_spec("conduit@0.1:lam=0.5")
    assert (s.policy, s.r, s.params, s.effective_r) == ("conduit", 0.1, {"lam": 0.5}, 0.1)
    assert parse_method_spec("reuse").effective_r == 0.0
    assert slug("conduit@0.1:lam=0.5") == "conduit_r0.1_lam-0.5"
    assert slug("conduit@0.1:use_v_norm=false") == "conduit_r0.1_use_v_norm-false"
    assert run_slugs(["conduit@0.1", "conduit@0.1:lam=1", "reuse"]) == {"conduit_r0.1": "conduit@0.1", "reuse": "reuse"}
    assert with_budget("cacheblend-conduit", 0.05) == "cacheblend-conduit@0.05"
    assert with_budget("conduit:lam=0.5", 0) == "conduit@0.0:lam=0.5"
    assert with_budget("reuse", 0.1) == "reuse" and with_budget("full", 0.1) == "full"


@pytest.mark.parametrize("spec, needle", [
    ("bogus@0.1", "unknown method 'bogus'"),
    ("conduit@1.5", "r must be a refresh ratio in [0, 1]"),
    ("conduit@-0.1", "r must be a refresh ratio in [0, 1]"),
    ("conduit@x", "got 'x'"),
    ("conduit@0.1:lam=2", "λ) must be in [0, 1], got 2"),
    ("conduit@0.1:lam=-0.5", "must be in [0, 1]"),
    ("conduit", "needs a budget"),
    ("reuse@0.1", "runs at r = 0 by definition"),
    ("full@0.5", "runs at r = 1 by definition"),
    ("full:lam=1", "unknown parameter 'lam' for 'full'"),
    ("conduit@0.1:foo=1", "unknown parameter 'foo' for 'conduit'"),
    ("conduit@0.1:lam", "is not key=value"),
    ("conduit@0.1:lam=0.5,lam=0.2", "given twice"),
    ("conduit@0.1:coef_source=mean", "coef_source must be"),
    ("con duit", "malformed"),
    # found by a fresh-clone review: these were silently accepted or failed with a TypeError
    ("conduit@0.1:use_v_norm=no", "use_v_norm must be true or false, got 'no'"),
    ("conduit@0.1:use_v_norm=1", "use_v_norm must be true or false, got 1"),
    ("conduit@0.1:lam=high", "lam must be a number, got 'high'"),
    ("conduit@0.1:layers=-3", "layers must be layer indices >= 0"),
])
def test_bad_specs_fail_with_clear_errors(spec, needle):
    with pytest.raises(ValueError) as e:
        parse_method_spec(spec)
    assert needle in str(e.value)
    with pytest.raises(ValueError):
        get_method(spec)


def test_single_layer_and_unknown_method_params():
    assert parse_method_spec("conduit@0.1:layers=2").params == {"layers": [2]}
    with pytest.raises(ValueError, match=r"unknown method parameter\(s\) \['nope'\]"):
        get_method("full", nope=1)


def test_get_method_builds_refresh_methods():
    m = get_method("conduit@0.1:lam=0.5", cache_dir="/nowhere")
    assert isinstance(m, RefreshMethod)
    assert m.config()["spec"] == "conduit@0.1:lam=0.5" and m.config()["policy_params"]["lam"] == 0.5
    with pytest.raises(ValueError, match="FullCache"):
        RefreshMethod(spec="full")
    with pytest.raises(ValueError, match="unknown method 'notamethod'"):
        get_method("notamethod")


def test_dry_run_validates_conduit_specs(tmp_path):
    cfg = yaml.safe_load(CI_CONFIG.read_text())
    cfg["conduit"]["ablation"] = [{"label": "bad", "method": "conduit@0.1:lam=2"}]
    r = snakemake(tmp_path, "-n", "--configfile", str(write_config(tmp_path / "bad.yaml", cfg)))
    assert r.returncode != 0 and "config conduit: conduit row 'bad': method spec 'conduit@0.1:lam=2'" in r.stdout, \
        r.stdout[-3000:]


# --- refresh eval runs on a random-weight zoo VLM ----------------------------------------------

def _records(tmp: Path) -> Path:
    recs = []
    for i, n_img in enumerate([2, 3, 2]):
        content = []
        for j in range(n_img):
            content += [{"type": "text", "text": f"Page {j + 1}:"},
                        {"type": "image", "image": "img/" + write_png(tmp / "img" / f"r{i}p{j}.png", 10 * i + j)}]
        recs.append({"id": f"d{i}", "task": "toydoc", "split": "test", "kind": "vlm",
                     "system": "Report the digit plus one.", "generic_system": "You are a helpful assistant.",
                     "content": content, "question": f"Page {1 + i % n_img}, cell B", "answer": "3",
                     "max_new_tokens": 3, "metric": "exact_match", "chance": 0.1, "meta": {"K": n_img}})
    return write_split(tmp / "test.jsonl", recs)


@pytest.fixture(scope="module")
def runs(vlm_dir, tmp_path_factory):
    """Run dirs of several methods over a 3-record multi-image split (one image cache shared)."""
    tmp = tmp_path_factory.mktemp("conduit_runs")
    split = _records(tmp)
    assert main(["cache", "--model", str(vlm_dir), "--split", str(split), "--cache-dir", str(tmp / "cache"),
                 "--out", str(tmp / "cache" / "index.json")]) == 0
    out = {}
    for spec in ["full", "reuse", "conduit@0.0", "conduit@1.0", "conduit@0.5", "kvshare-conduit@0.5",
                 "cacheblend@0.5"]:
        params = {} if spec == "full" else {"cache_dir": str(tmp / "cache"), "build_missing": False}
        run_eval(vlm_dir, split, method=spec, out_dir=tmp / slug(spec), method_params=params)
        out[spec] = tmp / slug(spec)
    out["split"], out["cache"] = split, tmp / "cache"
    return out


def _preds(run: Path) -> list[str]:
    return [r["prediction"] for r in read_jsonl(run / "predictions.jsonl")]


def test_cache_rule_index_and_reuse(runs):
    index = json.loads((runs["cache"] / "index.json").read_text())
    assert index["n_records"] == 3 and index["n_images"] == 7 and index["built"] == 7
    assert len(index["stores"]) == 1


def test_conduit_r1_equals_full_and_r0_equals_reuse(runs):
    assert all(r["status"] == "ok" for r in read_jsonl(runs["conduit@1.0"] / "predictions.jsonl"))
    assert _preds(runs["conduit@1.0"]) == _preds(runs["full"])
    assert _preds(runs["conduit@0.0"]) == _preds(runs["reuse"])


def test_rows_carry_the_refresh_plan(runs):
    rows = read_jsonl(runs["conduit@0.5"] / "predictions.jsonl")
    for row in rows:
        plan = row["plan"]
        assert plan["policy"] == "conduit" and plan["r"] == 0.5
        assert len(plan["selected"]) == plan["budget"] == math.ceil(0.5 * plan["n_visual"])
        vis = [i for s, e in plan["image_spans"] for i in range(s, e)]
        assert set(plan["selected"]) <= set(vis)  # sequence coordinates of visual tokens
        assert plan["layer_counts"] == [plan["budget"]] * plan["n_layers"]
        assert len(plan["coefficients"]) == plan["n_images"] and sum(plan["per_image_refreshed"]) == plan["budget"]
        assert plan["scores"]["threshold"] <= plan["scores"]["max"] and len(plan["tokens"]) >= 1
        assert plan["degenerate"] is False
        cost = plan["cost"]  # Table 1's cost columns: the analytic count agrees with the executed rows
        assert cost["row_layers"] == sum(plan["layer_counts"]) and cost["scoring"] > 0 < cost["executor"]
        assert cost["executor"] < cost["full_prefill"]
    for spec in ("reuse", "conduit@1.0", "kvshare-conduit@0.5", "cacheblend@0.5"):
        for row in read_jsonl(runs[spec] / "predictions.jsonl"):
            cost, plan = row["plan"]["cost"], row["plan"]
            assert cost["row_layers"] == sum(plan["layer_counts"]), spec
            assert (cost["scoring"] > 0) == spec.startswith("conduit"), spec  # only CONDUIT runs a scoring pass
            assert (cost["row_layers"] == 0) == (spec == "reuse"), spec
    for row in read_jsonl(runs["kvshare-conduit@0.5"] / "predictions.jsonl"):  # degenerate = layer 0 only
        counts = row["plan"]["layer_counts"]
        assert row["plan"]["degenerate"] == (counts[0] > 0 and not any(counts[1:]))
    method = read_config(runs["conduit@0.5"])["method"]
    assert method["spec"] == "conduit@0.5" and method["build_missing"] is False
    assert "plan" not in read_jsonl(runs["full"] / "predictions.jsonl")[0]


def test_read_only_cache_is_never_written(runs, vlm_dir, tmp_path):
    split = _records(tmp_path)  # same images: cached
    before = sorted(p.name for p in runs["cache"].rglob("*"))
    run_eval(vlm_dir, split, method="reuse", out_dir=tmp_path / "r",
             method_params={"cache_dir": str(runs["cache"]), "build_missing": False})
    assert sorted(p.name for p in runs["cache"].rglob("*")) == before
    empty = tmp_path / "empty-cache"
    with pytest.raises(MissingCacheEntry, match="has not been built"):
        run_eval(vlm_dir, split, method="reuse", out_dir=tmp_path / "r2",
                 method_params={"cache_dir": str(empty), "build_missing": False})
    assert not (tmp_path / "r2" / "metrics.json").exists()


def test_same_seed_gives_identical_predictions_and_table(runs, vlm_dir, tmp_path):
    """A second run of the same spec and seed: byte-identical predictions and metrics (timings live in
    timing.csv), the files every table is computed from."""
    run_eval(vlm_dir, runs["split"], method="conduit@0.5", out_dir=tmp_path / "again",
             method_params={"cache_dir": str(runs["cache"]), "build_missing": False})
    for name in ("predictions.jsonl", "metrics.json"):
        assert (tmp_path / "again" / name).read_bytes() == (runs["conduit@0.5"] / name).read_bytes(), name


def test_refresh_run_repeats_from_its_config(runs, tmp_path, capsys):
    """`kvbench eval --from` repeats a CONDUIT refresh run (the image cache named by its method parameters)."""
    cfg = read_config(runs["conduit@0.5"])
    assert cfg["run"]["method_params"] == {"cache_dir": str(runs["cache"]), "build_missing": False}
    assert cfg["method"]["policy"] == "conduit" and cfg["method"]["r"] == 0.5 and "image" in cfg["protocol"]["prefill"]
    assert main(["eval", "--from", str(runs["conduit@0.5"]), "--out", str(tmp_path / "again")]) == 0
    for name in ("predictions.jsonl", "metrics.json"):
        assert (tmp_path / "again" / name).read_bytes() == (runs["conduit@0.5"] / name).read_bytes(), name
    assert "identical" in capsys.readouterr().err


def test_corrupt_entry_in_a_read_only_cache_stops_the_run(runs, vlm_dir, tmp_path):
    """A read-only eval never scores a sample 0 for a cache problem: the run stops, no result is written
    (rows finished before the bad entry stay in the hidden work files, for a resume after the fix)."""
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(runs["cache"], cache)
    entry = sorted(cache.rglob("*.safetensors"))[0]
    entry.write_bytes(entry.read_bytes()[:-7] + b"garbage")
    with pytest.raises(MissingCacheEntry, match="no valid entry"):
        run_eval(vlm_dir, runs["split"], method="conduit@0.5", out_dir=tmp_path / "r",
                 method_params={"cache_dir": str(cache), "build_missing": False})
    assert not (tmp_path / "r").exists() or not any(p.name[0] != "." for p in (tmp_path / "r").iterdir())


def test_refresh_runs_refuse_imageless_records_and_bad_params_before_loading(tmp_path):
    recs = [json.loads(line) for line in _records(tmp_path).read_text().splitlines()]
    recs[1]["content"] = [{"type": "text", "text": "no pages here"}]
    split = write_split(tmp_path / "mixed.jsonl", recs)
    with pytest.raises(ValueError, match="'d1' has no image part"):
        run_eval("/nonexistent-model", split, method="conduit@0.1", out_dir=tmp_path / "r")
    with pytest.raises(ValueError, match="build_missing must be true or false, got 'no'"):
        run_eval("/nonexistent-model", split, method="reuse", out_dir=tmp_path / "r",
                 method_params={"build_missing": "no"})


@pytest.mark.parametrize("spec", ["conduit@0.5", "kvshare-conduit@0.5", "cacheblend@0.5", "reuse"])
def test_replay_cli_reproduces_the_prediction(runs, spec, capsys):
    for rid in ("d0", "d1"):
        assert main(["replay", "--run", str(runs[spec]), "--id", rid]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["match"] and out["replayed"] == out["recorded"] and out["replayed_tokens"] == out["recorded_tokens"]


def test_replay_needs_a_plan(runs, capsys):
    assert main(["replay", "--run", str(runs["full"]), "--id", "d0"]) == 2
    assert "has no refresh plan" in capsys.readouterr().err


def test_replay_refuses_a_record_of_the_pre_fix_check_layer_blend(runs, tmp_path, capsys):
    """Records made before the CacheBlend fix carry ``blend`` (rows whose new K/V were replaced by reused ones at the
    check layer); the executor no longer does that, so replaying one must fail, saying why, before any model work."""
    old = tmp_path / "old_cacheblend"
    shutil.copytree(runs["cacheblend@0.5"], old)
    rows = read_jsonl(old / "predictions.jsonl")
    assert "blend" not in rows[0]["plan"]  # new records have no such field
    rows[0]["plan"]["blend"] = {"1": rows[0]["plan"]["selected"] or [rows[0]["plan"]["image_spans"][0][0]]}
    write_split(old / "predictions.jsonl", rows)
    assert main(["replay", "--run", str(old), "--id", rows[0]["id"]]) == 2
    err = capsys.readouterr().err
    assert "pre-fix CacheBlend check-layer blend" in err and "rerun" in err
    ReplayPolicy({**rows[1]["plan"], "blend": {}})  # an empty field (old non-CacheBlend records) is fine


@pytest.mark.parametrize("spec", ["conduit@0.5", "cacheblend@0.5", "kvshare-conduit@0.3"])
def test_replayed_plan_is_bit_exact(runs, vlm_dir, spec):
    """Replaying the audit record re-executes the same rows per layer: identical logits and K/V."""
    model, proc = load_model(vlm_dir)
    method = RefreshMethod(spec=spec, cache_dir=str(runs["cache"]), build_missing=False)
    record = read_jsonl(runs["split"])[1]
    with torch.inference_mode():
        adapter, req, result = method.run(model, proc, record, runs["split"].parent)
        audit = json.loads(json.dumps(plan_audit(req, result, {}, [0])))  # through JSON, as stored
        again = refresh(adapter, req, ReplayPolicy(audit), audit["r"]).output
    assert torch.equal(again.logits, result.output.logits)
    assert all(torch.equal(a, b) for a, b in zip(again.keys, result.output.keys))
    assert again.layer_counts == result.output.layer_counts


# --- table builders on synthetic runs ----------------------------------------------------------

def _cfg(**over) -> dict:
    cfg = {
        "models": ["m"], "n_test": None, "threads": 1, "reference": "full",
        "multi_image": {"K2": {"dataset": "dp", "k": [2, 2]}, "K3": {"dataset": "dp", "k": [3, 3]}},
        "single_image": {"dg": {"dataset": "dg"}},
        "budgets": [0.1],
        "methods": [{"label": "Cache reuse", "method": "reuse"}, {"label": "CONDUIT", "method": "conduit"},
                    {"label": "Full prefill", "method": "full"}],
        "single_image_rows": [{"label": "r = 0", "method": "conduit@0"}, {"label": "Full prefill", "method": "full"}],
        "lambda": {"method": "conduit", "r": 0.1, "values": [0, 1]},
        "ablation": [{"label": "Composite", "method": "conduit@0.1"}],
        "curve": {"methods": ["CONDUIT"], "r": [0.1]},
        "gap": {"resamples": 1000, "seed": 0},
    }
    cfg.update(over)
    return cfg


DP_K = {"a": 2, "b": 2, "c": 2, "d": 2, "e": 3, "f": 3}


def _plan(spec: str, j: int) -> dict:
    """A refresh run's audit record with only what the cost columns read (none for full prefill): 4 visual tokens,
    2 layers; reuse recomputes no row-layer and has no scoring pass; others 1 + j % 2 row-layers and scoring 10."""
    if spec == "full":
        return {}
    reuse = spec == "reuse"
    return {"plan": {"n_visual": 4, "n_layers": 2, "cost": {
        "scoring": 0 if reuse else 10, "executor": 5 if reuse else 20, "full_prefill": 100,
        "row_layers": 0 if reuse else 1 + j % 2}}}


def _synthetic(root: Path, scores: dict[tuple[str, str], list[float]], cfg: dict | None = None):
    """Write split files and prediction rows ``scores[(dataset, spec)]`` (in id order) under ``root``."""
    write_split(root / "dp.jsonl", [{"id": i, "meta": {"K": k}} for i, k in DP_K.items()])
    write_split(root / "dg.jsonl", [{"id": f"g{i}", "meta": {}} for i in range(4)])
    cfg = cfg or _cfg()
    plan = ConduitPlan(cfg, "syn", zoo_models=cfg["models"])
    ids = {"dp": list(DP_K), "dg": [f"g{i}" for i in range(4)]}
    for key, vals in scores.items():  # (dataset, spec) on model "m", or (model, dataset, spec)
        model, ds, spec = key if len(key) == 3 else ("m", *key)
        rows = [{"id": i, "score": v, "status": "ok", **_plan(spec, j)} for j, (i, v) in enumerate(zip(ids[ds], vals))]
        write_split(root / plan.run_dir(model, ds, spec) / "predictions.jsonl", rows)
    return plan, {"profile": "syn", "conduit": cfg, "zoo_models": cfg["models"],
                  "splits": {"dp": str(root / "dp.jsonl"), "dg": str(root / "dg.jsonl")}}


def _read(path: Path) -> tuple[list[str], pd.DataFrame]:
    lines = path.read_text().splitlines()
    return [x for x in lines if x.startswith("#")], pd.read_csv(path, comment="#")


def test_table1_cells_and_percent_of_full(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, spec = _synthetic(tmp_path, {
        ("dp", "full"): [1, 1, 1, 0, 1, 0],          # K2: 75, K3: 50
        ("dp", "reuse"): [1, 0, 0, 0, 0, 0],         # K2: 25, K3: 0
        ("dp", "conduit@0.1"): [1, 1, 0, 0, 1, 0],   # K2: 50, K3: 50
    })
    tables.write("conduit/table1", json.dumps(spec), tmp_path / "t1.csv", root=tmp_path)
    header, df = _read(tmp_path / "t1.csv")
    assert "syn profile: tiny zoo (m) on smoke datasets; NOT the paper's numbers" in header[0]
    assert "records per column: K2=4, K3=2" in header[2]
    got = df.set_index("method")
    assert list(got.index) == ["Cache reuse", "CONDUIT", "Full prefill"] and list(got["spec"]) == ["reuse", "conduit@0.1", "full"]
    assert got.loc["CONDUIT", ["K2", "K2 %full", "K3", "K3 %full", "avg", "avg %full"]].tolist() == [50.0, 66.7, 50.0, 100.0, 50.0, 80.0]
    assert got.loc["Cache reuse", ["K2", "K2 %full", "K3", "K3 %full", "avg", "avg %full"]].tolist() == [25.0, 33.3, 0.0, 0.0, 12.5, 20.0]
    assert got.loc["Full prefill", ["K2 %full", "avg %full"]].tolist() == [100.0, 100.0]
    assert got["notes"].isna().all() and (got["r"] == 0.1).all()
    # cost beside score (issue #33, item 4): summed over the row's records from their audit records
    assert got.loc["CONDUIT", ["row-layers %", "FLOPs %full", "scoring %full"]].tolist() == [18.8, 30.0, 10.0]
    assert got.loc["Cache reuse", ["row-layers %", "FLOPs %full", "scoring %full"]].tolist() == [0.0, 5.0, 0.0]
    assert got.loc["Full prefill", ["row-layers %", "FLOPs %full", "scoring %full"]].tolist() == [100.0, 100.0, 0.0]
    assert any(h.startswith("# cost (every record") for h in header)


def test_cost_columns_are_empty_with_a_note_for_runs_without_audited_cost(tmp_path):
    _, spec = _synthetic(tmp_path, {("dp", "full"): [1] * 6, ("dp", "reuse"): [0] * 6, ("dp", "conduit@0.1"): [1] * 6})
    run = tmp_path / "results/runs/syn/m/dp/conduit/conduit_r0.1/predictions.jsonl"
    rows = read_jsonl(run)
    del rows[2]["plan"]["cost"]
    write_split(run, rows)
    tables.write("conduit/table1", spec, tmp_path / "t1.csv", root=tmp_path)
    got = _read(tmp_path / "t1.csv")[1].set_index("method")
    assert got.loc["CONDUIT", ["row-layers %", "FLOPs %full"]].isna().all()
    assert "has records without an audited cost" in got.loc["CONDUIT", "notes"]
    assert got.loc["Cache reuse", "FLOPs %full"] == 5.0


def test_missing_run_is_an_error_or_a_noted_empty_cell(tmp_path):
    _, spec = _synthetic(tmp_path, {("dp", "full"): [1] * 6, ("dp", "reuse"): [0] * 6})
    with pytest.raises(FileNotFoundError, match="run results/runs/syn/m/dp/conduit/conduit_r0.1 is missing"):
        tables.write("conduit/table1", spec, tmp_path / "t1.csv", root=tmp_path)
    tables.write("conduit/table1", {**spec, "allow_missing": True}, tmp_path / "t1.csv", root=tmp_path)
    _, df = _read(tmp_path / "t1.csv")
    row = df.set_index("method").loc["CONDUIT"]
    assert math.isnan(row["K2"]) and math.isnan(row["avg"])
    assert "K2: missing run results/runs/syn/m/dp/conduit/conduit_r0.1" in row["notes"]


def test_empty_reference_and_empty_bucket_are_noted(tmp_path):
    cfg = _cfg(multi_image={"K2": {"dataset": "dp", "k": [2, 2]}, "K9": {"dataset": "dp", "k": [9, 9]}})
    _, spec = _synthetic(tmp_path, {("dp", "full"): [0] * 6, ("dp", "reuse"): [0] * 6,
                                    ("dp", "conduit@0.1"): [1] * 6}, cfg)
    tables.write("conduit/table1", spec, tmp_path / "t1.csv", root=tmp_path)
    _, df = _read(tmp_path / "t1.csv")
    row = df.set_index("method").loc["CONDUIT"]
    assert row["K2"] == 100.0 and math.isnan(row["K2 %full"]) and math.isnan(row["K9"])
    assert "K2 %full: full prefill scores 0" in row["notes"]
    assert "K9: no record with K in [9, 9]" in row["notes"]


def test_table2_table4_table5_rows(tmp_path):
    _, spec = _synthetic(tmp_path, {
        ("dg", "full"): [1, 1, 0, 0], ("dg", "conduit@0.0"): [1, 0, 0, 0],
        ("dp", "full"): [1] * 6, ("dp", "conduit@0.1:lam=0.0"): [1, 0, 1, 0, 1, 0], ("dp", "conduit@0.1"): [1] * 6,
    })
    tables.write("conduit/table2", spec, tmp_path / "t2.csv", root=tmp_path)
    h2, t2 = _read(tmp_path / "t2.csv")
    assert t2.set_index("method").loc["r = 0", ["dg", "dg %full"]].tolist() == [25.0, 50.0]
    assert "# spread across rows (max - min, points): dg 25.00" in h2
    tables.write("conduit/table4", spec, tmp_path / "t4.csv", root=tmp_path)
    _, t4 = _read(tmp_path / "t4.csv")
    assert list(t4["method"]) == ["λ = 0", "λ = 1"] and list(t4["spec"]) == ["conduit@0.1:lam=0.0", "conduit@0.1"]
    assert t4["K2"].tolist() == [50.0, 100.0] and t4["K3"].tolist() == [50.0, 100.0]
    tables.write("conduit/table5", spec, tmp_path / "t5.csv", root=tmp_path)
    _, t5 = _read(tmp_path / "t5.csv")
    assert t5["avg %full"].tolist() == [100.0] and t5["r"].tolist() == [0.1]


def test_table1_header_names_degenerate_schedules_from_the_runs(tmp_path):
    """Rows whose runs recorded a degenerate layer schedule (audit ``degenerate``) are named in the header, with the
    budget and how many records; computed from the runs, and absent when no run had one."""
    cfg = _cfg(methods=[{"label": "KVShare", "method": "kvshare-conduit"}, {"label": "CONDUIT", "method": "conduit"},
                        {"label": "Full prefill", "method": "full"}])
    plan, spec = _synthetic(tmp_path, {("dp", "full"): [1] * 6, ("dp", "kvshare-conduit@0.1"): [0] * 6,
                                       ("dp", "conduit@0.1"): [1] * 6}, cfg)
    tables.write("conduit/table1", spec, tmp_path / "t1.csv", root=tmp_path)
    assert not any("DEGENERATE" in h for h in _read(tmp_path / "t1.csv")[0])
    path = tmp_path / plan.run_dir("m", "dp", "kvshare-conduit@0.1") / "predictions.jsonl"
    rows = read_jsonl(path)
    for i, row in enumerate(rows):
        row["plan"] = {"policy": "kvshare-conduit", "degenerate": i < 4}
    write_split(path, rows)
    tables.write("conduit/table1", spec, tmp_path / "t1.csv", root=tmp_path)
    line = [h for h in _read(tmp_path / "t1.csv")[0] if h.startswith("# DEGENERATE")]
    assert len(line) == 1 and "m/KVShare at r = 0.1 (kvshare-conduit@0.1: dp 4 of 6 records)" in line[0]
    assert "CONDUIT" not in line[0]


def test_flat_table_says_so_in_its_header(tmp_path):
    _, spec = _synthetic(tmp_path, {("dg", "full"): [1, 1, 0, 0], ("dg", "conduit@0.0"): [1, 0, 1, 0]})
    tables.write("conduit/table2", spec, tmp_path / "t2.csv", root=tmp_path)
    header, _ = _read(tmp_path / "t2.csv")
    assert any(h.startswith("# FLAT on this profile") and "dg 0.00" in h for h in header)


def test_flatness_is_judged_per_backbone_block():
    """Review finding (issue #33): the spread was taken over the whole table, so the mild backbone's flat block was
    never flagged beside the strong one's."""
    from kvbench.plan.conduit import Column
    from kvbench.report.conduit.accuracy import flatness_line

    df = pd.DataFrame({"backbone": ["s", "s", "m", "m"], "regime": ["strong", "strong", "mild", "mild"],
                       "K2": [30.0, 90.0, 95.0, 95.0], "K3": [20.0, 80.0, 90.0, 90.0]})
    line = flatness_line(df, [Column("K2", "dp"), Column("K3", "dp")])
    assert "s (strong): K2 60.00, K3 60.00" in line and "m (mild): FLAT, K2 0.00, K3 0.00" in line
    assert "FLAT: every row of that backbone" in line
    assert "FLAT" not in flatness_line(df[df["backbone"] == "s"], [Column("K2", "dp")])


def test_staleness_gap_ci_and_header(tmp_path):
    _, spec = _synthetic(tmp_path, {
        ("dp", "full"): [1, 1, 1, 1, 1, 0], ("dp", "reuse"): [0, 0, 0, 0, 1, 0],
        ("dg", "full"): [1, 0, 1, 0], ("dg", "reuse"): [1, 0, 1, 0],
    })
    tables.write("conduit/staleness_gap", spec, tmp_path / "gap.csv", root=tmp_path)
    header, df = _read(tmp_path / "gap.csv")
    g = df.set_index("column")
    assert g.loc["K2", ["n", "full", "reuse", "gap", "ci95_lo", "ci95_hi"]].tolist() == [4, 100.0, 0.0, -100.0, -100.0, -100.0]
    assert bool(g.loc["K2", "significant"]) and not bool(g.loc["dg", "significant"])
    assert g.loc["dg", ["gap", "ci95_lo", "ci95_hi"]].tolist() == [0.0, 0.0, 0.0]
    assert g.loc["dp (all K)", "gap"] == round(100 * -4 / 6, 2) and g.loc["dp (all K)", "n"] == 6
    assert "paired bootstrap, percentile method, 1000 resamples" in header[1]
    assert "significant at 95% (CI excludes 0): m/K2" in header[2]
    assert header[3].startswith("# gap NOT significant at 95% (CI includes 0):") and "m/dg" in header[3]


def test_regime_column_and_bad_regime_key(tmp_path):
    scores = {("dp", "full"): [1] * 6, ("dp", "reuse"): [0] * 6, ("dp", "conduit@0.1"): [1] * 6,
              ("dg", "full"): [1] * 4, ("dg", "reuse"): [1] * 4}
    _, spec = _synthetic(tmp_path, scores, _cfg(regimes={"m": "mild"}))
    for target in ("table1", "staleness_gap"):
        tables.write(f"conduit/{target}", spec, tmp_path / f"{target}.csv", root=tmp_path)
        _, df = _read(tmp_path / f"{target}.csv")
        assert list(df.columns[:2]) == ["backbone", "regime"] and (df["regime"] == "mild").all()
    with pytest.raises(ValueError, match=r"conduit.regimes names \['m2'\], which are not in conduit.models \['m'\]"):
        ConduitPlan(_cfg(regimes={"m2": "strong"}), "syn")


_T1_METHODS = [{"label": "Cache reuse", "method": "reuse"}, {"label": "CacheBlend", "method": "cacheblend"},
               {"label": "ProphetKV", "method": "prophetkv"}, {"label": "CONDUIT", "method": "conduit"},
               {"label": "Full prefill", "method": "full"}]


def test_table1_paired_difference_to_each_other_budgeted_row(tmp_path):
    """Per budget block, CONDUIT minus each budgeted row, the one with the highest avg first (computed: reuse,
    although it scores highest, carries no budget); one block whose CI excludes 0 and one that cannot be told
    apart."""
    cfg = _cfg(budgets=[0.05, 0.1], methods=_T1_METHODS)
    _, spec = _synthetic(tmp_path, {
        ("dp", "full"): [1] * 6, ("dp", "reuse"): [1] * 6,
        # r = 0.05: ProphetKV (avg 37.5) beats CacheBlend (0); CONDUIT wins 4, ties 2
        ("dp", "cacheblend@0.05"): [0] * 6, ("dp", "prophetkv@0.05"): [1, 0, 0, 0, 1, 0],
        ("dp", "conduit@0.05"): [1] * 6,
        # r = 0.1: CacheBlend (avg 75) beats ProphetKV (25); CONDUIT wins 2, loses 2, ties 2
        ("dp", "cacheblend@0.1"): [0, 1, 0, 1, 1, 1], ("dp", "prophetkv@0.1"): [0, 0, 0, 0, 1, 0],
        ("dp", "conduit@0.1"): [1, 0, 1, 0, 1, 1],
    }, cfg)
    tables.write("conduit/table1", spec, tmp_path / "t1.csv", root=tmp_path)
    header, df = _read(tmp_path / "t1.csv")
    assert (df["kind"] == "score").sum() == 10  # the score rows come first, unchanged
    paired = df[df["kind"] == "paired difference"]
    # every other budgeted row gets its pair, the strongest first in each block (issue #16 item 4: each of the
    # paper's orderings is tested with its own CI)
    assert list(paired["method"]) == [
        "CONDUIT − ProphetKV", "CONDUIT − CacheBlend", "CONDUIT − CacheBlend", "CONDUIT − ProphetKV"]
    assert list(paired["r"]) == [0.05, 0.05, 0.1, 0.1] and list(df["kind"].iloc[-4:]) == ["paired difference"] * 4
    diffs = paired.drop_duplicates("r").set_index("r")  # the first pair of each block: the strongest
    a = diffs.loc[0.05]
    assert a["method"] == "CONDUIT − ProphetKV" and a["spec"] == "conduit@0.05 − prophetkv@0.05"
    assert [a["K2"], a["K3"], a["diff"]] == [75.0, 50.0, round(100 * 4 / 6, 2)]
    assert [a["wins"], a["losses"], a["ties"], a["n"]] == [4, 0, 2, 6]
    assert 0 < a["ci95_lo"] <= a["diff"] <= a["ci95_hi"] and bool(a["told_apart"])
    b = diffs.loc[0.1]
    assert b["method"] == "CONDUIT − CacheBlend" and [b["K2"], b["K3"], b["diff"]] == [0.0, 0.0, 0.0]
    assert [b["wins"], b["losses"], b["ties"], b["n"]] == [2, 2, 2, 6]
    assert b["ci95_lo"] < 0 < b["ci95_hi"] and not bool(b["told_apart"])
    assert any(h.startswith("# paired differences") and "1000 resamples" in h and "pooled" in h for h in header)
    told = [h for h in header if h.startswith("# told apart")][0]
    cannot = [h for h in header if h.startswith("# CANNOT be told apart")][0]
    assert "m/CONDUIT − ProphetKV at r = 0.05" in told and "m/CONDUIT − CacheBlend at r = 0.05" in told
    assert "m/CONDUIT − CacheBlend at r = 0.1 (+0.00" in cannot and "CacheBlend at r = 0.1" not in told


def test_table1_pools_each_ordering_over_a_regime_s_training_seeds(tmp_path):
    """Issue #33, item 2: a regime with three seeds gets one seed-pooled row per ordering (CI over seeds and
    records), and the header names an ordering that holds in every seed apart from one that flips in a seed."""
    seeds = ["m-s0", "m-s1", "m-s2"]
    cfg = _cfg(models=[*seeds, "other"], regimes={**{m: "sparse" for m in seeds}, "other": "strong"},
               methods=_T1_METHODS)
    scores = {}
    for k, m in enumerate([*seeds, "other"]):
        scores.update({(m, "dp", "full"): [1] * 6, (m, "dp", "reuse"): [0] * 6,
                       (m, "dp", "conduit@0.1"): [1] * 6,     # above CacheBlend in every seed by 5 or 6 records
                       (m, "dp", "cacheblend@0.1"): [0] * 5 + [k % 2],
                       # ProphetKV: below CONDUIT in seeds 0 and 2, above... equal in seed 1 (a tie is not "above")
                       (m, "dp", "prophetkv@0.1"): [1] * 6 if k == 1 else [0] * 6})
    _, spec = _synthetic(tmp_path, scores, cfg)
    tables.write("conduit/table1", spec, tmp_path / "t1.csv", root=tmp_path)
    header, df = _read(tmp_path / "t1.csv")
    pooled = df[df["kind"] == "seed-pooled difference"].set_index("method")
    assert list(pooled["backbone"].unique()) == ["sparse (3 seeds)"]  # the one-seed regime is not pooled
    blend = pooled.loc["CONDUIT − CacheBlend"]
    assert blend["diff"] == round(100 * (1 + 5 / 6 + 1) / 3, 2) and blend["every_seed"] == ">"
    assert [blend["seeds"], blend["seeds_above"], blend["seeds_below"], blend["n"]] == [3, 3, 0, 18]
    assert 0 < blend["ci95_lo"] <= blend["diff"] <= blend["ci95_hi"] and bool(blend["told_apart"])
    prophet = pooled.loc["CONDUIT − ProphetKV"]
    assert [prophet["seeds_above"], prophet["seeds_below"]] == [2, 0] and pd.isna(prophet["every_seed"])
    assert prophet["ci95_lo"] == 0.0  # a resample can draw seed 1 three times
    held = [h for h in header if h.startswith("# orderings that hold in every seed")][0]
    not_held = [h for h in header if h.startswith("# orderings that do NOT hold")][0]
    assert "sparse (3 seeds)/CONDUIT − CacheBlend at r = 0.1" in held and "ProphetKV" not in held
    assert "sparse (3 seeds)/CONDUIT − ProphetKV" in not_held
    per_seed = df[(df["kind"] == "paired difference") & (df["method"] == "CONDUIT − ProphetKV")]
    assert list(per_seed["backbone"]) == [*seeds, "other"]  # the per-seed rows stay
    one_seed = [h for h in header if h.startswith("# one training seed")]
    assert len(one_seed) == 1 and "orderings of other rest on one trained model" in one_seed[0]
    assert "m-s0" not in one_seed[0]


def test_table5_paired_difference_of_the_composite_to_each_ablation(tmp_path):
    cfg = _cfg(ablation=[{"label": "Query-attention only", "method": "conduit@0.1:use_v_norm=false"},
                         {"label": "Intra-image throughput only", "method": "conduit@0.1:lam=0"},
                         {"label": "Composite", "method": "conduit@0.1"}])
    _, spec = _synthetic(tmp_path, {("dp", "full"): [1] * 6, ("dp", "conduit@0.1:use_v_norm=false"): [0] * 6,
                                    ("dp", "conduit@0.1:lam=0.0"): [1] * 6, ("dp", "conduit@0.1"): [1] * 6}, cfg)
    tables.write("conduit/table5", spec, tmp_path / "t5.csv", root=tmp_path)
    header, df = _read(tmp_path / "t5.csv")
    d = df[df["kind"] == "paired difference"].set_index("method")
    assert list(d.index) == ["Composite − Query-attention only", "Composite − Intra-image throughput only"]
    assert d.iloc[0][["diff", "ci95_lo", "ci95_hi", "wins", "losses", "ties"]].tolist() == [100.0, 100.0, 100.0, 6, 0, 0]
    assert bool(d.iloc[0]["told_apart"]) and not bool(d.iloc[1]["told_apart"])  # identical runs: CI [0, 0]
    assert d.iloc[1][["diff", "ties"]].tolist() == [0.0, 6]
    assert any(h.startswith("# CANNOT be told apart") and "Intra-image" in h for h in header)


def test_paired_difference_refuses_unpaired_runs(tmp_path):
    cfg = _cfg(ablation=[{"label": "A", "method": "conduit@0.1:lam=0"}, {"label": "C", "method": "conduit@0.1"}])
    _, spec = _synthetic(tmp_path, {("dp", "full"): [1] * 6, ("dp", "conduit@0.1:lam=0.0"): [1] * 5,
                                    ("dp", "conduit@0.1"): [1] * 6}, cfg)
    with pytest.raises(ValueError, match="hold different records; cannot pair them"):
        tables.write("conduit/table5", spec, tmp_path / "t5.csv", root=tmp_path)


def test_stratified_bootstrap_resamples_within_columns():
    """With strata, the statistic is the unweighted mean of the stratum means (a table's avg): constant strata
    give a zero-width CI at that value, where the pooled bootstrap varies around the pooled mean."""
    x, strata = np.array([1.0, 1, 1, 1, 0, 0]), np.array(["K2"] * 4 + ["K3"] * 2)
    assert paired_bootstrap(x, 500, 0, strata=strata) == (0.5, 0.5)
    lo, hi = paired_bootstrap(x, 500, 0)
    assert lo < 4 / 6 < hi


def test_staleness_gap_refuses_unpaired_runs(tmp_path):
    plan, spec = _synthetic(tmp_path, {("dp", "full"): [1] * 6, ("dp", "reuse"): [1] * 5,
                                       ("dg", "full"): [1] * 4, ("dg", "reuse"): [1] * 4})
    with pytest.raises(ValueError, match="different records"):
        staleness_gap(plan, Runs(tmp_path, spec["splits"]))


def test_fig3_pdf_and_data(tmp_path):
    _, spec = _synthetic(tmp_path, {("dp", "full"): [1] * 6, ("dp", "reuse"): [0] * 6,
                                    ("dp", "conduit@0.1"): [1, 1, 0, 0, 1, 1]})
    report_fig3(spec, tmp_path / "fig3.pdf", tmp_path / "fig3.csv", root=tmp_path)
    assert (tmp_path / "fig3.pdf").read_bytes().startswith(b"%PDF")
    _, df = _read(tmp_path / "fig3.csv")
    assert df.set_index("spec").loc["conduit@0.1", "avg"] == 75.0
    pts = df.set_index("spec")
    assert pts.loc["full", ["ci95_lo", "ci95_hi", "n"]].tolist() == [100.0, 100.0, 6]
    assert pts.loc["conduit@0.1", "ci95_lo"] < 75.0 < pts.loc["conduit@0.1", "ci95_hi"]
    assert set(df["method"]) == {"CONDUIT", "Full prefill", "Cache reuse"}
    # score against compute (issue #33, item 4): the FLOPs of each point from its runs' audit records
    assert pts["FLOPs %full"].to_dict() == {"full": 100.0, "reuse": 5.0, "conduit@0.1": 30.0}
    # the PDF carried its creation time, so a rebuilt figure differed from the first one
    report_fig3(spec, tmp_path / "again.pdf", tmp_path / "again.csv", root=tmp_path)
    assert (tmp_path / "again.pdf").read_bytes() == (tmp_path / "fig3.pdf").read_bytes()


# --- Snakemake targets -------------------------------------------------------------------------

CONDUIT_TARGETS = ["results/table1.csv", "results/table2.csv", "results/table4.csv", "results/table5.csv",
                   "results/conduit/staleness_gap.csv", "figures/conduit/fig3.pdf"]


@pytest.mark.parametrize("configfile", [None, CI_CONFIG], ids=["smoke", "ci"])
def test_conduit_targets_dry_run(tmp_path, configfile):
    args = ["-n", "-p", *CONDUIT_TARGETS] + (["--configfile", str(configfile)] if configfile else [])
    r = snakemake(tmp_path, *args)
    assert r.returncode == 0, r.stdout[-3000:]
    jobs = planned_jobs(r.stdout)
    assert jobs["table"] == 5 and jobs["conduit_table_alias"] == 4  # Tables 1, 2, 4, 5 and the staleness gap
    n_models = 2 if configfile is None else 1   # the smoke profile: the strong and the mild regime's VLM
    assert jobs["conduit_fig3"] == 1 and jobs["conduit_cache"] == 2 * n_models
    n_test = 300 if configfile is None else 8
    assert f"--limit {n_test}" in r.stdout and "--method conduit@0.1:lam=0.5 " in r.stdout
    assert not (tmp_path / "results").exists()


def test_conduit_targets_dry_run_paper(tmp_path):
    root = tmp_path / "kvbench-data"
    _fake_paper_root(root)
    r = snakemake(tmp_path, "-n", "-p", "conduit", "--configfile", str(PAPER_CONFIG), "--config", f"paths={{root: {root}}}")
    assert r.returncode == 0, r.stdout[-3000:]
    jobs = planned_jobs(r.stdout)
    # 2 backbones x (4 K=8 sets + 4 single-image sets) caches; no training, no data materialisation
    assert jobs["conduit_cache"] == 16 and "train" not in jobs and "data" not in jobs
    assert jobs["conduit_diag_capture"] == 6  # 2 backbones x pages, slides, natural images (Table 13's types)
    assert f"--split {root}/benchmarks/mmlongbench/longdocurl_K8.jsonl" in r.stdout


CONFIRM_CONFIG = REPO / "config" / "confirm.yaml"


def test_confirm_profile_dry_run(tmp_path):
    """The confirm profile: each regime's default zoo VLM (seed 0) and two seed replicas, each trained from its own
    seed into its own recipe directory, starting from the warm-up state its entry kept, each a backbone block of
    every CONDUIT table on its first 100 records per split (the entry: 300), the seeds of a regime pooled
    (issue #33, item 2). (Not marked slow: about as long as the smoke dry run above; parsing the workflow dominates,
    not the DAG's size.)"""
    r = snakemake(tmp_path, "-n", "-p", "conduit", "--configfile", str(CONFIRM_CONFIG))
    assert r.returncode == 0, r.stdout[-3000:]
    jobs = planned_jobs(r.stdout)
    assert jobs["train"] == 6 and jobs["conduit_cache"] == 12 and jobs["table"] == 7  # + Tables 14, 15
    assert jobs["eval"] == 6 * 48  # per backbone: 48 refresh runs, as on the default profile
    for entry in ("tiny-qwen2\\.5-vl", "tiny-qwen2\\.5-vl-mild"):
        dirs = set(re.findall(rf"--out (zoo/smoke/{entry}(-s\d)?-([0-9a-f]{{8}}))", r.stdout))
        assert {d[1] for d in dirs} == {"", "-s1", "-s2"} and len({d[2] for d in dirs}) == 3  # three recipe hashes
        h0 = next(d[2] for d in dirs if d[1] == "")
        assert re.search(rf"kvbench train --model {entry} .* --seed 0 .*--feeds '[^']*' 2>&1", r.stdout)
        for k in "12":
            assert re.search(rf"kvbench train --model {entry}-s{k} .* --seed {k} .* --warm-start "
                             rf"zoo/smoke/\.train/{entry}-{h0}/warmup 2>&1", r.stdout)
    lines = [line for line in r.stdout.splitlines() if "--limit " in line]
    replica = re.compile(r"--model \S*-s\d-[0-9a-f]{8} ")
    assert {re.search(r"--limit (\d+)", line).group(1) for line in lines if replica.search(line)} == {"100"}
    assert {re.search(r"--limit (\d+)", line).group(1) for line in lines if not replica.search(line)} == {"300"}
    assert "--n-test 300" in r.stdout
    cfg = yaml.safe_load(CONFIRM_CONFIG.read_text())
    default = yaml.safe_load((REPO / "config" / "config.yaml").read_text())["conduit"]  # the schema defaults' values
    plan = ConduitPlan({**default, **cfg["conduit"]}, "smoke", zoo_models=list(cfg["models"]))
    from kvbench.report.conduit.accuracy import seed_groups

    assert {k: len(v) for k, v in seed_groups(plan).items()} == {"strong": 3, "mild": 3}


def test_the_seed_pooled_header_says_what_the_seeds_share():
    """The confirm profile's replicas start from their entry's warm-up state, so the seed-pooled header line says
    which backbones share which phases, and that the spread leaves out what those phases would add."""
    from kvbench.report.conduit.accuracy import shared_warmup_note

    cfg = yaml.safe_load(CONFIRM_CONFIG.read_text())
    default = yaml.safe_load((REPO / "config" / "config.yaml").read_text())["conduit"]
    note = shared_warmup_note(ConduitPlan({**default, **cfg["conduit"]}, "smoke", zoo_models=list(cfg["models"])))
    assert note.startswith(" (tiny-qwen2.5-vl-s1, tiny-qwen2.5-vl-s2, tiny-qwen2.5-vl-mild-s1, tiny-qwen2.5-vl-mild-s2 "
                           "start from their entry's training state after its phases through 'grid'")
    assert "leaves out what the earlier phases would add" in note
    plain = {**default, "models": ["m-s0", "m-s1"], "regimes": {"m-s0": "strong", "m-s1": "strong"}}
    assert shared_warmup_note(ConduitPlan(plain, "smoke")) == ""  # not zoo replicas: nothing shared


def test_confirm_profile_reuses_the_default_profile_s_models_splits_and_runs():
    """Seed 0 of each regime in the confirm profile is the default profile's VLM: the same tokenizer, splits, model
    directories and CONDUIT run commands, so after the default ``snakemake conduit`` only the replicas are built."""
    from snakemake.utils import validate

    from kvbench.plan import build_plans
    from kvbench.plan.workspace import Workspace

    schema = str(REPO / "workflow" / "schemas" / "config.schema.yaml")
    confirm, default = (yaml.safe_load(p.read_text()) for p in (CONFIRM_CONFIG, REPO / "config" / "config.yaml"))
    for cfg in (confirm, default):
        validate(cfg, schema)  # fills the schema defaults, as the Snakefile does
    a, b = Workspace(confirm), Workspace(default)
    assert a.tokenizer_hash == b.tokenizer_hash
    assert {t: a.data_hashes[t] for t in ("docpages", "digitgrid")} == {t: b.data_hashes[t] for t in
                                                                       ("docpages", "digitgrid")}
    for model in default["conduit"]["models"]:
        assert a.model_dir(model) == b.model_dir(model)
    runs_a = {(r.model, r.dataset, r.name): r for r in build_plans(a)["conduit"].runs()}
    runs_b = {(r.model, r.dataset, r.name): r for r in build_plans(b)["conduit"].runs()}
    assert set(runs_b) < set(runs_a) and all(runs_a[k] == runs_b[k] for k in runs_b)


def _confirm_workspace(edit):
    """The confirm profile's Workspace and plans after ``edit(cfg)``, with the schema defaults filled in."""
    from snakemake.utils import validate

    from kvbench.plan import build_plans
    from kvbench.plan.workspace import Workspace

    cfg = yaml.safe_load(CONFIRM_CONFIG.read_text())
    edit(cfg)
    validate(cfg, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    ws = Workspace(cfg)
    return ws, build_plans(ws)


def test_a_seed_replica_needs_its_entry_s_recipe_and_fewer_records(tmp_path):
    """A seed replica starts from its entry's warm-up state, so the config must train the entry with the same
    overrides and threads; ``conduit.replica_n_test`` may not exceed ``n_test``. Each is refused naming the key."""
    load = _confirm_workspace
    ws, _ = load(lambda cfg: None)
    assert ws.warm_start_entry("tiny-qwen2.5-vl-mild-s2") == "tiny-qwen2.5-vl-mild"
    assert ws.warm_start_entry("tiny-qwen2.5-vl") is None
    with pytest.raises(ValueError, match=r"models.tiny-qwen2.5-vl-s1: a seed replica starts from its entry's warm-up "
                                         r"state \(the phases through 'grid'\), so the config must also train the "
                                         r"entry 'tiny-qwen2.5-vl'"):
        load(lambda cfg: cfg["models"].pop("tiny-qwen2.5-vl"))
    with pytest.raises(ValueError, match=r"models.tiny-qwen2.5-vl-mild-s1: a seed replica starts from its entry's "
                                         r"warm-up state, so its training overrides \{'steps_scale': 0.5\} must be "
                                         r"'tiny-qwen2.5-vl-mild''s \{\}"):
        load(lambda cfg: cfg["models"]["tiny-qwen2.5-vl-mild-s1"]["zoo"].update(overrides={"steps_scale": 0.5}))
    with pytest.raises(ValueError, match=r"conduit.replica_n_test \(400\) must be at most conduit.n_test \(300\)"):
        load(lambda cfg: cfg["conduit"].update(replica_n_test=400))


def test_training_uses_the_recipe_s_threads_whatever_the_cores(tmp_path):
    """The recipe hash holds the training's thread count, which changes the trained bytes; Snakemake scales a rule's
    {threads} down to --cores, so the train command takes the recipe's count from the config (a new user's dry run
    with --cores 1 showed --threads 1 under a hash that says 2)."""
    r = snakemake(tmp_path, "-n", "-p", "--cores", "1", "conduit", "--configfile", str(CONFIRM_CONFIG))
    assert r.returncode == 0, r.stdout[-3000:]
    trains = [line for line in r.stdout.splitlines() if "kvbench train " in line]
    assert len(trains) == 6 and all(" --threads 2 " in line for line in trains)


def test_a_seed_replica_must_name_its_seed(tmp_path):
    cfg = yaml.safe_load(CONFIRM_CONFIG.read_text())
    cfg["models"]["tiny-qwen2.5-vl-s1"]["zoo"]["seed"] = 2
    r = snakemake(tmp_path, "-n", "conduit", "--configfile", str(write_config(tmp_path / "c.yaml", cfg)))
    assert r.returncode != 0 and "tiny-qwen2.5-vl-s1: a seed replica of 'tiny-qwen2.5-vl' named -s1 must set zoo.seed: 1" \
        in r.stdout, r.stdout[-3000:]


def test_empty_single_image_fails_naming_it(tmp_path):
    """Regression: a schema-valid config without conduit.single_image ended in a ZeroDivisionError in the job."""
    cfg = yaml.safe_load(CI_CONFIG.read_text())
    cfg["conduit"]["single_image"] = {}
    r = snakemake(tmp_path, "-n", "results/conduit/table2.csv", "--configfile", str(write_config(tmp_path / "c.yaml", cfg)))
    assert r.returncode != 0 and "config conduit.single_image is empty" in r.stdout, r.stdout[-3000:]


def test_no_conduit_section_fails_naming_it(tmp_path):
    cfg = yaml.safe_load(CI_CONFIG.read_text())
    del cfg["conduit"]
    r = snakemake(tmp_path, "-n", "results/conduit/table1.csv", "--configfile", str(write_config(tmp_path / "c.yaml", cfg)))
    assert r.returncode != 0 and "has no `conduit:` section" in r.stdout, r.stdout[-3000:]


@pytest.mark.slow
def test_conduit_targets_real_run(tmp_path, vlm_dir):
    """Every CONDUIT target for real on a tiny config: a random-weight VLM, 4-6 records (minutes on 2 cores)."""
    cfg = {"profile": "tiny", "models": {"rand-vl": {"kind": "vlm", "checkpoint": str(vlm_dir), "gpus": 0}},
           "datasets": {"docpages": {"kind": "vlm", "smoke": {"n_train": 0, "n_test": 6}},
                        "digitgrid": {"kind": "vlm", "smoke": {"n_train": 0, "n_test": 4}}},
           "eval": {"matrix": {"rand-vl": ["digitgrid"]}},
           "conduit": {"models": ["rand-vl"], "n_test": 6,
                       "multi_image": {"K2-3": {"dataset": "docpages", "k": [2, 3]},
                                       "K4-6": {"dataset": "docpages", "k": [4, 6]}},
                       "single_image": {"digitgrid": {"dataset": "digitgrid"}},
                       "budgets": [0.1], "methods": [{"label": "Cache reuse", "method": "reuse"},
                                                     {"label": "CONDUIT", "method": "conduit"},
                                                     {"label": "Full prefill", "method": "full"}],
                       "lambda": {"values": [1]}, "ablation": [{"label": "Composite", "method": "conduit@0.1"}],
                       "curve": {"methods": ["CONDUIT"], "r": [0.1]}, "gap": {"resamples": 200}},
           "conduit_diagnostics": {"n_records": 3, "layers": [1, 2], "budgets": [0.1],
                                   "datasets": {"docpages": "page", "digitgrid": "grid"}}}
    r = snakemake(tmp_path, "conduit", "--cores", "2", "--configfile", str(write_config(tmp_path / "t.yaml", cfg)),
                  timeout=3600)
    assert r.returncode == 0, r.stdout[-5000:]
    for name in ("table1", "table2", "table4", "table5", "staleness_gap", "table11", "table12", "table13", "table14",
                 "table15"):
        header, df = _read(tmp_path / "results" / "conduit" / f"{name}.csv")
        assert header[0].startswith("# CONDUIT") and len(df) >= 1
    for n in (3, 4):
        assert (tmp_path / "figures" / "conduit" / f"fig{n}.pdf").read_bytes().startswith(b"%PDF")
    run = tmp_path / "results" / "runs" / "tiny" / "rand-vl" / "docpages" / "conduit" / "conduit_r0.1"
    rid = read_jsonl(run / "predictions.jsonl")[0]["id"]
    assert main(["replay", "--run", str(run), "--id", rid]) == 0


def test_policy_layers_outside_the_model_fail_before_any_run():
    """Review finding: `conduit@0.1:layers=99` passed the dry run and failed every sample of the run."""
    plan = ConduitPlan(_cfg(ablation=[{"label": "L", "method": "conduit@0.1:layers=99"}]), "syn", ["m"])
    with pytest.raises(ValueError, match=r"'conduit@0.1:layers=99' on 'm': layers \[99\] outside the model's 6 layers"):
        plan.check_layers({"m": 6})
    plan.check_layers({"m": 100})
    plan.check_layers({})  # a checkpoint not there yet: checked when its run starts


def test_a_press_in_a_conduit_row_is_refused():
    """Review finding: `snapkv:keep=0.3` as a Table 2 row passed the dry run and failed at run time."""
    with pytest.raises(ValueError, match=r"'snapkv:keep=0.3' is a compression press; CONDUIT rows take refresh"):
        ConduitPlan(_cfg(single_image_rows=[{"label": "a", "method": "snapkv:keep=0.3"}]), "syn", ["m"])


def test_conduit_diagnose_cli_captures_from_the_read_only_cache(runs, vlm_dir, tmp_path, capsys):
    import pandas as pd

    from kvbench.models.tiny import VLM_TEXT

    before = sorted(p.name for p in runs["cache"].rglob("*"))
    out = tmp_path / "cap.csv"
    args = ["conduit-diagnose", "--model", str(vlm_dir), "--model-name", "v", "--dataset", "toydoc",
            "--split", str(runs["split"]), "--cache-dir", str(runs["cache"]), "--out", str(out), "--n", "2"]
    assert main(args) == 0
    df = pd.read_csv(out)
    assert df["record"].unique().tolist() == ["d0", "d1"] and set(df["model"]) == {"v"}
    assert df.groupby("record")["layer"].nunique().tolist() == [VLM_TEXT["num_hidden_layers"]] * 2
    assert df["k"].tolist()[0] == 2 and (df["evidence_image"] == -1).all()  # the toy records name no page
    assert sorted(p.name for p in runs["cache"].rglob("*")) == before      # read-only
    with pytest.raises(SystemExit):                                          # bad input: argparse names it
        main([*args[:-2], "--n", "0"])
    assert "--n" in capsys.readouterr().err
    # review finding: an empty split wrote a 1-byte CSV, then failed with "error: record"
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    bad = [*args[:args.index("--split") + 1], str(empty), *args[args.index("--split") + 2:]]
    bad[bad.index("--out") + 1] = str(tmp_path / "none.csv")
    assert main(bad) != 0
    assert "has no records" in capsys.readouterr().err and not (tmp_path / "none.csv").exists()


def test_diagnostics_targets_dry_run(tmp_path):
    """Tables 11-13: one capture per backbone x dataset (reading that pair's image cache), three table jobs; the
    `conduit` aggregate includes them; a section the caches cannot serve fails the DAG naming the key."""
    r = snakemake(tmp_path, "-n", "-p", "results/conduit/table11.csv", "results/conduit/table12.csv",
                  "results/conduit/table13.csv")
    assert r.returncode == 0, r.stdout[-3000:]
    jobs = planned_jobs(r.stdout)
    assert jobs["conduit_diag_capture"] == 4 and jobs["table"] == 3 and jobs["conduit_cache"] == 4
    assert "kvbench conduit-diagnose --model " in r.stdout and "--n 64 --m 5 --seed 0" in r.stdout
    r = snakemake(tmp_path, "-n", "conduit")
    assert r.returncode == 0 and planned_jobs(r.stdout)["conduit_diag_capture"] == 4
    cfg = load(REPO / "config" / "config.yaml")
    cfg["conduit_diagnostics"]["n_records"] = 301
    r = snakemake(tmp_path, "-n", "conduit", "--configfile", str(write_config(tmp_path / "bad.yaml", cfg)))
    assert r.returncode != 0 and "n_records (301) exceeds conduit.n_test (300)" in r.stdout
    cfg["conduit_diagnostics"]["n_records"] = 8
    cfg["conduit_diagnostics"]["datasets"] = {"niah_1k": "text"}
    r = snakemake(tmp_path, "-n", "conduit", "--configfile", str(write_config(tmp_path / "bad.yaml", cfg)))
    assert r.returncode != 0 and "'niah_1k' must be a vlm dataset" in r.stdout


@pytest.mark.parametrize("section, key, value, target, needle", [
    # layers the 24-layer zoo VLMs do not have (the schema's old default [7, 14, 24] was one)
    ("conduit_diagnostics", "layers", [5, 9, 24], "conduit", "[24] are not layers of 'tiny-qwen2.5-vl', which has 24"),
    ("conduit_diagnostics", "datasets", {"docpages": "page", "digitgrid": "page"}, "results/conduit/table13.csv",
     "Table 13 compares image types"),
    ("evidence", "column", "K9", "results/conduit/table14.csv", "conduit.evidence.column 'K9' is not"),
    ("evidence", "recover_r", 0.05, "conduit", "recover_r (0.05) must be above conduit.evidence.r (0.1)"),
    ("case_study", "column", "K9", "figures/conduit/fig4.pdf", "conduit.case_study.column 'K9' is not"),
    ("conduit_latency", "model", "tiny-qwen2-lm", "results/conduit/table3.csv", "is a 'lm' model; Table 3 times"),
])
def test_values_only_a_late_job_would_refuse_fail_the_dry_run(tmp_path, section, key, value, target, needle):
    """Found by a new-user review: each of these passed `snakemake -n` and failed (or gave empty rows) only after
    training and evaluation. They now fail while the DAG is built, naming the key."""
    cfg = load(REPO / "config" / "config.yaml")
    (cfg["conduit"].setdefault(section, {}) if section in ("evidence", "case_study") else cfg[section])[key] = value
    r = snakemake(tmp_path, "-n", target, "--configfile", str(write_config(tmp_path / "bad.yaml", cfg)))
    assert r.returncode != 0 and needle in r.stdout, r.stdout[-3000:]


def test_seed_replicas_with_a_repeated_seed_or_another_regime_are_refused():
    """A replica trained from a seed another model of its entry already uses would count one model twice in the
    seed-pooled CI, and a replica pooled under another regime than its entry's would mix regimes: both refused
    naming the keys. An override that drops the shared phase leaves a replica training from step 0."""
    load = _confirm_workspace
    def add(cfg, name, seed):
        cfg["models"][name] = {"kind": "vlm", "zoo": {"seed": seed, "threads": 2, "floors": {"docpages": 0.8}}}

    with pytest.raises(ValueError, match=r"models.tiny-qwen2.5-vl-s0: trains 'tiny-qwen2.5-vl' from seed 0, as "
                                         r"'tiny-qwen2.5-vl' does"):
        load(lambda cfg: add(cfg, "tiny-qwen2.5-vl-s0", 0))
    with pytest.raises(ValueError, match=r"models.tiny-qwen2.5-vl-s01: trains 'tiny-qwen2.5-vl' from seed 1, as "
                                         r"'tiny-qwen2.5-vl-s1' does"):
        load(lambda cfg: add(cfg, "tiny-qwen2.5-vl-s01", 1))
    with pytest.raises(ValueError, match=r"trains 'tiny-qwen2.5-vl' from seed 2, as 'tiny-qwen2.5-vl' does"):
        load(lambda cfg: cfg.update(seed=2))
    with pytest.raises(ValueError, match=r"conduit.regimes: 'tiny-qwen2.5-vl-s1' is 'mild', but it is a seed replica "
                                         r"of 'tiny-qwen2.5-vl', which is 'strong'"):
        load(lambda cfg: cfg["conduit"]["regimes"].update({"tiny-qwen2.5-vl-s1": "mild"}))
    with pytest.raises(ValueError, match=r"models.tiny-qwen2.5-vl-s1.zoo.threads: 1, but .* must be "
                                         r"'tiny-qwen2.5-vl''s \(2\)"):
        load(lambda cfg: cfg["models"]["tiny-qwen2.5-vl-s1"]["zoo"].update(threads=1))

    def drop_grid(cfg):
        cfg["training"]["overrides"] = {"drop_phases": ["grid"]}
    ws, _ = load(drop_grid)
    assert ws.warm_start_entry("tiny-qwen2.5-vl-s1") is None  # nothing shared: trains from step 0
