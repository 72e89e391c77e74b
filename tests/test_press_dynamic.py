"""Quest and OmniKV: full KV kept, attention reads a query-dependent subset (Quest pages, OmniKV tokens)."""
from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import pytest
import torch
from test_rkv_cache import _run as chunked_run

from kvbench.compress.cache import Press, StepState, StoreLayer
from kvbench.compress.generate import greedy_generate
from kvbench.compress.presses import omnikv
from kvbench.compress.presses.omnikv import OmniKVPress, filter_step
from kvbench.compress.presses.quest import QuestPress, page_bounds, page_scores

class StubCache:
    """What :func:`filter_step` needs of a :class:`~kvbench.compress.cache.PressCache`."""

    def __init__(self):
        self.step, self.selections = StepState(), []

    def record_selection(self, selected, limit):
        if len(self.selections) < limit:
            self.selections.append(selected.tolist())


CUTS = (100, 110, 111, 112)   # context, question chunk, three decode-like single tokens, a last chunk


def ids_of(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def chunked_logits(model, press, ids, cuts=CUTS):
    """Logits of ``ids`` forwarded in chunks ending at ``cuts`` through ``press``'s cache, and the cache."""
    return chunked_run(model, press, ids, cuts)


# -- Quest -----------------------------------------------------------------------------------------------
def test_page_score_hand_computed_and_upper_bound():
    keys = torch.tensor([[1.0, 3.0], [2.0, -1.0]]).view(1, 1, 2, 2)
    kmin, kmax = page_bounds(keys, torch.tensor([0, 0]), 2)
    assert kmin[0, 0, 0].tolist() == [1.0, -1.0] and kmax[0, 0, 0].tolist() == [2.0, 3.0]
    q = torch.tensor([1.0, -2.0]).view(1, 1, 1, 2)
    s = page_scores(q, kmin, kmax)
    assert s[0, 0, 0].tolist() == [4.0, -math.inf]        # max(2, 1) + max(-6, 2); page 1 is empty
    g = torch.Generator().manual_seed(0)
    keys, q = torch.randn(1, 2, 64, 8, generator=g), torch.randn(1, 4, 3, 8, generator=g)
    kmin, kmax = page_bounds(keys, torch.arange(64) // 16, 4)
    bound = page_scores(q, kmin, kmax)                                          # [1, 4, 3, 4]
    exact = (q @ keys.repeat_interleave(2, 1).transpose(-1, -2)).view(1, 4, 3, 4, 16).amax(-1)
    assert (bound >= exact - 1e-5).all()


def test_quest_keep_one_equals_full(tiny_lm):
    ids = ids_of(120)
    ref, _ = chunked_logits(tiny_lm, Press(), ids)
    got, cache = chunked_logits(tiny_lm, QuestPress(keep=1.0), ids)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert cache.attended[-1] == [120, 120, 120]


def test_quest_page_budget_counts(tiny_lm):
    _, cache = chunked_logits(tiny_lm, QuestPress(keep=0.3), ids_of(120))
    # last row at position 119: ceil(0.3 * 120 / 16) = 3 pages: its own page 112..119 (8 keys) + 2 full pages
    assert cache.attended[-1] == [120, 120, 8 + 32]
    # row 110 (a single-token chunk): ceil(0.3 * 111 / 16) = 3 pages: 96..110 (15 keys) + 2 full pages
    assert cache.attended[2] == [111, 111, 15 + 32]
    # 3-page minimum on short contexts: ceil(0.3 * 40 / 16) = 1 < 3, and 40 keys hold exactly 3 pages
    _, cache = chunked_logits(tiny_lm, QuestPress(keep=0.3), ids_of(41), cuts=(40,))
    assert cache.attended[-1] == [41, 41, 41]


def test_quest_dense_prefill_option(tiny_lm):
    """sparse_prefill=False: multi-token chunks read everything (the authors' q_len > 1 branch)."""
    ids = ids_of(120)
    _, cache = chunked_logits(tiny_lm, QuestPress(keep=0.3, sparse_prefill=False), ids, cuts=(100,))
    assert cache.attended[-1] == [120, 120, 120]
    # sparse_prefill=True: the question chunk is sparse, the context chunk (no history) stays exact
    got, cache = chunked_logits(tiny_lm, QuestPress(keep=0.3), ids, cuts=(100,))
    ref, _ = chunked_logits(tiny_lm, Press(), ids, cuts=(100,))
    torch.testing.assert_close(got[:, :100], ref[:, :100], atol=1e-5, rtol=1e-5)
    assert cache.attended[0] == [100, 100, 100] and cache.attended[-1] == [120, 120, 8 + 32]


def test_quest_tiny_context_and_ratio(tiny_lm):
    new, _ = greedy_generate(tiny_lm, QuestPress(), ids_of(4), 3, max_new_tokens=3, eos=set())
    full, _ = greedy_generate(tiny_lm, Press(), ids_of(4), 3, max_new_tokens=3, eos=set())
    assert new == full                                    # fewer than 3 pages exist: nothing is dropped
    assert QuestPress(keep=0.3).compute_ratio(3) == pytest.approx((2 + 0.3) / 3)
    with pytest.raises(ValueError, match="keep"):
        QuestPress(keep=0.0)
    with pytest.raises(ValueError, match="page_size"):
        QuestPress(page_size=0)


# -- OmniKV ----------------------------------------------------------------------------------------------
def test_filter_layer_selects_by_max_logit_over_heads():
    """Candidate i is token position i: scores |s_p| (two query heads q = ±e0), sinks and window excluded."""
    cache = StubCache()
    selector = SimpleNamespace(n_sink=2, window=3, block=1, audit_steps=1, n_keep=lambda n: 2, sparse_prefill=False,
                               row_agg="mean")
    layer = StoreLayer(SimpleNamespace(layer_idx=0), cache)
    layer.after_commit = functools.partial(filter_step, selector)
    s = torch.tensor([0.0, 0.0, 1.0, -5.0, 2.0, 0.5, -3.0, 9.0, 9.0, 9.0, 0.0])
    keys = torch.stack([s, torch.zeros_like(s)], -1).view(1, 1, 11, 2)
    q = torch.tensor([[1.0, 0.0], [-1.0, 0.0]]).view(1, 2, 1, 2)

    def attend(n0: int, n1: int, query: torch.Tensor) -> None:   # as the press attention does, after attention
        layer.update(keys[..., n0:n1, :], keys[..., n0:n1, :])
        chunk = layer._pending
        layer.commit(chunk, query)
        layer.after_commit(layer, chunk, query)

    attend(0, 10, q.expand(1, 2, 10, 2))
    assert cache.step.selected is None and cache.selections == []   # a multi-token chunk selects nothing
    attend(10, 11, q)
    # candidates 2..6 (boundary 10 - 3 = 7) with |s| = 1, 5, 2, 0.5, 3: top 2 are positions 3 and 6
    assert cache.step.selected.tolist() == [3, 6] and cache.step.selected.dtype == torch.long
    assert cache.selections == [[3, 6]]


def test_omnikv_sparse_layer_reads_sinks_selected_window(tiny_lm, monkeypatch):
    # the step's view is dropped after the layer's attention (not held between steps): keep the last one to look at
    commit = StoreLayer.commit

    def spy(self, chunk, query):
        self.last_view = self._view
        commit(self, chunk, query)
    monkeypatch.setattr(StoreLayer, "commit", spy)
    press = OmniKVPress(keep=0.17, filter_layers=(1,), n_sink=4, window=8, audit_steps=2)
    ids = ids_of(61)
    _, cache = chunked_logits(tiny_lm, press, ids, cuts=(60,))
    _, full = chunked_logits(tiny_lm, Press(), ids, cuts=(60,))
    # decode step at position 60: candidates 4..51 (boundary 60 - 8), int(0.17 * 48) = 8 selected
    sel = cache.step.selected
    assert len(sel) == 8 and sel.min() >= 4 and sel.max() < 52 and (sel.diff() > 0).all()
    assert cache.selections == [sel.tolist()]           # the context chunk had no candidate
    view = cache.layers[2].last_view
    want = torch.cat([torch.arange(4), sel, torch.arange(52, 61)])
    assert torch.equal(view.positions[0, 0], want)
    assert cache.layers[2]._view is None                 # not held once the step is over
    ref = full.layers[2].last_view
    assert torch.equal(view.keys, ref.keys[..., want, :]) and torch.equal(view.values, ref.values[..., want, :])
    assert [type(layer) for layer in cache.layers] == [StoreLayer, StoreLayer, omnikv.SparseLayer]
    assert [layer.after_commit for layer in cache.layers] == [None, press.filter, None]
    assert cache.attended[-1] == [61, 61, 4 + 8 + 9]


def test_omnikv_keep_one_equals_full(tiny_lm):
    ids = ids_of(120)
    ref, _ = chunked_logits(tiny_lm, Press(), ids)
    got, _ = chunked_logits(tiny_lm, OmniKVPress(keep=1.0, filter_layers=(1,), n_sink=0, window=0), ids)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_omnikv_defaults_tiny_context_and_errors(tiny_lm):
    press = OmniKVPress()
    assert press.layers_for(8) == (2, 4) and press.layers_for(32) == (2, 8, 18) and press.layers_for(28) == (2, 4, 7, 14)
    assert press.n_keep(100) == 17 and press.n_keep(1) == 1 and press.n_keep(0) == 0
    new, _ = greedy_generate(tiny_lm, OmniKVPress(filter_layers=(1,)), ids_of(3), 2, max_new_tokens=3, eos=set())
    full, _ = greedy_generate(tiny_lm, Press(), ids_of(3), 2, max_new_tokens=3, eos=set())
    assert new == full                                    # shorter than sinks + window: everything is read
    with pytest.raises(ValueError, match="filter_layers"):
        OmniKVPress(filter_layers=(5,)).new_cache(tiny_lm)
    with pytest.raises(ValueError, match="keep"):
        OmniKVPress(keep=1.5)


def test_residualkv_omnikv_runs_this_filter_step(tiny_lm, tmp_path):
    """residualkv+omnikv composes OmniKV's own filter step (with the storage's sinks and window)."""
    from test_rkv_cache import _identity_codec

    from kvbench.compress.residualkv.cache import ResidualKVPress
    codec_dir = _identity_codec(tiny_lm, tmp_path / "id", n_sink=2, window=4, stride=5)
    press = ResidualKVPress(codec_dir=str(codec_dir), selector=OmniKVPress(keep=0.5), full_layers=(0, 1))
    cache = press.new_cache(tiny_lm)
    hook = cache.layers[1].after_commit
    assert hook.__func__ is OmniKVPress.filter and (hook.__self__.n_sink, hook.__self__.window) == (2, 4)
    assert cache.layers[0].after_commit is None and all(x.after_commit is None for x in cache.layers[2:])

# -- OmniKV: when it selects, how rows aggregate, how many (the authors' form, issue #13 item 3) -----------
def _reference_scores(query: torch.Tensor, keys: torch.Tensor) -> list[float]:
    """The authors' score written out: per query head, the mean over query rows of q·k (the head's KV head by
    GQA grouping), then the max over heads."""
    h_q, t, n = query.shape[1], query.shape[2], keys.shape[2]
    group = h_q // keys.shape[1]
    out = []
    for j in range(n):
        per_head = [sum(float(query[0, h, r] @ keys[0, h // group, j]) for r in range(t)) / t for h in range(h_q)]
        out.append(max(per_head))
    return out


def test_row_mean_and_row_max_pick_different_tokens():
    """Two query rows e0, e1 (one head): candidate A (4, -4) has row logits 4, -4 (mean 0, max 4), B (1, 1) has
    1, 1 (mean 1, max 1), C (-3, 2.5) has -3, 2.5 (mean -0.25, max 2.5): the mean keeps B, the max keeps A."""
    keys = torch.tensor([[4.0, -4.0], [1.0, 1.0], [-3.0, 2.5]]).view(1, 1, 3, 2)
    q = torch.eye(2).view(1, 1, 2, 2)
    mean, mx = omnikv.token_scores(q, keys, "mean"), omnikv.token_scores(q, keys, "max")
    assert mean.tolist() == pytest.approx(_reference_scores(q, keys))
    assert mean.tolist() == pytest.approx([0.0, 1.0, -0.25])
    assert mx.tolist() == pytest.approx([4.0, 1.0, 2.5])
    assert mean.argmax() == 1 and mx.argmax() == 0
    # GQA, several rows: the mean over rows then the max over heads, as the written-out reference
    g = torch.Generator().manual_seed(3)
    q, keys = torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 2, 7, 8, generator=g)
    assert omnikv.token_scores(q, keys).tolist() == pytest.approx(_reference_scores(q, keys), abs=1e-5)
    # one row (a decode step): both aggregations are the same score
    torch.testing.assert_close(omnikv.token_scores(q[..., :1, :], keys, "mean"), omnikv.token_scores(q[..., :1, :], keys, "max"))


def test_filter_step_aggregates_rows_as_asked():
    """With sparse_prefill, a two-row chunk after the context selects by its row mean (B) or row max (A)."""
    s_keys = torch.tensor([[0.0, 0.0], [4.0, -4.0], [1.0, 1.0], [-3.0, 2.5], [0.0, 0.0]]).view(1, 1, 5, 2)
    picks = {}
    for agg in ("mean", "max"):
        cache = StubCache()
        selector = OmniKVPress(keep=0.34, n_sink=1, window=1, sparse_prefill=True, row_agg=agg)
        layer = StoreLayer(SimpleNamespace(layer_idx=0), cache)
        for n0, n1 in ((0, 5), (5, 7)):     # context (no history), then a 2-token chunk: candidates 1..3
            layer.update(s_keys.new_zeros(1, 1, n1 - n0, 2) if n0 else s_keys, s_keys[..., :n1 - n0, :])
            chunk = layer._pending
            layer.commit(chunk, None)
            filter_step(selector, layer, chunk, torch.eye(2).view(1, 1, 2, 2) if n0 else torch.zeros(1, 1, 5, 2))
        picks[agg] = cache.step.selected.tolist()
    assert picks == {"mean": [2], "max": [1]}    # int(0.34 * 3) = 1 candidate


def test_omnikv_keeps_int_keep_times_candidates():
    """The authors' count: int(n · keep), at least one, at most n (ceil would keep one more on 48 · 0.17 = 8.16)."""
    for keep in (0.11, 0.17, 0.185, 0.3, 0.5, 1.0):
        press = OmniKVPress(keep=keep)
        assert [press.n_keep(n) for n in range(200)] == [0] + [max(1, min(n, int(n * keep))) for n in range(1, 200)]
    assert OmniKVPress(keep=0.17).n_keep(48) == 8 and OmniKVPress(keep=0.1).n_keep(5) == 1
    assert OmniKVPress(keep=1.0).n_keep(7) == 7


def test_omnikv_keep_tokens_is_an_absolute_count_clamped_to_the_candidates(tiny_lm):
    """``keep_tokens``: min(keep_tokens, n) candidates (ResidualKV's decode keep of 2,048 on Llama), at a decode step
    of a real run too; exclusive with a non-default ``keep``; spelled in a spec standalone and composed."""
    from kvbench.compress.registry import PRESS
    from kvbench.utils.spec import parse
    press = OmniKVPress(keep_tokens=5)
    assert [press.n_keep(n) for n in range(12)] == [0] + [min(5, n) for n in range(1, 12)]
    assert OmniKVPress(keep_tokens=2048).n_keep(10_000) == 2048 and OmniKVPress(keep_tokens=2048).n_keep(300) == 300
    ids, cuts = ids_of(71), (60, 70)        # decode at 70: candidates 4..61 (58)
    _, cache = chunked_logits(tiny_lm, OmniKVPress(keep_tokens=5, filter_layers=(1,), n_sink=4, window=8), ids, cuts=cuts)
    assert len(cache.step.selected) == 5 and cache.attended[2] == [71, 71, 4 + 5 + 9]
    _, cache = chunked_logits(tiny_lm, OmniKVPress(keep_tokens=500, filter_layers=(1,), n_sink=4, window=8), ids, cuts=cuts)
    assert len(cache.step.selected) == 58
    for kwargs, needle in [({"keep": 0.2, "keep_tokens": 8}, r"keep=0.2 .* and keep_tokens=8 .* set one"),
                           ({"keep_tokens": 0}, "keep_tokens .* int >= 1"), ({"keep_tokens": 2.5}, "keep_tokens")]:
        with pytest.raises(ValueError, match=needle):
            OmniKVPress(**kwargs)
    spec = parse("residualkv+omnikv:full_layers=0+1,keep_tokens=2048", PRESS)
    assert spec.canonical == "residualkv+omnikv:full_layers=0+1,keep_tokens=2048" and parse(spec.canonical, PRESS) == spec
    sel = spec.build(codec_dir="c").selector
    assert (sel.keep_tokens, sel.n_keep(100)) == (2048, 100)
    assert "min(2048, n) candidates" in sel.selection_form()
    assert parse("omnikv:keep_tokens=16", PRESS).build().keep_tokens == 16
    with pytest.raises(ValueError, match="keep=0.2 .* keep_tokens=16"):
        parse("residualkv+omnikv:full_layers=0+1,keep=0.2,keep_tokens=16", PRESS)


def test_omnikv_reads_every_token_in_a_multi_token_chunk(tiny_lm):
    """Default (the authors'): the question chunk after the context reads every token, so its logits are the
    full cache's, and only the decode step is sparse; ``sparse_prefill=true`` also selects in the chunk."""
    ids, cuts = ids_of(71), (60, 70)        # context 0..59, question 60..69 (candidates 4..51), decode at 70
    ref, _ = chunked_logits(tiny_lm, Press(), ids, cuts=cuts)
    got, cache = chunked_logits(tiny_lm, OmniKVPress(keep=0.17, filter_layers=(1,), n_sink=4, window=8), ids, cuts=cuts)
    torch.testing.assert_close(got[:, :70], ref[:, :70], atol=1e-5, rtol=1e-5)
    assert cache.attended[1] == [70, 70, 70]
    # decode at 70: candidates 4..61 (58), int(0.17 * 58) = 9 selected, + 4 sinks + window 62..70
    assert len(cache.step.selected) == 9 and cache.attended[2] == [71, 71, 4 + 9 + 9]
    assert cache.selections == [cache.step.selected.tolist()]
    sparse, cache = chunked_logits(tiny_lm, OmniKVPress(keep=0.17, filter_layers=(1,), n_sink=4, window=8,
                                                        sparse_prefill=True), ids, cuts=cuts)
    assert cache.attended[1] == [70, 70, 4 + 8 + 18]    # int(0.17 * 48) = 8 of 4..51, window 52..69
    assert not torch.allclose(sparse[:, 60:70], ref[:, 60:70], atol=1e-3)


def test_residualkv_omnikv_reads_every_restored_token_in_a_multi_token_chunk(tiny_lm, tmp_path):
    """The composition honours the selector's fields: with an identity codec stored exactly, the question chunk
    equals the full cache (every coded token restored), the decode steps read sinks + selected + window."""
    from test_rkv_cache import _identity_codec

    from kvbench.compress.residualkv.cache import ResidualKVPress
    codec_dir = _identity_codec(tiny_lm, tmp_path / "id", n_sink=2, window=4, stride=5)
    ids, cuts = ids_of(40), (24, 36, 37, 38, 39)
    ref, _ = chunked_logits(tiny_lm, Press(), ids, cuts=cuts)

    def run(**selector):
        press = ResidualKVPress(codec_dir=str(codec_dir), bits=32, ref_fp8=False, full_layers=(0, 1),
                                selector=OmniKVPress(keep=0.2, **selector))
        return chunked_logits(tiny_lm, press, ids, cuts=cuts)

    got, cache = run()
    torch.testing.assert_close(got[:, :36], ref[:, :36], atol=2e-5, rtol=1e-4)
    assert cache.attended[1][2] == 36
    # decode at 36..39: the candidates are the n coded tokens (blocks of 4, the window, once 8 are raw), int(0.2 n)
    # of them, + 2 sinks + the raw rest (4..7 tokens) + the new token
    for step, pos in enumerate(range(36, 40), start=2):
        n = (pos - 2 - 4) // 4 * 4
        assert cache.attended[step][2] == 2 + int(0.2 * n) + (pos - 2 - n) + 1
    sparse, cache = run(sparse_prefill=True, row_agg="max")
    assert cache.attended[1][2] == 2 + int(0.2 * 16) + 6 + 12   # candidates 2..17, raw 18..23, the chunk
    assert not torch.allclose(sparse[:, 24:36], ref[:, 24:36], atol=1e-3)
