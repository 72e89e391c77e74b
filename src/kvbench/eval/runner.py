"""Run one evaluation method over one benchmark split and write a run directory.

``run_eval`` is what ``kvbench eval`` calls. A run directory holds
(``docs/architecture.md``):

- ``predictions.jsonl``: one row per sample: ``id``, ``prediction``, ``gold``,
  ``score`` (float in [0, 1]), ``chance``, ``metric``, ``status`` (``"ok"`` or
  ``"error"``), ``error`` (message or ``None``) and, for refresh and compression
  methods, ``plan``. A multi-query record (``multi_turns``, :mod:`kvbench.eval.multiquery`) has lists of
  predictions and golds, per-query ``scores`` and their mean as ``score``. No wall-clock value: two runs give
  the same bytes.
- ``metrics.json``: :func:`kvbench.eval.metrics.aggregate` plus ``task``,
  ``method``, ``model``, ``metric``, ``split`` (no wall-clock value either).
- ``timing.csv``: ``id, latency_ms`` (wall time of ``predict``, ms), one line per
  sample, also for samples scored before a resume (each timed in the invocation
  that scored it); the only per-sample figure that differs between two runs.
- ``config.yaml``: the full resolved configuration (:mod:`kvbench.eval.runconfig`): the arguments, the model
  checkpoint (class, dtype, file hashes), the split (hash), the method's resolved hyper-parameters, the
  protocol, method input files (a codec, hashed), package versions and git revision. No clock or host either:
  ``kvbench eval --from DIR`` repeats the run from it alone (:func:`rerun`).
- ``run_info.json``: the circumstances of the invocation that finished the run (host, platform, command
  line, timestamps, wall time, records resumed, torch's thread count); it differs between runs by design.

A sample that raises is recorded with ``status="error"`` and score 0 (a
:class:`~kvbench.eval.methods.FatalRunError`, such as a missing image cache, stops the run instead); the run
fails only when every sample fails. An interrupted run resumes: finished rows are kept in hidden work
files (:mod:`kvbench.eval.resume`) and a rerun with the same arguments continues after the last one, giving
the same bytes as an uninterrupted run. ``predictions.jsonl`` is moved into place when every sample is done,
then ``timing.csv``, ``config.yaml``, ``run_info.json`` and, last, ``metrics.json`` are written, each atomically.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import sys
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

import torch

from kvbench.data.scbench import TURNS
from kvbench.eval.methods import FatalRunError
from kvbench.eval.metrics import METRICS, aggregate
from kvbench.eval.multiquery import check_turns, is_multi, record_score, score_turns
from kvbench.eval.registry import get_method
from kvbench.eval.resume import RunLog
from kvbench.eval.runconfig import (
    CONFIG_FILE,
    RunArgs,
    check_inputs,
    checkpoint_files,
    describe,
    differences,
    git_revision,
    model_section,
    plain,
    read_config,
    sha256,
    versions,
    write_config,
)
from kvbench.models.loader import load_model, resolve_spec
from kvbench.utils.io import read_jsonl, write_json
from kvbench.utils.steps import StepProgress

#: Fields every record must have, and those its ``kind`` adds.
REQUIRED_FIELDS = ("id", "task", "kind", "question", "answer", "max_new_tokens", "metric", "chance")
KIND_FIELDS = {"text": ("context",), "vlm": ("system", "content")}
#: How each record's generators are seeded (``config.yaml``'s protocol).
RECORD_SEEDS = "torch.manual_seed(record_seed(seed, index)) before each record (kvbench.eval.runner)"


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
        multi = is_multi(r)  # queries in multi_turns instead of question/answer (kvbench.eval.multiquery)
        for f in REQUIRED_FIELDS:
            if f not in r and not (multi and f in ("question", "answer")):
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
        if multi:
            check_turns(r, where, METRICS)
        if rid in seen:
            raise ValueError(f"{where}: duplicate record id {rid!r} (ids must be unique in a split)")
        seen.add(rid)


def _file_identity(path: Path) -> str:
    """SHA-256 of a file, or its size and modification time when it is too large to hash on every start."""
    st = path.stat()
    return sha256(path) or f"{st.st_size} bytes, mtime_ns {st.st_mtime_ns}"


def _run_identity(run: RunArgs) -> dict:
    """What a run's rows depend on: its arguments, the split and checkpoint contents, the code. A resumed run
    must match it (:class:`~kvbench.eval.resume.RunLog`): Snakemake reruns a job whose inputs changed without
    deleting hidden work files, so rows of the old inputs must be refused, not reused. Uncommitted edits of
    the package are not seen (the git revision is).
    """
    files = checkpoint_files(resolve_spec(run.model))  # the files config.yaml records, tokenizer included
    return {
        "args": run.as_dict(),
        "split_sha256": sha256(run.split),
        "checkpoint": {f.name: _file_identity(f) for f in files if f.is_file()},
        "git_commit": git_revision()["commit"],
        "versions": versions(),
    }


def _recorded_run(out_dir: Path) -> dict | None:
    """The ``run`` section of the finished run in ``out_dir`` (for a run made before ``config.yaml`` existed,
    its arguments as ``run_info.json`` held them; None when neither file is there).

    Raises:
        ValueError: neither file readable: a finished run whose arguments are unknown must not be overwritten
            on a guess.
    """
    delete = f"delete {out_dir} to replace it"
    if (out_dir / CONFIG_FILE).is_file():
        try:
            return read_config(out_dir)["run"]
        except ValueError as e:
            raise ValueError(f"{e}; {delete}") from None
    info_path = out_dir / "run_info.json"
    if not info_path.is_file():
        return None
    try:
        old = json.loads(info_path.read_text())["args"]
        return {"model": old["model_spec"], "split": old["split_path"],
                **{k: old[k] for k in ("method", "method_params", "seed", "limit", "threads", "device")}}
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{out_dir}: a finished run without a readable {CONFIG_FILE} or run_info.json "
                         f"({type(e).__name__}); {delete}") from e


def _refuse_other_finished_run(out_dir: Path, run: RunArgs) -> None:
    """Refuse to overwrite a finished run (``metrics.json`` present) made with other arguments: a second method
    written into one directory would silently replace the first one's results. Same arguments (threads and
    device aside, which the rows do not depend on): a rerun.

    Raises:
        ValueError: naming the directory, the arguments that differ (old -> new) and how to proceed.
    """
    old, new = (_recorded_run(out_dir) if (out_dir / "metrics.json").is_file() else None), run.as_dict()
    if old is None:
        return
    differ = {k: (old.get(k), new[k]) for k in new if k not in ("threads", "device") and old.get(k) != new[k]}
    if differ:
        what = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in differ.items())
        raise ValueError(f"{out_dir} holds a finished run made with other arguments ({what}); choose another --out, "
                         "or delete that directory to replace its results")


def _check_as_recorded(expected: dict, section: str, now: dict, skip: tuple[str, ...] = ()) -> None:
    """Refuse a repeat (``--from``) whose ``section`` resolves otherwise than ``expected`` recorded it.

    Raises:
        ValueError: naming the section, each differing key (recorded -> now) and the git commits.
    """
    diff = differences({k: v for k, v in expected[section].items() if k not in skip},
                       {k: v for k, v in plain(now).items() if k not in skip})
    if diff:
        commit = (expected["git"].get("commit"), git_revision()["commit"])
        raise ValueError(f"the run's {section} resolves otherwise than its {CONFIG_FILE} recorded "
                         f"({'; '.join(diff)}), so this would not repeat it (git commit recorded {commit[0]}, "
                         f"now {commit[1]}: check out the recorded one)")


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
    expected: dict | None = None,
) -> dict:
    """Evaluate ``method`` on every record of ``split_path`` and write the run directory.

    Args:
        model_spec: checkpoint directory or zoo name (:func:`kvbench.models.load_model`).
        split_path: JSONL split; relative image paths resolve against its directory.
        method: method spec (:func:`kvbench.eval.registry.get_method`).
        out_dir: run directory (created). Holding an unfinished run with the same arguments, the run
            resumes after its last finished record (:mod:`kvbench.eval.resume`).
        seed: ``torch.manual_seed(seed)`` before loading, ``torch.manual_seed(record_seed(seed, i))``
            before record ``i``.
        limit: evaluate only the first ``limit`` records.
        threads: ``torch.set_num_threads``.
        method_params: the method's hyper-parameters (dataclass fields).
        device: torch device; default ``"cuda"`` when available, else ``"cpu"``.
        expected: a validated ``config.yaml`` mapping this run repeats (:func:`rerun`): the method, protocol
            and model must resolve as it recorded them (checked before the first record).

    Returns:
        The ``metrics.json`` dict.

    Raises:
        ValueError: unknown method, invalid records, empty split, or ``out_dir`` holds an unfinished
            run with other arguments or inputs (names what differs and the files to delete), or a finished run
            with other arguments (it is never overwritten silently); with ``expected``, a method, protocol or
            model that resolves otherwise than recorded.
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
    multi = next((r for r in records if is_multi(r)), None)
    if multi is not None and not evaluator.multi_query:
        raise ValueError(f"{split_path}: record {multi['id']!r} holds several queries ({TURNS}), and method {method!r} "
                         "answers one query per record; run a compression press (its shared-context protocol "
                         "answers each query from the compressed context: kvbench.compress.multiquery)")
    evaluator.check_records(records)
    method_cfg = evaluator.config()
    protocol = {**evaluator.protocol(), "record_seeds": RECORD_SEEDS}
    if expected is not None:
        _check_as_recorded(expected, "method", method_cfg)
        _check_as_recorded(expected, "protocol", protocol)

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    run = RunArgs(model=str(model_spec), split=str(split_path), method=method, method_params=method_params or {},
                  seed=seed, limit=None if limit is None else int(limit), threads=int(threads), device=device)
    ids = [r["id"] for r in records]
    _refuse_other_finished_run(out_dir, run)
    log = RunLog(out_dir, _run_identity(run))
    rows = log.resume(ids)  # before loading: arguments that do not match the unfinished run fail at once

    torch.manual_seed(seed)
    torch.set_num_threads(int(threads))
    model, proc = load_model(model_spec, device=device)
    model_info = model_section(model_spec, resolve_spec(model_spec), model)
    if expected is not None:  # the checkpoint's files matched (check_inputs); its class and dtype must too
        _check_as_recorded(expected, "model", model_info, skip=("checkpoint", "device"))
    model_name = Path(model_info["checkpoint"]).name

    first_exc, n_resumed = None, len(rows)
    progress = StepProgress(f"eval {method} {model_name} {_tasks(records)}", len(records), done=len(rows))
    if rows:
        print(f"[kvbench eval] resuming {out_dir} after {len(rows)} of {len(records)} records", file=sys.stderr)
    for i in range(len(rows), len(records)):
        r = records[i]
        torch.manual_seed(record_seed(seed, i))
        evaluator.start(i)
        ts = time.perf_counter()
        try:
            pred = evaluator.predict(model, proc, r, split_path.parent)
            if is_multi(r):  # one prediction per query; the record's score: each metric's mean, averaged
                scores = score_turns(r, pred, METRICS)
                score, status, err = record_score(r, scores), "ok", None
            else:
                score, status, err = float(METRICS[r["metric"]](pred, r["answer"])), "ok", None
        except FatalRunError:
            raise
        except Exception as e:  # noqa: BLE001 - one bad sample must not kill the run
            first_exc = first_exc or e
            pred, score, status, err = None, 0.0, "error", f"{type(e).__name__}: {e}"
            print(f"[kvbench eval] sample {r['id']!r} failed:\n{traceback.format_exc()}", file=sys.stderr)
        latency_ms = (time.perf_counter() - ts) * 1e3
        gold = [t["answer"] for t in r[TURNS]] if is_multi(r) else r["answer"]
        row = {"id": r["id"], "prediction": pred, "gold": gold, "score": score, "chance": r["chance"],
               "metric": r["metric"], "status": status, "error": err}
        if is_multi(r):
            row["scores"] = scores if status == "ok" else None
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
        "model": model_name,
        "metric": ",".join(sorted({r["metric"] for r in records})),
        "split": str(split_path),
    }
    config = describe(run, split_path=split_path, n_records=len(records), method=method_cfg, protocol=protocol,
                      input_files=evaluator.input_files(), model=model_info)
    if expected is not None:  # other software may still give the same bytes: said, not refused
        diff = differences({k: expected[k] for k in ("versions", "git")}, {k: config[k] for k in ("versions", "git")})
        if diff:
            print(f"[kvbench eval] note: software differs from the repeated run's ({'; '.join(diff)})", file=sys.stderr)
    ended = datetime.now(UTC)
    run_info = {
        "config": CONFIG_FILE,  # everything the results depend on; this file: the circumstances of this invocation
        "torch_threads": torch.get_num_threads(),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "argv": sys.argv,
        "started_at": started.isoformat(),  # of this invocation: a resumed run started earlier
        "ended_at": ended.isoformat(),
        "wall_s": time.perf_counter() - t0,
        "resumed_after": n_resumed,
    }
    log.finish(ids)
    write_config(out_dir, config)
    write_json(out_dir / "run_info.json", run_info)
    write_json(out_dir / "metrics.json", metrics)
    return metrics


