"""RULER / SCBench-style long-context text tasks with lengths measured in tokens.

Three generators, all over the closed lexicon of :mod:`kvbench.data.lexicon`
(keys: upper-case three-consonant codes ``" QZV"``, values: lower-case ones
``" bqz"``), each written with a leading space so that it is exactly ONE token
of the zoo tokenizer (checked for the whole lexicon on first use). A key or
value that the sample relies on never occurs elsewhere in the context: codes
whose token appears in the prose filler (or, for keys, whose letters appear
anywhere in it) are excluded per sample. Every hop is a plain induction lookup —
the question ends with the key token and the answer is the token that followed
it in the context — because a tiny model learns induction but not
role-conditional lookups (docs/log.md, "2026-11 One-thread LM trial").

- ``niah`` (RULER needle-in-a-haystack): real prose lines (stdlib comments and
  docstrings, :func:`kvbench.data.corpus.prose_lines`) with needles
  ``" KEY VAL."`` at random line boundaries; ``"\\nQuery: KEY"`` -> ``" VAL"``.
- ``kv`` (RULER/SCBench key-value retrieval): ``"Pairs:" + " KEY VAL," * n``
  with unique keys; ``"\\nQuery: KEY"`` -> ``" VAL"``.
- ``vt`` (RULER variable tracking): prose haystack with chains
  ``" NUM X1."``, ``" X1 X2."``, ... (NUM a value code, X a key code) (``"SRC DST."`` means DST takes SRC's
  value) plus 2-3 distractor chains; ``"\\nChain: NUM"`` -> ``" X1 X2 ..."``.

Length contract: ``n_tokens(context + question)`` lies in
``[length_tokens - 64, length_tokens]`` (in practice within a few tokens of
``length_tokens``), measured with the given tokenizer without special tokens.
Every context piece (prose line, needle, statement, pair) starts with a space
and prose lines start with a letter, so piece token counts add up (Qwen2's
pre-tokeniser splits before " word"); the count of the assembled
``context + question`` is re-measured (a trailing "." can merge with the
question's "\n") and the filler is shortened if it overshoots.
"""
from __future__ import annotations

import random
import re
from functools import lru_cache

from kvbench.data import corpus, lexicon

#: Tolerance of the length contract (tokens below ``length_tokens``).
LENGTH_TOLERANCE = 64
_SPLITS = ("train", "test")


