"""ResidualKV Table IV as a DAG target on both profiles (dry runs), and SCBench's files converted for it
(kvbench.data.scbench, `kvbench scbench-convert`)."""
from __future__ import annotations

import json

import pytest
from test_workflow import CONFIG, PAPER_CONFIG, _fake_paper_root, load, planned_jobs, snakemake, write_config

from kvbench.data import scbench
from kvbench.eval.runner import validate_records
from kvbench.utils.io import read_jsonl


def test_smoke_table_iv_plans_its_runs(tmp_path):
    cfg = load(CONFIG)
    r = snakemake(tmp_path, "-n", "-p", "results/tableIV.csv")
    assert r.returncode == 0, r.stdout[-3000:]
    jobs = planned_jobs(r.stdout)
    rows, tasks = cfg["residualkv"]["tableIV"], cfg["residualkv"]["target_tasks"]["tableIV"]
    assert jobs["eval"] == len(rows) * len(tasks) and jobs["data"] == len(tasks) and jobs["table"] == 1
    assert jobs["residualkv_table_alias"] == 1 and jobs["rkv_codec"] == 1
    for task in tasks:   # the multi-query smoke splits, every row under shared_context
        assert f"results/runs/smoke/tiny-qwen2-lm/{task}/residualkv/fullkv_decode_tail-1_protocol-shared_context" in r.stdout
    assert "alpha-0.0_decode_tail-1_full_kv_bits-4_full_layers-0.1_keep-0.2_protocol-shared_context" in r.stdout


def test_paper_table_iv_reads_converted_scbench_files(tmp_path):
    root = tmp_path / "kvbench-data"
    cfg = _fake_paper_root(root)
    r = snakemake(tmp_path, "-n", "-p", "results/residualkv/tableIV.csv", "--configfile", str(PAPER_CONFIG),
                  "--config", f"paths={{root: {root}}}")
    assert r.returncode == 0, r.stdout[-3000:]
    tasks = cfg["residualkv"]["target_tasks"]["tableIV"]
    jobs = planned_jobs(r.stdout)
    assert jobs["scbench_convert"] == len(tasks) and jobs["eval"] == len(cfg["residualkv"]["tableIV"]) * len(tasks)
    assert "rkv_codec" in jobs and "data" not in jobs   # the main codec; no smoke data
    for task in tasks:
        src = root / cfg["datasets"][task]["jsonl"]
        assert (f"kvbench scbench-convert --task {cfg['datasets'][task]['scbench']} --src {src} "
                f"--out data/paper/{task}-scbench/test.jsonl") in r.stdout
        assert f"--split data/paper/{task}-scbench/test.jsonl" in r.stdout


def test_table_iv_task_outside_datasets_is_named(tmp_path):
    cfg = load(CONFIG)
    cfg["residualkv"]["target_tasks"]["tableIV"].append("kv_9k_mq")
    r = snakemake(tmp_path, "-n", "--configfile", str(write_config(tmp_path / "bad.yaml", cfg)))
    assert r.returncode != 0 and "residualkv.target_tasks.tableIV: 'kv_9k_mq'" in r.stdout


# -- the converter -----------------------------------------------------------------------------------
def _scb_line(**kw):
    line = {"id": 7, "context": '{"a1": "v1", "b2": "v2"}',
            "multi_turns": [{"input": 'Key: "a1"\nThe value associated with the specified key is: ', "answer": "v1"},
                            {"input": "Key: b2", "answer": "v2"}]}
    line.update(kw)
    return line


def test_scbench_file_converts_to_valid_multi_query_records(tmp_path):
    src = tmp_path / "scbench_kv.jsonl"
    src.write_text(json.dumps(_scb_line()) + "\n")
    meta = scbench.convert("scbench_kv", src, tmp_path / "out" / "test.jsonl")
    recs = read_jsonl(tmp_path / "out" / "test.jsonl")
    validate_records(recs)
    assert meta["n"] == 1 and meta["n_queries"] == 2 and len(meta["source_sha256"]) == 64
    r = recs[0]
    assert r["id"] == "scbench_kv-00000" and r["metric"] == "scb_substring" and r["max_new_tokens"] == 150
    assert r["context"].startswith("Extract the value corresponding to the specified key in the JSON object below.\n\n{")
    assert [t["input"][:2] for t in r["multi_turns"]] == ["\n\n", "\n\n"] and r["multi_turns"][1]["answer"] == "v2"


def test_mixed_task_turns_take_their_sub_task_scorer_and_budget(tmp_path):
    line = _scb_line(multi_turns=[{"input": "Summarise.", "answer": "a summary", "task": "scbench_summary"},
                                  {"input": "The pass key?", "answer": 71432, "task": "scbench_passkey"}])
    rec = scbench.convert_record(line, "scbench_summary_with_needles", 0)
    assert [(t["metric"], t["max_new_tokens"], t["answer"]) for t in rec["multi_turns"]] == [
        ("scb_rouge_lsum", 800, "a summary"), ("scb_first_int", 15, "71432")]
    with pytest.raises(ValueError, match=r"multi_turns\[0\]: 'task' must be one of"):
        scbench.convert_record(_scb_line(), "scbench_summary_with_needles", 0)


