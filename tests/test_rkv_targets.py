"""ResidualKV Table I and Fig. 3 as DAG targets (workflow/rules/rkv_observations.smk): dry runs on the smoke profile and
on config/paper.yaml over a fake data root."""
from __future__ import annotations

import json
import re

import yaml
from test_workflow import PAPER_CONFIG, _fake_paper_root, planned_jobs, snakemake

TARGETS = ["results/residualkv/tableI.csv", "figures/residualkv/fig3.pdf"]


def test_smoke_table_i_and_fig3_resolve(tmp_path):
    r = snakemake(tmp_path, "-n", "-p", *TARGETS)
    assert r.returncode == 0, r.stdout[-3000:]
    jobs = planned_jobs(r.stdout)
    assert jobs["rkv_observations"] == jobs["rkv_fig3"] == jobs["table"] == 1
    assert jobs["rkv_codec"] == 1  # Table I reads the main codec's codec.json
    # the analysis runs on the zoo LM over the residualkv tasks' test splits with the main codec's schedule
    assert re.search(r"kvbench analyze rkv-observations --model zoo/smoke/tiny-qwen2-lm-[0-9a-f]{8} ", r.stdout)
    assert "--split niah_1k=data/smoke/niah_1k-" in r.stdout and "--k 4 --n-sink 8 --stride 10" in r.stdout
    assert "--records-per-task 2 --max-tokens 4096 --device cpu --dtype float32 --zoo" in r.stdout
    assert re.search(r"input: zoo/smoke/tiny-qwen2-lm-[0-9a-f]{8}/config.json, codecs/smoke/tiny-qwen2-lm/main-", r.stdout)
    assert not (tmp_path / "results").exists()


def test_short_name_of_table_i_and_the_residualkv_aggregate(tmp_path):
    r = snakemake(tmp_path, "-n", "results/tableI.csv")
    assert r.returncode == 0, r.stdout[-3000:]
    assert planned_jobs(r.stdout)["residualkv_table_alias"] == 1
    r = snakemake(tmp_path, "-n", "residualkv")
    assert r.returncode == 0, r.stdout[-3000:]
    jobs = planned_jobs(r.stdout)
    assert jobs["rkv_fig3"] == 1 and "output: results/residualkv/tableI.csv" in r.stdout
    # the tables beyond the paper are in the aggregate under their canonical names only: no Roman short name
    assert "output: results/residualkv/table_layer_flow.csv" in r.stdout
    r = snakemake(tmp_path, "-n", "results/table_layer_flow.csv")
    assert r.returncode != 0 and "No rule to produce results/table_layer_flow.csv" in r.stdout


def test_paper_table_i_and_fig3_resolve(tmp_path):
    root = tmp_path / "kvbench-data"
    cfg = _fake_paper_root(root)
    r = snakemake(tmp_path, "-n", "-p", *TARGETS, "--configfile", str(PAPER_CONFIG), "--config", f"paths={{root: {root}}}")
    assert r.returncode == 0, r.stdout[-3000:]
    jobs = planned_jobs(r.stdout)
    assert jobs["rkv_observations"] == jobs["rkv_fig3"] == jobs["table"] == jobs["rkv_codec"] == 1
    # Table I: every model with a Table I entry, read from its local config.json
    with_entry = [m for m, s in cfg["models"].items() if s.get("codec")]
    # the paper's six Table I rows; Qwen3-4B's serves both its Instruct and Thinking checkpoints (Table V's backbone)
    assert len(with_entry) == 7 and {"qwen3-4b", "qwen3-4b-thinking"} <= set(with_entry)
    for m in with_entry:
        assert f"{root}/{cfg['models'][m]['checkpoint']}/config.json" in r.stdout
    spec = json.loads(re.search(r"kvbench report residualkv/tableI --spec '(.*?)' --out", r.stdout).group(1))
    assert spec["models"][0]["name"] == "llama-3.1-8b" and len(spec["models"]) == 7
    # Fig. 3 on the paper's checkpoint, on a GPU, over the configured LongBench contexts
    fig3 = cfg["residualkv"]["fig3"]
    assert f"--model {root}/checkpoints/Qwen2.5-7B-Instruct-1M --model-name qwen2.5-7b-1m" in r.stdout
    assert f"lb_lcc={root}/benchmarks/longbench/lcc.jsonl" in r.stdout
    assert (f"--max-tokens {fig3['max_tokens']} --context-tokens {fig3['context_tokens']} --device cuda "
            "--dtype bfloat16 --threads") in r.stdout and " --zoo" not in r.stdout
    assert "--alpha 0.001" in r.stdout  # the main codec's dynamic stride


