"""Visual-token presses: FastV, PACT, DivPrune (kvbench.compress.presses.{fastv,pact,divprune,visual}).

A tiny random Qwen2 text model stands in for the VLM's language model; ``cache.visual`` is set by hand to a span
of the prompt (the VLM path sets it from the processor's image tokens). The references are computed here
independently: token removal by running the decoder layers on the shortened sequence with the kept tokens'
original position ids (FastV's latency path, DivPrune's pruned input up to position ids), FastV's selection from
the eager attention map, DivPrune's by brute force.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from kvbench.compress.cache import Press, VisualTokens, press_attention
from kvbench.compress.presses.divprune import (
    DivPrunePress,
    cosine_distances,
    divprune_select,
)
from kvbench.compress.presses.fastv import FastVPress
from kvbench.compress.presses.pact import (
    PACTPress,
    dbdpc_centers,
    euti_keep,
    euti_scores,
    pact_clusters,
    reduction_of,
)
from kvbench.models import rope

pytestmark = pytest.mark.usefixtures("one_thread")

T, VIS = 48, torch.arange(8, 32)          # prompt length; the "image" span


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, intermediate_size=128, vocab_size=256)
    cfg._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(cfg).float().eval()


def ids_of(n=T, seed=1):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def visual(model, ids, positions=VIS):
    with torch.no_grad():
        return VisualTokens(positions, model.get_input_embeddings()(ids)[0, positions])


def run(model, press, ids, chunks=(T,), positions=VIS, extra=()):
    """Logits of every chunk (``chunks``: their ends), then of each token of ``extra`` decoded one by one."""
    cache = press.new_cache(model)
    cache.visual = None if positions is None else visual(model, ids, positions)
    out, start = [], 0
    with torch.inference_mode(), press_attention(model, cache):
        for end in list(chunks) + [T + i + 1 for i in range(len(extra))]:
            chunk = ids[:, start:end] if end <= T else torch.tensor([[extra[end - T - 1]]])
            pos = torch.arange(start, end).view(1, -1)
            out.append(model(input_ids=chunk, position_ids=pos, cache=cache, use_cache=True).logits[0])
            start = end
    return out, cache


@torch.no_grad()
def removal(model, ids, start, kept):
    """Reference: decoder layers ``< start`` over every token, layers ``>= start`` over the ``kept`` positions
    only (int64, ascending), each token at its original position id. Logits ``[n_kept, V]``."""
    inner = model.model
    h, pos = inner.embed_tokens(ids), torch.arange(ids.shape[1])
    for i, layer in enumerate(inner.layers):
        if i == start:
            h, pos = h[:, kept], pos[kept]
        n = h.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool).tril().view(1, 1, n, n)
        h = layer(h, attention_mask=mask, position_ids=pos.view(1, -1),
                  position_embeddings=inner.rotary_emb(h, pos.view(1, -1)))
    logits = model.lm_head(inner.norm(h))[0]
    return logits if start < len(inner.layers) else logits[kept]


def kept_after(removed, n=T):
    keep = torch.ones(n, dtype=torch.bool)
    keep[removed] = False
    return keep.nonzero().flatten()


def test_the_removal_reference_is_the_model_when_nothing_is_removed(model):
    ids = ids_of()
    assert torch.allclose(removal(model, ids, 2, torch.arange(T)), model(ids).logits[0], atol=1e-5)


# -- FastV ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layer, keep", [(2, 0.5), (1, 0.25), (3, 0.1)])
def test_fastv_equals_token_removal_from_layer_k(model, layer, keep):
    ids = ids_of()
    # reference selection: layer K-1's eager attention map, mean over heads, last row, top round(keep * n)
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            att = model(ids, output_attentions=True).attentions[layer - 1][0, :, -1].mean(0)
    finally:
        model.set_attn_implementation("sdpa")
    top = VIS[att[VIS].topk(round(keep * len(VIS))).indices]
    kept = kept_after(VIS[~torch.isin(VIS, top)])
    tok = 7
    (prefill, step), cache = run(model, FastVPress(layer=layer, keep=keep), ids, extra=[tok])
    assert torch.equal(cache.layers[-1].state.reduction.removed, VIS[~torch.isin(VIS, top)])
    ref = removal(model, ids, layer, kept)
    assert torch.allclose(prefill[kept], ref, atol=1e-4)
    # decoding reads the same kept set (the original's KV-cache variant); the new token is position T
    ids2 = torch.cat([ids, torch.tensor([[tok]])], 1)
    assert torch.allclose(step[-1], removal(model, ids2, layer, torch.cat([kept, torch.tensor([T])]))[-1], atol=1e-4)


def test_fastv_leaves_the_first_k_layers_whole(model):
    ids = ids_of()
    _, full = run(model, Press(), ids, positions=None)
    _, cache = run(model, FastVPress(layer=2, keep=0.25), ids)
    for i, (a, b) in enumerate(zip(full.layers, cache.layers)):
        if i < 2:
            assert torch.equal(a._stored.keys, b._stored.keys) and torch.equal(a._stored.values, b._stored.values)
            assert b.kept_share() == 1.0
        else:   # 18 of 24 visual tokens evicted, and KR follows the bytes kept
            assert b._stored.keys.shape[-2] == T - 18 and b.kept_share() == (T - 18) / T
            assert b.packed_bytes().full_layer == a.packed_bytes().full_layer * (T - 18) // T


# -- DivPrune ---------------------------------------------------------------------------------------------
def min_pairwise(dist, subset):
    return min(float(dist[i, j]) for i, j in itertools.combinations(subset, 2))


def test_divprune_greedy_reaches_the_brute_force_max_min_on_a_small_example():
    deg = torch.tensor([0.0, 10.0, 90.0, 180.0, 185.0]) * math.pi / 180
    emb = torch.stack([deg.cos(), deg.sin()], 1)
    dist = cosine_distances(emb)
    picked = divprune_select(emb, 3).tolist()
    assert picked == [2, 4, 0]   # 90 deg (its nearest is farthest), then 185, then 0
    best = max(min_pairwise(dist, s) for s in itertools.combinations(range(5), 3))
    assert math.isclose(min_pairwise(dist, picked), best, rel_tol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_divprune_follows_the_greedy_rule_step_by_step(seed):
    emb = torch.randn(9, 5, generator=torch.Generator().manual_seed(seed))
    dist = cosine_distances(emb)
    n = 9
    first = max(range(n), key=lambda i: (min(float(dist[i, j]) for j in range(n) if j != i), -i))
    want = [first]
    while len(want) < 6:
        want.append(max((i for i in range(n) if i not in want),
                        key=lambda i: (min(float(dist[i, j]) for j in want), -i)))
    assert divprune_select(emb, 6).tolist() == want


def test_divprune_kept_tokens_see_only_each_other_from_layer_zero(model):
    ids = ids_of()
    press = DivPrunePress(keep=0.3)
    (prefill,), cache = run(model, press, ids)
    removed = cache.layers[0].state.reduction.removed
    assert len(removed) == len(VIS) - round(0.3 * len(VIS))
    k = len(VIS) - len(removed)
    assert sorted(VIS[~torch.isin(VIS, removed)].tolist()) == sorted(VIS[divprune_select(visual(model, ids).embeds, k)].tolist())
    kept = kept_after(removed)
    assert torch.allclose(prefill[kept], removal(model, ids, 0, kept), atol=1e-4)
    for layer in cache.layers:   # evicted everywhere, layer 0 included
        assert not torch.isin(layer._stored.positions, removed).any()


# -- PACT -------------------------------------------------------------------------------------------------
def unit(*v):
    x = torch.tensor(v, dtype=torch.float32)
    return x / x.norm()


def test_pact_clusters_a_hand_made_example():
    # three directions: 3 tokens around e1, 2 around e2, 1 at e3 (EUTI kept), then two pruned tokens: one close to
    # e1 (joins its cluster), one between e1 and e3 (farther than 1.5 * cutoff from every centre: dropped)
    vec = torch.stack([unit(1, .08, 0), unit(1, 0, 0), unit(1, -.08, 0), unit(0, 1, 0), unit(0, 1, .1),
                       unit(0, 0, 1), unit(1, .1, .05), unit(1, 0, 1)])
    kept = torch.tensor([True] * 6 + [False, False])
    # each group's centre is its densest token, density summed over every kept token (dc = 2)
    density = torch.exp(-(cosine_distances(vec[:6]).clamp_min(0) / 2) ** 2).sum(1)
    a, b = int(density[:3].argmax()), 3 + int(density[3:5].argmax())
    assert sorted(dbdpc_centers(vec[kept], cutoff=0.05).tolist()) == [a, b, 5]
    assign = pact_clusters(vec, kept, cutoff=0.05, coef_pruned=1.5)
    assert assign.tolist() == [a, a, a, b, b, 5, a, -1]
    red = reduction_of(torch.arange(100, 108), assign, start=2)
    assert red.removed.tolist() == [p for p in range(100, 108) if p - 100 not in (a, b, 5)]
    assert red.centers.tolist() == [100 + a, 100 + b]              # the singleton at e3 is kept, not merged
    assert torch.allclose(red.log_size.exp(), torch.tensor([4.0, 2.0]))
    assert sorted(red.members.tolist()) == [100, 101, 102, 103, 104, 106]
    assert red.member_of.tolist() == [0 if m - 100 in (0, 1, 2, 6) else 1 for m in red.members.tolist()]


def test_dbdpc_with_a_zero_cutoff_makes_every_distinct_token_a_centre():
    x = torch.randn(14, 6, generator=torch.Generator().manual_seed(0))
    assert sorted(dbdpc_centers(x, 0.0).tolist()) == list(range(14))


def test_euti_ranks_by_attention_times_hidden_norm():
    # equal keys: the global query's softmax is uniform, so the hidden-state norm decides
    q, k = torch.randn(1, 4, 6, 8), torch.ones(1, 2, 6, 8)
    s = euti_scores(q, k, torch.tensor([1, 2, 3, 4]), torch.tensor([1.0, 3.0, 2.0, 3.0]))
    assert torch.allclose(s, torch.tensor([1.0, 3.0, 2.0, 3.0]) / 6)
    assert euti_keep(s, 0.55).tolist() == [False, True, False, True]     # int(4 * 0.55) = 2, ties to lowest index
    assert euti_keep(s, 0.1).tolist() == [False, True, False, False]     # at least one


def test_pact_merges_clusters_in_the_cache_as_the_mean_of_members_before_rope(model):
    ids = ids_of()
    press = PACTPress(layer=1, keep=0.75, cutoff=0.5)
    _, full = run(model, Press(), ids, positions=None)
    _, cache = run(model, press, ids)
    red = cache.layers[-1].state.reduction
    assert red.centers.numel() > 0 and (red.log_size > 0).all()
    layer, ref = cache.layers[1], full.layers[1]    # layer L's input is untouched, so its members' K/V are the full's
    rot, fn = cache.layers[1].ctx.rotary_emb, cache.layers[1].ctx.apply_rope
    cos, sin = rope.cos_sin(rot, torch.arange(T).view(1, -1), torch.float32)
    pre = rope.unrotate(fn, ref._stored.keys, cos, sin)
    at = torch.searchsorted(layer._stored.positions[0, 0], red.centers)
    for c, (p, ls) in enumerate(zip(red.centers.tolist(), red.log_size.tolist())):
        members = red.members[red.member_of == c]
        assert len(members) == round(math.exp(ls))
        k = rope.rotate(fn, pre[:, :, members].mean(2, keepdim=True), cos[:, [p]], sin[:, [p]])
        assert torch.allclose(layer._stored.keys[:, :, at[c]], k[:, :, 0], atol=1e-5)
        assert torch.allclose(layer._stored.values[:, :, at[c]], ref._stored.values[:, :, members].mean(2), atol=1e-6)
    for i, lay in enumerate(cache.layers):
        n_kept = T if i < 1 else T - len(red.removed)
        assert lay._stored.keys.shape[-2] == n_kept and not (i >= 1 and torch.isin(lay._stored.positions, red.removed).any())
    assert torch.equal(cache.layers[0]._stored.keys, full.layers[0]._stored.keys)


def test_pact_proportional_attention_changes_what_the_merged_tokens_weigh(model):
    ids = ids_of()
    (a, a_step), ca = run(model, PACTPress(layer=1, keep=0.75, cutoff=0.5), ids, extra=[5])
    (b, b_step), cb = run(model, PACTPress(layer=1, keep=0.75, cutoff=0.5, proportional=False), ids, extra=[5])
    assert torch.equal(ca.layers[1]._stored.keys, cb.layers[1]._stored.keys)      # the bias is not stored
    assert not torch.allclose(a[-1], b[-1], atol=1e-6) and not torch.allclose(a_step, b_step, atol=1e-6)


# -- every press ------------------------------------------------------------------------------------------
EXACT = [FastVPress(keep=1.0), DivPrunePress(keep=1.0), PACTPress(layer=1, keep=1.0, cutoff=0.0)]


@pytest.mark.parametrize("press", EXACT, ids=lambda p: p.name)
def test_keeping_every_visual_token_is_the_full_cache(model, press):
    ids = ids_of()
    want, _ = run(model, Press(), ids, chunks=(40, T), positions=None, extra=[3, 9])
    got, cache = run(model, press, ids, chunks=(40, T), extra=[3, 9])
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    assert [lay.kept_share() for lay in cache.layers] == [1.0] * 4


@pytest.mark.parametrize("press", [FastVPress(), DivPrunePress(), PACTPress(layer=1)], ids=lambda p: p.name)
def test_a_request_without_visual_tokens_is_refused(model, press):
    with pytest.raises(ValueError, match=f"'{press.name}' acts on visual tokens only.*PressCache.visual is None"):
        run(model, press, ids_of(), positions=None)


@pytest.mark.parametrize("press", [FastVPress(), DivPrunePress(), PACTPress(layer=1)], ids=lambda p: p.name)
def test_visual_tokens_across_two_prefill_chunks_are_refused(model, press):
    with pytest.raises(ValueError, match=r"visual tokens at positions 8..31 cross the prefill chunk of positions 0..19"):
        run(model, press, ids_of(), chunks=(20, T))


@pytest.mark.parametrize("cls, kwargs, needle", [
    (FastVPress, {"layer": 0}, "layer must be an int >= 1"),
    (FastVPress, {"layer": 1.5}, "layer must be an int >= 1"),
    (FastVPress, {"keep": 0.0}, r"keep must be in \(0, 1\], got 0.0"),
    (FastVPress, {"keep": 1.2}, r"keep must be in \(0, 1\]"),
    (DivPrunePress, {"keep": -0.1}, r"keep must be in \(0, 1\]"),
    (PACTPress, {"layer": -1}, "layer must be an int >= 0"),
    (PACTPress, {"keep": 0}, r"keep must be in \(0, 1\]"),
    (PACTPress, {"cutoff": 2.5}, r"cutoff \(a cosine distance\) must be in \[0, 2\], got 2.5"),
    (PACTPress, {"dc": 0.0}, "dc .* must be > 0"),
    (PACTPress, {"coef_pruned": -1.0}, "coef_pruned must be >= 0"),
])
def test_bad_parameters_are_refused_naming_the_value(cls, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        cls(**kwargs)


@pytest.mark.parametrize("press, needle", [(FastVPress(layer=4), "fastv layer=4 is outside the model's 4 layers"),
                                           (PACTPress(), "pact layer=4 is outside the model's 4 layers")])
def test_a_layer_the_model_lacks_is_refused(model, press, needle):
    with pytest.raises(ValueError, match=needle):
        press.new_cache(model)


# -- on a VLM with M-RoPE (Qwen2.5-VL: 3-axis positions for the image) ---------------------------------------
@pytest.fixture(scope="module")
def vlm_request(vlm_dir):
    """The random-weight zoo Qwen2.5-VL, one image request: (model, input embeddings with the image features,
    3-axis position ids, image positions). The image features are computed outside the press's attention (the
    vision tower's attention has no cache layer)."""
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    proc = AutoProcessor.from_pretrained(vlm_dir)
    vlm = Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (112, 112, 3), dtype=np.uint8), "RGB")
    enc = proc(text=["Page:<|vision_start|><|image_pad|><|vision_end|>Which digit?"], images=[img], return_tensors="pt")
    pos = (enc["mm_token_type_ids"][0] == 1).nonzero().flatten()
    with torch.no_grad():
        feats = vlm.model.get_image_features(enc["pixel_values"], enc["image_grid_thw"], return_dict=True).pooler_output
        emb = vlm.get_input_embeddings()(enc["input_ids"]).clone()
        emb[0, pos] = torch.cat(list(feats), 0)
        p3, _ = vlm.model.get_rope_index(enc["input_ids"], enc["mm_token_type_ids"], image_grid_thw=enc["image_grid_thw"])
    return vlm, emb, p3, pos


