"""Run one evaluation method over one benchmark split and write a run directory.

``run_eval`` is what ``kvbench eval`` calls. A run directory holds
(``docs/architecture.md``):

- ``predictions.jsonl``: one row per sample: ``id``, ``prediction``, ``gold``,
  ``score`` (float in [0, 1]), ``chance``, ``metric``, ``status`` (``"ok"`` or
  ``"error"``), ``error`` (message or ``None``), ``latency_ms`` (wall time of
  ``predict``, ms).
- ``metrics.json``: :func:`kvbench.eval.metrics.aggregate` plus ``task``,
  ``method``, ``model``, ``metric``, ``split``.
- ``run_info.json``: everything needed to reproduce or audit the run (full
  arguments, method hyper-parameters, package versions, git revision, model
  checkpoint path and hashes, attention implementation, dtype, device, seed,
  threads, host, timestamps, wall time).

A sample that raises is recorded with ``status="error"`` and score 0 (a
:class:`~kvbench.eval.methods.FatalRunError`, such as a missing image cache, stops the run instead); the run
fails only when every sample fails. All files are written atomically.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
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
from tqdm.auto import tqdm

from kvbench.eval.methods import FatalRunError, get_method
from kvbench.eval.metrics import METRICS, aggregate
from kvbench.models.loader import load_model, resolve_spec
from kvbench.utils.io import read_jsonl, write_json, write_jsonl

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
        out_dir: run directory (created).
        seed: ``torch.manual_seed`` before loading and evaluating.
        limit: evaluate only the first ``limit`` records.
        threads: ``torch.set_num_threads``.
        method_params: the method's hyper-parameters (dataclass fields).
        device: torch device; default ``"cuda"`` when available, else ``"cpu"``.

    Returns:
        The ``metrics.json`` dict.

    Raises:
        ValueError: unknown method, invalid records, empty split.
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

    torch.manual_seed(seed)
    torch.set_num_threads(int(threads))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, proc = load_model(model_spec, device=device)
    model_info = _model_info(model_spec, model)

    rows, first_exc = [], None
    for r in tqdm(records, desc=f"{method} {model_info['name']} {_tasks(records)}", unit="sample", file=sys.stderr):
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
        rows.append({
            "id": r["id"], "prediction": pred, "gold": r["answer"], "score": score, "chance": r["chance"],
            "metric": r["metric"], "status": status, "error": err,
            "latency_ms": (time.perf_counter() - ts) * 1e3,
        })
        if status == "ok" and (audit := evaluator.audit()) is not None:
            rows[-1]["plan"] = audit  # refresh runs: the executed plan (kvbench.eval.audit)
    if all(row["status"] == "error" for row in rows):
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
        "args": {"model_spec": str(model_spec), "split_path": str(split_path), "method": method,
                 "out_dir": str(out_dir), "seed": seed, "limit": limit, "threads": threads,
                 "method_params": method_params or {}, "device": device},
        "method": evaluator.config(),
        "decoding": "greedy (do_sample=False, num_beams=1, repetition_penalty=1.0), stop at EOS",
        "model": model_info,
        "split": {"path": str(split_path.resolve()), "sha256": _sha256(split_path), "n_records": len(records)},
        "seed": seed,
        "threads": int(threads),
        "torch_threads": torch.get_num_threads(),
        "versions": _versions(),
        "git": _git_revision(),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "argv": sys.argv,
        "started_at": started.isoformat(),
        "ended_at": ended.isoformat(),
        "wall_s": time.perf_counter() - t0,
    }
    write_jsonl(out_dir / "predictions.jsonl", rows)
    write_json(out_dir / "run_info.json", run_info)
    write_json(out_dir / "metrics.json", metrics)
    return metrics
