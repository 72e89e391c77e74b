"""Engine invariants over every policy: r=1 = full prefill, r=0 = plain reuse, the reusable cache is
untouched, runs are deterministic, decoding works, and bad input fails early."""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math

import pytest
import torch
from _docstrings import parameters_section
from _reuse_fixtures import record, tiny_vlm

from kvbench.reuse import (
    ImageKVStore,
    adapter_for,
    available_policies,
    get_policy,
    continuation_logprob,
    greedy_decode,
    prepare,
    refresh,
    run_record,
)
from kvbench.reuse.executor import LayerSchedule, execute
from kvbench.reuse.policies import REFRESH, REGISTRY
from kvbench.reuse.policies.cacheblend import degenerate, linear_layer_counts
from kvbench.reuse.validate import budget_count
from kvbench.utils.spec import parse

torch.set_num_threads(1)
#: Every registered policy that takes a budget (from the registry: a new policy is tested without a line here).
BUDGETED = sorted({cls.name for cls in REGISTRY.values()} - set(REFRESH.fixed_r))


@pytest.fixture(scope="module")
def vlm(tokenizer):
    return adapter_for(*tiny_vlm(tokenizer))


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("imgcache")


@pytest.fixture(scope="module")
def req(vlm, store_dir):
    rec = record([1, 2, 3])
    return prepare(vlm, ImageKVStore(store_dir, vlm, rec["generic_system"]), rec)


@pytest.fixture(scope="module")
def full(vlm, req):
    return refresh(vlm, req, "full", 1.0).output


@pytest.fixture(scope="module")
def reuse(vlm, req):
    return refresh(vlm, req, "reuse", 0.0).output


def test_registry_has_every_method():
    # the papers' methods are all there (a new policy file adds to these, with no line here)
    assert {"conduit", "prophetkv", "mpic", "mpic-first", "cacheblend", "cacheblend-conduit",
            "kvshare-conduit"} <= set(BUDGETED)
    assert set(BUDGETED) | {"reuse", "full", "kvshare"} == set(available_policies())


def test_every_policy_states_what_tables_and_costs_need():
    """The knowledge the reports and the cost model read lives in the policy's class: a label per policy that
    tells its Table 3 row apart from every other, and, for a baseline, which of its forms it is."""
    classes = {cls for cls in REGISTRY.values()}
    labels = [cls.label for cls in classes]
    assert all(isinstance(x, str) and x for x in labels) and len(set(labels)) == len(labels), sorted(labels)
    assert all(cls.form is None or (isinstance(cls.form, str) and cls.form) for cls in classes)
    assert all(dataclasses.is_dataclass(cls) for cls in classes)


def test_stale_reuse_really_differs_from_full(full, reuse):
    """Otherwise the r=0 / r=1 invariants below could not tell the two apart."""
    assert (full.logits - reuse.logits).abs().max() > 1e-2


@pytest.mark.parametrize("policy", BUDGETED)
def test_r1_reproduces_full_prefill(vlm, req, full, policy):
    out = refresh(vlm, req, policy, 1.0).output
    torch.testing.assert_close(out.logits, full.logits, rtol=1e-4, atol=1e-4)
    for layer in range(vlm.n_layers):
        torch.testing.assert_close(out.keys[layer], full.keys[layer], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.values[layer], full.values[layer], rtol=1e-4, atol=1e-4)
    assert out.layer_counts == [req.n_visual] * vlm.n_layers


@pytest.mark.parametrize("policy", [p for p in BUDGETED if p != "cacheblend"])
def test_r0_reproduces_plain_reuse(vlm, req, reuse, policy):
    """Budgeted policies at r = 0 equal plain reuse. For the CacheBlend/KVShare as-run schedules layer 0 is
    still fully recomputed, which is a no-op on K/V: layer-0 inputs of visual tokens are the prefix-independent
    vision features. (The paper-form ``cacheblend`` also recomputes its check layer: next test.)"""
    out = refresh(vlm, req, policy, 0.0).output
    torch.testing.assert_close(out.logits, reuse.logits, rtol=1e-5, atol=1e-5)


