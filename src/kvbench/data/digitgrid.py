"""Single-image (K=1) digit-grid QA, the smoke analogue of CONDUIT's Table 2 setting.

One 4x4 grid of real digit scans (112x112 px = 16 Qwen2.5-VL visual tokens),
each cell printed with its letter (no page number),
served under an instruction prefix exactly as in :mod:`kvbench.data.docpages`;
``content = [image]`` and ``question = "Cell {X}"`` (cells lettered A..P row-major).
Answer, metric (exact_match), chance (0.1) and meta fields are those of
docpages with ``K = 1`` and ``page = 1``.
"""
from __future__ import annotations

import random

from kvbench.data.docpages import field_code, grid_record

ROWS = COLS = 4


def sample(rng: random.Random, split: str, n_queries: int | None = None, K: int | None = None,
           instruction: str | None = None) -> dict:
    """One digitgrid record (image as an in-memory ``PIL.Image``).

    Parameters
    ----------
    rng : random.Random — the record's generator.
    split : str — ``"train"`` or ``"test"`` (disjoint scan pools).
    n_queries : int, default 1 for test, 8 for train — questions per record (distinct cells).
    K : int, default 1 — accepted for a uniform VLM signature; only 1 is valid.
    instruction : str, default drawn uniformly.

    Raises:
        ValueError: ``K`` other than 1.
    """
    if K not in (None, 1):
        raise ValueError(f"digitgrid is single-image: K must be 1, got {K}")
    if n_queries is None:
        n_queries = 8 if split == "train" else 1
    return grid_record(
        rng, split, K=1, rows=ROWS, cols=COLS, page_labels=False,
        question_fn=lambda p, r, c: f"Cell {field_code(1, r, c, ROWS, COLS)}",
        n_queries=n_queries, instruction=instruction, family="digitgrid",
    )
