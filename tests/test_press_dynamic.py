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
    cache = SimpleNamespace(step=StepState(), selections=[])
    selector = SimpleNamespace(n_sink=2, window=3, audit_steps=1, n_keep=lambda n: 2)
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
    assert cache.step.selected.tolist() == [] and cache.selections == []   # nothing before the window yet
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
    # decode step at position 60: candidates 4..51 (boundary 60 - 8), ceil(0.17 * 48) = 9 selected
    sel = cache.step.selected
    assert len(sel) == 9 and sel.min() >= 4 and sel.max() < 52 and (sel.diff() > 0).all()
    assert cache.selections == [sel.tolist()]           # the context chunk had no candidate
    view = cache.layers[2].last_view
    want = torch.cat([torch.arange(4), sel, torch.arange(52, 61)])
    assert torch.equal(view.positions[0, 0], want)
    assert cache.layers[2]._view is None                 # not held once the step is over
    ref = full.layers[2].last_view
    assert torch.equal(view.keys, ref.keys[..., want, :]) and torch.equal(view.values, ref.values[..., want, :])
    assert [type(layer) for layer in cache.layers] == [StoreLayer, StoreLayer, omnikv.SparseLayer]
    assert [layer.after_commit for layer in cache.layers] == [None, press.filter, None]
    assert cache.attended[-1] == [61, 61, 4 + 9 + 9]


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