def test_cacheblend_paper_form_at_r0_keeps_the_check_layers_new_kv(vlm, req, reuse):
    """At r = 0 CacheBlend still computes every visual token up to its check layer and keeps their new K/V there
    (as the original does): reuse with layers 0-1 fully recomputed, not plain reuse. Before the fix the check
    layer handed every unselected token its reused K/V back, which made r = 0 equal plain reuse."""
    N, L = req.n_visual, vlm.n_layers
    out = refresh(vlm, req, "cacheblend", 0.0).output
    assert out.layer_counts == [N, N] + [0] * (L - 2)
    vis = req.visual_index
    same = execute(vlm, req, LayerSchedule([vis, vis] + [vis[:0]] * (L - 2)))
    assert torch.equal(out.logits, same.logits)
    assert (out.logits - reuse.logits).abs().max() > 1e-4


def test_conduit_midway_is_between_and_nonzero(vlm, req, full, reuse):
    out = refresh(vlm, req, "conduit", 0.3).output
    assert (out.logits - full.logits).abs().max() > 1e-4 and (out.logits - reuse.logits).abs().max() > 1e-4
    assert out.layer_counts == [6] * vlm.n_layers  # ceil(0.3 * 18)


def _digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_reusable_cache_is_byte_identical_after_runs(vlm, req, store_dir):
    files = {p.name: p.read_bytes() for p in store_dir.iterdir()}
    mem = _digest([t for im in req.images for t in (*im.keys, *im.values, im.embeds)])
    stale = _digest(req.stale_k + req.stale_v + [req.embeds])
    for policy in available_policies():
        refresh(vlm, req, policy, 0.4)
    assert {p.name: p.read_bytes() for p in store_dir.iterdir()} == files
    assert _digest([t for im in req.images for t in (*im.keys, *im.values, im.embeds)]) == mem
    assert _digest(req.stale_k + req.stale_v + [req.embeds]) == stale


@pytest.mark.parametrize("policy", BUDGETED + ["reuse"])
@pytest.mark.parametrize("r", [0.1, 0.4])
def test_in_place_refresh_equals_the_copying_one(vlm, req, store_dir, policy, r):
    """The serving path (no second copy of the stale cache) computes exactly what the copying path does: same
    logits, same recomputed rows, same K/V; the request is then consumed and refused, the image cache untouched.
    r = 0.1 makes the shrinking schedules (CacheBlend, KVShare) read old K/V at layers after layer 0."""
    ref = refresh(vlm, req, policy, r)
    mem = _digest([t for im in req.images for t in (*im.keys, *im.values, im.embeds)])
    rec = record([1, 2, 3])   # the `req` fixture's record, assembled afresh
    own = prepare(vlm, ImageKVStore(store_dir, vlm, rec["generic_system"]), rec)
    got = refresh(vlm, own, policy, r, in_place=True)
    assert torch.equal(got.output.logits, ref.output.logits)
    assert got.output.layer_counts == ref.output.layer_counts
    for a, b in zip(got.output.computed_visual, ref.output.computed_visual):
        assert torch.equal(a, b)
    for a, b in zip(got.output.keys + got.output.values, ref.output.keys + ref.output.values):
        assert torch.equal(a, b)
    assert got.output.keys[0] is own.stale_k[0]   # written into the request's own cache, not a copy
    assert own.consumed == (policy != "reuse")
    if own.consumed:
        with pytest.raises(ValueError, match="refreshed in place"):
            refresh(vlm, own, "conduit", r)
    assert _digest([t for im in req.images for t in (*im.keys, *im.values, im.embeds)]) == mem


