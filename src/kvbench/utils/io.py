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


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JSON Lines file.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a line is not valid JSON (the message names file and line).
    """
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from e
    return rows
