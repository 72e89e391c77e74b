"""Benchmark requests: smoke ``docpages`` records with their pages scaled up to set the context length.

A docpages page is 84x84 px (9 visual tokens). For latency the pages are
resized (nearest neighbour) to ``page_px`` x ``page_px``: ``(page_px / 28)²``
visual tokens per page, at most 256 with the zoo processor (``max_pixels``).
With 448 px (256 tokens per page), 4 / 8 / 16 pages give 1,091 / 2,140 / 4,262
tokens, 94-96% of them visual, as in CONDUIT's document setting. The serving prefix, page labels and
question are the record's own.

A docpages record has at most 6 pages (24 printed field codes). Longer
requests (the paper's 4k/8k/16k contexts: 16/32/64 pages of 256 tokens) keep
that record's first 6 pages and question and append further distinct pages of
test-split scans, each cell labelled with the page number's last two digits
(``07``, ``16``; a label has two characters): the question cannot
name a cell on them, which does not matter for what the benchmark measures
(FLOPs and TTFT depend on the token counts, not on the page content).
"""
from __future__ import annotations

import random

from PIL import Image

from kvbench.data import digits, docpages
from kvbench.data.digits import CELL_PX

#: Largest page side the zoo processor keeps unchanged (``max_pixels`` = 256 visual tokens).
MAX_PAGE_PX = 16 * CELL_PX


def visual_tokens_per_page(page_px: int) -> int:
    """Visual tokens of one ``page_px`` page (one per 28x28 px)."""
    return (page_px // CELL_PX) ** 2


def bench_record(n_pages: int, page_px: int, seed: int = 0) -> dict:
    """A docpages test record with ``n_pages`` pages resized to ``page_px`` px (images in memory).

    Raises:
        ValueError: ``page_px`` not a positive multiple of 28 up to :data:`MAX_PAGE_PX`, or ``n_pages`` < 1.
    """
    if page_px <= 0 or page_px % CELL_PX or page_px > MAX_PAGE_PX:
        raise ValueError(f"page_px must be a multiple of {CELL_PX} in {CELL_PX}..{MAX_PAGE_PX}, got {page_px}")
    if n_pages < 1:
        raise ValueError(f"n_pages must be >= 1, got {n_pages}")
    rng = random.Random(seed * 1000 + n_pages)
    rec = docpages.sample(rng, "test", K=min(n_pages, docpages.K_RANGE[1]))
    parts = list(rec["content"])
    scans = digits.pool("test")
    for k in range(docpages.K_RANGE[1] + 1, n_pages + 1):
        cells = docpages.ROWS * docpages.COLS
        page = digits.render_page([rng.choice(scans) for _ in range(cells)], docpages.ROWS, docpages.COLS,
                                  labels=[f"{k % 100:02d}"] * cells)
        parts += [{"type": "text", "text": f"Page {k}:"}, {"type": "image", "image": page}]
    content = []
    for part in parts:
        if part["type"] == "image":
            part = {**part, "image": part["image"].resize((page_px, page_px), Image.NEAREST)}
        content.append(part)
    return {**rec, "content": content, "id": f"{rec['id']}-{n_pages}p-{page_px}px"}
