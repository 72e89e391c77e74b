"""CONDUIT over ResidualKV-compressed image caches (issue #17, deliverable 7): the plan, the table writer on tiny
fake runs, and the paper profile's dry run."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest
import yaml
from test_workflow import REPO, paper_dry_run, planned_jobs, snakemake

from kvbench.report import tables
from kvbench.plan.conduit import ConduitPlan
from kvbench.plan.compressed_cache import CompressedCachePlan

IDS = {"a": 2, "b": 2, "c": 3, "d": 3}   # record id -> K (columns K2, K3)


def _conduit() -> dict:
    return {"models": ["m"], "n_test": None, "threads": 1, "reference": "full",
            "multi_image": {"K2": {"dataset": "dp", "k": [2, 2]}, "K3": {"dataset": "dp", "k": [3, 3]}},
            "single_image": {}, "budgets": [0.05, 0.1],
            "methods": [{"label": "Cache reuse", "method": "reuse"}, {"label": "ProphetKV", "method": "prophetkv"},
                        {"label": "MPIC", "method": "mpic-first"}, {"label": "CONDUIT", "method": "conduit"},
                        {"label": "Full prefill", "method": "full"}],
            "single_image_rows": [], "lambda": {"method": "conduit", "r": 0.1, "values": [1]},
            "ablation": [{"label": "Composite", "method": "conduit@0.1"}],
            "curve": {"methods": ["CONDUIT"], "r": [0.1]}, "gap": {"resamples": 500, "seed": 0}}


SECTION = {"model": "m", "r": 0.1, "storage": {"full_layers": [0], "full_kv_bits": 4, "bits": 4}}


def _spec(root: Path, section: dict = SECTION) -> dict:
    split = root / "dp.jsonl"
    split.write_text("".join(json.dumps({"id": i, "meta": {"K": k}}) + "\n" for i, k in IDS.items()))
    index = root / "index.json"
    summary = {"n_images": 10, "tokens_per_image": 4.0, "raw_kv_bytes": 1000.0, "compressed_kv_bytes": 250.0,
               "kr": 0.25, "parts": {"codes": 100.0, "references": 150.0}, "embeds_bytes": 40.0,
               "rel_err_k_mean": 0.1, "rel_err_v_mean": 0.2}
    index.write_text(json.dumps({"codec_id": "ab" * 32, "summary": summary}))
    return {"profile": "syn", "conduit": _conduit(), "beyond": {"conduit_rkv_cache": section},
            "splits": {"dp": str(split)}, "zoo_models": ["m"], "codec_dir": "codecs/syn/m/mm-00000000/codec",
            "indexes": {"dp": "index.json"}}


def _run(root: Path, group: str, slug: str, scores: dict[str, float]) -> None:
    d = root / "results/runs/syn/m/dp" / group / slug
    d.mkdir(parents=True, exist_ok=True)
    (d / "predictions.jsonl").write_text("".join(json.dumps({"id": i, "score": s}) + "\n" for i, s in scores.items()))


def _all_runs(root: Path, skip: str | None = None) -> None:
    """Raw (Table 1) and compressed runs: per slug the score of the K2 records and of the K3 records."""
    raw = {"reuse": (0, 0), "prophetkv_r0.1": (0.5, 0.5), "mpic-first_r0.1": (0.5, 0.5), "conduit_r0.1": (1, 0),
           "full": (1, 1)}
    comp = {"reuse": (0, 0), "prophetkv_r0.1": (0.25, 0.75), "mpic-first_r0.1": (1, 1), "conduit_r0.1": (0.75, 0.25)}
    for group, runs in (("conduit", raw), ("conduit-rkv", comp)):
        for slug, (k2, k3) in runs.items():
            if slug != skip or group == "conduit":
                _run(root, group, slug, {i: float(k2 if k == 2 else k3) for i, k in IDS.items()})


def test_plan_runs_and_errors():
    plan = CompressedCachePlan(SECTION, ConduitPlan(_conduit(), "syn", ["m"]))
    assert [r.label for r in plan.rows()] == ["Cache reuse", "ProphetKV", "MPIC", "CONDUIT", "Full prefill"]
    new = [r.path("syn") for r in plan.new_runs()]
    assert "results/runs/syn/m/dp/conduit-rkv/conduit_r0.1" in new and not any(p.endswith("/full") for p in new)
    assert plan.compressed_run("dp", "full").path("syn") == "results/runs/syn/m/dp/conduit/full"
    assert plan.cache_dir("dp", "c1") != plan.cache_dir("dp", "c2")   # another codec: another directory
    for bad, match in [({"model": "x"}, "not a CONDUIT backbone"), ({"r": 0.2}, "not a Table 1 block"),
                       ({"storage": {"bits": 3}}, "storage: bits must be"),
                       ({"storage": {"full_kv_bits": 4}}, "storage: full_kv_bits=4 quantises")]:
        with pytest.raises(ValueError, match=match):
            CompressedCachePlan({**SECTION, **bad}, ConduitPlan(_conduit(), "syn", ["m"]))


def test_table_pairs_by_record_and_reports_bytes(tmp_path):
    _all_runs(tmp_path)
    # one record more in the raw CONDUIT run (e.g. a larger n_test): paired on the records both hold
    _run(tmp_path, "conduit", "conduit_r0.1", {**{i: 1.0 if k == 2 else 0.0 for i, k in IDS.items()}, "e": 1.0})
    spec = _spec(tmp_path)
    with open(tmp_path / "dp.jsonl", "a") as f:
        f.write(json.dumps({"id": "e", "meta": {"K": 2}}) + "\n")
    out = tmp_path / "t.csv"
    tables.write("beyond/conduit_rkv_cache", spec, out, tmp_path)
    text = out.read_text()
    assert "tiny zoo (m)" in text and "No published number exists" in text and "KIVI-style 4-bit" in text
    assert "raw FP16 K+V of all layers 1,000 B, compressed 250 B (KR 25.0%" in text
    df = pd.read_csv(out, comment="#")
    score = df[df["kind"] == "score"].set_index("method")
    # CONDUIT: K2 records 1.0 -> 0.75, K3 records 0.0 -> 0.25: avg 50 both sides, pooled diff 0 over the 4 paired ids
    c = score.loc["CONDUIT"]
    assert (c["raw"], c["compressed"], c["diff"], c["n"]) == (50.0, 50.0, 0.0, 4)
    assert "paired on the 2 records both runs hold (2 and 3)" in c["notes"]
    assert (c["raw bytes/image"], c["compressed bytes/image"], c["KR %"]) == (1000, 250, 25.0)
    p = score.loc["ProphetKV"]   # K2 0.5 -> 0.25 (-0.25 x 2), K3 0.5 -> 0.75 (+0.25 x 2)
    assert p["diff"] == 0.0 and p["ci95_lo"] <= 0 <= p["ci95_hi"]
    full = score.loc["Full prefill"]
    assert full["diff"] == 0.0 and pd.isna(full["KR %"]) and "reads no image cache" in full["notes"]
    # ordering rows: CONDUIT - ProphetKV and - the strongest other (MPIC on the compressed caches), both forms
    order = df[df["kind"].str.startswith("paired difference")]
    assert set(order["method"]) == {"CONDUIT − ProphetKV", "CONDUIT − MPIC"}
    assert set(order["kind"]) == {"paired difference (compressed caches)", "paired difference (raw caches)"}
    assert "# ordering on the compressed caches: CONDUIT − ProphetKV" in text
    mpic = order[(order["method"] == "CONDUIT − MPIC") & (order["kind"] == "paired difference (compressed caches)")]
    # compressed: CONDUIT 0.75 / 0.25 against MPIC 1 / 1 -> -0.25 on two records, -0.75 on two: -50 points
    assert mpic["diff"].iloc[0] == -50.0 and "strongest other budgeted row" in mpic["notes"].iloc[0]


def test_missing_run_leaves_an_empty_cell_with_its_reason(tmp_path):
    _all_runs(tmp_path, skip="conduit_r0.1")
    out = tmp_path / "t.csv"
    tables.write("beyond/conduit_rkv_cache", _spec(tmp_path), out, tmp_path)
    df = pd.read_csv(out, comment="#")
    c = df[(df["kind"] == "score") & (df["method"] == "CONDUIT")].iloc[0]
    assert pd.isna(c["compressed"]) and pd.isna(c["diff"])
    assert "missing run results/runs/syn/m/dp/conduit-rkv/conduit_r0.1" in c["notes"]


def test_paper_dry_run_lists_the_jobs(tmp_path):
    cfg, root, r = paper_dry_run(tmp_path, "results/beyond/conduit_rkv_cache.csv")
    section = cfg["beyond"]["conduit_rkv_cache"]
    datasets = {c["dataset"] for c in cfg["conduit"]["multi_image"].values()}
    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    n_rows = len(cfg["conduit"].get("methods") or schema["properties"]["conduit"]["properties"]["methods"]["default"])
    # per dataset: Table 1's raw runs of the block, the compressed runs (all but full prefill), both caches
    assert planned_jobs(r.stdout) == {"eval": len(datasets) * (2 * n_rows - 1), "conduit_cache": len(datasets),
                                      "conduit_rkv_cache": len(datasets), "rkv_mm_codec": 1, "table": 1}
    ckpt = f"{root}/{cfg['models'][section['model']]['checkpoint']}"
    assert f"--model {ckpt} " in r.stdout and "--data vlm" in r.stdout
    codec = re.search(rf"--out (codecs/paper/{section['model']}/mm-[0-9a-f]{{8}}) ", r.stdout).group(1)
    assert f'"codec_dir": "{codec}/codec"' in r.stdout   # the compressed caches are coded with that codec
    run = next(line for line in r.stdout.splitlines() if "--method conduit@0.1 " in line and "/conduit-rkv/" in line)
    assert '"cache_dir": "cache/conduit_rkv/paper/' in run and '"build_missing": false' in run
    assert '"compressed": {"codec_dir": ' + f'"{codec}/codec"' in run


def test_failed_samples_are_named_and_a_repeated_record_id_is_refused(tmp_path):
    """Review: a failed sample (scored 0) read as the cost of compression with no note, and a repeated id let the
    last row win silently."""
    _all_runs(tmp_path)
    comp = tmp_path / "results/runs/syn/m/dp/conduit-rkv/conduit_r0.1/predictions.jsonl"
    rows = [json.loads(x) for x in comp.read_text().splitlines()]
    rows[0].update(status="error", score=0.0)
    comp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "t.csv"
    tables.write("beyond/conduit_rkv_cache", _spec(tmp_path), out, tmp_path)
    df = pd.read_csv(out, comment="#")
    c = df[(df["kind"] == "score") & (df["method"] == "CONDUIT")].iloc[0]
    assert "1 of 4 samples of results/runs/syn/m/dp/conduit-rkv/conduit_r0.1 failed (scored 0)" in c["notes"]
    comp.write_text(comp.read_text() + json.dumps({"id": rows[0]["id"], "score": 1.0}) + "\n")
    with pytest.raises(ValueError, match=r"conduit-rkv/conduit_r0.1: record id\(s\) .* appear more than once"):
        tables.write("beyond/conduit_rkv_cache", _spec(tmp_path), out, tmp_path)


def test_a_full_layer_outside_the_zoo_model_fails_the_dag(tmp_path):
    """Review: `storage.full_layers: [0, 30]` on the 24-layer zoo VLM passed the dry run and failed in the cache job,
    after the VLM and its codec had trained."""
    overlay = tmp_path / "ov.yaml"
    overlay.write_text(yaml.safe_dump({"beyond": {"conduit_rkv_cache": {"storage": {"full_layers": [0, 30]}}}}))
    r = snakemake(tmp_path, "-n", "results/beyond/conduit_rkv_cache.csv", "--configfile",
                  str(REPO / "config/config.yaml"), str(overlay))
    assert r.returncode != 0
    assert "beyond.conduit_rkv_cache.storage.full_layers: [30] outside tiny-qwen2.5-vl's 24 layers" in r.stdout


def test_header_says_when_the_restore_error_is_near_total_and_layer_0_is_lossy():
    """Review finding (issue #33): the table did not say that its restore error was near total nor that its lossy
    layer 0 favours schedules that recompute every token at layer 0."""
    from types import SimpleNamespace

    from kvbench.report.beyond.conduit_rkv_cache import restore_notes

    lost = {"rel_err_k": 0.93, "rel_err_v": 0.41}
    lines = restore_notes(SimpleNamespace(full_layers=(0, 1), full_kv_bits=4), lost)
    assert len(lines) == 2 and "near total (relative L2 error of K 0.930" in lines[0]
    assert "layer 0 is lossy here (stored at 4 bits)" in lines[1]
    assert "coded as a residual layer" in restore_notes(SimpleNamespace(full_layers=(1,), full_kv_bits=16), None)[0]
    assert restore_notes(SimpleNamespace(full_layers=(0, 1), full_kv_bits=16), {"rel_err_k": 0.1, "rel_err_v": 0.2}) == []
