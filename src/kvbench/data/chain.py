"""Long-chain variable tracking: an answer of hundreds of generated tokens, each one a lookup in the prompt.

The smoke stand-in for ResidualKV Table V (AIME with a thinking model, up to 32,768 generated tokens): the answer is
a long chain the model writes token by token, every token read from a statement far back in the prompt, and only the
chain's final token is scored (:func:`kvbench.eval.metrics.final_answer`), so one wrong hop anywhere makes the answer
wrong, as one wrong step of a reasoning trace does.

Record: the context is ``"Chains:"`` followed by the statements of ``1 + n_distractors`` chains interleaved at random
(each chain's statements in order), RULER variable tracking's form without the prose haystack:
``" NUM X1."``, ``" X1 X2."``, ..., ``" X(h-1) Xh."`` (NUM a value code, the X key codes of
:mod:`kvbench.data.lexicon`, each one token of the zoo tokenizer, every variable used once). The question is
``"\\nChain: NUM"`` and the answer ``" X1 X2 ... Xh"``; ``max_new_tokens`` is ``h``, so the scored final token is the
``h``-th generated one. Each hop is a plain induction lookup: the latest earlier occurrence of the token just written
is its own statement's key (the statement naming it as a value comes before it, since a chain's statements are in
order), and the token that follows it there is the next variable.

What the chain reads: every hop reads the prompt, at a distance that grows as the answer is written; the generated
tokens are read by the next hop only (the token just written is the lookup's query). So compression of the prompt
during decoding (SnapKV's decoding form evicting statements the later hops need) decides the score; the coding of
generated tokens (ResidualKV's raw window leaving them as codes) is exercised, but no later hop looks one up
(docs/decisions/residualkv-tables.md, "Table V: long generation").

chance = 1 / (number of variables): a uniform guess of the final variable.
"""
from __future__ import annotations

import random

from kvbench.data.longctx import lexicon_tokens, n_tokens

_SPLITS = ("train", "test")
HEAD = "Chains:"


def _check(split: str, hops: int, min_hops: int | None) -> None:
    if split not in _SPLITS:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if not isinstance(hops, int) or hops < 1:
        raise ValueError(f"chain hops must be an int >= 1, got {hops!r}")
    if min_hops is not None and not (isinstance(min_hops, int) and 1 <= min_hops <= hops):
        raise ValueError(f"chain min_hops must be an int in [1, hops={hops}], got {min_hops!r}")


def _statements(rng: random.Random, keys: list[str], values: list[str], h: int,
                n_chains: int) -> tuple[str, list[str], list[list[str]]]:
    """``(context, nums, chains)``: ``n_chains`` chains of ``h`` fresh variables, each started by its own NUM, their
    statements interleaved at random after :data:`HEAD` (each chain's in order)."""
    if h * n_chains > len(keys):
        raise ValueError(f"{n_chains} chains of {h} hops need {h * n_chains} variables; the lexicon has {len(keys)}")
    var = rng.sample(keys, h * n_chains)
    nums = rng.sample(values, n_chains)
    chains = [var[j * h:(j + 1) * h] for j in range(n_chains)]
    stmts = [[f" {nums[j]} {ch[0]}."] + [f" {a} {b}." for a, b in zip(ch, ch[1:])] for j, ch in enumerate(chains)]
    order = [j for j, s in enumerate(stmts) for _ in s]
    rng.shuffle(order)   # interleaving of the chains; within a chain the order is kept
    nxt = [0] * n_chains
    pieces = [HEAD]
    for j in order:
        pieces.append(stmts[j][nxt[j]])
        nxt[j] += 1
    return "".join(pieces), nums, chains


def sample_chain(rng: random.Random, split: str, tok, hops: int = 128, min_hops: int | None = None,
                 n_distractors: int = 1) -> dict:
    """One chain record (module docstring).

    Parameters
    ----------
    hops : int, default 128 — variables in the asked chain (= statements per chain = answer tokens =
        ``max_new_tokens``); with ``min_hops``, the chain lengths are drawn uniformly in ``[min_hops, hops]``.
    min_hops : int or None — see ``hops`` (training curricula vary the length inside a phase).
    n_distractors : int, default 1 — further chains of the same length drawn with other NUMs and variables.

    In the ``train`` split every distractor chain is asked too (``meta.extra_queries``, one supervised chain each);
    the data are synthetic, so the split only selects that.

    Raises:
        ValueError: a bad split, ``hops < 1``, ``min_hops`` outside ``[1, hops]``, ``n_distractors < 0``, or more
            variables than the lexicon has keys.
    """
    _check(split, hops, min_hops)
    if not isinstance(n_distractors, int) or n_distractors < 0:
        raise ValueError(f"chain n_distractors must be an int >= 0, got {n_distractors!r}")
    keys, values, _ = lexicon_tokens(tok)
    h = hops if min_hops is None else rng.randint(min_hops, hops)
    context, nums, chains = _statements(rng, keys, values, h, 1 + n_distractors)
    n_chains = len(chains)
    var = [x for ch in chains for x in ch]
    queries = [(f"\nChain: {nums[j]}", "".join(f" {x}" for x in chains[j])) for j in range(n_chains)]
    question, answer = queries[0]
    meta = {"hops": h, "n_chains": n_chains, "num": nums[0], "final": chains[0][-1],
            "n_tokens": n_tokens(tok, context + question)}
    if split == "train":
        meta["extra_queries"] = [{"question": q, "answer": a} for q, a in queries[1:]]
    return {
        "id": f"chain-{split}-{rng.getrandbits(48):012x}",
        "task": "chain", "split": split, "kind": "text",
        "context": context, "question": question, "answer": answer,
        "max_new_tokens": h, "metric": "final_answer", "chance": 1.0 / len(var), "meta": meta,
    }


