"""Real handwritten digit scans rendered as document-page images.

Source: scikit-learn's bundled ``load_digits()`` (1,797 real 8x8 scans of
handwritten digits, 16 grey levels, UCI "Optical Recognition of Handwritten
Digits"). No download is needed.

Pools are disjoint by scan index: ``test`` = ``index % 5 == 0`` (360 scans),
``train`` = the rest (1,437 scans), so no test page shows a scan seen in training.

Geometry: every digit cell is exactly 28x28 px. Qwen2.5-VL cuts an image into
14x14-px patches and its merger joins 2x2 neighbouring patches into one
visual token, so one 28x28 cell becomes exactly one visual token and a page of
``rows x cols`` cells becomes ``rows * cols`` visual tokens (provided the
processor's ``min_pixels``/``max_pixels`` leave the page size unchanged; all
page sizes here are multiples of 28).
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
from PIL import Image

#: Side of one rendered digit cell in pixels (= one Qwen2.5-VL visual token: 2x2 patches of 14 px).
CELL_PX = 28
#: Side of the upscaled digit inside its cell; the remaining 2-px white margin separates cells.
_INK_PX = 24
#: Side of the scan inside a labelled cell (bottom half; the top half holds the printed label).
_LABELLED_INK_PX = 14
#: Point size of the printed labels (Pillow's bundled FreeType font, so rendering needs no font files).
_LABEL_PT = 12
#: Every ``TEST_EVERY``-th scan (index % TEST_EVERY == 0) is in the test pool.
TEST_EVERY = 5


@lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images.astype(np.float64), d.target.astype(np.int64)


def images() -> np.ndarray:
    """All scans, shape ``(1797, 8, 8)``, float64 ink intensity in ``[0, 16]``."""
    return _digits()[0]


def labels() -> np.ndarray:
    """Digit label of every scan, shape ``(1797,)``, int64 in ``0..9``."""
    return _digits()[1]


@lru_cache(maxsize=2)
def pool(split: str) -> tuple[int, ...]:
    """Sorted scan indices of one split: ``test`` = index % 5 == 0, ``train`` = the rest.

    Raises:
        ValueError: ``split`` is not ``"train"`` or ``"test"``.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    n = len(labels())
    want_test = split == "test"
    return tuple(i for i in range(n) if (i % TEST_EVERY == 0) == want_test)


def _grey(img8x8: np.ndarray) -> np.ndarray:
    a = np.asarray(img8x8, dtype=np.float64)
    if a.shape != (8, 8):
        raise ValueError(f"img8x8 must have shape (8, 8), got {a.shape}")
    if a.min() < 0 or a.max() > 16:
        raise ValueError(f"img8x8 values must lie in [0, 16], got [{a.min()}, {a.max()}]")
    return np.round(255.0 * (1.0 - a / 16.0)).astype(np.uint8)


@lru_cache(maxsize=1)
def _font():
    from PIL import ImageFont

    return ImageFont.load_default(size=_LABEL_PT)


@lru_cache(maxsize=256)
def _label_band(label: str) -> np.ndarray:
    from PIL import ImageDraw

    band = Image.new("L", (CELL_PX, CELL_PX // 2), 255)
    draw = ImageDraw.Draw(band)
    half = CELL_PX // 2
    for k, ch in enumerate(label):
        if ch != " ":
            draw.text((half * k + half // 2, half // 2), ch, font=_font(), fill=0, anchor="mm")
    return np.asarray(band)


def render_cell(img8x8: np.ndarray, label: str | None = None) -> np.ndarray:
    """Render one 8x8 scan as a 28x28 RGB cell: black ink on white paper.

    The scan (ink 0..16) is inverted to grey levels (0 = black ink, 255 =
    paper) and upscaled bilinearly. Unlabelled, it fills 24x24 px centred with
    a 2-px white margin. With a ``label`` (a printed form-field code, e.g.
    ``"3E"`` = page 3, cell E) the label's two characters are printed in the
    top 14-px band, one per 14x14 patch (a space leaves a patch blank), and the
    scan is 14x14 px in the bottom band, so the label and the handwriting sit
    in distinct Qwen2.5-VL patches of the same visual token.

    Args:
        img8x8: array of shape ``(8, 8)``, values in ``[0, 16]``.
        label: ``None`` or exactly two characters.

    Returns:
        ``np.uint8`` array of shape ``(28, 28, 3)``.

    Raises:
        ValueError: wrong shape, values outside ``[0, 16]``, or a label that is not two characters.
    """
    grey = _grey(img8x8)
    cell = np.full((CELL_PX, CELL_PX), 255, dtype=np.uint8)
    if label is None:
        ink = Image.fromarray(grey, mode="L").resize((_INK_PX, _INK_PX), Image.Resampling.BILINEAR)
        m = (CELL_PX - _INK_PX) // 2
        cell[m : m + _INK_PX, m : m + _INK_PX] = np.asarray(ink)
    else:
        if not isinstance(label, str) or len(label) != 2:
            raise ValueError(f"label must be a string of exactly 2 characters, got {label!r}")
        half = CELL_PX // 2
        ink = Image.fromarray(grey, mode="L").resize((_LABELLED_INK_PX, _LABELLED_INK_PX), Image.Resampling.BILINEAR)
        m = (CELL_PX - _LABELLED_INK_PX) // 2
        cell[:half] = _label_band(label)
        cell[half:, m : m + _LABELLED_INK_PX] = np.asarray(ink)
    return np.repeat(cell[:, :, None], 3, axis=2)


@lru_cache(maxsize=1)
def _all_cells() -> np.ndarray:
    return np.stack([render_cell(im) for im in images()])  # (1797, 28, 28, 3)


def render_page(digit_indices: Sequence[int], rows: int, cols: int,
                labels: Sequence[str] | None = None) -> Image.Image:
    """Lay scans out row-major as a ``rows x cols`` grid page.

    Args:
        digit_indices: ``rows * cols`` scan indices (into :func:`images`), row-major.
        rows, cols: grid shape (>= 1 each).
        labels: ``None`` (plain cells) or ``rows * cols`` two-character labels
            printed in the cells (:func:`render_cell`).

    Returns:
        RGB ``PIL.Image`` of ``28*cols`` x ``28*rows`` px (width x height), i.e.
        ``rows * cols`` Qwen2.5-VL visual tokens, one per cell.

    Raises:
        ValueError: non-positive grid, wrong number of indices, or an index out of range.
    """
    if rows < 1 or cols < 1:
        raise ValueError(f"rows and cols must be >= 1, got rows={rows}, cols={cols}")
    idx = [int(i) for i in digit_indices]
    if len(idx) != rows * cols:
        raise ValueError(f"need rows*cols = {rows * cols} digit indices, got {len(idx)}")
    cells = _all_cells()
    bad = [i for i in idx if not 0 <= i < len(cells)]
    if bad:
        raise ValueError(f"digit indices out of range [0, {len(cells)}): {bad}")
    if labels is None:
        chosen = cells[idx]
    else:
        if len(labels) != len(idx):
            raise ValueError(f"need rows*cols = {len(idx)} labels, got {len(labels)}")
        chosen = np.stack([render_cell(images()[i], lab) for i, lab in zip(idx, labels)])
    grid = chosen.reshape(rows, cols, CELL_PX, CELL_PX, 3)
    page = grid.transpose(0, 2, 1, 3, 4).reshape(rows * CELL_PX, cols * CELL_PX, 3)
    return Image.fromarray(np.ascontiguousarray(page), mode="RGB")