def test_in_place_scoring_pass_leaves_the_visual_entries_and_the_request_usable(vlm, store_dir):
    from kvbench.reuse.scoring import scoring_pass

    rec = record([1, 2, 3])
    own = prepare(vlm, ImageKVStore(store_dir, vlm, rec["generic_system"]), rec)
    vis = own.visual_index
    before = [k[:, :, vis].clone() for k in own.stale_k + own.stale_v]
    copy_sp, sp = scoring_pass(vlm, own), scoring_pass(vlm, own, in_place=True)
    assert torch.equal(sp.attn, copy_sp.attn) and torch.equal(sp.vnorm, copy_sp.vnorm)
    assert all(torch.equal(k[:, :, vis], b) for k, b in zip(own.stale_k + own.stale_v, before))
    assert not own.consumed
    assert torch.equal(refresh(vlm, own, "conduit", 0.4).output.logits,
                      refresh(vlm, prepare(vlm, ImageKVStore(store_dir, vlm, rec["generic_system"]), rec),
                              "conduit", 0.4).output.logits)


@pytest.mark.parametrize("policy", ["conduit", "cacheblend", "kvshare-conduit"])
def test_same_seed_same_result(tokenizer, tmp_path, policy):
    outs = []
    for i in range(2):
        ad = adapter_for(*tiny_vlm(tokenizer, seed=7))
        rec = record([5, 6])
        res = run_record(ad, ImageKVStore(tmp_path / str(i), ad, rec["generic_system"]), rec, policy, 0.25)
        outs.append(res)
    assert torch.equal(outs[0].output.logits, outs[1].output.logits)
    assert outs[0].output.layer_counts == outs[1].output.layer_counts
    for a, b in zip(outs[0].output.computed_visual, outs[1].output.computed_visual):
        assert torch.equal(a, b)


def test_greedy_decoding_from_refreshed_cache(vlm, req, full):
    """r = 1 decodes exactly what the HF model generates; the K/V of a partial refresh decode too."""
    enc = {k: v for k, v in req.enc.items() if k in ("input_ids", "pixel_values", "image_grid_thw",
                                                     "mm_token_type_ids", "attention_mask")}
    gen = vlm.model.generate(**enc, max_new_tokens=4, do_sample=False)[0, req.seq_len:].tolist()
    assert greedy_decode(vlm, refresh(vlm, req, "conduit", 1.0).output, 4) == gen
    assert greedy_decode(vlm, full, 4) == gen
    part = refresh(vlm, req, "conduit", 0.2).output
    assert len(greedy_decode(vlm, part, 3)) == 3
    assert part.keys[0].shape[2] == req.seq_len  # decoding worked on a copy


def test_continuation_logprob_equals_the_models_own_forward(vlm, req, full):
    """Scoring a continuation over the K/V of full prefill = log-softmax of one HF forward over prompt + continuation."""
    cont = [11, 12, 13]
    enc = {k: v for k, v in req.enc.items() if k in ("input_ids", "pixel_values", "image_grid_thw",
                                                     "mm_token_type_ids", "attention_mask")}
    ids = torch.cat([enc["input_ids"], torch.tensor([cont])], 1)
    enc.update(input_ids=ids, attention_mask=torch.ones_like(ids),
               mm_token_type_ids=torch.cat([enc["mm_token_type_ids"], torch.zeros(1, 3, dtype=torch.long)], 1))
    with torch.no_grad():
        lp = torch.log_softmax(vlm.model(**enc).logits[0, req.seq_len - 1:-1].float(), -1)
    want = float(lp[torch.arange(3), torch.tensor(cont)].sum())
    got, greedy = continuation_logprob(vlm, full, cont)
    assert got == pytest.approx(want, abs=1e-4)
    assert greedy == bool((lp.argmax(-1) == torch.tensor(cont)).all())
    top = greedy_decode(vlm, full, 3)
    assert continuation_logprob(vlm, full, top)[1] is True
    assert continuation_logprob(vlm, full, top[:1])[0] == pytest.approx(float(torch.log_softmax(full.logits, -1)[top[0]]))
    with pytest.raises(ValueError, match="at least one token"):
        continuation_logprob(vlm, full, [])


