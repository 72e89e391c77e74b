"""The Table 3 job as the workflow builds it (no Snakemake run): inputs and arguments from each config."""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from kvbench.bench import TABLE3_METHODS
from kvbench.bench.workflow import TIMED_METHODS, latency_job
from kvbench.cli import build_parser

REPO = Path(__file__).resolve().parents[1]


def _config(name):
    with open(REPO / "config" / f"{name}.yaml") as f:
        return yaml.safe_load(f)


def test_smoke_job_uses_the_timing_model_and_tokenizer():
    job = latency_job(_config("config"), lambda m: f"zoo/{m}", "zoo/tokenizer")
    assert job.input == "zoo/tokenizer/tokenizer.json"
    args = build_parser().parse_args(["bench", "conduit-latency", "--out", "x.csv", *job.args.split()])
    assert args.model == "timing-qwen2.5-vl-wide" and args.sizes == [4, 8, 16] and args.r == 0.1
    assert "conduit" in args.methods and args.repeats >= 3


def test_paper_job_reads_the_checkpoint():
    job = latency_job(_config("paper"), lambda m: f"/data/{m}", "zoo/tokenizer")
    assert job.input == "/data/qwen2.5-vl-3b/config.json" and "--model /data/qwen2.5-vl-3b" in job.args


def test_table3_methods_are_listed_once():
    """Table 3's methods are kvbench.bench.TABLE3_METHODS alone: the schema gives no default and no config repeats
    them (a config names methods only to time others); a section without ``methods`` times every one but full."""
    schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    assert "default" not in schema["properties"]["conduit_latency"]["properties"]["methods"]
    every = set(TABLE3_METHODS) - {"full"}
    for path in sorted((REPO / "config").glob("*.yaml")):
        methods = (yaml.safe_load(path.read_text()).get("conduit_latency") or {}).get("methods")
        assert methods is None or set(methods) - {"full"} != every, f"{path.name} repeats TABLE3_METHODS"
    argv = shlex.split(latency_job(_config("config"), str, "zoo/tokenizer").args)
    assert argv[argv.index("--methods") + 1:argv.index("--repeats")] == TIMED_METHODS
    assert TIMED_METHODS == [m for m in TABLE3_METHODS if m != "full"]


def test_bad_sections_fail_naming_the_problem():
    with pytest.raises(ValueError, match="conduit_latency"):
        latency_job({"models": {}}, str, "t")
    with pytest.raises(ValueError, match="nope"):
        latency_job({"models": {}, "conduit_latency": {"model": "nope"}}, str, "t")


# --- the DAG (dry runs only: CI never times anything) --------------------------------------------------

from test_workflow import CI_CONFIG, planned_jobs, snakemake, write_config  # noqa: E402


@pytest.mark.parametrize("configfile", [None, CI_CONFIG], ids=["smoke", "ci"])
def test_table3_is_a_dag_target(tmp_path, configfile):
    r = snakemake(tmp_path, "-n", "results/table3.csv", *(["--configfile", str(configfile)] if configfile else []))
    assert r.returncode == 0, r.stdout
    assert planned_jobs(r.stdout) == {"tokenizer": 1, "conduit_latency": 1, "table": 1, "conduit_table_alias": 1}
    assert "kvbench bench conduit-latency" in r.stdout or "conduit_latency" in r.stdout


def test_table3_without_section_fails_naming_it(tmp_path):
    cfg = _config("ci")
    cfg.pop("conduit_latency")
    r = snakemake(tmp_path, "-n", "results/conduit/table3.csv", "--configfile",
                  str(write_config(tmp_path / "c.yaml", cfg)))
    assert r.returncode != 0 and "conduit_latency" in r.stdout
