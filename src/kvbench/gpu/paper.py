"""The paper profile's jobs at the real shapes on a lent GPU (``scripts/gpu_paper.sh``; issue #16 item 3).

**Random weights**: the checkpoints written here have the exact architectures of Qwen2.5-VL-3B-Instruct (text
decoder :data:`~kvbench.bench.timing_model.TIMING_MODELS` ``timing-qwen2.5-vl-3b`` plus
:data:`~kvbench.bench.timing_model.QWEN2_5_VL_3B_CHECKPOINT`: its vision tower and remaining fields) and
Llama-3.1-8B-Instruct (:data:`~kvbench.bench.timing_lm.TIMING_LMS` ``timing-llama-3.1-8b`` plus
:data:`~kvbench.bench.timing_lm.LLAMA_3_1_8B_CHECKPOINT`: llama3 RoPE scaling, 128K positions), drawn at random
and saved with ``save_pretrained`` (safetensors, bfloat16) beside the zoo's tokenizer, whose vocabulary is
smaller than their embedding tables. They give true memory and time, not accuracy: every score this writes is
meaningless, and the CSV header says so. The benchmark records are the smoke generators' content
(:mod:`kvbench.bench.requests`-scaled docpages pages for CONDUIT's ``longdocurl_K8``, RULER-style needle and
variable-tracking records for two LongBench files), not the benchmarks.

The jobs mirror the paper profile's rules (``snakemake -n -p`` on ``config/paper.yaml``), run here without
Snakemake (not on the GPU machine), in DAG order, each a subprocess with a time cap:

- ``workflow/rules/conduit.smk`` ``conduit_cache``: ``kvbench cache`` of ``longdocurl_K8`` on qwen2.5-vl-3b;
- ``workflow/rules/eval.smk`` ``eval`` (CONDUIT Table 1 cells): refresh runs ``full``, ``reuse``, ``conduit@0.1``,
  ``prophetkv@0.1`` reading that cache (``build_missing: false``), in ``results/runs/paper/.../conduit/<slug>``;
- ``workflow/rules/residualkv.smk`` ``rkv_codec_import``: ``kvbench codec-import --from-deltakv`` of a random
  compressor in the authors' layout (Table I sizes: d_c 512, d_ff 3072), and ``rkv_codec``: ``kvbench
  codec-train`` for 2 steps of 8,192 tokens, cuda/bfloat16/checkpointing as the profile's ``residualkv.train``,
  on a small local JSONL corpus (``--data-files``; no ``datasets`` there: :mod:`kvbench.data.local_text` reads
  it with the standard library);
- ``eval`` (ResidualKV Table III cells): the rows ``Full cache``, ``SnapKV``, ``OmniKV`` and ``ResidualKV`` of
  ``residualkv.tableIII`` with the profile's protocol, the last with the imported codec.

Every job's row in ``gpu_paper_jobs.csv``: name, rule, command, exit status, wall seconds, peak CUDA memory
allocated / reserved (``KVBENCH_JOB_STATS``, :mod:`kvbench.utils.jobstats`), and for an eval its score, records
and failed records; a failed or timed-out job keeps its log tail there and the others still run (those that need
its output are skipped, saying which).

``--device cpu`` is the dry run: the same architectures at tiny sizes (the real class, RoPE and layer pattern;
a 20-layer Llama so Table I's full-attention layers 0, 1, 2, 8, 18 exist), 2 pages of 56 px, 640-token
contexts (past the codec's sinks and window, so tokens are coded), bfloat16 checkpoints run on the CPU (``kvbench eval`` loads a checkpoint in its own dtype).

The module imports neither torch nor transformers (nor what pulls them): each builder imports what it uses, so
the orchestrator of the jobs' subprocesses stays light.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvbench.bench.timing_lm import LLAMA_3_1_8B_CHECKPOINT, timing_lm_config
from kvbench.data import longctx
from kvbench.data.corpus import prose_lines
from kvbench.utils.io import atomic_path, write_json, write_jsonl
from kvbench.utils.jobstats import ENV as STATS_ENV, recorded

REPO = Path(__file__).resolve().parents[3]
PAPER_CONFIG = REPO / "config" / "paper.yaml"
VLM, LM = "qwen2.5-vl-3b", "llama-3.1-8b"        # config/paper.yaml's model names
CONDUIT_DATASET = "longdocurl_K8"
#: LongBench files written (config/paper.yaml dataset name -> smoke family of the stand-in records)
RKV_TASKS = {"lb_passage_retrieval_en": "niah", "lb_hotpotqa": "vt"}
CONDUIT_METHODS = ("full", "reuse", "conduit@0.1", "prophetkv@0.1")
RKV_ROWS = ("Full cache", "SnapKV", "OmniKV", "ResidualKV")   # labels of residualkv.tableIII
RANDOM_NOTE = ("RANDOM WEIGHTS: checkpoints of the real architectures drawn at random and synthetic records; "
               "wall time and memory are real, every score is meaningless")
CSV_COLUMNS = ["job", "rule", "status", "rc", "wall_s", "cuda_max_allocated", "cuda_max_reserved", "score", "n",
               "n_error", "command", "log_tail"]


@dataclass(frozen=True)
class Plan:
    """Sizes of one device's run. ``tiny``: the dry run's small shapes; ``pages``/``page_px``: CONDUIT requests;
    ``context``: LongBench stand-in tokens; ``new_tokens``: their ``max_new_tokens``; ``records``: per file;
    ``seq_len``/``steps``: the codec-train job; ``budget_s``: all jobs together; ``cap_s``: per job kind."""

    device: str
    tiny: bool
    pages: int
    page_px: int
    context: int
    new_tokens: int
    records: int
    seq_len: int
    steps: int
    budget_s: float
    cap_s: dict


PLANS = {
    # H200: 8 pages of 448 px (256 visual tokens each, ~2.1K tokens a request), ~3.5K-token contexts; the
    # budget keeps the script under 8 minutes with imports and the pip install (estimates: docs/decisions/benchmarks.md, "The paper profile on a GPU")
    "cuda": Plan("cuda", False, pages=8, page_px=448, context=3500, new_tokens=32, records=3, seq_len=8192, steps=2,
                 budget_s=400.0, cap_s={"prepare": 150, "cache": 90, "eval": 90, "import": 60, "train": 150}),
    "cpu": Plan("cpu", True, pages=2, page_px=56, context=640, new_tokens=4, records=2, seq_len=128, steps=2,
                budget_s=1200.0, cap_s={"prepare": 300, "cache": 300, "eval": 300, "import": 120, "train": 300}),
}
#: The dry run's tiny shapes of the same classes (text decoder of the VLM: ``timing-qwen2.5-vl-test``).
TINY_VISION = {"depth": 4, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "fullatt_block_indexes": [1, 3]}
TINY_LM = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 20, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16}
TINY_CODEC = {"d_c": 32, "d_ff": 96}   # d_kv = 2 x 2 x 16 = 64 (Llama-3.1-8B: 2,048 -> Table I's 512 / 3,072)


def paper_config(path: str | os.PathLike = PAPER_CONFIG) -> dict:
    """config/paper.yaml as a dict (the source of checkpoint and file paths, codec settings and Table III rows)."""
    return yaml.safe_load(Path(path).read_text())


# --- checkpoints ---------------------------------------------------------------------------------------------
def vlm_config(tokenizer: Any, tiny: bool) -> Any:
    """Qwen2.5-VL-3B-Instruct's config (``Qwen2_5_VLConfig``; ``tiny``: its tiny-size twin) for ``tokenizer``'s
    special-token ids."""
    import transformers

    from kvbench.bench.timing_model import QWEN2_5_VL_3B_CHECKPOINT, timing_config

    d = timing_config("timing-qwen2.5-vl-test" if tiny else "timing-qwen2.5-vl-3b", tokenizer).to_dict()
    extra = dict(QWEN2_5_VL_3B_CHECKPOINT["text"])
    theta = extra.pop("rope_theta")
    if tiny:
        extra.pop("vocab_size"), extra.pop("max_position_embeddings")
    d["text_config"].update(extra)
    d["text_config"]["rope_parameters"] = {**d["text_config"]["rope_parameters"], "rope_theta": theta}
    vision = dict(QWEN2_5_VL_3B_CHECKPOINT["vision"])
    if tiny:
        vision.update(TINY_VISION, out_hidden_size=d["text_config"]["hidden_size"])
    d["vision_config"].update(vision)
    d["tie_word_embeddings"] = extra.get("tie_word_embeddings", True)
    cfg = transformers.Qwen2_5_VLConfig.from_dict(d)
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    return cfg


def lm_config(tokenizer: Any, tiny: bool) -> Any:
    """Llama-3.1-8B-Instruct's config (``LlamaConfig``; ``tiny``: its tiny-size twin) for ``tokenizer``'s
    special-token ids."""
    import transformers

    d = timing_lm_config("timing-llama-3.1-8b").to_dict()
    d.update(LLAMA_3_1_8B_CHECKPOINT, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
             bos_token_id=None)
    if tiny:
        d.update(TINY_LM, vocab_size=len(tokenizer))
    cfg = transformers.LlamaConfig.from_dict(d)
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def write_checkpoint(model: str, root: Path, tokenizer_dir: Path, device: str, tiny: bool) -> Path:
    """Random-weight bfloat16 checkpoint of ``model`` (:data:`VLM` or :data:`LM`) at its config/paper.yaml path
    under ``root``, drawn on ``device`` (an 8B model is never materialised in float32 on the host), with the
    zoo tokenizer (and processor, for the VLM) and ``kvbench_random_weights.json`` saying what it is."""
    import torch
    import transformers

    from kvbench.models.loader import save_checkpoint
    from kvbench.models.tiny import build_processor

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    if model == VLM:
        cfg, cls, proc = vlm_config(tok, tiny), transformers.Qwen2_5_VLForConditionalGeneration, build_processor(tok)
    elif model == LM:
        cfg, cls, proc = lm_config(tok, tiny), transformers.LlamaForCausalLM, tok
    else:
        raise ValueError(f"model must be {VLM!r} or {LM!r}, got {model!r}")
    cfg.dtype = torch.bfloat16
    old = torch.get_default_dtype()
    torch.manual_seed(0)
    with torch.device(device):
        torch.set_default_dtype(torch.bfloat16)
        try:
            net = cls(cfg)
        finally:
            torch.set_default_dtype(old)
    out = root / paper_config()["models"][model]["checkpoint"]
    save_checkpoint(net.eval(), proc, out)
    n = sum(p.numel() for p in net.parameters())
    write_json(out / "kvbench_random_weights.json",
               {"random_weights": True, "architecture": cfg.architectures[0], "parameters": n, "tiny": tiny,
                "note": RANDOM_NOTE, "source": "kvbench.gpu.paper.write_checkpoint"})
    print(f"{model}: {n / 1e9:.3f}B random parameters -> {out}")
    return out


# --- records -------------------------------------------------------------------------------------------------
def write_data(root: Path, tokenizer_dir: Path, plan: Plan) -> dict:
    """The benchmark files the jobs read, at their config/paper.yaml paths under ``root``: ``longdocurl_K8``
    (docpages records of ``plan.pages`` pages of ``plan.page_px`` px, images as PNG files beside the JSONL) and
    :data:`RKV_TASKS` (needle / variable-tracking records of ``plan.context`` tokens), ``plan.records`` each, and
    ``corpus/part-000.jsonl`` (stdlib prose documents, ``text`` column) for codec-train. Returns ``{name: path}``."""
    import transformers

    from kvbench.bench.requests import bench_record
    from kvbench.data.smoke import _save_image

    cfg = paper_config()
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    written = {}

    path = root / cfg["datasets"][CONDUIT_DATASET]["jsonl"]
    rows = []
    for i in range(plan.records):
        rec = bench_record(plan.pages, plan.page_px, seed=i)
        content = [{**p, "image": _save_image(p["image"], path.parent)} if p["type"] == "image" else p
                   for p in rec["content"]]
        rows.append({**rec, "content": content, "task": CONDUIT_DATASET,
                     "meta": {**rec["meta"], "stand_in": "kvbench docpages pages (bench.requests), not LongDocURL"}})
    write_jsonl(path, rows)
    written[CONDUIT_DATASET] = str(path)
    samplers = {"niah": longctx.sample_niah, "vt": longctx.sample_vt}
    for name, family in RKV_TASKS.items():
        path = root / cfg["datasets"][name]["jsonl"]
        rows = []
        for i in range(plan.records):
            rec = samplers[family](random.Random(f"gpu_paper/{name}/{i}"), "test", tok, length_tokens=plan.context)
            # a LongBench-like answer length, so the compressed decode path runs (OmniKV selects on decode steps)
            rows.append({**rec, "id": f"{name}-{i:05d}", "task": name, "max_new_tokens": plan.new_tokens,
                         "meta": {**rec["meta"], "stand_in": f"kvbench.data.longctx {family}, not LongBench"}})
        write_jsonl(path, rows)
        written[name] = str(path)
    lines = prose_lines("train")
    docs = [" ".join(lines[j:j + 60]) for j in range(0, min(len(lines), 60 * 400), 60)]
    path = root / "corpus" / "part-000.jsonl"
    write_jsonl(path, [{"id": i, "text": d} for i, d in enumerate(docs)])
    written["corpus"] = str(path)
    print(json.dumps(written, indent=2))
    return written


def compressor_dir(root: Path) -> Path:
    """Where the random authors'-layout compressor goes (as config/paper.yaml's commented ``import:`` example)."""
    return root / "compressors" / "Llama-3.1-8B-Instruct-Compressor"


def codec_overrides(tiny: bool) -> dict:
    """The main codec's settings: config/paper.yaml's ``residualkv.codec`` (Table I d_c 512, d_ff 3072), the
    dry run's sizes for its tiny LM."""
    codec = {k: v for k, v in paper_config()["residualkv"]["codec"].items() if k != "import"}
    return {**codec, **(TINY_CODEC if tiny else {})}