def test_cacheblend_paper_form_fixes_the_set_at_the_check_layer(vlm, req, full):
    """Layers 0 and 1 (the check layer) compute every visual token and keep all their new K/V; from layer 2 on
    only the top ⌈r·N⌉ by value deviation at layer 1 are computed, the others keep their reused K/V."""
    res = refresh(vlm, req, "cacheblend", 0.25)
    N, vis = req.n_visual, req.visual_index
    counts = res.output.layer_counts
    assert counts[:2] == [N, N] and all(c == 5 for c in counts[2:])  # ceil(0.25*18)
    sel = res.plan.schedule.selected
    for layer in range(2, vlm.n_layers):
        assert torch.equal(res.output.computed_visual[layer], sel)
    dropped = vis[~torch.isin(vis, sel)]
    # every visual row computed at layers 0-1 sees exactly full prefill's inputs there, so its new K/V are the full
    # prefill's; the dropped ones' stale K/V differ from them (else the check below could not tell the two apart)
    assert not torch.allclose(req.stale_v[1][:, :, dropped], full.values[1][:, :, dropped], atol=1e-4)
    for layer in (0, 1):
        torch.testing.assert_close(res.output.keys[layer][:, :, vis], full.keys[layer][:, :, vis], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(res.output.values[layer][:, :, vis], full.values[layer][:, :, vis],
                                   rtol=1e-4, atol=1e-4)
    # from layer 2 on only the selected set carries new K/V
    for layer in range(2, vlm.n_layers):
        assert torch.equal(res.output.keys[layer][:, :, dropped], req.stale_k[layer][:, :, dropped])
        assert torch.equal(res.output.values[layer][:, :, dropped], req.stale_v[layer][:, :, dropped])
        assert not torch.equal(res.output.values[layer][:, :, sel], req.stale_v[layer][:, :, sel])


def test_cacheblend_check_layer_selects_by_value_deviation_there(vlm, req):
    """The fixed set is the top ⌈r·N⌉ by Σ(v_new − v_old)² at the check layer (``deviation="k"``: keys)."""
    for deviation, new_of in (("v", lambda out: out.values[1]), ("k", lambda out: out.keys[1])):
        res = refresh(vlm, req, "cacheblend", 0.25, deviation=deviation)
        old = req.stale_v[1] if deviation == "v" else req.stale_k[1]
        vis = req.visual_index
        dev = ((new_of(res.output) - old)[0][:, vis].float() ** 2).sum(dim=(0, 2))
        want = vis[torch.sort(-dev, stable=True).indices[:5]]
        assert torch.equal(res.plan.schedule.selected.sort().values, want.sort().values), deviation


def test_cacheblend_conduit_schedule(vlm, req):
    res = refresh(vlm, req, "cacheblend-conduit", 0.4)
    counts = res.output.layer_counts
    assert counts == res.plan.info["layer_counts"]
    assert counts[0] == req.n_visual and sum(counts) == 8 * vlm.n_layers  # mean = ceil(0.4*18) = 8
    assert all(a >= b for a, b in itertools.pairwise(counts))
    for a, b in zip(res.output.computed_visual, res.output.computed_visual[1:]):
        assert bool(torch.isin(b, a).all())  # nested


@pytest.mark.parametrize("policy", ["cacheblend-conduit", "kvshare-conduit"])
def test_as_run_first_shrink_ties_first_or_random(vlm, req, policy):
    """Issue #33, item 5: every layer-0 deviation is 0, so with the default tie rule the first shrink keeps the first
    visual tokens in every request; ``ties=random`` keeps a seeded random subset (the plan records the rule)."""
    first = refresh(vlm, req, policy, 0.4)
    kept = first.output.computed_visual[1]
    assert kept.tolist() == req.visual_index[:kept.numel()].tolist()
    torch.manual_seed(0)
    rand = refresh(vlm, req, policy, 0.4, ties="random")
    torch.manual_seed(0)
    again = refresh(vlm, req, policy, 0.4, ties="random")
    assert rand.output.layer_counts == first.output.layer_counts and rand.plan.info["ties"] == "random"
    assert rand.output.computed_visual[1].tolist() == again.output.computed_visual[1].tolist() != kept.tolist()
    assert "ties" not in first.plan.info
    with pytest.raises(ValueError, match=f"{policy} ties must be one of .'first', 'random'., got 'rand'"):
        refresh(vlm, req, policy, 0.4, ties="rand")


@pytest.mark.parametrize("L,N,k", [(28, 1000, 100), (6, 18, 8), (6, 18, 2), (6, 18, 18), (1, 5, 1), (4, 3, 1)])
def test_linear_layer_counts(L, N, k):
    c = linear_layer_counts(L, N, k)
    assert len(c) == L and c[0] == N and all(a >= b >= 0 for a, b in itertools.pairwise(c))
    assert sum(c) == max(N, min(k * L, N * L))


def _authors_layer_counts(L: int, N: int, avg: int) -> list[int]:
    """Reference: CONDUIT's ``build_cacheblend_layer_counts`` (``cpa2001/CONDUIT`` @ 96c71d2,
    ``nanovllm/engine/recompute.py``), re-derived from what it does, written independently:

    1. the target total is the average clipped to [0, N], times L, clipped to [N, N·L]; all-N or layer-0-only
       at the two ends;
    2. a continuous profile, N at layer 0 and N·(1 − l/H) clipped to [0, N] after, is fitted to that total by
       halving an interval for H (start [0, 1], double the top until it reaches the total, then 64 halvings,
       keeping the top end);
    3. each layer takes floor(value + 1e-12) and remembers value minus that floor; layer 0 is N; counts are
       made non-increasing;
    4. every unit still missing goes, one at a time, to the layer with the largest remembered fraction among
       the layers strictly below their predecessor (scanning from layer 1, a later layer wins only by more
       than 1e-12). The fractions are never spent, so that layer keeps winning until it reaches its
       predecessor.
    """
    target = max(N, min(max(0, min(avg, N)) * L, N * L))
    if target == N * L:
        return [N] * L
    if target == N:
        return [N] + [0] * (L - 1)

    def total(h):
        return sum([float(N)] + [max(0.0, min(float(N), N * (1.0 - layer / h))) for layer in range(1, L)])

    top = 1.0
    while total(top) < target:
        top *= 2.0
    bottom = 0.0
    for _ in range(64):
        middle = (bottom + top) / 2.0
        if total(middle) < target:
            bottom = middle
        else:
            top = middle
    values = [float(N)] + [max(0.0, min(float(N), N * (1.0 - layer / top))) for layer in range(1, L)]
    out, parts = [], []
    for v in values:
        whole = math.floor(v + 1e-12)
        out.append(min(N, max(0, whole)))
        parts.append(v - whole)
    out[0] = N
    for layer in range(1, L):
        out[layer] = min(out[layer], out[layer - 1])
    missing = target - sum(out)
    while missing > 0:
        winner, best = None, -1.0
        for layer in range(1, L):
            if out[layer] < out[layer - 1] and parts[layer] > best + 1e-12:
                winner, best = layer, parts[layer]
        out[winner] += 1
        missing -= 1
    return out


@pytest.mark.parametrize("L", [2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 28, 36])
def test_linear_layer_counts_are_the_authors(L):
    """``linear_layer_counts`` = CONDUIT's ``build_cacheblend_layer_counts`` (leftover units included) over many
    (N, r): the schedule both ``cacheblend-conduit`` and ``kvshare-conduit`` run."""
    for N in (1, 2, 5, 7, 18, 30, 64, 100, 256, 333, 1000, 2048):
        for r in (0.0, 0.02, 0.05, 0.1, 0.16, 0.2, 0.25, 1 / 3, 0.5, 0.75, 0.9, 1.0):
            k = budget_count(r, N)
            assert linear_layer_counts(L, N, k) == _authors_layer_counts(L, N, k), (L, N, r)


@pytest.fixture(scope="module")
def shallow(tokenizer, store_dir):
    """A 6-layer zoo VLM (the depth of the former zoo model) and its request: (adapter, request, reuse output)."""
    vlm = adapter_for(*tiny_vlm(tokenizer, num_hidden_layers=6))
    rec = record([1, 2, 3])
    req = prepare(vlm, ImageKVStore(store_dir / "shallow", vlm, rec["generic_system"]), rec)
    return vlm, req, refresh(vlm, req, "reuse", 0.0).output


@pytest.mark.parametrize("policy", ["cacheblend-conduit", "kvshare-conduit"])
def test_as_run_schedule_says_when_it_is_degenerate(shallow, vlm, req, policy):
    """6 layers, 18 visual tokens: at r = 0.05 the budget ⌈0.9⌉ = 1 times 6 layers is below N, so the whole budget
    goes to layer 0 and the run equals plain reuse; the plan says so. At r = 0.4 it does not. The 24-layer zoo
    VLM is not degenerate at r = 0.05 (1 x 24 > 18)."""
    assert not refresh(vlm, req, policy, 0.05).plan.info["degenerate"]
    vlm, req, reuse = shallow
    assert vlm.n_layers == 6
    low = refresh(vlm, req, policy, 0.05)
    assert low.output.layer_counts == [req.n_visual] + [0] * (vlm.n_layers - 1) and low.plan.info["degenerate"]
    torch.testing.assert_close(low.output.logits, reuse.logits, rtol=1e-5, atol=1e-5)
    assert not refresh(vlm, req, policy, 0.4).plan.info["degenerate"]


def test_linear_layer_counts_leftovers_follow_the_authors():
    """Hand-worked case: L = 5, N = 7, average 3 → total 15; H = 42/13 gives 7, 4.83, 2.67, 0.5, 0 → floors
    7, 4, 2, 0, 0 (13). Both missing units go to layer 1 (largest fraction, never spent), not one to layer 1
    and one to layer 2 as a largest-remainder rule would: [7, 6, 2, 0, 0]."""
    assert linear_layer_counts(5, 7, 3) == [7, 6, 2, 0, 0]
    assert linear_layer_counts(6, 18, 2) == [18, 0, 0, 0, 0, 0] and degenerate(linear_layer_counts(6, 18, 2))
    assert not degenerate(linear_layer_counts(6, 18, 4)) and not degenerate([5]) and not degenerate([0, 0])


@pytest.mark.parametrize("policy", ["conduit", "prophetkv"])
def test_as_run_phase2_differs_from_full_only_through_inter_image_text(vlm, req, full, tmp_path, policy):
    """CONDUIT's code recomputes only the trailing query text in Phase 2 (for its ProphetKV too); text between
    images keeps its Stage-I K/V, so even r = 1 misses full prefill there. With one image and no text after it
    except the query, the two coincide."""
    asrun = refresh(vlm, req, policy, 1.0, phase2_text="query")
    assert torch.equal(asrun.plan.text_rows, req.query_index) and asrun.plan.base_from_stage1
    assert (asrun.output.logits - full.logits).abs().max() > 1e-4
    rec = record([9])
    one = prepare(vlm, ImageKVStore(tmp_path, vlm, rec["generic_system"]), rec)
    torch.testing.assert_close(refresh(vlm, one, policy, 1.0, phase2_text="query").output.logits,
                               refresh(vlm, one, "full", 1.0).output.logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy", ["conduit", "prophetkv"])
def test_phase2_text_option_is_shared(policy):
    """One field, default and check for both scorers (``Phase2TextPolicy``), also through a method spec."""
    assert get_policy(policy).phase2_text == "all"
    with pytest.raises(ValueError, match="phase2_text must be 'all' or 'query', got 'some'"):
        get_policy(policy, phase2_text="some")
    spec = parse(f"{policy}@0.1:phase2_text=query", REFRESH)
    assert spec.canonical == f"{policy}@0.1:phase2_text=query" and spec.build().phase2_text == "query"
    assert parse(f"{policy}@0.1:phase2_text=all", REFRESH).canonical == f"{policy}@0.1"  # the default is dropped


@pytest.mark.parametrize("r", [-0.1, 1.5, float("nan"), "0.5", True])
def test_bad_ratio(vlm, req, r):
    with pytest.raises(ValueError, match=r"r must be a refresh ratio in \[0, 1\]"):
        refresh(vlm, req, "conduit", r)


@pytest.mark.parametrize("lam", [-0.5, 1.01, float("nan")])
def test_bad_lambda(lam):
    with pytest.raises(ValueError, match=r"λ\) must be in \[0, 1\]"):
        get_policy("conduit", lam=lam)


def test_unknown_policy(vlm, req):
    with pytest.raises(ValueError, match="unknown refresh policy 'snapkv'; expected one of"):
        refresh(vlm, req, "snapkv", 0.1)


def test_bad_input_fails_before_any_work(vlm, tmp_path):
    """Errors come before any cache is built (the store directory stays empty but for its manifest)."""
    rec = record([1])
    store = ImageKVStore(tmp_path, vlm, rec["generic_system"])
    for kwargs, msg in [({"policy": "conduit", "r": 2.0}, "refresh ratio"),
                        ({"policy": "nope", "r": 0.1}, "unknown refresh policy"),
                        ({"policy": "conduit", "r": 0.1, "lam": 3.0}, "λ"),
                        ({"policy": "mpic", "r": 0.1, "k": -1}, "mpic k")]:
        with pytest.raises(ValueError, match=msg):
            run_record(vlm, store, rec, **kwargs)
    no_img = dict(rec, content=[{"type": "text", "text": "Page 1:"}])
    with pytest.raises(ValueError, match="has no image part"):
        run_record(vlm, store, no_img, "conduit", 0.1)
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


@pytest.mark.parametrize("name", sorted({cls.name for cls in REGISTRY.values()}))
def test_every_policy_documents_its_source_and_parameters(name):
    """Each registered policy's class docstring names the paper it implements and has a Parameters section that
    names every field (a parameter a spec can set)."""
    cls = REGISTRY[name]
    params = parameters_section(cls)
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in params]
    assert not missing, f"{cls.__name__}'s Parameters section does not name {missing}"


def test_oracle_refreshes_the_tokens_of_largest_true_deviation(vlm, req, full, reuse):
    """``oracle-kv`` picks the top ⌈r·N⌉ by Σ_l ‖Δ[K‖V]‖₂ against the full prefill, recomputed by hand here; at r = 1
    it is full prefill. Its refresh closes more of the reuse -> full logit gap than refreshing the tokens of
    *smallest* deviation (the same count), on this random model too."""
    vis = req.visual_index
    dev = torch.zeros(len(vis))
    for layer in range(vlm.n_layers):
        kv = lambda x: x[0][:, vis].float().permute(1, 0, 2).reshape(len(vis), -1)  # noqa: E731
        dev += torch.cat([kv(full.keys[layer]) - kv(req.stale_k[layer]),
                          kv(full.values[layer]) - kv(req.stale_v[layer])], dim=1).norm(dim=1)
    res = refresh(vlm, req, "oracle-kv", 0.25)
    k = res.n_selected
    want = vis[torch.sort(-dev, stable=True).indices[:k]]
    assert torch.equal(res.plan.selected, want.sort().values)
    assert torch.allclose(res.plan.scores, dev, rtol=1e-4, atol=1e-5)
    worst = vis[torch.sort(dev, stable=True).indices[:k]].sort().values
    from kvbench.reuse.executor import LayerSchedule, execute

    low = execute(vlm, req, LayerSchedule(worst))
    gap = lambda out: (out.logits - full.logits).abs().sum()  # noqa: E731
    assert gap(res.output) < gap(low) < gap(reuse) + 1e-6
    top = refresh(vlm, req, "oracle-kv", 1.0)
    assert torch.allclose(top.output.logits, full.logits, atol=1e-4)
