"""Multi-query smoke records: several questions about one context (SCBench's shared-context layout), for
ResidualKV's Table IV on the zoo LM.

Each generator draws one record of a retrieval family of :mod:`kvbench.data.longctx` with several queries (the
families already draw them: a training record's ``meta.extra_queries``) and lays it out as SCBench does
(``microsoft/MInference`` ``scbench/``): ``context`` plus ``multi_turns``, a list of ``{"input", "answer"}``
(:mod:`kvbench.eval.multiquery`). Every query is in the single-query form the zoo LM was trained and evaluated on
(``"\\nQuery: KEY"`` -> ``" VAL"``; ``"\\nChain: NUM"`` -> ``" X1 X2"``), so each one, asked alone after the context,
is a record of the family's own test task; nothing of the zoo's training recipe changes, and the existing tasks'
records do not either (a record's generator is seeded by its task name, :func:`kvbench.data.smoke.record_rng`).

- ``kv_mq``: key-value retrieval, ``n_queries`` distinct pairs asked (default 4);
- ``niah_mq``: ``n_queries`` needles, each asked once (default 4);
- ``vt_mq``: variable tracking with ``n_queries`` chains (default 3: the target chain and two distractor chains),
  each asked once, ``hops`` variables per chain (default 2, the test task's).

Chance is the family's per-query chance (every query of a record has the same).
"""
from __future__ import annotations

import random

from kvbench.data import longctx
from kvbench.data.scbench import TURNS


def _shared(rec: dict, n_queries: int) -> dict:
    """``rec`` (a longctx record with ``n_queries`` queries) in the multi-query layout."""
    meta = dict(rec["meta"])
    extra = meta.pop("extra_queries", [])
    turns = [{"input": rec["question"], "answer": rec["answer"]}] + [
        {"input": q["question"], "answer": q["answer"]} for q in extra]
    if len(turns) != n_queries:  # the family's own contract; a change there must not go unseen here
        raise AssertionError(f"{rec['task']}: {len(turns)} queries drawn, {n_queries} asked")
    out = {k: v for k, v in rec.items() if k not in ("question", "answer", "meta")}
    return {**out, TURNS: turns, "meta": {**meta, "n_queries": n_queries}}


def _check_n(n_queries: int) -> None:
    if isinstance(n_queries, bool) or not isinstance(n_queries, int) or n_queries < 2:
        raise ValueError(f"n_queries must be an int >= 2 (several queries share a context), got {n_queries!r}")


def sample_kv_mq(rng: random.Random, split: str, tok, length_tokens: int = 1024, n_queries: int = 4) -> dict:
    """Key-value retrieval with ``n_queries`` (>= 2) distinct pairs asked about one context.

    Raises:
        ValueError: ``n_queries`` < 2, or as :func:`kvbench.data.longctx.sample_kv`.
    """
    _check_n(n_queries)
    return _shared(longctx.sample_kv(rng, split, tok, length_tokens, n_queries=n_queries), n_queries)


def sample_niah_mq(rng: random.Random, split: str, tok, length_tokens: int = 1024, n_queries: int = 4) -> dict:
    """Needle in a haystack with ``n_queries`` (>= 2) needles, each asked once.

    Raises:
        ValueError: ``n_queries`` < 2, or as :func:`kvbench.data.longctx.sample_niah`.
    """
    _check_n(n_queries)
    return _shared(longctx.sample_niah(rng, split, tok, length_tokens, n_queries=n_queries), n_queries)


def sample_vt_mq(rng: random.Random, split: str, tok, length_tokens: int = 1024, n_queries: int = 3,
                 hops: int = 2) -> dict:
    """Variable tracking with ``n_queries`` (>= 2) chains (``n_queries - 1`` of them distractors of the target chain),
    each asked once.

    Raises:
        ValueError: ``n_queries`` < 2, or as :func:`kvbench.data.longctx.sample_vt`.
    """
    _check_n(n_queries)
    rec = longctx.sample_vt(rng, split, tok, length_tokens, n_queries=n_queries, hops=hops,
                            n_distractors=n_queries - 1)
    return _shared(rec, n_queries)
