"""Atomic file writes and JSON/JSONL helpers.

Every artefact the pipeline writes goes through these helpers so that an
interrupted job never leaves a half-written file that a later rule would
mistake for a finished one: data is written to a temporary file in the same
directory and moved into place with :func:`os.replace` (atomic on POSIX).
"""
from __future__ import annotations

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


def write_text(path: str | os.PathLike, text: str) -> None:
    """Atomically write ``text`` (UTF-8) to ``path``."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Atomically write ``obj`` as indented, key-sorted JSON."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> int:
    """Atomically write ``rows`` as JSON Lines; returns the number of rows."""
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True, default=str) + "\n")
            n += 1
    return n


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