def write_compressor(root: Path, device: str, tiny: bool) -> Path:
    """A freshly initialised (seeded, random) codec for the Llama checkpoint under ``root``, written in the ResidualKV
    authors' layout (:func:`~kvbench.compress.residualkv.deltakv_format.export_deltakv`, bfloat16)."""
    import torch

    from kvbench.compress.residualkv.codec import (
        ResidualCodec,
        codec_config_for_shape,
        config_kv_shape,
    )
    from kvbench.compress.residualkv.deltakv_format import (
        export_deltakv,
        model_config_dict,
    )

    model = root / paper_config()["models"][LM]["checkpoint"]
    n_layers, d_kv = config_kv_shape(model_config_dict(model), str(model))
    torch.manual_seed(0)
    with torch.device(device):
        codec = ResidualCodec(codec_config_for_shape(n_layers, d_kv, **codec_overrides(tiny)))
    out = export_deltakv(codec, compressor_dir(root), model, dtype=torch.bfloat16)
    print(json.dumps({"out": str(compressor_dir(root)), "random_weights": True, **out["config"]}, default=str)[:2000])
    return compressor_dir(root)


# --- the jobs ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """One job: ``name``, the ``rule`` it mirrors, ``argv`` (after the Python interpreter), its cap kind, the
    jobs it needs, and its run directory (evals: metrics.json is read from there)."""

    name: str
    rule: str
    argv: tuple[str, ...]
    kind: str
    needs: tuple[str, ...] = ()
    run_dir: str | None = None


def _kvbench(*args: Any) -> tuple[str, ...]:
    return ("-m", "kvbench.cli", *map(str, args))


def _prepare(*args: Any) -> tuple[str, ...]:
    return ("-m", "kvbench.gpu.paper", "prepare", *map(str, args))


def jobs(plan: Plan, root: Path) -> list[Job]:
    """The jobs in DAG order; paths relative to the work directory as Snakemake's (``results/``, ``cache/``,
    ``codecs/``), checkpoint and benchmark paths under ``root`` as config/paper.yaml's ``paths.root``."""
    from kvbench.eval.registry import canonical, slug
    from kvbench.plan.residualkv import RKVPlan

    cfg = paper_config()
    profile, seed = cfg["profile"], cfg["seed"]
    tok = root / "tokenizer"
    vlm, lm = (root / cfg["models"][m]["checkpoint"] for m in (VLM, LM))
    common = ("--device", plan.device, "--root", root) + (("--tiny",) if plan.tiny else ())
    out = [
        Job("tokenizer", "tokenizer (zoo tokenizer)", _kvbench("tokenizer", "--out", tok, "--vocab-size", 4096),
            "prepare"),
        Job(f"checkpoint {VLM}", "(random checkpoint)", _prepare("checkpoint", VLM, *common, "--tokenizer", tok),
            "prepare", ("tokenizer",)),
        Job(f"checkpoint {LM}", "(random checkpoint)", _prepare("checkpoint", LM, *common, "--tokenizer", tok),
            "prepare", ("tokenizer",)),
        Job("data", "(benchmark files)", _prepare("data", *common, "--tokenizer", tok), "prepare", ("tokenizer",)),
        Job("compressor", "(random DeltaKV compressor)", _prepare("compressor", *common), "prepare",
            (f"checkpoint {LM}",)),
    ]
    threads = str(cfg["conduit"].get("threads", 1))
    split = root / cfg["datasets"][CONDUIT_DATASET]["jsonl"]
    cache_dir = f"cache/conduit/{profile}/{VLM}/{CONDUIT_DATASET}"
    out.append(Job("conduit_cache", "conduit.smk:conduit_cache",
                   _kvbench("cache", "--model", vlm, "--split", split, "--cache-dir", cache_dir,
                            "--out", f"{cache_dir}/index.json", "--threads", threads),
                   "cache", (f"checkpoint {VLM}", "data")))
    for spec in map(canonical, CONDUIT_METHODS):
        params = {} if spec == "full" else {"cache_dir": cache_dir, "build_missing": False}
        run = f"results/runs/{profile}/{VLM}/{CONDUIT_DATASET}/conduit/{slug(spec)}"
        out.append(Job(f"eval {CONDUIT_DATASET} {spec}", "eval.smk:eval (CONDUIT Table 1)",
                       _kvbench("eval", "--model", vlm, "--split", split, "--method", spec, "--method-params",
                                json.dumps(params), "--out", run, "--seed", seed, "--threads", threads),
                       "eval", (f"checkpoint {VLM}", "data") + (() if spec == "full" else ("conduit_cache",)), run))
    rkv = cfg["residualkv"]
    overrides = json.dumps(codec_overrides(plan.tiny), sort_keys=True)
    codec = f"codecs/{profile}/{LM}/main-import/codec"
    out.append(Job("rkv_codec_import", "residualkv.smk:rkv_codec_import",
                   _kvbench("codec-import", "--from-deltakv", compressor_dir(root), "--out", codec, "--model", lm,
                            "--overrides", overrides), "import", ("compressor",)))
    rkv_plan = RKVPlan(rkv, profile, zoo=False)
    rows = {r.label: r.spec for r in rkv_plan.rows("tableIII")}
    missing = [label for label in RKV_ROWS if label not in rows]
    if missing:
        raise ValueError(f"config/paper.yaml residualkv.tableIII lacks the rows {missing} (has {sorted(rows)})")
    rthreads = str(rkv.get("threads", 1))
    evals: list[list[Job]] = []
    for task in RKV_TASKS:
        split = root / cfg["datasets"][task]["jsonl"]
        evals.append([])
        for label in RKV_ROWS:
            spec = rows[label]
            needs = (f"checkpoint {LM}", "data")
            params: dict = {}
            if rkv_plan.codec_of(spec) is not None:
                params, needs = {"codec_dir": codec}, needs + ("rkv_codec_import",)
            run = rkv_plan.run_dir(task, spec)
            evals[-1].append(Job(f"eval {task} {label}", "eval.smk:eval (ResidualKV Table III)",
                                 _kvbench("eval", "--model", lm, "--split", split, "--method", spec,
                                          "--method-params", json.dumps(params), "--out", run, "--seed", seed,
                                          "--threads", rthreads), "eval", needs, run))
    train = rkv["train"]
    flags = (["--device", train["device"], "--dtype", train["dtype"]] if plan.device != "cpu"
             else ["--device", "cpu", "--dtype", "bfloat16"]) + (["--checkpointing"] if train.get("checkpointing") else [])
    codec_train = Job("rkv_codec (2 steps)", "residualkv.smk:rkv_codec",
                      _kvbench("codec-train", "--model", lm, "--out", f"codecs/{profile}/{LM}/main-short",
                               "--overrides", overrides, "--objective", train["objective"], "--steps", plan.steps,
                               "--seq-len", plan.seq_len, "--slice-s", 0, "--lr", train["lr"], "--data",
                               train["data"], "--seed", seed, "--threads", train.get("threads", 1), *flags,
                               "--data-files", root / "corpus" / "part-000.jsonl"),
                      "train", (f"checkpoint {LM}", "data"))
    # the first task's four rows, then the one training job, then the other task: if the budget runs out, what
    # is skipped is a repeat of rows already measured
    out += evals[0] + [codec_train] + [job for task_jobs in evals[1:] for job in task_jobs]
    return out


