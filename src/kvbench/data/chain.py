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
(docs/decisions.md, "Table V").

chance = 1 / (number of variables): a uniform guess of the final variable.
"""
from __future__ import annotations

import random

from kvbench.data.longctx import lexicon_tokens, n_tokens

_SPLITS = ("train", "test")
HEAD = "Chains:"


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
    if split not in _SPLITS:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if not isinstance(hops, int) or hops < 1:
        raise ValueError(f"chain hops must be an int >= 1, got {hops!r}")
    if min_hops is not None and not (isinstance(min_hops, int) and 1 <= min_hops <= hops):
        raise ValueError(f"chain min_hops must be an int in [1, hops={hops}], got {min_hops!r}")
    if not isinstance(n_distractors, int) or n_distractors < 0:
        raise ValueError(f"chain n_distractors must be an int >= 0, got {n_distractors!r}")
    keys, values, _ = lexicon_tokens(tok)
    h = hops if min_hops is None else rng.randint(min_hops, hops)
    n_chains = 1 + n_distractors
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
    context = "".join(pieces)
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
