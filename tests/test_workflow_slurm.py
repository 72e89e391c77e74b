"""The SLURM profile sends every job that asks for a GPU to a GPU partition, every other job to a CPU one
(issue #11, item 8).

The partition is the SLURM executor plugin's own choice from profiles/slurm/partitions.yaml (its
``slurm-partition-config``), made from each job's resources. A dry run never reaches the executor, so the
test takes each job's resources from the dry run of docs/workflow.md's SLURM command on the paper profile and asks the
plugin's ``Executor.get_partition_arg`` (the code that writes ``sbatch -p``) which partition it submits to.
"""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import yaml

from test_workflow import PAPER_CONFIG, REPO, _fake_paper_root, snakemake

slurm = pytest.importorskip("snakemake_executor_plugin_slurm")
from snakemake_executor_plugin_slurm.partitions import read_partition_file  # noqa: E402
from snakemake_executor_plugin_slurm.utils import set_gres_string  # noqa: E402

PROFILE = REPO / "profiles" / "slurm"
# Every rule that submits work, with a GPU-asking job on the paper profile for each of these.
GPU_RULES = {"eval", "conduit_cache", "conduit_latency", "rkv_throughput",
             "rkv_variant_throughput"}


class _Resources(dict):
    """A job's resources as the plugin reads them (``.get`` and attributes)."""

    def __getattr__(self, name):
        return self[name]


def _jobs(out: str) -> list[SimpleNamespace]:
    """Non-local jobs of a dry run: rule name, threads and resources (integers as such, as the plugin gets them)."""
    jobs = []
    for block in re.split(r"\n(?=\[.*\]\n(?:local)?rule )", out):
        head = re.search(r"^(local)?rule (\w+):$", block, flags=re.M)
        res = re.search(r"^    resources: (.*)$", block, flags=re.M)
        if not head or head.group(1):
            continue
        threads = re.search(r"^    threads: (\d+)$", block, flags=re.M)
        pairs = [kv.split("=", 1) for kv in res.group(1).split(", ")] if res else []
        resources = _Resources((k, int(v) if v.isdigit() else v) for k, v in pairs)
        jobs.append(SimpleNamespace(name=head.group(2), threads=int(threads.group(1)) if threads else 1,
                                    resources=resources))
    return jobs


def _partition(job, partitions) -> str:
    """The partition the plugin submits ``job`` to (its get_partition_arg; sinfo's default never asked)."""
    quiet = SimpleNamespace(debug=lambda *a: None, info=lambda *a: None, warning=lambda *a: None)
    executor = SimpleNamespace(_partitions=partitions, logger=quiet, _fallback_partition="<cluster default>")
    return slurm.Executor.get_partition_arg(executor, job).removeprefix(" -p ").strip("'")


def test_gpu_jobs_go_to_the_gpu_partition(tmp_path):
    root = tmp_path / "kvbench-data"
    _fake_paper_root(root)
    # docs/workflow.md's SLURM command (profiles/slurm; profiles/default's default-resources would replace its own)
    r = snakemake(tmp_path, "-n", "--profile", str(PROFILE), "--workflow-profile", "none",
                  "all", "conduit", "residualkv", "results/conduit/table3.csv",
                  "--configfile", str(PAPER_CONFIG), "--config", f"paths={{root: {root}}}")
    assert r.returncode == 0, r.stdout[-3000:]
    profile = yaml.safe_load((PROFILE / "config.yaml").read_text())
    config = profile.get("slurm-partition-config")
    partitions = read_partition_file(PROFILE / config) if config else None
    jobs = _jobs(r.stdout)
    assert len(jobs) > 800 and {j.name for j in jobs} >= GPU_RULES | {"tokenizer", "table"}
    placed = {(job.name, int(job.resources.get("gpu", 0)), _partition(job, partitions)) for job in jobs}
    wrong = sorted(p for p in placed if p[2] != ("gpu" if p[1] else "cpu"))
    assert not wrong, f"(rule, gpus, partition) placed wrong: {wrong}"
    assert {name for name, gpus, _ in placed if gpus} >= GPU_RULES
    for job in jobs:
        assert "slurm_partition" not in job.resources, f"{job.name} pins a partition: {job.resources}"
        gpus = job.resources.get("gpu", 0)
        assert set_gres_string(job) == (f" --gpus={gpus}" if gpus else ""), (job.name, job.resources)