def encode(tok, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens (the fast backend directly when there is one)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return tok(texts, add_special_tokens=False)["input_ids"]


def n_tokens(tok, text: str) -> int:
    """Number of tokens of ``text`` (no special tokens added)."""
    return len(encode(tok, [text])[0])


@lru_cache(maxsize=8)
def lexicon_tokens(tok) -> tuple[list[str], list[str], dict[str, int]]:
    """``(keys, values, token_id)`` after checking each ``" " + code`` is one token.

    ``token_id`` maps every key and value code to the id of ``" " + code``.

    Raises:
        ValueError: the tokenizer splits some lexicon entries (it was not built
            by :func:`kvbench.data.tokenizer.build_tokenizer`); names a few.
    """
    keys, values = lexicon.key_codes(), lexicon.value_codes()
    words = keys + values
    ids = encode(tok, [" " + w for w in words])
    bad = [w for w, i in zip(words, ids) if len(i) != 1]
    if bad:
        raise ValueError(f"tokenizer splits {len(bad)} lexicon entries into several tokens, e.g. "
                         f"{[' ' + w for w in bad[:5]]}; build it with `kvbench tokenizer`")
    return keys, values, {w: i[0] for w, i in zip(words, ids)}


class _Prose:
    """Prose lines of one split with lazily cached token ids of ``" " + line``."""

    def __init__(self, tok, split: str):
        self.tok = tok
        self.lines = corpus.prose_lines(split)
        if not self.lines:
            raise ValueError(f"no prose lines in the {split!r} stdlib split")
        self.ids: list[list[int] | None] = [None] * len(self.lines)

    def line_ids(self, i: int) -> list[int]:
        if self.ids[i] is None:  # encode the next 128 lines in one batch
            todo = [j for j in range(i, min(i + 128, len(self.lines))) if self.ids[j] is None]
            for j, x in zip(todo, encode(self.tok, [" " + self.lines[j] for j in todo])):
                self.ids[j] = x
        return self.ids[i]


@lru_cache(maxsize=8)
def _prose(tok, split: str) -> _Prose:
    return _Prose(tok, split)


def _check(split: str, length_tokens: int) -> None:
    if split not in _SPLITS:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    _check_int("length_tokens", length_tokens, 16)


def _check_int(name: str, value, minimum: int) -> None:
    """Raise ValueError unless ``value`` is an integer (not a bool, not a float) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def haystack(rng: random.Random, tok, split: str, budget: int) -> tuple[list[str], set[int]]:
    """Consecutive prose lines from a random start, as pieces ``" " + line``, ``budget`` tokens at most.

    Lines are taken while they fit; the first line that does not fit is cut at
    a word boundary to fill the rest, so the total is ``budget`` or a token or
    two less (the pool wraps around at its end).

    Returns:
        ``(pieces, token_ids)``: the pieces and the set of token ids they contain.
    """
    prose = _prose(tok, split)
    n = len(prose.lines)
    i, total, pieces, used = rng.randrange(n), 0, [], set()
    while total < budget:
        ids = prose.line_ids(i % n)
        if total + len(ids) <= budget:
            pieces.append(" " + prose.lines[i % n])
            used.update(ids)
            total += len(ids)
            i += 1
            continue
        words = prose.lines[i % n].split()
        lo, hi, best = 0, len(words), []  # largest prefix of words that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            ids = encode(tok, [" " + " ".join(words[:mid])])[0]
            if len(ids) <= budget - total:
                lo, best = mid, ids
            else:
                hi = mid - 1
        if lo:
            pieces.append(" " + " ".join(words[:lo]))
            used.update(best)
        break
    return pieces, used


def _absent(codes: list[str], token_id: dict[str, int], used: set[int], text: str | None = None) -> list[str]:
    """Codes whose token is not in ``used`` (and, if ``text`` is given, whose letters never occur in it)."""
    present = set(re.findall(r"(?=([A-Z]{3}))", text)) if text is not None else set()
    return [c for c in codes if token_id[c] not in used and c not in present]


def _insert(rng: random.Random, pieces: list[str], chains: list[list[str]]) -> tuple[list[str], set[int], list[list[float]]]:
    """Insert statement chains at uniformly random line boundaries, each chain in order.

    Returns the new piece list, the indices of the inserted pieces in it and,
    per chain, the depth (boundary / n_lines, in [0, 1]) of each statement.
    """
    order = [c for c, ch in enumerate(chains) for _ in ch]
    rng.shuffle(order)  # interleaving of the chains; within a chain the order is kept
    bounds = sorted(rng.randint(0, len(pieces)) for _ in order)
    at: dict[int, list[str]] = {}
    nxt = [0] * len(chains)
    depths: list[list[float]] = [[] for _ in chains]
    for b, c in zip(bounds, order):
        at.setdefault(b, []).append(chains[c][nxt[c]])
        nxt[c] += 1
        depths[c].append(round(b / max(len(pieces), 1), 4))
    out: list[str] = []
    inserted: set[int] = set()
    for j in range(len(pieces) + 1):
        for stmt in at.get(j, []):
            inserted.add(len(out))
            out.append(stmt)
        if j < len(pieces):
            out.append(pieces[j])
    return out, inserted, depths


def _fit(tok, pieces: list[str], inserted: set[int], question: str, length_tokens: int) -> tuple[str, int]:
    """Join pieces; while ``context + question`` exceeds ``length_tokens``, cut the last word of filler.

    Piece counts add up except where a trailing "." merges with the next
    token, so this loop runs at most a couple of times.
    Returns ``(context, n_tokens(context + question))``.
    """
    pieces = list(pieces)
    while True:
        context = "".join(pieces)
        total = n_tokens(tok, context + question)
        if total <= length_tokens:
            return context, total
        filler = [k for k in range(len(pieces)) if k not in inserted and pieces[k]]
        if not filler:
            raise AssertionError(f"{total} tokens > length_tokens={length_tokens} and no filler left to cut")
        j = filler[-1]
        words = pieces[j].split()
        pieces[j] = " " + " ".join(words[:-1]) if len(words) > 1 else ""


def _record(family: str, rng: random.Random, split: str, tok, length_tokens: int, context: str, total: int,
            queries: list[tuple[str, str]], max_new_tokens: int, chance: float, meta: dict) -> dict:
    question, answer = queries[0]
    if not length_tokens - LENGTH_TOLERANCE <= total <= length_tokens:
        raise AssertionError(f"{family}: {total} tokens outside [{length_tokens - LENGTH_TOLERANCE}, {length_tokens}]")
    meta = {"n_tokens": total, "length_tokens": length_tokens, **meta}
    if split == "train" or len(queries) > 1:
        meta["extra_queries"] = [{"question": q, "answer": a} for q, a in queries[1:]]
    return {
        "id": f"{family}-{split}-{rng.getrandbits(48):012x}",
        "task": family, "split": split, "kind": "text",
        "context": context, "question": question, "answer": answer,
        "max_new_tokens": max_new_tokens, "metric": "exact_match", "chance": chance, "meta": meta,
    }


def multi_token_values(rng: random.Random, pool: list[str], n: int, value_tokens: int) -> list[str]:
    """``n`` values of ``value_tokens`` codes each, drawn without replacement from ``pool``.

    Returns strings ``"c1 c2 ..."`` (space-joined codes; a context writes ``" " + value``). Every code occurs in
    one value only, so each answer token after the first is a plain induction lookup of the token before it.

    Raises:
        ValueError: ``pool`` holds fewer than ``n * value_tokens`` codes (both named).
    """
    if n * value_tokens > len(pool):
        raise ValueError(f"{n} values of value_tokens={value_tokens} distinct codes need {n * value_tokens} codes, "
                         f"only {len(pool)} are free in this record")
    codes = rng.sample(pool, n * value_tokens)
    return [" ".join(codes[i * value_tokens:(i + 1) * value_tokens]) for i in range(n)]


def sample_niah(rng: random.Random, split: str, tok, length_tokens: int = 1024, n_queries: int | None = None,
                value_tokens: int = 1) -> dict:
    """Needle in a haystack: one needle per query.

    Parameters
    ----------
    length_tokens : int, default 1024 — target of ``n_tokens(context + question)``.
    n_queries : int, default 1 for test, uniform 1..4 for train — number of needles
        (each queried once, in random order; the first query is the record's).
    value_tokens : int, default 1 — tokens per needle value (= ``max_new_tokens``). Above 1 the value is
        :func:`multi_token_values`' value codes not in the prose, each occurring once in the record, so that every
        answer token is one induction lookup (RULER's multi-token values are numbers, which the zoo tokenizer splits
        into digits that repeat; a tiny model cannot continue those from the last token alone).

    chance = 1/90 (a uniform guess over the lexicon's values) at ``value_tokens=1``, (1/pool)**value_tokens above.
    """
    _check(split, length_tokens)
    _check_int("value_tokens", value_tokens, 1)
    keys, values, tid = lexicon_tokens(tok)
    n = n_queries if n_queries is not None else (rng.randint(1, 4) if split == "train" else 1)
    _check_int("niah n_queries", n, 1)
    q_len = n_tokens(tok, "\nQuery:") + 1
    budget = length_tokens - q_len - n * (1 + value_tokens + n_tokens(tok, "."))
    if budget < 0:
        raise ValueError(f"length_tokens={length_tokens} too short for {n} needles")
    pieces, used = haystack(rng, tok, split, budget)
    free_keys = _absent(keys, tid, used, "".join(pieces))
    ks = rng.sample(free_keys, n)
    if value_tokens == 1:
        vs, chance = [rng.choice(values) for _ in ks], 1 / len(values)
    else:
        pool = _absent(values, tid, used)
        vs, chance = multi_token_values(rng, pool, n, value_tokens), (1 / len(pool)) ** value_tokens
    pieces, inserted, depths = _insert(rng, pieces, [[f" {k} {v}."] for k, v in zip(ks, vs)])
    order = rng.sample(range(n), n)
    queries = [(f"\nQuery: {ks[i]}", f" {vs[i]}") for i in order]
    context, total = _fit(tok, pieces, inserted, queries[0][0], length_tokens)
    meta = {"n_needles": n, "key": ks[order[0]], "value": vs[order[0]], "depth": depths[order[0]][0],
            "needles": [{"key": k, "value": v, "depth": d[0]} for k, v, d in zip(ks, vs, depths)]}
    if value_tokens > 1:
        meta["value_tokens"] = value_tokens
    return _record("niah", rng, split, tok, length_tokens, context, total, queries, value_tokens, chance, meta)


def sample_kv(rng: random.Random, split: str, tok, length_tokens: int = 1024, n_queries: int | None = None,
              value_tokens: int = 1) -> dict:
    """Key-value retrieval over ``"Pairs:" + " KEY VAL," * n_pairs`` (unique keys, random values).

    Parameters
    ----------
    length_tokens : int, default 1024 — as many pairs as fit (``2 + value_tokens`` tokens each);
        at most :data:`lexicon.N_KEYS` pairs, i.e. about 4.6k tokens.
    n_queries : int, default 1 for test, 16 for train — distinct pairs queried.
    value_tokens : int, default 1 — tokens per value (= ``max_new_tokens``). Above 1 every value is
        :func:`multi_token_values`' value codes, each occurring once in the record, so ``n_pairs * value_tokens``
        must not exceed the 90 value codes: about 140 tokens at 4 (no 1k task; a lexicon-wide pool of upper- and
        lower-case codes fitted 1k, but the zoo LM, whose one-token answers are all lower-case codes, learned none
        of it: docs/log.md, "2026-12-05 Retrieval past the full layers").

    The data are synthetic, so ``split`` only selects the query defaults.
    chance = 1/90 at ``value_tokens=1``, (1/pool)**value_tokens above.

    Raises:
        ValueError: bad ``n_queries`` or ``value_tokens``, or more distinct value codes than the lexicon has.
    """
    _check(split, length_tokens)
    _check_int("value_tokens", value_tokens, 1)
    keys, values, _ = lexicon_tokens(tok)
    n_q = n_queries if n_queries is not None else (16 if split == "train" else 1)
    _check_int("kv n_queries", n_q, 1)
    head = "Pairs:"
    q_len = n_tokens(tok, "\nQuery:") + 1
    per_pair = 1 + value_tokens + n_tokens(tok, ",")
    n_pairs = min((length_tokens - n_tokens(tok, head) - q_len) // per_pair, len(keys))
    if value_tokens > 1 and n_pairs * value_tokens > len(values):
        raise ValueError(f"kv at length_tokens={length_tokens} with value_tokens={value_tokens} needs "
                         f"{n_pairs * value_tokens} distinct value codes for its {n_pairs} pairs, the lexicon has "
                         f"{len(values)} (shorten length_tokens)")
    if not 1 <= n_q <= n_pairs:
        raise ValueError(f"kv n_queries must be in 1..{n_pairs} at length_tokens={length_tokens}, got {n_q}")
    ks = rng.sample(keys, n_pairs)
    if value_tokens == 1:
        vs, chance = [rng.choice(values) for _ in ks], 1 / len(values)
    else:
        vs, chance = multi_token_values(rng, values, n_pairs, value_tokens), (1 / len(values)) ** value_tokens
    asked = rng.sample(range(n_pairs), n_q)
    queries = [(f"\nQuery: {ks[i]}", f" {vs[i]}") for i in asked]
    pieces = [head] + [f" {k} {v}," for k, v in zip(ks, vs)]
    context, total = _fit(tok, pieces, set(range(len(pieces))), queries[0][0], length_tokens)
    meta = {"n_pairs": n_pairs, "key": ks[asked[0]], "value": vs[asked[0]], "index": asked[0],
            "depth": round(asked[0] / n_pairs, 4)}
    if value_tokens > 1:
        meta["value_tokens"] = value_tokens
    return _record("kv", rng, split, tok, length_tokens, context, total, queries, value_tokens, chance, meta)


def sample_vt(rng: random.Random, split: str, tok, length_tokens: int = 1024, n_queries: int | None = None,
              hops: int | None = None, n_distractors: int | None = None, variables: str = "keys") -> dict:
    """Variable tracking: follow ``" NUM X1."``, ``" X1 X2."``, ... and list every variable holding NUM.

    NUM is a value code (``" bqz"``), the variables X are key codes (``" QZV"``); with ``variables="values"`` the
    other way round (NUM a key code, the variables value codes), so the answer tokens are value codes as in every
    other retrieval task of the zoo LM's training (the task ``vt_1k_values``: the LM answers it, untrained on it,
    while it answers none of the RULER-form ``vt_1k``: docs/log.md, "2026-12-05 Retrieval past the full layers").

    Parameters
    ----------
    length_tokens : int, default 1024.
    n_queries : int, default 1 for test, all chains for train — chains queried
        (the first is the target chain, the rest random other chains).
    hops : int, default 2 for test, uniform 1..3 for train — variables per chain
        (= statements per chain = answer tokens = ``max_new_tokens``).
    n_distractors : int, default uniform 2..3 — further chains with other NUMs and variables.
    variables : str, default ``"keys"`` — which codes the variables are: ``"keys"`` or ``"values"``.

    chance = (1 / number of variables in the sample) ** hops.
    """
    _check(split, length_tokens)
    if variables not in ("keys", "values"):
        raise ValueError(f"vt variables must be 'keys' or 'values', got {variables!r}")
    keys, values, tid = lexicon_tokens(tok)
    hops = hops if hops is not None else (rng.randint(1, 3) if split == "train" else 2)
    nd = n_distractors if n_distractors is not None else rng.randint(2, 3)
    _check_int("vt hops", hops, 1)
    _check_int("vt n_distractors", nd, 0)
    n_chains = 1 + nd
    n_q = n_queries if n_queries is not None else (n_chains if split == "train" else 1)
    _check_int("vt n_queries", n_q, 1)
    if not 1 <= n_q <= n_chains:
        raise ValueError(f"vt n_queries must be in 1..{n_chains} (one per chain), got {n_q}")
    q_len = n_tokens(tok, "\nChain:") + 1
    budget = length_tokens - q_len - hops * n_chains * (2 + n_tokens(tok, "."))
    if budget < 0:
        raise ValueError(f"length_tokens={length_tokens} too short for {n_chains} chains of {hops} hops")
    pieces, used = haystack(rng, tok, split, budget)
    free_keys, free_values = _absent(keys, tid, used, "".join(pieces)), _absent(values, tid, used)
    var_pool, num_pool = (free_keys, free_values) if variables == "keys" else (free_values, free_keys)
    if hops * n_chains > len(var_pool):
        raise ValueError(f"vt needs {hops * n_chains} distinct variables ({n_chains} chains of {hops} hops), only "
                         f"{len(var_pool)} {variables[:-1]} codes are free in this record")
    var = rng.sample(var_pool, hops * n_chains)
    nums = rng.sample(num_pool, n_chains)
    chains = [var[j * hops:(j + 1) * hops] for j in range(n_chains)]
    stmts = [[f" {nums[j]} {ch[0]}."] + [f" {a} {b}." for a, b in zip(ch, ch[1:])] for j, ch in enumerate(chains)]
    pieces, inserted, depths = _insert(rng, pieces, stmts)
    asked = [0] + rng.sample(range(1, n_chains), n_q - 1)
    queries = [(f"\nChain: {nums[j]}", "".join(f" {x}" for x in chains[j])) for j in asked]
    context, total = _fit(tok, pieces, inserted, queries[0][0], length_tokens)
    meta = {"hops": hops, "n_chains": n_chains, "num": nums[0], "chain": chains[0], "depths": depths[0],
            "distractors": [{"num": nums[j], "chain": chains[j]} for j in range(1, n_chains)]}
    chance = (1.0 / len(var)) ** hops
    return _record("vt", rng, split, tok, length_tokens, context, total, queries, hops, chance, meta)
