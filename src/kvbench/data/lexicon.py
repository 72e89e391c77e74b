"""The closed vocabularies of the synthetic long-context tasks.

RULER and SCBench draw keys from word lists or UUIDs and values from numbers.
Here keys are upper-case three-consonant codes (``" QZV"``) and values are
lower-case ones (``" bqz"``); numbers cannot be values because the Qwen2
pre-tokeniser splits digits one by one. Both are made single BPE tokens by including
them in the tokenizer's training corpus (:mod:`kvbench.data.tokenizer`),
so a retrieval answer is one token and keys never occur in the prose filler
(stdlib comments contain no such upper-case codes, and samples re-check it).
"""
from __future__ import annotations

import itertools
import random

#: Number of distinct key codes in the lexicon (enough unique keys for 4k-token KV lists).
N_KEYS = 1536
_LETTERS = "BCDFGHJKLMNPQRSTVWXZ"  # consonants only: avoids real words and English acronyms


def key_codes() -> list[str]:
    """``N_KEYS`` distinct three-consonant codes, fixed order (seeded shuffle)."""
    codes = ["".join(t) for t in itertools.product(_LETTERS, repeat=3)]
    random.Random(1234).shuffle(codes)
    return sorted(codes[:N_KEYS])


#: Number of distinct value codes.
N_VALUES = 90


def value_codes() -> list[str]:
    """``N_VALUES`` distinct lower-case three-consonant codes (disjoint from keys by case)."""
    codes = ["".join(t) for t in itertools.product(_LETTERS.lower(), repeat=3)]
    random.Random(4321).shuffle(codes)
    return sorted(codes[:N_VALUES])


def tokenizer_corpus_lines(repeats: int = 200) -> list[str]:
    """Lines that teach the BPE tokenizer the lexicon as whole tokens."""
    keys, vals = key_codes(), value_codes()
    lines = []
    for r in range(repeats):
        rng = random.Random(r)
        ks = keys[:]
        rng.shuffle(ks)
        for i in range(0, len(ks), 16):
            lines.append(" ".join(f"{k} {rng.choice(vals)}" for k in ks[i : i + 16]))
    return lines