def _shown(job: Job) -> str:
    """The command as the rules spell it (``kvbench <verb> ...``)."""
    argv = list(job.argv)
    head = ["kvbench"] if argv[:2] == ["-m", "kvbench.cli"] else ["python", "-m", argv[1]]
    return shlex.join(head + argv[2:])


def _tail(path: Path, n: int = 6) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return " | ".join(line.strip() for line in lines[-n:])[-1500:]


def run_job(job: Job, work: Path, logs: Path, timeout_s: float) -> dict:
    """Run ``job`` in ``work`` (its own process group, killed at ``timeout_s``); its CSV row."""
    import math

    log, stats = logs / f"{_file_name(job.name)}.log", logs / f"{_file_name(job.name)}.stats.jsonl"
    stats.unlink(missing_ok=True)
    env = {**os.environ, STATS_ENV: str(stats), "PYTHONUNBUFFERED": "1"}
    row = {"job": job.name, "rule": job.rule, "command": _shown(job)}
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, *job.argv], cwd=work, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc, status = proc.wait(), f"timeout ({timeout_s:.0f} s)"
    row.update(status=status, rc=rc, wall_s=round(time.perf_counter() - t0, 2))
    lines = stats.read_text().splitlines() if stats.is_file() else []
    peaks = [json.loads(line) for line in lines if line.strip()]
    for key in ("cuda_max_allocated", "cuda_max_reserved"):
        vals = [p[key] for p in peaks if p.get(key) is not None]
        row[key] = max(vals) if vals else None
    if job.run_dir and (work / job.run_dir / "metrics.json").is_file():
        m = json.loads((work / job.run_dir / "metrics.json").read_text())
        score = m.get("score")
        row.update(score=None if score is None or (isinstance(score, float) and math.isnan(score)) else score,
                   n=m.get("n"), n_error=m.get("n_error"))
        if m.get("n_error"):
            row["status"] = f"{status}, {m['n_error']} record(s) failed"
    if status != "ok" or row.get("n_error"):
        row["log_tail"] = _tail(log)
    return row


