"""LongBench-LCC-style next-line code completion on real Python standard-library source.

LongBench's LCC task (Bai et al., 2023, https://arxiv.org/abs/2308.14508)
gives a long code prefix and scores the model's next line with an edit
similarity. Here the code is the interpreter's own stdlib
(:func:`kvbench.data.corpus.stdlib_files`; train and test files are disjoint
by path hash), so nothing is downloaded.

Record (kind ``"text"``)::

    context  = file prefix (from the top, at least 20 lines, up to ~length_tokens
               tokens) ending at a line boundary + the target line's indentation
    question = ""
    answer   = the next non-empty line, leading whitespace stripped
               (comment-only lines and lines over 48 tokens are never targets)
    max_new_tokens = 48, metric = "edit_sim"
    chance   = edit similarity of the copy-the-previous-non-empty-line baseline

The metric is :func:`edit_sim` (LongBench's ``code_sim_score``), defined here because the records' chance level
is scored with it; :data:`kvbench.eval.metrics.METRICS` registers it.
"""
from __future__ import annotations

import bisect
import random

from kvbench.data import corpus

MIN_LINES = 20
MAX_NEW_TOKENS = 48
_PREFIX_TRIES = 20
_MAX_TRIES = 100


def indel_ratio(a: str, b: str) -> float:
    """``fuzz.ratio(a, b) / 100``: normalised Indel similarity ``2 * LCS / (len(a) + len(b))``.

    Two empty strings are identical (1.0); one empty string scores 0.0, as in
    fuzzywuzzy. ``rapidfuzz`` is the maintained implementation of fuzzywuzzy's ratio.
    Unlike fuzzywuzzy (which LongBench imports) the value is not rounded to whole percent.
    """
    if a == b:
        return 1.0
    if not a or not b:
        return 0.0
    # imported here, not with the module: the bare GPU machine (scripts/gpu_paper.sh) has no rapidfuzz, and only
    # this metric needs it
    from rapidfuzz.fuzz import ratio

    return ratio(a, b) / 100.0


def first_code_line(pred: str) -> str:
    """LongBench's line rule for code completion.

    Leading newlines are dropped, then the first line containing none of
    ``` ` ```, ``#`` or ``//`` is kept (comment and markdown-fence lines are
    skipped; an empty line in the middle is *not* skipped, as in LongBench).
    Returns ``""`` when no line qualifies.
    """
    for line in pred.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def edit_sim(pred: str, gold: str) -> float:
    """LongBench ``code_sim_score``: ``indel_ratio(first_code_line(pred), gold)``, in [0, 1].

    Source: THUDM/LongBench ``metrics.py`` (``code_sim_score``); the gold line is used as is.
    """
    return indel_ratio(first_code_line(pred), gold)


def copy_last_line_baseline(context: str, answer: str) -> float:
    """Chance level of an LCC record: score of predicting the previous non-empty line (stripped)."""
    prev = next((ln.strip() for ln in reversed(context.split("\n")) if ln.strip()), "")
    return edit_sim(prev, answer)


def _files(split: str) -> tuple[tuple[str, str], ...]:
    files = tuple(f for f in corpus.stdlib_files(split) if f[1].count("\n") > MIN_LINES)
    if not files:
        raise ValueError(f"no stdlib files with more than {MIN_LINES} lines in split {split!r}")
    return files


def _line_starts(lines: list[str]) -> list[int]:
    starts, pos = [], 0
    for ln in lines:
        starts.append(pos)
        pos += len(ln) + 1
    return starts


def _target(line: str) -> bool:
    s = line.strip()
    return bool(s) and not s.startswith("#")


def _cut(lines: list[str], starts: list[int], i: int) -> int:
    """Character offset where the context ends: start of line ``i`` plus its indentation."""
    return starts[i] + len(lines[i]) - len(lines[i].lstrip())