PAIRS_QUESTION = "\nPairs:"
ASK = "\nAsk:"


def sample_chain_pairs(rng: random.Random, split: str, tok, hops: int = 64, min_hops: int | None = None,
                       n_asks: int = 4) -> dict:
    """One chain-pairs record: two chains written in alternation, then a question whose answer is only in what was
    written.

    The context is :func:`sample_chain`'s with two chains A and B (``" NUM_A A1."``, ``" A1 A2."``, ...,
    ``" NUM_B B1."``, ... interleaved at random). The question ``"\\nPairs: NUM_A NUM_B"`` asks for both chains
    in alternation, ``" A1 B1 A2 B2 ... Ah Bh"`` (``max_new_tokens = 2h``, the generated trace); every step is an
    induction lookup keyed by the token *two* back (after ``B(k-1)`` the next A follows ``A(k-1)``'s statement;
    :data:`kvbench.train.heads.SKIP_HEAD`). Then the final question ``final.question = "\\nAsk: Aq"`` is appended
    after the trace and the answer ``final.answer = " Bq"`` is decoded (``final.max_new_tokens = 1``): which B
    stood beside ``Aq`` in the trace. ``Aq`` and ``Bq`` sit in different chains, at the same step only of the
    written trace: the pairing is nowhere in the prompt, so the answer reads the generated token ``Bq``
    ``2 (h - q)`` + (final question tokens) back (a plain induction lookup on ``Aq``; ``meta.distance``). ``q`` is drawn in
    ``[1, ceil(h / 2)]``, so that read reaches at least ``h`` tokens back. ResidualKV coding generated tokens as they
    leave its raw window, and SnapKV's decoding eviction of them, decide the final answer: the task the issue asks
    for (docs/decisions/residualkv-tables.md, "Table V: long generation").

    ``answer`` is the whole reference (trace + final question + final answer) and the metric ``final_answer``
    compares its last word with the prediction's (the runner appends the final question to the generated trace
    and decodes the final answer: :mod:`kvbench.compress.generate`, :class:`kvbench.eval.methods.FullCache`).
    In the ``train`` split ``meta.extra_queries`` holds ``n_asks - 1`` further asks of other steps (anywhere in
    ``[1, h]``), each supervised after the final answer.

    Parameters
    ----------
    hops : int, default 64 — variables per chain (the trace has ``2 * hops`` tokens); with ``min_hops``, drawn
        uniformly in ``[min_hops, hops]``.
    min_hops : int or None — see ``hops``.
    n_asks : int, default 4 — asks per training record (the test split asks one).

    chance = 1 / h: a uniform guess among chain B's variables.

    Raises:
        ValueError: a bad split, ``hops < 1``, ``min_hops`` outside ``[1, hops]``, ``n_asks < 1`` or more than
            ``h`` asks, or more variables than the lexicon has keys.
    """
    _check(split, hops, min_hops)
    if not isinstance(n_asks, int) or n_asks < 1:
        raise ValueError(f"chain-pairs n_asks must be an int >= 1, got {n_asks!r}")
    keys, values, _ = lexicon_tokens(tok)
    h = hops if min_hops is None else rng.randint(min_hops, hops)
    if split == "train" and n_asks > h:
        raise ValueError(f"chain-pairs n_asks={n_asks} exceeds the {h} steps a trace has")
    context, nums, (a, b) = _statements(rng, keys, values, h, 2)
    question = f"{PAIRS_QUESTION} {nums[0]} {nums[1]}"
    trace = "".join(f" {x} {y}" for x, y in zip(a, b))
    q = rng.randint(1, (h + 1) // 2)
    final = {"question": f"{ASK} {a[q - 1]}", "answer": f" {b[q - 1]}", "max_new_tokens": 1}
    meta = {"hops": h, "n_chains": 2, "nums": nums, "ask": q, "asked": a[q - 1], "final": b[q - 1],
            # tokens from the trace's B_q to the position that predicts the final answer
            "distance": 2 * (h - q) + n_tokens(tok, final["question"]),
            "n_tokens": n_tokens(tok, context + question)}
    if split == "train":
        others = rng.sample([r for r in range(1, h + 1) if r != q], n_asks - 1)
        meta["extra_queries"] = [{"question": f"{ASK} {a[r - 1]}", "answer": f" {b[r - 1]}"} for r in others]
    return {
        "id": f"chain_pairs-{split}-{rng.getrandbits(48):012x}",
        "task": "chain_pairs", "split": split, "kind": "text",
        "context": context, "question": question, "answer": trace + final["question"] + final["answer"],
        "final": final, "max_new_tokens": 2 * h, "metric": "final_answer", "chance": 1.0 / h, "meta": meta,
    }
