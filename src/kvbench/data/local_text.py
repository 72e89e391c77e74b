"""A plain-text training corpus from local files, read with 🤗 ``datasets`` (no hub access).

The ResidualKV paper trains its codecs on FineWeb-Edu packed to 8,192-token sequences (§V-A; the authors'
``train_compressor.py`` reads a tokenised ``load_from_disk`` copy). Any local corpus in that layout works here:
JSONL / JSON / parquet files whose rows carry the document text in one column (FineWeb-Edu's is ``text``), or
plain ``.txt`` files (one document per line). The files are memory-mapped by ``datasets``, so a corpus of
hundreds of millions of tokens is not held in Python strings. Where ``datasets`` is not installed (the bare GPU
machine of ``scripts/gpu_paper.sh``), the same rows are read with the standard library (JSON / JSON lines, text
lines) or pyarrow (parquet) into memory: :func:`read_rows`; fine for a small corpus, not for FineWeb-Edu.

Documents are split into a training and a validation pool by a stable hash of the document's position, so
the split does not depend on how many documents are read or on the order files are listed in (files are
sorted first).
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: File suffix -> ``datasets`` packaged builder.
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
#: Share of documents held out for the validation windows (by hash of the document index).
VAL_SHARE = 0.01


class Documents(Sequence):
    """Texts of one pool of a local corpus: ``docs[i]`` is a ``str`` (``len(docs)`` documents)."""

    def __init__(self, table: Any, column: str, index: list[int]) -> None:
        self.table, self.column, self.index = table, column, index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        return self.table[self.index[i]][self.column]


def _pool_of(i: int) -> str:
    h = int(hashlib.sha1(str(i).encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "test" if h < VAL_SHARE else "train"


def corpus_builder(files: Sequence[str | os.PathLike]) -> str:
    """The ``datasets`` builder of a corpus file list, from the names alone (the workflow calls it while the DAG is
    built, before the files need exist).

    Raises:
        ValueError: no files, a directory (its files must be listed), or not one shared suffix of :data:`BUILDERS`.
    """
    paths = [Path(f) for f in files]
    if not paths:
        raise ValueError("no corpus files given (expected .jsonl, .json, .parquet or .txt files)")
    dirs = [str(p) for p in paths if p.is_dir()]
    if dirs:
        raise ValueError(f"corpus files {dirs} are directories: list their files (e.g. every .parquet file)")
    suffixes = {p.suffix for p in paths}
    if len(suffixes) != 1 or next(iter(suffixes)) not in BUILDERS:
        raise ValueError(f"corpus files must share one suffix of {sorted(BUILDERS)}, got {sorted(suffixes)}")
    return BUILDERS[next(iter(suffixes))]


def local_documents(files: Sequence[str | os.PathLike], split: str, text_field: str = "text") -> Documents:
    """The ``split`` pool (``"train"`` or ``"test"``) of the documents in ``files``.

    Args:
        files: corpus files (``.jsonl``, ``.json``, ``.parquet`` or ``.txt``, one suffix for all), sorted
            before reading.
        split: ``"train"``: documents whose index hashes outside :data:`VAL_SHARE`; ``"test"``: the others
            (at least one document: the first, when the hash leaves the pool empty; it then also stays in
            ``"train"``, which only happens for corpora of under ~100 documents).
        text_field: column holding the text (ignored for ``.txt``: ``datasets``' ``text`` builder).

    Raises:
        ValueError: no files, unknown ``split``, mixed or unknown suffixes, a missing file, a file ``datasets``
            cannot parse, no ``text_field`` column (naming the columns found), or no documents.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    paths = sorted({Path(f) for f in files})  # a file listed twice is read once
    builder = corpus_builder(paths)
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ValueError(f"corpus files not found: {missing}")
    shown = [str(p) for p in paths][:3]
    if all(p.stat().st_size == 0 for p in paths):
        raise ValueError(f"corpus files {shown} hold no documents (empty files)")
    try:
        try:
            import datasets
        except ImportError:
            table: Any = read_rows(paths, builder)
            columns = list(dict.fromkeys(k for row in table for k in row))
        else:
            table = datasets.load_dataset(builder, data_files=[str(p) for p in paths], split="train")
            columns = table.column_names
    except Exception as e:  # datasets raises many types for a malformed file (JSON, arrow, parquet errors)
        raise ValueError(f"corpus files {shown} could not be read as {builder} "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
    column = "text" if builder == "text" else text_field
    if column not in columns:
        raise ValueError(f"corpus files {shown} have no column {column!r} "
                         f"(columns: {columns}); pass the text column's name")
    if len(table) == 0:
        raise ValueError(f"corpus files {shown} hold no documents")
    index = [i for i in range(len(table)) if _pool_of(i) == split]
    if not index:
        index = [0]
    return Documents(table, column, index)


def read_rows(paths: Sequence[Path], builder: str) -> list[dict]:
    """The rows ``datasets.load_dataset(builder, data_files=paths)`` gives, read without ``datasets``, in memory.

    ``json``: a file holding one JSON array of objects, else JSON lines (blank lines skipped); ``text``: one row
    ``{"text": line}`` per line, empty lines included, line breaks dropped (as ``datasets``' text builder);
    ``parquet``: pyarrow's rows. One difference: a JSON row lacking the text column is None under ``datasets``
    and a KeyError here, when :class:`Documents` reads it.

    Raises:
        ValueError: unknown ``builder``; json.JSONDecodeError: a malformed line; ImportError: parquet without pyarrow.
    """
    rows: list[dict] = []
    for path in paths:
        if builder == "json":
            text = path.read_text(encoding="utf-8")
            if text.lstrip().startswith("["):
                rows.extend(json.loads(text))
            else:
                rows.extend(json.loads(line) for line in text.splitlines() if line.strip())
        elif builder == "text":
            rows.extend({"text": line} for line in path.read_text(encoding="utf-8").splitlines())
        elif builder == "parquet":
            import pyarrow.parquet as pq

            rows.extend(pq.read_table(path).to_pylist())
        else:
            raise ValueError(f"unknown builder {builder!r}; expected one of {sorted(set(BUILDERS.values()))}")
    return rows