def run_vlm(vlm_request, press):
    vlm, emb, p3, pos = vlm_request
    cache = press.new_cache(vlm)
    if press.name != "full":
        cache.visual = VisualTokens(pos, emb[0, pos])
    with torch.inference_mode(), press_attention(vlm, cache):
        logits = vlm(inputs_embeds=emb, position_ids=p3, cache=cache, use_cache=True).logits[0]
    return logits, cache


@pytest.mark.slow
def test_on_an_mrope_vlm_keep_all_is_exact_and_pact_merges_with_the_model_s_own_rope(vlm_request):
    full, ref = run_vlm(vlm_request, Press())
    for press in (FastVPress(keep=1.0), DivPrunePress(keep=1.0), PACTPress(layer=1, keep=1.0, cutoff=0.0)):
        assert torch.equal(run_vlm(vlm_request, press)[0], full), press.name
    vlm, emb, p3, _ = vlm_request
    _, cache = run_vlm(vlm_request, PACTPress(layer=1, cutoff=0.3))
    red = cache.layers[-1].state.reduction
    assert red.centers.numel() > 0
    # the merged key: members' keys unrotated with their own M-RoPE angles, averaged, rotated at the centre's
    cos, sin = vlm.model.language_model.rotary_emb(emb, p3)
    fn = cache.layers[1].ctx.apply_rope
    pre = rope.unrotate(fn, ref.layers[1]._stored.keys, cos, sin)
    at = torch.searchsorted(cache.layers[1]._stored.positions[0, 0], red.centers)
    for c, p in enumerate(red.centers.tolist()):
        k = rope.rotate(fn, pre[:, :, red.members[red.member_of == c]].mean(2, keepdim=True), cos[:, [p]], sin[:, [p]])
        assert torch.allclose(cache.layers[1]._stored.keys[:, :, at[c]], k[:, :, 0], atol=1e-5)


@pytest.mark.parametrize("spec, record", [
    ("fastv:keep=0.5", {"id": "t0", "kind": "text", "context": "abc", "question": "q", "answer": "a"}),
    ("divprune:keep=0.5", {"id": "t0", "kind": "text", "context": "abc", "question": "q", "answer": "a"}),
    ("kvzip:ratio=0.3", {"id": "v0", "kind": "vlm", "images": ["p.png"], "question": "q", "answer": "a"}),
])
def test_a_split_the_press_cannot_answer_is_refused_before_any_sample(spec, record):
    """Review of the merge: fastv on a text split (or kvzip on a VLM split) passed check_records and then failed
    every sample."""
    from kvbench.eval.compress import CompressMethod

    with pytest.raises(ValueError, match=f"answers .* records only, but record '{record['id']}' is '{record['kind']}'"):
        CompressMethod(spec=spec).check_records([record])
