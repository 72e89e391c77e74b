"""Resumable evaluation: the rows of finished records survive an interrupted ``kvbench eval``.

While a run is in progress its run directory holds hidden work files:

- ``.predictions.jsonl.partial``: one ``predictions.jsonl`` line per finished
  record, in split order, ``fsync``-ed as each record finishes;
- ``.predictions.jsonl.partial.meta.json``: the run's identity (arguments,
  input hashes, code version) the rows were computed under;
- ``.timing.jsonl.partial``: ``{"id", "latency_ms"}`` per finished record.

A rerun with the same identity keeps the complete lines (a line cut short by
the kill is dropped) and continues after the last one; any other identity is
refused, so two runs are never mixed. When every record is done the partial
file is renamed to ``predictions.jsonl`` (same bytes as an uninterrupted run),
``timing.csv`` is written and the work files are removed.
"""
from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

from kvbench.eval.runconfig import differences
from kvbench.utils.io import AppendLog, write_json, write_text

PARTIAL = ".predictions.jsonl.partial"
META = PARTIAL + ".meta.json"
TIMING_PARTIAL = ".timing.jsonl.partial"


class RunLog:
    """The work files of one run directory (module docstring).

    Args:
        out_dir: run directory.
        identity: JSON-serialisable description of everything the rows depend on
            (arguments, input hashes, code version); a resumed run must match it exactly.
    """

    def __init__(self, out_dir: str | os.PathLike, identity: dict) -> None:
        self.out_dir = Path(out_dir)
        self.identity = json.loads(json.dumps(identity, sort_keys=True, default=str))  # as it reads back from disk
        self.rows = AppendLog(self.out_dir / PARTIAL)
        self.timing = AppendLog(self.out_dir / TIMING_PARTIAL)
        self.meta = self.out_dir / META
        self.latency_ms: dict[str, float] = {}

    def resume(self, ids: list[str]) -> list[dict]:
        """Rows already finished for the run's records ``ids`` (in order; [] on a fresh start).

        Raises:
            ValueError: the work files belong to another run (the message names what differs
                and the file to delete), or their rows are not a prefix of ``ids``.
        """
        if not self.rows.path.exists():
            self.discard()  # stale metadata or timings of an earlier run must not leak into this one
            return []
        delete = f"delete {self.rows.path} and {self.meta} to start this run over"
        if not self.meta.is_file():
            raise ValueError(f"{self.rows.path}: unfinished run without its {self.meta.name}, so the arguments its "
                             f"rows were computed with are unknown; {delete}")
        try:
            old = json.loads(self.meta.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{self.meta}: unreadable ({e}); {delete}") from None
        if old != self.identity:
            diff = "; ".join(differences(old, self.identity))
            raise ValueError(f"{self.out_dir} holds an unfinished run with other arguments ({diff}); rerun with "
                             f"the original arguments to resume it, or {delete}")
        done = self.rows.recover()
        got = [r.get("id") for r in done]
        if got != ids[: len(got)]:  # the identity matched, so only a hand-edited file gets here
            raise ValueError(f"{self.rows.path}: its {len(got)} rows are not the first {len(got)} records of "
                             f"the split; {delete}")
        # a kill between the timing line and its row leaves one timing ahead: the record reruns, its new time wins
        self.latency_ms = {t["id"]: t["latency_ms"] for t in self.timing.recover()}
        return done

    def append(self, row: dict, latency_ms: float) -> None:
        """Record one finished record (timing first, so every kept row has its time)."""
        if not self.rows.path.exists():
            write_json(self.meta, self.identity)
        self.timing.append({"id": row["id"], "latency_ms": latency_ms})
        self.latency_ms[row["id"]] = latency_ms
        self.rows.append(row)

    def finish(self, ids: list[str]) -> None:
        """Move the rows into place as ``predictions.jsonl``, write ``timing.csv`` and remove the work files.

        ``timing.csv`` has columns ``id, latency_ms`` (wall time of ``predict`` in ms, measured in the
        invocation that scored the record; empty if that time was lost with a damaged work file).
        """
        self.rows.commit(self.out_dir / "predictions.jsonl")
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["id", "latency_ms"])
        w.writerows([i, self.latency_ms.get(i, "")] for i in ids)
        write_text(self.out_dir / "timing.csv", buf.getvalue())
        self.timing.discard()
        self.meta.unlink(missing_ok=True)

    def discard(self) -> None:
        """Delete every work file (a fresh start, or a run whose every sample failed)."""
        self.rows.discard()
        self.timing.discard()
        self.meta.unlink(missing_ok=True)
