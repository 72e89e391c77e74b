"""Scoring pass pieces: attention mass, V norms, image coefficients, budget, top-k."""
from __future__ import annotations

import math

import pytest
import torch
from _reuse_fixtures import prepared_request, record, tiny_vlm
from _tolerance import arith_atol

from kvbench.reuse import (
    ImageKVStore,
    adapter_for,
    budget_count,
    get_policy,
    prepare,
    scoring_pass,
)
from kvbench.reuse.scoring import (
    attention_mass,
    image_coefficients,
    layer_mean,
    top_k,
    value_norms,
)


@pytest.fixture(scope="module")
def vlm(tokenizer):
    return adapter_for(*tiny_vlm(tokenizer))


@pytest.fixture(scope="module")
def req(vlm, tmp_path_factory):
    return prepared_request(vlm, tmp_path_factory.mktemp("c"), [1, 2, 3])


def test_attention_mass_in_query_chunks_equals_one_block():
    """KVShare's mass reads every computed row (n_q = T): chunked so no [n_heads, T, T] block is built."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 4, 37, 8, generator=g), torch.randn(1, 2, 37, 8, generator=g)
    pos = torch.arange(37)
    whole = attention_mass(q, k, pos, 0.35)
    for chunk in (4 * 37, 4 * 37 * 5, 1):   # one query, five queries, and below one query per block
        torch.testing.assert_close(attention_mass(q, k, pos, 0.35, chunk_elements=chunk), whole)
    assert abs(float(attention_mass(q, k, pos, 0.35, chunk_elements=100).sum()) - 1.0) < 1e-5


def test_attention_mass_matches_bruteforce_with_gqa():
    torch.manual_seed(0)
    H, Hkv, nq, T, d = 4, 2, 3, 7, 5
    q, k = torch.randn(1, H, nq, d), torch.randn(1, Hkv, T, d)
    pos = torch.tensor([4, 5, 6])
    want = torch.zeros(T)
    for h in range(H):
        for i in range(nq):
            logits = (q[0, h, i] @ k[0, h // (H // Hkv)].T) * 0.3  # query head h reads kv head h // 2
            logits[pos[i] + 1:] = -math.inf
            want += torch.softmax(logits, -1)
    torch.testing.assert_close(attention_mass(q, k, pos, 0.3), want / (H * nq))
    with pytest.raises(ValueError, match="multiple"):
        attention_mass(torch.randn(1, 3, 1, d), k, pos[:1], 1.0)


def test_scoring_pass_layer0_mass_equals_eager_attention_of_full_prefill(vlm, req):
    """At layer 0 the stale visual keys equal the fresh ones (layer-0 inputs do not depend on the prefix),
    so α_0 must equal the eager attention probabilities of a full prefill, averaged over the trailing-text
    queries and heads. Later layers differ (stale cache), which the second assert checks."""
    sp = scoring_pass(vlm, req)
    vlm.model.config._attn_implementation = "eager"
    vlm.model.config.text_config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            out = vlm.model(**{k: v for k, v in req.enc.items() if k in
                               ("input_ids", "pixel_values", "image_grid_thw", "mm_token_type_ids")},
                            output_attentions=True)
    finally:
        vlm.model.config._attn_implementation = "sdpa"
        vlm.model.config.text_config._attn_implementation = "sdpa"
    ref = [a[0][:, req.query_index].mean(dim=(0, 1))[req.visual_index] for a in out.attentions]
    torch.testing.assert_close(sp.attn[0], ref[0].float(), rtol=1e-4, atol=1e-6)
    assert (sp.attn[-1] - ref[-1]).abs().max() > 1e-5
    # ‖V‖ is the cached (stale) value norm over all KV heads
    torch.testing.assert_close(sp.vnorm[2], value_norms(req.stale_v[2])[req.visual_index])


def test_value_norms_over_all_kv_heads():
    v = torch.zeros(1, 2, 3, 2)
    v[0, 0, 1] = torch.tensor([3.0, 0.0])
    v[0, 1, 1] = torch.tensor([0.0, 4.0])
    assert value_norms(v).tolist() == [0.0, 5.0, 0.0]


def test_image_coefficients_formula_and_k1():
    ids = torch.tensor([0, 0, 1, 1])
    s = torch.tensor([1.0, 3.0, 1.0, 1.0])  # m = [2, 1], mean m = 1.5
    c = image_coefficients(s, ids, 2, 1.0)
    torch.testing.assert_close(c, torch.tensor([2 / 1.5, 1 / 1.5]))
    torch.testing.assert_close(image_coefficients(s, ids, 2, 0.5), 1 + 0.5 * (torch.tensor([2, 1]) / 1.5 - 1))
    assert image_coefficients(s, ids, 2, 0.0).tolist() == [1.0, 1.0]
    assert image_coefficients(torch.tensor([0.5, 9.0]), torch.tensor([0, 0]), 1, 1.0).tolist() == [1.0]
    # negative scores are clamped at 0 inside m_j (authors' code)
    torch.testing.assert_close(image_coefficients(torch.tensor([-5.0, 2.0, 1.0]), torch.tensor([0, 0, 1]), 2, 1.0),
                               torch.tensor([1.0, 1.0]))


def test_k1_request_gives_coefficient_one(vlm, tmp_path):
    rec = record([4])
    req1 = prepare(vlm, ImageKVStore(tmp_path, vlm, rec["generic_system"]), rec)
    sp = scoring_pass(vlm, req1)
    plan = get_policy("conduit").plan(req1, sp, 0.5)
    assert plan.coefficients.tolist() == [1.0]
    torch.testing.assert_close(plan.scores, sp.token_scores())


def test_budget_count_is_ceil_and_exact():
    assert budget_count(0.1, 30) == 3  # 0.1*30 = 3.0000000000000004 in binary: still 3
    assert budget_count(0.1, 31) == 4
    assert budget_count(0.0, 50) == 0 and budget_count(1.0, 50) == 50
    assert budget_count(0.05, 18) == 1


@pytest.mark.parametrize("policy", ["conduit", "prophetkv", "mpic-first"])
@pytest.mark.parametrize("r", [0.05, 0.1, 0.3, 0.5])
def test_selected_count_equals_ceil_r_n(vlm, req, policy, r):
    sp = scoring_pass(vlm, req)
    plan = get_policy(policy).plan(req, sp, r)
    assert plan.selected.numel() == math.ceil(r * req.n_visual - 1e-9)
    assert bool(torch.isin(plan.selected, req.visual_index).all())
    assert plan.selected.unique().numel() == plan.selected.numel()


def test_conduit_selects_the_top_of_its_own_scores(vlm, req):
    sp = scoring_pass(vlm, req)
    plan = get_policy("conduit").plan(req, sp, 0.3)
    s = sp.token_scores()
    c = sp.coefficients(s, 1.0)
    final = s * c[req.image_of_visual]
    torch.testing.assert_close(plan.scores, final)
    chosen = torch.isin(req.visual_index, plan.selected)
    assert final[chosen].min() >= final[~chosen].max()
    # layer subset is honoured
    sub = get_policy("conduit", layers=[1, 3]).plan(req, sp, 0.3)
    s13 = layer_mean(sp.attn * sp.vnorm, [1, 3])
    torch.testing.assert_close(sub.scores, s13 * sp.coefficients(s13, 1.0)[req.image_of_visual])
    # ProphetKV = attention only, no coefficient
    torch.testing.assert_close(get_policy("prophetkv").plan(req, sp, 0.3).scores, sp.attn.mean(0))


def test_top_k_ties_are_deterministic():
    s = torch.tensor([1.0, 2.0, 2.0, 0.5, 2.0])
    assert top_k(s, 2).tolist() == [1, 2]
    assert top_k(s, 0).tolist() == []


def test_top_k_random_ties_are_seeded_and_leave_distinct_scores_alone():
    """``ties="random"`` (issue #33, item 5): all-equal scores (the as-run first shrink at layer 0) give a random
    subset, the same under the same torch seed and another under another; distinct scores rank as with "first"."""
    flat = torch.zeros(40)
    picks = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        picks.append(top_k(flat, 10, ties="random").tolist())
    assert picks[0] == picks[1] != picks[2] and picks[0] != list(range(10)) and len(set(picks[0])) == 10
    assert top_k(flat, 10).tolist() == list(range(10))
    s = torch.randn(50)
    torch.manual_seed(3)
    assert top_k(s, 7, ties="random").tolist() == top_k(s, 7).tolist()
    s = torch.tensor([1.0, 2.0, 2.0, 0.5, 2.0])   # the top one is fixed, the tied pair is drawn among three
    torch.manual_seed(0)
    got = top_k(s, 2, ties="random").tolist()
    assert len(got) == 2 and set(got) <= {1, 2, 4}


def test_scoring_pass_projects_queries_for_the_trailing_rows_only(vlm, req, monkeypatch):
    """§3.3 reads the attention mass of the query tokens alone: the pass projects only their queries (not every
    text row's), with the same α as the mass of those rows' queries computed over every row."""
    from kvbench.reuse.scoring import _ScoringSchedule

    want = scoring_pass(vlm, req)
    seen = []
    original = type(vlm).queries

    def counted(self, layer, x, cos, sin):
        seen.append(x.shape[1])
        return original(self, layer, x, cos, sin)
    monkeypatch.setattr(type(vlm), "queries", counted)
    monkeypatch.setattr(_ScoringSchedule, "query_mask", lambda self, rows: None)   # the former pass: every row's
    # queries projected, then the trailing rows' taken

    def former_observe(self, state):
        qrow = torch.isin(state.rows, self.req.query_index)
        mass = attention_mass(state.queries[:, :, qrow], state.keys, state.rows[qrow], state.scale)
        self.attn.append(mass[self.req.visual_index])
        self.vnorm.append(value_norms(state.values)[self.req.visual_index])
    monkeypatch.setattr(_ScoringSchedule, "observe", former_observe)
    every = scoring_pass(vlm, req)
    assert set(seen) == {len(req.text_index)} and len(req.query_index) < len(req.text_index)
    # the same masses summed from queries projected in batches of another shape: softmax over the request's keys
    torch.testing.assert_close(every.attn, want.attn, rtol=0, atol=arith_atol(want.attn, req.seq_len))
    seen.clear()
    monkeypatch.undo()
    monkeypatch.setattr(type(vlm), "queries", counted)
    again = scoring_pass(vlm, req)
    assert seen == [len(req.query_index)] * vlm.n_layers and torch.equal(again.attn, want.attn)


@pytest.mark.parametrize("heads,kv,n_q,T,hd", [(4, 2, 5, 40, 32), (16, 2, 9, 700, 128), (12, 12, 3, 100, 64)])
def test_grouped_attention_mass_is_bitwise_the_repeated_k_form(heads, kv, n_q, T, hd):
    """Grouping the query heads per KV head (no copy of K per query head) changes no bit of α here."""
    g = torch.Generator().manual_seed(heads + T)
    q, k = torch.randn(1, heads, n_q, hd, generator=g), torch.randn(1, kv, T, hd, generator=g)
    pos = torch.sort(torch.randint(T // 2, T, (n_q,), generator=g)).values
    kk = k.repeat_interleave(heads // kv, dim=1)
    logits = (q @ kk.transpose(-1, -2)) * hd ** -0.5
    logits = logits.masked_fill((torch.arange(T)[None, :] > pos[:, None])[None, None], float("-inf"))
    assert torch.equal(attention_mass(q, k, pos, hd ** -0.5), torch.softmax(logits, -1).mean(dim=(0, 1, 2)))
