"""Real text bundled with Python: the standard library's own source files.

Used as (a) the tokenizer's training corpus, (b) the language-modelling /
next-line code-completion split (LongBench LCC-style) and (c) the prose
"haystack" filler of the needle task (docstrings and comments).

Files are split into disjoint train / test pools by a stable hash of their
path relative to the stdlib root, so a test file is never seen in training.
"""
from __future__ import annotations

import hashlib
import sysconfig
from functools import cache
from pathlib import Path

#: Share of stdlib files assigned to the test pool (by path hash).
TEST_SHARE = 0.2
#: Sub-trees left out: tests hold generated/binary-like data, site-packages is not stdlib.
_EXCLUDE = ("test/", "tests/", "site-packages/", "idlelib/", "lib2to3/tests/", "__pycache__/")


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library source."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(rel_path: str) -> str:
    """``"test"`` or ``"train"`` for a stdlib-relative path, by SHA-1 of the path."""
    h = int(hashlib.sha1(rel_path.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "test" if h < TEST_SHARE else "train"


@cache
def stdlib_files(split: str | None = None, max_bytes: int = 400_000) -> tuple[tuple[str, str], ...]:
    """Sorted ``(relative_path, text)`` pairs of stdlib ``.py`` files.

    Args:
        split: ``"train"``, ``"test"`` or ``None`` for both.
        max_bytes: skip files larger than this (a few generated tables).

    Raises:
        ValueError: unknown ``split``.
        FileNotFoundError: the stdlib source is not installed.
    """
    if split not in (None, "train", "test"):
        raise ValueError(f"split must be 'train', 'test' or None, got {split!r}")
    root = stdlib_root()
    if not (root / "os.py").exists():
        raise FileNotFoundError(f"Python standard library source not found under {root}")
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if any(rel.startswith(e) or f"/{e}" in rel for e in _EXCLUDE):
            continue
        if split is not None and split_of(rel) != split:
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if 0 < len(text) <= max_bytes:
            out.append((rel, text))
    return tuple(out)


def prose_lines(split: str) -> list[str]:
    """English prose lines (comments and docstring lines) from the stdlib split.

    A line qualifies when it is mostly letters and spaces, at least 6 words,
    after stripping comment markers; code lines are dropped.
    """
    lines = []
    for _, text in stdlib_files(split):
        for raw in text.splitlines():
            s = raw.strip().lstrip("#").strip().strip('"').strip()
            if len(s.split()) < 6 or len(s) > 200:
                continue
            letters = sum(c.isalpha() or c == " " for c in s)
            if letters / len(s) > 0.9 and s[0].isalpha():
                lines.append(s)
    return lines