def _prefix_candidates(tok, text: str, lines: list[str], starts: list[int], length_tokens: int) -> list[int]:
    """Target lines (>= MIN_LINES) whose whole file prefix fits in about ``length_tokens`` tokens."""
    head = text[: 8 * length_tokens]  # >= 2 chars per token: more than length_tokens tokens of code
    ends = [e for _, e in tok(head, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]
    out = []
    for i in range(MIN_LINES, len(lines)):
        cut = _cut(lines, starts, i)
        if cut > len(head) or bisect.bisect_right(ends, cut) > length_tokens - 2:
            break
        if _target(lines[i]):
            out.append(i)
    return out


def _window_start(tok, text: str, starts: list[int], i: int, cut: int, length_tokens: int) -> int | None:
    """Earliest line start ``s < starts[i]`` with ``text[s:cut]`` within about ``length_tokens`` tokens."""
    seg0 = max(0, cut - 8 * length_tokens)
    offs = [a + seg0 for a, _ in tok(text[seg0:cut], add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]
    for j in range(bisect.bisect_left(starts, seg0), i):
        if len(offs) - bisect.bisect_left(offs, starts[j]) <= length_tokens - 2:
            return starts[j]
    return None


def sample(rng: random.Random, split: str, tok, length_tokens: int = 1000, n_queries: int | None = None) -> dict:
    """One next-line completion record.

    The context is the whole file prefix up to the target line (``meta["mode"]
    = "prefix"``). Only when 20 random files in a row offer no target whose
    prefix fits (short ``length_tokens``, as in a training curriculum) the
    context becomes the longest line-aligned window ending at the target that
    fits (``"window"``); the target is still at least 20 lines into its file.

    Parameters
    ----------
    rng : random.Random — the record's generator.
    split : str — ``"train"`` or ``"test"`` (disjoint stdlib files).
    tok : tokenizer — measures the context length.
    length_tokens : int, default 1000 — the context is at most this many tokens.
    n_queries : int or None — only 1 is meaningful (one next line per file prefix).

    Raises:
        ValueError: bad split / n_queries / length_tokens, or no valid target in 100 tries.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if n_queries not in (None, 1):
        raise ValueError(f"lcc has one query per record, got n_queries={n_queries}")
    if length_tokens < 16:
        raise ValueError(f"lcc length_tokens must be >= 16, got {length_tokens}")
    files = _files(split)
    for attempt in range(_MAX_TRIES):
        path, text = rng.choice(files)
        lines = text.split("\n")
        starts = _line_starts(lines)
        window = attempt >= _PREFIX_TRIES
        if window:
            cands = [i for i in range(MIN_LINES, len(lines)) if _target(lines[i])]
        else:
            cands = _prefix_candidates(tok, text, lines, starts, length_tokens)
        if not cands:
            continue
        i = rng.choice(cands)
        cut = _cut(lines, starts, i)
        begin = _window_start(tok, text, starts, i, cut, length_tokens) if window else 0
        if begin is None:
            continue
        context, answer = text[begin:cut], lines[i].strip()
        n_ctx = len(tok(context, add_special_tokens=False)["input_ids"])
        if n_ctx > length_tokens or len(tok(answer, add_special_tokens=False)["input_ids"]) > MAX_NEW_TOKENS:
            continue
        return {
            "id": f"lcc-{split}-{rng.getrandbits(48):012x}",
            "task": "lcc", "split": split, "kind": "text",
            "context": context, "question": "", "answer": answer,
            "max_new_tokens": MAX_NEW_TOKENS, "metric": "edit_sim",
            "chance": copy_last_line_baseline(context, answer),
            "meta": {"file": path, "line": i + 1, "mode": "window" if window else "prefix",
                     "n_tokens": n_ctx, "length_tokens": length_tokens,
                     **({"extra_queries": []} if split == "train" else {})},
        }
    raise ValueError(f"lcc: no target line within length_tokens={length_tokens} after {_MAX_TRIES} tries")