def test_fig3_names_a_bad_model_or_task(tmp_path):
    root = tmp_path / "kvbench-data"
    cfg = _fake_paper_root(root)
    cfg["paths"] = {"root": str(root)}
    for patch, needle in (({"model": "nope"}, "residualkv.fig3.model: 'nope' is not defined"),
                          ({"tasks": ["mmbench"]}, "residualkv.fig3.tasks: 'mmbench' must be a text dataset")):
        bad = yaml.safe_load(yaml.safe_dump(cfg))
        bad["residualkv"]["fig3"].update(patch)
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(bad))
        r = snakemake(tmp_path, "-n", "--configfile", str(path))
        assert r.returncode != 0 and needle in r.stdout, r.stdout[-2000:]


def test_a_vlm_dataset_under_residualkv_tasks_fails_the_plan():
    """Review finding: a VLM dataset in `residualkv.tasks` built a plan that ran the LM on image records; only Fig. 3's
    check (naming `residualkv.fig3.tasks`) caught it, and not when `fig3.tasks` was set. The plan refuses it, naming the key."""
    import pytest
    from snakemake.utils import validate

    from kvbench.plan import Workspace, build_plans
    from test_workflow import CONFIG, REPO

    for where in ("tasks", "target_tasks"):
        cfg = yaml.safe_load(CONFIG.read_text())
        cfg["residualkv"]["fig3"] = {"tasks": ["niah_1k"]}
        if where == "tasks":
            cfg["residualkv"]["tasks"] = [*cfg["residualkv"]["tasks"], "docpages"]
            needle = "config residualkv.tasks: 'docpages' is a `vlm` dataset"
        else:
            cfg["residualkv"]["target_tasks"] = {"tableIII": ["docpages"]}
            needle = "config residualkv.target_tasks.tableIII: 'docpages' is a `vlm` dataset"
        validate(cfg, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))  # the Snakefile's defaults
        with pytest.raises(ValueError, match=re.escape(needle)):
            build_plans(Workspace(cfg))


def test_repeated_tasks_and_unknown_target_tasks_keys_fail_the_schema():
    """Review finding (issue #32): a task listed twice pooled its records twice in the paired CIs (n doubled, CIs too
    narrow), and a misspelt `target_tasks` key (`tableiii`) silently fell back to `tasks`. The schema refuses both
    (uniqueItems, propertyNames), naming the value."""
    import pytest
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    from test_workflow import CONFIG, REPO

    schema = str(REPO / "workflow" / "schemas" / "config.schema.yaml")
    cases = [({"tasks": ["niah_1k", "kv_1k", "niah_1k"]}, "has non-unique elements"),
             ({"target_tasks": {"tableIII": ["niah_1k", "niah_1k"]}}, "has non-unique elements"),
             ({"long_generation": {"tasks": ["chain_pairs_64", "chain_pairs_64"]}}, "has non-unique elements")]
    cases += [({"target_tasks": {bad: ["niah_1k"]}}, f"'{bad}' is not one of ['tableIII'")
              for bad in ("tableiii", "tableV", "tableII")]   # Table V's and II's columns come from their own sections
    for change, needle in cases:
        cfg = yaml.safe_load(CONFIG.read_text())
        for key, value in change.items():
            cfg["residualkv"][key] = value if key != "long_generation" else {**cfg["residualkv"][key], **value}
        with pytest.raises(WorkflowError, match=re.escape(needle)):
            validate(cfg, schema)
