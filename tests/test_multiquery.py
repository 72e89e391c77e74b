"""Several queries from one compressed context (SCBench multi-request / SCDQ: kvbench.compress.multiquery).

- every registered press (and each storage+selector composition): N queries answered from one prefilled context
  give the tokens of N fresh single-query runs (context chunk, then the query chunk), so the snapshot restores
  every press's post-context state;
- the full cache: the first answer step's logits equal a fresh run's, and the context is prefilled once;
- bad input is refused with a message naming it.
"""
from __future__ import annotations

import pytest
import torch

from kvbench.compress import multiquery
from kvbench.compress.cache import Press
from kvbench.compress.generate import greedy_generate
from kvbench.compress.multiquery import answer_queries
from kvbench.compress.presses.visual import VisualPress
from kvbench.utils.spec import parse
from kvbench.compress.registry import PRESS
from test_press_matrix import SPECS, USUAL, identity_codec, resources  # noqa: F401  (fixture re-exported)

N_CTX, N_NEW = 70, 4
#: multi-query records are text (SCBench); the visual-token presses refuse a request without visual tokens
TEXT_SPECS = [n for n in SPECS if not issubclass(parse(n + USUAL.get(n, ""), PRESS).cls, VisualPress)]


def _ids(n, seed):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _queries():
    return [_ids(5, 11), _ids(3, 12), _ids(7, 13)]


@pytest.mark.parametrize("name", TEXT_SPECS)
def test_queries_from_one_context_equal_fresh_single_query_runs(tiny_lm, identity_codec, name):
    spec = parse(name + USUAL.get(name, ""), PRESS)
    press = spec.build(**resources(spec.cls, identity_codec))
    press.load()
    ctx = _ids(N_CTX, 3)
    answers, _ = answer_queries(tiny_lm, press, ctx, _queries(), [N_NEW] * 3, eos=set())
    fresh = [greedy_generate(tiny_lm, press, torch.cat([ctx, q], 1), N_CTX, N_NEW, eos=set())[0] for q in _queries()]
    assert [a.new_ids for a in answers] == fresh, name
    # each query's record of attended keys covers its own chunk and decode steps, every layer
    assert [len(a.attended) for a in answers] == [N_NEW] * 3
    assert all(len(row) == tiny_lm.config.num_hidden_layers for a in answers for row in a.attended)


def test_full_cache_logits_equal_a_fresh_run_and_the_context_runs_once(tiny_lm, monkeypatch):
    ctx, qs = _ids(N_CTX, 4), _queries()
    seen, forward = [], multiquery.forward_chunk

    def spy(model, cache, ids, start):
        seen.append((start, ids.shape[1]))
        return forward(model, cache, ids, start)

    monkeypatch.setattr(multiquery, "forward_chunk", spy)
    firsts = []
    answers, _ = answer_queries(tiny_lm, Press(), ctx, qs, [1] * 3, eos=set(),
                                audit=lambda cache: cache.get_seq_length())
    assert [s for s in seen if s[1] == N_CTX] == [(0, N_CTX)]          # the context: one chunk, once
    assert [a.audit for a in answers] == [N_CTX + q.shape[1] for q in qs]  # each query starts at the context's end
    for q in qs:   # exact full cache: the query's logits are those of context + query in one forward
        with torch.inference_mode():
            firsts.append(int(tiny_lm(torch.cat([ctx, q], 1)).logits[0, -1].argmax()))
    assert [a.new_ids[0] for a in answers] == firsts


def test_snapshot_copies_are_independent_of_the_live_cache(tiny_lm):
    press = Press()
    cache = press.new_cache(tiny_lm)
    from kvbench.compress.cache import press_attention

    with torch.inference_mode(), press_attention(tiny_lm, cache):
        multiquery.forward_chunk(tiny_lm, cache, _ids(10, 1), 0)
        snap = multiquery.Snapshot(cache)
        before = cache.layers[0]._stored.keys.clone()
        multiquery.forward_chunk(tiny_lm, cache, _ids(4, 2), 10)
        assert cache.get_seq_length() == 14
        snap.restore()
        assert cache.get_seq_length() == 10 and torch.equal(cache.layers[0]._stored.keys, before)
        assert cache.layers[0].ctx is snap.cache.layers[0].ctx   # shared context kept, not copied


@pytest.mark.parametrize("ctx, queries, budgets, match", [
    (torch.zeros(1, 0, dtype=torch.long), [_ids(2, 1)], [1], "n_context >= 1"),
    (_ids(5, 1), [torch.zeros(1, 0, dtype=torch.long)], [1], "query 0"),
    (_ids(5, 1), [_ids(2, 1)], [0], "max_new_tokens"),
    (_ids(5, 1), [_ids(2, 1), _ids(2, 2)], [1], "one positive int per query"),
])
def test_bad_input_is_refused(tiny_lm, ctx, queries, budgets, match):
    with pytest.raises(ValueError, match=match):
        answer_queries(tiny_lm, Press(), ctx, queries, budgets, eos=set())
