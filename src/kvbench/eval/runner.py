"""Run one evaluation method over one benchmark split and write a run directory.

``run_eval`` is what ``kvbench eval`` calls. A run directory holds
(``docs/architecture.md``):

- ``predictions.jsonl``: one row per sample: ``id``, ``prediction``, ``gold``,
  ``score`` (float in [0, 1]), ``chance``, ``metric``, ``status`` (``"ok"`` or
  ``"error"``), ``error`` (message or ``None``) and, for refresh and compression
  methods, ``plan``. No wall-clock value: two runs give the same bytes.
- ``metrics.json``: :func:`kvbench.eval.metrics.aggregate` plus ``task``,
  ``method``, ``model``, ``metric``, ``split`` (no wall-clock value either).
- ``timing.csv``: ``id, latency_ms`` (wall time of ``predict``, ms), one line per
  sample, also for samples scored before a resume (each timed in the invocation
  that scored it); the only per-sample figure that differs between two runs.
- ``run_info.json``: provenance, everything needed to reproduce or audit the run
  (full arguments, method hyper-parameters, package versions, git revision, model
  checkpoint path and hashes, attention implementation, dtype, device, seed,
  threads, host, timestamps, wall time); it differs between runs by design.

A sample that raises is recorded with ``status="error"`` and score 0 (a
:class:`~kvbench.eval.methods.FatalRunError`, such as a missing image cache, stops the run instead); the run
fails only when every sample fails. An interrupted run resumes: finished rows are kept in hidden work
files (:mod:`kvbench.eval.resume`) and a rerun with the same arguments continues after the last one, giving
the same bytes as an uninterrupted run. ``predictions.jsonl`` is moved into place when every sample is done,
then ``timing.csv``, ``run_info.json`` and, last, ``metrics.json`` are written, each atomically.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from kvbench.eval.methods import FatalRunError
from kvbench.eval.metrics import METRICS, aggregate
from kvbench.eval.registry import get_method
from kvbench.eval.resume import RunLog
from kvbench.models.loader import load_model, resolve_spec
from kvbench.utils.io import read_jsonl, write_json
from kvbench.utils.steps import StepProgress

#: Fields every record must have, and those its ``kind`` adds.
REQUIRED_FIELDS = ("id", "task", "kind", "question", "answer", "max_new_tokens", "metric", "chance")
KIND_FIELDS = {"text": ("context",), "vlm": ("system", "content")}

_VERSIONED = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "pillow", "kvbench")


def validate_records(records: list[dict], path: str | os.PathLike = "") -> None:
    """Check records against the contract in ``docs/architecture.md`` before any model work.

    Raises:
        ValueError: naming the record id (or line number) and the offending field:
            a missing field, unknown ``kind`` or ``metric``, a non-positive
            ``max_new_tokens``, a ``chance`` that is not a number in [0, 1], a duplicate ``id``.
    """
    seen: set[str] = set()
    for i, r in enumerate(records, 1):
        rid = r.get("id", f"<line {i}>")
        where = f"{path}: record {rid!r}"
        for f in REQUIRED_FIELDS:
            if f not in r:
                raise ValueError(f"{where}: missing required field {f!r}")
        if r["kind"] not in KIND_FIELDS:
            raise ValueError(f"{where}: field 'kind' must be one of {sorted(KIND_FIELDS)}, got {r['kind']!r}")
        for f in KIND_FIELDS[r["kind"]]:
            if f not in r:
                raise ValueError(f"{where}: missing required field {f!r} (kind {r['kind']!r})")
        if r["metric"] not in METRICS:
            raise ValueError(f"{where}: field 'metric' must be one of {sorted(METRICS)}, got {r['metric']!r}")
        if not isinstance(r["max_new_tokens"], int) or r["max_new_tokens"] < 1:
            raise ValueError(f"{where}: field 'max_new_tokens' must be a positive int, got {r['max_new_tokens']!r}")
        c = r["chance"]
        if isinstance(c, bool) or not isinstance(c, int | float) or not 0 <= c <= 1:  # NaN fails the range too
            raise ValueError(f"{where}: field 'chance' must be a number in [0, 1] (the record's chance-level "
                             f"score), got {c!r}")
        if rid in seen:
            raise ValueError(f"{where}: duplicate record id {rid!r} (ids must be unique in a split)")
        seen.add(rid)


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in _VERSIONED:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _git_revision() -> dict:
    """HEAD commit of the git work tree holding this package, or ``None`` values.

    ``dirty`` is true when files of the package itself (tracked or untracked)
    differ from that commit.
    """
    here = Path(__file__).resolve().parents[1]  # src/kvbench
    info: dict[str, Any] = {"commit": None, "dirty": None}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(here), *args], capture_output=True, text=True, timeout=10, check=False)

    try:
        head = run("rev-parse", "HEAD")
        if head.returncode == 0:
            info["commit"] = head.stdout.strip()
            status = run("status", "--porcelain", "--", ".")
            info["dirty"] = bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def _sha256(path: Path, limit_bytes: int = 1 << 30) -> str | None:
    """SHA-256 of a file, or ``None`` when it is larger than ``limit_bytes`` (real 7B weights)."""
    if path.stat().st_size > limit_bytes:
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _model_info(spec: str | os.PathLike, model: Any) -> dict:
    path = resolve_spec(spec).resolve()
    weights = sorted(path.glob("*.safetensors"))
    cfg = model.config
    return {
        "spec": str(spec),
        "name": path.name,
        "checkpoint": str(path),
        "architecture": (getattr(cfg, "architectures", None) or [type(model).__name__])[0],
        "config_sha256": _sha256(path / "config.json"),
        "weights": [{"file": w.name, "bytes": w.stat().st_size, "sha256": _sha256(w)} for w in weights],
        "n_params": sum(p.numel() for p in model.parameters()),
        "dtype": str(model.dtype),
        "device": str(model.device),
        "attn_implementation": getattr(cfg, "_attn_implementation", None),
    }


def _file_identity(path: Path) -> str:
    """SHA-256 of a file, or its size and modification time when it is too large to hash on every start."""
    st = path.stat()
    return _sha256(path) or f"{st.st_size} bytes, mtime_ns {st.st_mtime_ns}"


def _run_identity(args: dict, split_path: Path, model_spec: str | os.PathLike) -> dict:
    """What a run's rows depend on: its arguments (``out_dir`` aside), the split and checkpoint contents, the
    code. A resumed run must match it (:class:`~kvbench.eval.resume.RunLog`): Snakemake reruns a job whose
    inputs changed without deleting hidden work files, so rows of the old inputs must be refused, not reused.
    Uncommitted edits of the package are not seen (the git revision is).
    """
    ckpt = resolve_spec(model_spec)
    files = [ckpt / "config.json", *sorted(ckpt.glob("*.safetensors"))]
    return {
        "args": {k: v for k, v in args.items() if k != "out_dir"},
        "split_sha256": _sha256(split_path),
        "checkpoint": {f.name: _file_identity(f) for f in files if f.is_file()},
        "git_commit": _git_revision()["commit"],
        "versions": _versions(),
    }


def _refuse_other_finished_run(out_dir: Path, args: dict) -> None:
    """Refuse to overwrite a finished run (``metrics.json`` present) made with other arguments: a second method
    written into one directory would silently replace the first one's results. Same arguments: a rerun.

    Raises:
        ValueError: naming the directory, the arguments that differ (old -> new) and how to proceed.
    """
    info_path = out_dir / "run_info.json"
    if not (out_dir / "metrics.json").is_file() or not info_path.is_file():
        return
    try:
        old = json.loads(info_path.read_text())["args"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        # a finished run whose arguments cannot be read must not be overwritten on a guess
        raise ValueError(f"{info_path}: unreadable run_info ({type(e).__name__}); delete {out_dir} to replace it") from e
    keys = [k for k in args if k not in ("out_dir", "threads", "device")]
    differ = {k: (old.get(k), args[k]) for k in keys if old.get(k) != args[k]}
    if differ:
        what = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in differ.items())
        raise ValueError(f"{out_dir} holds a finished run made with other arguments ({what}); choose another --out, "
                         "or delete that directory to replace its results")


def record_seed(seed: int, index: int) -> int:
    """Seed of torch's generators before the ``index``-th record (0-based) of a run with ``seed``.

    Greedy decoding draws no random numbers, but a method that does must not depend on how many
    records ran before it in this process, or a resumed run would differ from an uninterrupted one.
    A hash keeps ``(seed, index)`` pairs apart (``seed + index`` would give seed 1's record 0 the
    generator state of seed 0's record 1). Returns an int in [0, 2**63).
    """
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "little") >> 1


def _tasks(records: list[dict]) -> str:
    tasks = sorted({r["task"] for r in records})
    return tasks[0] if len(tasks) == 1 else ",".join(tasks)


def run_eval(
    model_spec: str | os.PathLike,
    split_path: str | os.PathLike,
    method: str = "full",
    out_dir: str | os.PathLike = "results/runs/adhoc",
    seed: int = 0,
    limit: int | None = None,
    threads: int = 1,
    *,
    method_params: dict | None = None,
    device: str | None = None,
) -> dict:
    """Evaluate ``method`` on every record of ``split_path`` and write the run directory.

    Args:
        model_spec: checkpoint directory or zoo name (:func:`kvbench.models.load_model`).
        split_path: JSONL split; relative image paths resolve against its directory.
        method: name in :data:`kvbench.eval.methods.METHODS`.
        out_dir: run directory (created). Holding an unfinished run with the same arguments, the run
            resumes after its last finished record (:mod:`kvbench.eval.resume`).
        seed: ``torch.manual_seed(seed)`` before loading, ``torch.manual_seed(record_seed(seed, i))``
            before record ``i``.
        limit: evaluate only the first ``limit`` records.
        threads: ``torch.set_num_threads``.
        method_params: the method's hyper-parameters (dataclass fields).
        device: torch device; default ``"cuda"`` when available, else ``"cpu"``.

    Returns:
        The ``metrics.json`` dict.

    Raises:
        ValueError: unknown method, invalid records, empty split, or ``out_dir`` holds an unfinished
            run with other arguments or inputs (names what differs and the files to delete), or a finished run
            with other arguments (it is never overwritten silently).
        RuntimeError: every sample failed (the first error is chained).
    """
    t0, started = time.perf_counter(), datetime.now(UTC)
    evaluator = get_method(method, **(method_params or {}))  # fail fast on an unknown method
    split_path, out_dir = Path(split_path), Path(out_dir)
    records = read_jsonl(split_path)
    if limit is not None:
        if int(limit) < 0:
            raise ValueError(f"limit must be >= 0 (records to evaluate), got {limit}")
        records = records[: int(limit)]
    if not records:
        raise ValueError(f"{split_path}: no records to evaluate (limit={limit})")
    validate_records(records, split_path)
    evaluator.check_records(records)

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    args = {"model_spec": str(model_spec), "split_path": str(split_path), "method": method,
            "out_dir": str(out_dir), "seed": seed, "limit": limit, "threads": threads,
            "method_params": method_params or {}, "device": device}
    ids = [r["id"] for r in records]
    _refuse_other_finished_run(out_dir, args)
    log = RunLog(out_dir, _run_identity(args, split_path, model_spec))
    rows = log.resume(ids)  # before loading: arguments that do not match the unfinished run fail at once

    torch.manual_seed(seed)
    torch.set_num_threads(int(threads))
    model, proc = load_model(model_spec, device=device)
    model_info = _model_info(model_spec, model)

    first_exc, n_resumed = None, len(rows)
    progress = StepProgress(f"eval {method} {model_info['name']} {_tasks(records)}", len(records), done=len(rows))
    if rows:
        print(f"[kvbench eval] resuming {out_dir} after {len(rows)} of {len(records)} records", file=sys.stderr)
    for i in range(len(rows), len(records)):
        r = records[i]
        torch.manual_seed(record_seed(seed, i))
        evaluator.start(i)
        ts = time.perf_counter()
        try:
            pred = evaluator.predict(model, proc, r, split_path.parent)
            score, status, err = float(METRICS[r["metric"]](pred, r["answer"])), "ok", None
        except FatalRunError:
            raise
        except Exception as e:  # noqa: BLE001 - one bad sample must not kill the run
            first_exc = first_exc or e
            pred, score, status, err = None, 0.0, "error", f"{type(e).__name__}: {e}"
            print(f"[kvbench eval] sample {r['id']!r} failed:\n{traceback.format_exc()}", file=sys.stderr)
        latency_ms = (time.perf_counter() - ts) * 1e3
        row = {"id": r["id"], "prediction": pred, "gold": r["answer"], "score": score, "chance": r["chance"],
               "metric": r["metric"], "status": status, "error": err}
        if status == "ok" and (audit := evaluator.audit()) is not None:
            row["plan"] = audit  # refresh runs: the executed plan (kvbench.eval.audit)
        log.append(row, latency_ms)
        rows.append(row)
        progress.update(i + 1, errors=sum(x["status"] == "error" for x in rows))
    if all(row["status"] == "error" for row in rows):
        log.discard()  # nothing worth resuming: a rerun after the fix starts over
        raise RuntimeError(f"{split_path}: all {len(rows)} samples failed; first: {rows[0]['error']}") from first_exc

    metrics = {
        **aggregate(rows),
        "task": _tasks(records),
        "method": method,
        "model": model_info["name"],
        "metric": ",".join(sorted({r["metric"] for r in records})),
        "split": str(split_path),
    }
    ended = datetime.now(UTC)
    run_info = {
        "args": args,
        "method": evaluator.config(),
        "decoding": "greedy (do_sample=False, num_beams=1, repetition_penalty=1.0), stop at EOS",
        "model": model_info,
        "split": {"path": str(split_path.resolve()), "sha256": _sha256(split_path), "n_records": len(records)},
        "seed": seed,
        "record_seeds": "torch.manual_seed(record_seed(seed, index)) before each record (kvbench.eval.runner)",
        "threads": int(threads),
        "torch_threads": torch.get_num_threads(),
        "versions": _versions(),
        "git": _git_revision(),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "argv": sys.argv,
        "started_at": started.isoformat(),  # of this invocation: a resumed run started earlier
        "ended_at": ended.isoformat(),
        "wall_s": time.perf_counter() - t0,
        "resumed_after": n_resumed,
    }
    log.finish(ids)
    write_json(out_dir / "run_info.json", run_info)
    write_json(out_dir / "metrics.json", metrics)
    return metrics
