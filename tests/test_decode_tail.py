"""``decode_tail``: the question's last tokens fed as decode steps (issue #32), so a one-token answer reads the
compressed cache as a decoded token does. The full cache must not change; a decode-time selector must act."""
from __future__ import annotations

import pytest
import torch
from test_press_matrix import identity_codec, resources  # noqa: F401  (fixture re-exported)

from kvbench.compress.cache import Press
from kvbench.compress.generate import greedy_generate
from kvbench.compress.multiquery import answer_queries
from kvbench.compress.presses.omnikv import OmniKVPress
from kvbench.compress.registry import PRESS
from kvbench.utils.spec import parse


def _ids(n, seed):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def test_the_full_cache_is_unchanged_by_the_tail(tiny_lm):
    """Chunking the same attention: the answer and its first logits are those of one chunk."""
    ids = _ids(90, 1)
    base, _ = greedy_generate(tiny_lm, Press(protocol="one_pass"), ids, 90, 6, eos=set())
    # (split, tail, prefill chunks): 80 + 7 | 3 steps; 80 | 10 steps (the whole question)
    for split, tail, chunks in ((90, 1, 1), (90, 5, 1), (80, 3, 2), (80, 10, 1)):
        got, cache = greedy_generate(tiny_lm, Press(protocol="one_pass"), ids, split, 6, eos=set(), tail=tail)
        assert got == base, (split, tail)
        # forwards: the prefill chunks, one per tail token, one per decoded token but the last
        assert len(cache.attended) == chunks + tail + 5


def test_a_decode_time_selector_acts_on_the_tail(tiny_lm):
    """OmniKV selects at one-token steps only: with a one-token answer and no tail it never selects; with a tail
    of 3 it selects at each of the 3 steps (its sinks and window excluded from the candidates)."""
    press = OmniKVPress(keep=0.3, filter_layers=(1,), n_sink=2, window=4, protocol="one_pass")
    ids = _ids(120, 2)
    _, none = greedy_generate(tiny_lm, press, ids, 120, 1, eos=set())
    _, some = greedy_generate(tiny_lm, press, ids, 120, 1, eos=set(), tail=3)
    assert none.selections == [] and len(some.selections) == 3


@pytest.mark.parametrize("name", ["fullkv", "omnikv:keep=0.3", "kivi:bits=2", "snapkv:keep=0.5",
                                  "residualkv+omnikv:full_layers=0,keep=0.5,full_kv_bits=4"])
def test_queries_with_a_tail_equal_fresh_single_query_runs(tiny_lm, identity_codec, name):
    spec = parse(name, PRESS)
    press = spec.build(**resources(spec.cls, identity_codec))
    press.load()
    ctx, qs = _ids(70, 3), [_ids(5, 11), _ids(2, 12), _ids(7, 13)]
    answers, _ = answer_queries(tiny_lm, press, ctx, qs, [3] * 3, eos=set(), tail=3)
    fresh = [greedy_generate(tiny_lm, press, torch.cat([ctx, q], 1), 70, 3, eos=set(), tail=min(3, q.shape[1]))[0]
             for q in qs]
    assert [a.new_ids for a in answers] == fresh, name
    # a query of 2 tokens runs wholly as decode steps: 2 steps + 2 decoded tokens forwarded
    assert [len(a.attended) for a in answers] == [1 + 3 + 2, 2 + 2, 1 + 3 + 2]


def test_bad_tails_are_refused(tiny_lm):
    with pytest.raises(ValueError, match="decode_tail .* must be an int >= 0, got -1"):
        parse("snapkv:keep=0.3,decode_tail=-1", PRESS)
    with pytest.raises(ValueError, match="tail must be in"):
        greedy_generate(tiny_lm, Press(), _ids(20, 1), 15, 1, eos=set(), tail=8)   # would cut the context chunk
    with pytest.raises(ValueError, match="tail must be an int >= 0"):
        answer_queries(tiny_lm, Press(), _ids(20, 1), [_ids(3, 2)], [1], eos=set(), tail=-2)