def _file_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def write_csv(rows: list[dict], path: Path, plan: Plan) -> None:
    """The jobs CSV (atomically), its first line a ``#`` header saying what ran and that the weights are random."""
    import pandas as pd

    header = (f"# kvbench paper profile jobs (scripts/gpu_paper.sh) on {plan.device}"
              f"{' (tiny dry-run shapes)' if plan.tiny else ''}: {RANDOM_NOTE}. Peak CUDA bytes per job "
              f"(empty: CUDA not used); mirrors workflow/rules/{{conduit,eval,residualkv}}.smk\n")
    with atomic_path(path) as tmp:
        Path(tmp).write_text(header + pd.DataFrame(rows, columns=CSV_COLUMNS).to_csv(index=False))


def run(plan: Plan, out: Path, root: Path, budget_s: float | None = None) -> list[dict]:
    """Every job of :func:`jobs` in order within ``budget_s`` (default the plan's); writes ``out``/
    ``gpu_paper_jobs.csv`` after each job and returns its rows. A job whose needs failed, or that would start
    with under 15 s of budget left, is skipped (a row says why); each runs at most its kind's cap."""
    budget = plan.budget_s if budget_s is None else budget_s
    if not budget > 0:
        raise ValueError(f"budget_s must be a positive number of seconds, got {budget}")
    work, logs = root / "work", root / "work" / "logs" / "gpu_paper"
    logs.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    done: dict[str, bool] = {}
    t0 = time.perf_counter()
    csv = out / "gpu_paper_jobs.csv"
    for job in jobs(plan, root):
        left = budget - (time.perf_counter() - t0)
        failed = [n for n in job.needs if not done.get(n)]
        if failed:
            row = {"job": job.name, "rule": job.rule, "command": _shown(job), "status": f"skipped: {failed[0]} did not finish"}
        elif left < 15:
            row = {"job": job.name, "rule": job.rule, "command": _shown(job), "status": f"skipped: budget ({budget:.0f} s) spent"}
        else:
            print(f"[{time.perf_counter() - t0:6.1f} s] {job.name}: {_shown(job)[:300]}", flush=True)
            row = run_job(job, work, logs, min(plan.cap_s[job.kind], left))
            print(f"    -> {row['status']} in {row['wall_s']} s, peak CUDA {row.get('cuda_max_allocated')} B"
                  + (f", score {row.get('score')}" if job.run_dir else "")
                  + (f"\n    {row['log_tail']}" if row.get("log_tail") else ""), flush=True)
        done[job.name] = row.get("status") == "ok"
        rows.append(row)
        write_csv(rows, csv, plan)
    ok = sum(done.values())
    print(f"{csv}: {ok} of {len(rows)} jobs ok in {time.perf_counter() - t0:.0f} s. {RANDOM_NOTE}.")
    return rows