@pytest.mark.parametrize("task, line, match", [
    ("scbench_repoqa", _scb_line(), "not converted; kvbench serves"),
    ("scbench_kv", _scb_line(context=""), "line 1: needs a non-empty string 'context'"),
    ("scbench_kv", _scb_line(multi_turns=[]), "needs a non-empty list 'multi_turns'"),
    ("scbench_kv", _scb_line(multi_turns=[{"answer": "v"}]), r"multi_turns\[0\]: needs a string 'input'"),
    ("scbench_kv", _scb_line(multi_turns=[{"input": "k", "answer": None}]), "'answer' must be a string"),
])
def test_bad_scbench_lines_are_named(tmp_path, task, line, match):
    src = tmp_path / "f.jsonl"
    src.write_text(json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=match):
        scbench.convert(task, src, tmp_path / "out.jsonl")


# -- the table writer ------------------------------------------------------------------------------
def test_table_iv_columns_kr_cr_and_header(tmp_path):
    from test_rkv_report import SECTION, _fake_run

    from kvbench.report import tables
    from kvbench.report.residualkv import table_iv as rkv_scbench
    from kvbench.plan.residualkv import RKVPlan

    section = {**SECTION, "tableIV": [
        {"label": "ResidualKV", "method": "residualkv+omnikv:full_layers=0+1,keep=0.2,alpha=0,protocol=shared_context"},
        {"label": "Full cache", "method": "fullkv:protocol=shared_context"}],
        "target_tasks": {"tableIV": ["kv_1k_mq", "vt_1k_mq"]}}
    plan = RKVPlan(section, "smoke", seed=0, model_dir="zoo/tiny-qwen2-lm")
    assert plan.target_tasks("tableIV") == ["kv_1k_mq", "vt_1k_mq"] and plan.target_tasks("tableIII") == SECTION["tasks"]
    rkv, full = (r.spec for r in plan.rows("tableIV"))
    assert {t for t, _ in plan.target_runs("tableIV")} == {"kv_1k_mq", "vt_1k_mq"}
    _fake_run(tmp_path, plan, "kv_1k_mq", rkv, [0.75, 0.25], 0.25, 0.2)   # record scores: means over queries
    _fake_run(tmp_path, plan, "vt_1k_mq", rkv, [1 / 3, 0], 0.25, 0.4)
    _fake_run(tmp_path, plan, "kv_1k_mq", full, [1, 0.5], 1.0, 1.0)
    _fake_run(tmp_path, plan, "vt_1k_mq", full, [1, 1], 1.0, 1.0)
    spec = {"profile": "smoke", "residualkv": section, "seed": 0, "model_dir": str(tmp_path / "absent")}
    df = tables.write("residualkv/tableIV", spec, tmp_path / "t4.csv", root=tmp_path)
    pair = df[df["kind"] == "paired difference"]
    assert pair["method"].tolist() == ["ResidualKV − Full cache"]   # the pair, pooled over both tasks' 4 records
    assert pair["diff"].tolist() == [round(100 * (-0.25 - 0.25 + (1 / 3 - 1) - 1) / 4, 2)]
    df = df[df["kind"] == "score"]
    assert df["method"].tolist() == ["ResidualKV", "Full cache"]
    assert df["kv_1k_mq"].tolist() == [50.0, 75.0] and df["vt_1k_mq"].tolist() == [16.67, 100.0]
    assert df["avg"].tolist() == [33.34, 87.5]   # the mean of the rounded cells, as Table III
    assert df["KR_packed %"].tolist() == [25.0, 100.0] and df["CR %"].tolist() == [30.0, 100.0]
    text = (tmp_path / "t4.csv").read_text()
    assert "tiny zoo LM trained here, not the paper's models" in text and "tasks kv_1k_mq, vt_1k_mq" in text
    assert "# mode: SCBench multi-request (SCDQ)" in text and "not the paper's numbers" in text
    # a row that would answer its queries without compressing the context first is refused, naming it
    section["tableIV"][1]["method"] = "fullkv"
    with pytest.raises(ValueError, match="row 'Full cache': SCBench's rows run under protocol=shared_context"):
        rkv_scbench.write_table_iv(RKVPlan(section, "smoke"), tmp_path / "bad.csv", tmp_path)


def test_a_table_iv_row_without_shared_context_fails_the_dag(tmp_path):
    """Review of the merge: the row check ran in the table job only, after every run of the table."""
    import yaml

    from test_workflow import CONFIG, load, snakemake

    cfg = load(CONFIG)
    cfg["residualkv"]["tableIV"][1]["method"] = "kvzip:ratio=0.3,protocol=one_pass"
    conf = tmp_path / "c.yaml"
    conf.write_text(yaml.safe_dump(cfg))
    r = snakemake(tmp_path, "-n", "--configfile", str(conf))
    assert r.returncode != 0 and "SCBench's rows run under protocol=shared_context" in r.stdout, r.stdout[-2000:]
