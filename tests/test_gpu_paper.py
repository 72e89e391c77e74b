"""The paper profile at real shapes on a GPU (scripts/gpu_paper.sh, kvbench.gpu.paper; issue #16 item 3): the
job-stats hook of `kvbench`, the exact configs of the random checkpoints, the job list against the rules, and the
CPU dry run end to end on tiny shapes under an emulation of the bare GPU machine's missing packages."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pandas as pd
import pytest

from kvbench.gpu import paper as gpu_paper
from kvbench.cli import main
from kvbench.utils import jobstats

REPO = Path(__file__).resolve().parents[1]
#: packages absent on the bare GPU machine (its image's package list): importing one there fails
BARE = ("rapidfuzz", "datasets", "snakemake", "jsonschema", "lmms_eval")


def test_job_stats_line_at_exit(tmp_path, monkeypatch, capsys):
    stats = tmp_path / "s.jsonl"
    monkeypatch.setenv(jobstats.ENV, str(stats))
    assert main(["eval", "--model", "m"]) == 2            # bad input: still one line, with its exit status
    assert "the following arguments are required: --split, --out" in capsys.readouterr().err
    (line,) = stats.read_text().splitlines()
    rec = json.loads(line)
    assert rec["verb"] == "eval" and rec["rc"] == 2 and 0 <= rec["wall_s"] < 60
    assert rec["cuda_max_allocated"] is None and rec["cuda_max_reserved"] is None   # no CUDA used here
    monkeypatch.delenv(jobstats.ENV)
    assert main(["eval", "--model", "m"]) == 2 and len(stats.read_text().splitlines()) == 1


def test_job_stats_reads_cuda_peaks_only_when_cuda_was_initialised(tmp_path, monkeypatch):
    cuda = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True,
                                 max_memory_allocated=lambda: 123, max_memory_reserved=lambda: 456)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    rec = jobstats.append_job_stats(tmp_path / "s.jsonl", "codec-train", 0, 1.5)
    assert (rec["cuda_max_allocated"], rec["cuda_max_reserved"]) == (123, 456)
    cuda.is_initialized = lambda: False
    assert jobstats.append_job_stats(tmp_path / "s.jsonl", "eval", None, 2)["cuda_max_allocated"] is None
    rows = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [r["rc"] for r in rows] == [0, None]


def test_checkpoint_configs_are_the_papers(tokenizer):
    """The exact configs of Qwen2.5-VL-3B-Instruct and Llama-3.1-8B-Instruct (their config.json's shapes)."""
    tok = tokenizer
    v = gpu_paper.vlm_config(tok, tiny=False)
    t, vis = v.text_config, v.vision_config
    assert (t.hidden_size, t.intermediate_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads,
            t.vocab_size, t.rope_parameters["rope_theta"], t.rope_parameters["mrope_section"], t.rms_norm_eps) == (
        2048, 11008, 36, 16, 2, 151936, 1e6, [16, 24, 24], 1e-6)
    assert (vis.depth, vis.hidden_size, vis.out_hidden_size, vis.intermediate_size, vis.num_heads, vis.patch_size,
            vis.spatial_merge_size, vis.temporal_patch_size, vis.window_size, vis.fullatt_block_indexes) == (
        32, 1280, 2048, 3420, 16, 14, 2, 2, 112, [7, 15, 23, 31])
    assert v.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    c = gpu_paper.lm_config(tok, tiny=False)
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.vocab_size, c.max_position_embeddings, c.tie_word_embeddings) == (
        4096, 14336, 32, 32, 8, 128, 128256, 131072, False)
    assert c.rope_parameters == {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    tiny = gpu_paper.lm_config(tok, tiny=True)
    assert tiny.num_hidden_layers == 20 and tiny.vocab_size == len(tok) and tiny.rope_parameters == c.rope_parameters


def test_jobs_mirror_the_rules(tmp_path):
    """Commands as the paper profile's rules spell them (snakemake -n -p on config/paper.yaml), in DAG order."""
    jobs = gpu_paper.jobs(gpu_paper.PLANS["cuda"], tmp_path)
    names = [j.name for j in jobs]
    assert names.index("conduit_cache") < names.index("eval longdocurl_K8 reuse")
    assert names.index("rkv_codec_import") < names.index("eval lb_passage_retrieval_en ResidualKV")
    for j in jobs:
        assert all(n in names[:names.index(j.name)] for n in j.needs), j.name
    shown = {j.name: gpu_paper._shown(j) for j in jobs}
    assert shown["eval longdocurl_K8 conduit@0.1"] == (
        f"kvbench eval --model {tmp_path}/checkpoints/Qwen2.5-VL-3B-Instruct --split "
        f"{tmp_path}/benchmarks/mmlongbench/longdocurl_K8.jsonl --method conduit@0.1 --method-params "
        "'{\"cache_dir\": \"cache/conduit/paper/qwen2.5-vl-3b/longdocurl_K8\", \"build_missing\": false}' --out "
        "results/runs/paper/qwen2.5-vl-3b/longdocurl_K8/conduit/conduit_r0.1 --seed 0 --threads 4")
    assert ("--method omnikv:filter_layers=2+8+18,keep=0.1704,n_sink=0,protocol=one_pass,window=32 --method-params "
            "'{}' --out results/runs/paper/llama-3.1-8b/lb_hotpotqa/residualkv/omnikv_filter_layers-2.8.18_keep-"
            "0.1704_n_sink-0_protocol-one_pass_window-32 ") in shown["eval lb_hotpotqa OmniKV"]
    assert '"d_c": 512, "d_ff": 3072' in shown["rkv_codec_import"]


def test_eval_commands_are_the_ones_snakemake_prints(tmp_path):
    """Review finding: the test above compared with strings typed into it, so a change of the rules went unseen.
    Here the same two eval jobs are planned by Snakemake (`-n -p`) on config/paper.yaml over the same data root; the
    commands must agree but for --threads (the rule scales it to the cores it is given)."""
    from test_workflow import _fake_paper_root, snakemake

    root = tmp_path / "root"
    _fake_paper_root(root)
    shown = {j.name: gpu_paper._shown(j) for j in gpu_paper.jobs(gpu_paper.PLANS["cuda"], root)}
    work = tmp_path / "work"
    work.mkdir()

    def norm(cmd: str) -> str:
        return re.sub(r" --threads \d+", "", cmd.split(" > ")[0]).strip()

    for name in ("eval longdocurl_K8 conduit@0.1", "eval lb_hotpotqa OmniKV"):
        run = shown[name].split(" --out ")[1].split()[0]
        r = snakemake(work, "-n", "-p", f"{run}/metrics.json", "--configfile", str(REPO / "config" / "paper.yaml"),
                      "--config", f"paths={{root: {root}}}")
        assert r.returncode == 0, r.stdout[-3000:]
        planned = [norm(line.removeprefix("Shell command: ")) for line in r.stdout.splitlines()
                   if line.startswith("Shell command: kvbench eval")]
        assert planned == [norm(shown[name])], (planned, shown[name])
    assert re.search(r"codec-train .* --steps 2 --seq-len 8192 .*--device cuda --dtype bfloat16 --checkpointing "
                     r"--data-files \S+/corpus/part-000.jsonl$", shown["rkv_codec (2 steps)"])


@pytest.mark.slow
def test_cpu_dry_run_end_to_end(tmp_path):
    """`bash scripts/gpu_paper.sh --device cpu` (about 3 minutes on 2 cores): every job ok, with rapidfuzz,
    datasets, snakemake and jsonschema unimportable as on the bare GPU machine."""
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "sitecustomize.py").write_text(
        "import sys\n"
        f"BARE = {set(BARE)!r}\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BARE:\n"
        "            raise ImportError(f'{name}: not on the bare GPU machine (emulated)')\n"
        "sys.meta_path.insert(0, _Block())\n")
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_INSTALL": "0",
           "PYTHONPATH": f"{bare}{os.pathsep}{REPO / 'src'}"}
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_paper.sh"), "--device", "cpu"], env=env,
                       capture_output=True, text=True, timeout=1500, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    csv = out / "gpu_paper_jobs.csv"
    assert "RANDOM WEIGHTS" in csv.read_text().splitlines()[0]
    df = pd.read_csv(csv, comment="#")
    assert len(df) == len(gpu_paper.jobs(gpu_paper.PLANS["cpu"], tmp_path)) and (df["status"] == "ok").all()
    evals = df[df["job"].str.startswith("eval ")]
    assert len(evals) == 12 and (evals["n"] == 2).all() and (evals["n_error"] == 0).all()
    assert df["cuda_max_allocated"].isna().all() and (df["wall_s"] > 0).all()
    assert (out / "gpu_paper_runs.tar.gz").stat().st_size > 0 and not (out / "root").exists()


def test_an_existing_data_root_is_refused_and_left_alone(tmp_path):
    """Bug (review): GPU_PAPER_ROOT naming an existing directory got random checkpoints written into it and was then
    deleted with everything in it."""
    root = tmp_path / "my data"
    root.mkdir()
    (root / "sentinel.txt").write_text("precious\n")
    env = {**os.environ, "GPU_PAPER_ROOT": str(root), "OUT": str(tmp_path / "out")}
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_paper.sh"), "--device", "cpu"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "exists and is not an empty directory" in r.stderr
    assert (root / "sentinel.txt").read_text() == "precious\n" and sorted(p.name for p in root.iterdir()) == ["sentinel.txt"]