def main(argv: list[str] | None = None) -> int:
    """``python -m kvbench.gpu.paper run --device cuda|cpu --out DIR --root DIR`` (the orchestrator:
    exit 0 when every job is ok, else 1), or ``prepare checkpoint|data|compressor ...`` (one preparation job)."""
    p = argparse.ArgumentParser(prog="gpu_paper", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--device", choices=sorted(PLANS), default="cuda")
    r.add_argument("--out", required=True, help="where gpu_paper_jobs.csv goes")
    r.add_argument("--root", required=True, help="data root (checkpoints/, benchmarks/, corpus/, work/)")
    r.add_argument("--budget-s", type=float, default=None, help="seconds for all jobs (default: the plan's)")
    q = sub.add_parser("prepare")
    q.add_argument("what", choices=["checkpoint", "data", "compressor"])
    q.add_argument("model", nargs="?", choices=[VLM, LM])
    q.add_argument("--device", required=True)
    q.add_argument("--root", required=True)
    q.add_argument("--tokenizer", default=None)
    q.add_argument("--tiny", action="store_true")
    a = p.parse_args(argv)
    if a.cmd == "run":
        return _command(a)
    with recorded(f"gpu_paper prepare {a.what}") as job:  # one stats line per preparation job
        job["rc"] = _command(a)
    return job["rc"]


def _command(a: argparse.Namespace) -> int:
    """Run the parsed ``run`` or ``prepare`` command; bad input prints one error line and returns 2."""
    try:
        if a.cmd == "run":
            if a.device == "cuda":
                import torch

                if not torch.cuda.is_available():
                    raise ValueError("--device cuda: no CUDA device is visible (use --device cpu for the dry run)")
            out, root = Path(a.out), Path(a.root)
            out.mkdir(parents=True, exist_ok=True)
            rows = run(PLANS[a.device], out.resolve(), root.resolve(), a.budget_s)
            return 0 if all(r.get("status") == "ok" for r in rows) else 1
        root = Path(a.root)
        plan = dataclasses.replace(PLANS["cpu" if a.tiny else "cuda"], device=a.device)
        if a.what == "checkpoint":
            if a.model is None or a.tokenizer is None:
                raise ValueError(f"prepare checkpoint needs a model ({VLM} or {LM}) and --tokenizer")
            write_checkpoint(a.model, root, Path(a.tokenizer), a.device, a.tiny)
        elif a.what == "data":
            if a.tokenizer is None:
                raise ValueError("prepare data needs --tokenizer")
            write_data(root, Path(a.tokenizer), plan)
        else:
            write_compressor(root, a.device, a.tiny)
        return 0
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"gpu_paper: error: {e}", file=sys.stderr)
        return 2

if __name__ == "__main__":
    sys.exit(main())
