"""Atomic file writes and JSON/JSONL helpers.

Every artefact the pipeline writes goes through these helpers so that an
interrupted job never leaves a half-written file that a later rule would
mistake for a finished one: data is written to a temporary file in the same
directory and moved into place with :func:`os.replace` (atomic on POSIX).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; move it onto ``path`` on success.

    On an exception the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        # mkstemp creates 0600 files; give the result the mode a plain open() would (umask).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp_path, 0o666 & ~umask)
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks (provenance of imported weights)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_text(path: str | os.PathLike, text: str) -> None:
    """Atomically write ``text`` (UTF-8) to ``path``."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Atomically write ``obj`` as indented, key-sorted JSON."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def jsonl_line(row: dict) -> str:
    """``row`` as one JSON Lines line (key-sorted, ``\\n``-terminated): the bytes every JSONL writer here uses."""
    return json.dumps(row, sort_keys=True, default=str) + "\n"


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> int:
    """Atomically write ``rows`` as JSON Lines; returns the number of rows."""
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(jsonl_line(row))
            n += 1
    return n


class AppendLog:
    """An append-only JSON Lines file whose finished lines survive a crash (resumable work).

    :meth:`append` writes one :func:`jsonl_line` and ``fsync``s it, so after a
    kill the file holds every appended row plus at most one torn last line (no
    ``\\n``), which :meth:`recover` cuts off. The bytes equal
    :func:`write_jsonl`'s for the same rows, so :meth:`commit` can move the file
    into place as the finished artefact.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._f = None

    def recover(self) -> list[dict]:
        """Rows of the complete lines on disk ([] if there is no file); a torn last line is truncated away.

        Raises:
            ValueError: a complete line that is not a UTF-8 JSON object: the file was damaged
                (not merely cut short); the message names file and line.
        """
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        keep = data.rfind(b"\n") + 1  # bytes after the last newline are a write cut short by the kill
        rows = []
        for i, line in enumerate(data[:keep].split(b"\n")[:-1], 1):
            try:
                row = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                row = None
            if not isinstance(row, dict):  # bad file content: a ValueError, not a caller's TypeError
                raise ValueError(f"{self.path}:{i}: damaged line in the middle of an append-only log "  # noqa: TRY004
                                 f"(only the last line can be cut short); delete {self.path} to start over")
            rows.append(row)
        if keep < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(keep)
                os.fsync(f.fileno())
        return rows

    def append(self, row: dict) -> None:
        """Append ``row`` and flush it to disk before returning (creates the file and its directory)."""
        if self._f is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "ab")  # noqa: SIM115 - held open across appends, closed by close()
        self._f.write(jsonl_line(row).encode("utf-8"))
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def commit(self, dest: str | os.PathLike) -> None:
        """Close the log and atomically rename it to ``dest`` (same directory: :func:`os.replace`)."""
        self.close()
        os.replace(self.path, dest)

    def discard(self) -> None:
        """Close the log and delete its file (if any)."""
        self.close()
        self.path.unlink(missing_ok=True)


_JSON_TYPES = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number",
               type(None): "null"}


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JSON Lines file of objects (one ``dict`` per non-blank line).

    Lines are decoded one at a time (split on ``\\n`` only), so a bad byte is
    reported with its line rather than as a bare ``UnicodeDecodeError``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: naming file and line: a line that is not UTF-8 (with its byte
            offset in the file), not valid JSON, or valid JSON but not an object.
    """
    rows, offset = [], 0
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{i}: not UTF-8 text (byte {offset + e.start} of the file is "
                                 f"{raw[e.start:e.start + 1]!r}); splits must be UTF-8 JSON Lines") from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from e
            if not isinstance(row, dict):  # bad file content: a ValueError, not a caller's TypeError
                raise ValueError(f"{path}:{i}: expected a JSON object ({{...}}) per line, got "  # noqa: TRY004
                                 f"{_JSON_TYPES.get(type(row), type(row).__name__)}: {line.strip()[:60]}")
            rows.append(row)
    return rows


def write_csv(df: Any, header: list[str], out: str) -> None:
    """Write DataFrame ``df`` to ``out`` atomically under ``#`` header lines (read back with
    ``pd.read_csv(path, comment="#")``): the one writer of the CONDUIT tables' CSVs."""
    with atomic_path(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(header) + "\n")
        df.to_csv(f, index=False)