def rerun(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None, threads: int | None = None) -> dict:
    """Repeat the run recorded in ``run_dir/config.yaml`` (``kvbench eval --from``) from that file alone.

    Before any model work the files it names are checked (:func:`kvbench.eval.runconfig.check_inputs`: the
    split, the checkpoint's config and weights, method inputs such as a codec, each by SHA-256); then
    :func:`run_eval` runs with the recorded arguments and refuses a method, protocol or model that resolves
    otherwise than recorded. Other package versions or another git commit are reported, not refused.

    Args:
        run_dir: a finished run directory (its ``config.yaml``).
        out_dir: where the repeat is written (default ``run_dir``: only for an unfinished run, which resumes; a
            finished run is refused in place, since the repeat would replace the results it is compared with).
        threads: ``torch.set_num_threads`` (default: the recorded count; more threads may change float
            rounding, so the repeat is byte-identical only at the recorded count).

    Returns:
        The ``metrics.json`` dict of the repeat.

    Raises:
        FileNotFoundError: no ``config.yaml``, or a file it names is gone.
        ValueError: a finished ``run_dir`` repeated in place, a bad ``config.yaml`` (unknown, missing or mistyped
            key), a file whose hash differs, the recorded device unavailable, or as :func:`run_eval`.
    """
    config = read_config(run_dir)
    run = config["run"]
    if out_dir is None and (Path(run_dir) / "metrics.json").is_file():
        # in place, a repeat would replace the recorded results before anything could compare them
        raise ValueError(f"{run_dir} is a finished run: repeat it into another directory with --out NEW (the "
                         "exit status then says whether predictions.jsonl and metrics.json are byte-identical); "
                         "in place, --from only resumes an unfinished run")
    if run["device"].startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"{Path(run_dir) / CONFIG_FILE}: the run used device {run['device']!r}, and this machine "
                         "has no CUDA device")
    check_inputs(config)
    return run_eval(run["model"], run["split"], method=run["method"], out_dir=Path(run_dir if out_dir is None else out_dir),
                    seed=run["seed"], limit=run["limit"], threads=run["threads"] if threads is None else threads,
                    method_params=run["method_params"], device=run["device"], expected=config)
