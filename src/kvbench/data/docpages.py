"""Multi-image document QA over pages of handwritten digits (CONDUIT's multi-image setting).

A request shows K pages (K uniform in 2..6 unless given), each a 2x2 grid of
real digit scans (56x56 px = 4 Qwen2.5-VL visual tokens, see
:mod:`kvbench.data.digits`) laid out like a form: each cell carries a printed
page number and field code (``"3J"``) above the handwriting, and the field
codes run on across the document (A-D on page 1, E-H on page 2, ...). The
printed codes make the lookup content-based, as on a real form, rather than
counting visual-token positions, which a model trained for minutes on a CPU
does not learn (docs/decisions/zoo.md, "Printed field codes"). Pages are preceded
by a serving prefix that contains a reading instruction
(:mod:`kvbench.data.instructions`). The question names one cell; the answer
is the instruction applied to that cell's digit, so a model must read the
page *under the instruction*, which is what stale per-image KV reuse (pages
cached under ``generic_system``) can get wrong.

Record (kind ``"vlm"``, see docs/architecture.md)::

    content  = [{"type": "text", "text": "Page 1:"}, {"type": "image", "image": <PIL.Image>}, ...]
    question = "Page {p}, cell {X}"    (X = field code, row-major across pages; the answer follows directly)
    answer   = str(instruction_fn(digit))          (one digit, max_new_tokens 1)
    metric   = "exact_match", chance = 0.1
    meta     = {K, page, row, col, digit, instruction, digit_indices, [extra_queries]}
"""
from __future__ import annotations

import random
from collections.abc import Callable

from kvbench.data import digits, instructions

ROWS = COLS = 2
K_RANGE = (2, 6)
#: Field codes, one letter each, running on across pages: page 1 holds A-D, page 2 E-H, ...
FIELD_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWX"


def field_code(page: int, row: int, col: int, rows: int, cols: int) -> str:
    """Letter of 1-based cell (row, col) of page ``page``, numbered row-major across the document.

    One letter names one cell of the whole document (on 2x2 pages: A-D on
    page 1, E-H on page 2, ...; on a single 4x4 page: A-P). One question
    token per cell is what the staleness trial (docs/log.md, "2026-11
    Staleness trial") could learn; and with a code that is unique in the document the
    answer is a one-hop lookup. With per-page letters (each page A-I) a model
    trained for minutes on the CPU found the right cell but not the right
    page (docs/decisions/zoo.md, "Printed field codes").

    Raises:
        ValueError: a cell beyond the 24 available codes.
    """
    i = (page - 1) * rows * cols + (row - 1) * cols + (col - 1)
    if not 0 <= i < len(FIELD_LETTERS):
        raise ValueError(f"no field code for page {page}, cell ({row}, {col}) of {rows}x{cols} pages: "
                         f"only {len(FIELD_LETTERS)} codes")
    return FIELD_LETTERS[i]


def grid_record(
    rng: random.Random,
    split: str,
    *,
    K: int,
    rows: int,
    cols: int,
    page_labels: bool,
    question_fn: Callable[[int, int, int], str],
    n_queries: int,
    instruction: str | None,
    family: str,
) -> dict:
    """One VLM record over ``K`` pages of ``rows x cols`` digit cells (shared by docpages and digitgrid).

    Args:
        rng: the record's random generator (all draws come from it).
        split: ``"train"`` or ``"test"``: which scan pool the digits come from.
        K: number of pages (>= 1).
        rows, cols: grid shape of each page.
        page_labels: put a ``"Page k:"`` text part before each page and print
            the page number in each cell's label (else only the cell letter).
        question_fn: ``(page, row, col) -> question`` (1-based).
        n_queries: questions about distinct cells; the first is the record's
            ``question``/``answer``, the rest go to ``meta["extra_queries"]``.
        instruction: fix the instruction by name, or ``None`` to draw one.
        family: generator name used in ``task`` and ``id``.

    Raises:
        ValueError: bad ``K``, ``n_queries`` or ``split``.
    """
    if K < 1:
        raise ValueError(f"K must be >= 1, got {K}")
    n_cells = K * rows * cols
    if not 1 <= n_queries <= n_cells:
        raise ValueError(f"n_queries must be in 1..{n_cells} (distinct cells), got {n_queries}")
    scan_pool = digits.pool(split)
    labels = digits.labels()
    name, system = instructions.sample_system(rng, instruction)
    pages = [[rng.choice(scan_pool) for _ in range(rows * cols)] for _ in range(K)]
    content: list[dict] = []
    for k, idx in enumerate(pages, 1):
        if page_labels:
            content.append({"type": "text", "text": f"Page {k}:"})
        printed = [f"{k if page_labels else ' '}{field_code(k, r + 1, c + 1, rows, cols)}"
                   for r in range(rows) for c in range(cols)]
        content.append({"type": "image", "image": digits.render_page(idx, rows, cols, labels=printed)})
    cells = rng.sample(range(n_cells), n_queries)
    queries = []
    for cell in cells:
        p, rc = divmod(cell, rows * cols)
        r, c = divmod(rc, cols)
        digit = int(labels[pages[p][rc]])
        queries.append(dict(page=p + 1, row=r + 1, col=c + 1, digit=digit,
                            question=question_fn(p + 1, r + 1, c + 1),
                            answer=str(instructions.apply(name, digit))))
    q0 = queries[0]
    meta = {"K": K, "page": q0["page"], "row": q0["row"], "col": q0["col"], "digit": q0["digit"],
            "instruction": name, "digit_indices": pages}
    if split == "train" or n_queries > 1:
        meta["extra_queries"] = [{"question": q["question"], "answer": q["answer"]} for q in queries[1:]]
    return {
        "id": f"{family}-{split}-{rng.getrandbits(48):012x}",
        "task": family,
        "split": split,
        "kind": "vlm",
        "system": system,
        "generic_system": instructions.GENERIC_SYSTEM,
        "content": content,
        "question": q0["question"],
        "answer": q0["answer"],
        "max_new_tokens": 1,
        "metric": "exact_match",
        "chance": 0.1,
        "meta": meta,
    }


def sample(rng: random.Random, split: str, n_queries: int | None = None, K: int | None = None,
           instruction: str | None = None) -> dict:
    """One docpages record (images as in-memory ``PIL.Image``).

    Parameters
    ----------
    rng : random.Random — the record's generator.
    split : str — ``"train"`` or ``"test"`` (disjoint scan pools).
    n_queries : int, default 1 for test, 8 for train — questions per record (distinct cells).
    K : int, default uniform in 2..6 — number of 56x56 pages.
    instruction : str, default drawn uniformly — one of :data:`instructions.INSTRUCTIONS`.
    """
    if K is None:
        K = rng.randint(*K_RANGE)
    if n_queries is None:
        n_queries = 8 if split == "train" else 1
    return grid_record(
        rng, split, K=K, rows=ROWS, cols=COLS, page_labels=True,
        question_fn=lambda p, r, c: f"Page {p}, cell {field_code(p, r, c, ROWS, COLS)}",
        n_queries=n_queries, instruction=instruction, family="docpages",
    )
