"""Static-eviction presses: SnapKV, PyramidKV, KVzip (kvbench.compress.presses.{snapkv,pyramidkv,kvzip})."""
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from kvbench.compress.cache import KVView, Press, press_attention
from kvbench.compress.generate import greedy_generate
from kvbench.compress.presses.eviction import (
    PAD_POSITION,
    EvictingLayer,
    budget,
    topk_mask,
)
from kvbench.compress.presses.kvzip import KVzipPress, reconstruction_scores
from kvbench.compress.presses.pyramidkv import PyramidKVPress, linear_ratio, pyramid_budget
from kvbench.compress.presses.snapkv import SnapKVPress, snapkv_scores

D = 16


class CharTok:
    """Stand-in tokenizer: one id per character."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 256 for c in text]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=D, intermediate_size=128, vocab_size=256)
    cfg._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(cfg).float().eval()


def two_chunks(model, press, ids, split):
    """Question-chunk logits [1, T - split, V] after a context chunk, as greedy_generate runs them."""
    cache = press.new_cache(model)
    with torch.inference_mode(), press_attention(model, cache):
        model(input_ids=ids[:, :split], position_ids=torch.arange(split).view(1, -1), cache=cache, use_cache=True)
        press.after_context(model, cache, ids[:, :split])
        pos = torch.arange(split, ids.shape[1]).view(1, -1)
        logits = model(input_ids=ids[:, split:], position_ids=pos, cache=cache, use_cache=True).logits
    return logits, cache


def ids_of(n, seed=1):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


# -- scores -----------------------------------------------------------------------------------------
def test_snapkv_scores_uniform_keys_hand_computed():
    # Zero keys: softmax is uniform over the visible keys. Window query at position 3 sees 4 keys (1/4 each);
    # avg-pool kernel 3 with zero padding counted: [0.5/3, 0.75/3, 0.5/3]; the window key scores +inf.
    s = snapkv_scores(torch.randn(1, 1, 1, D), torch.zeros(1, 1, 4, D), kernel=3)
    assert torch.allclose(s[..., :3], torch.tensor([[[1 / 6, 1 / 4, 1 / 6]]]))
    assert s[0, 0, 3] == float("inf")


def test_snapkv_scores_causal_window():
    # w = 2 over n = 3: query 0 (position 1) sees keys 0,1 (1/2), query 1 (position 2) sees all (1/3).
    s = snapkv_scores(torch.randn(1, 1, 2, D), torch.zeros(1, 1, 3, D), kernel=1)
    assert torch.allclose(s[0, 0, 0], torch.tensor(1 / 2 + 1 / 3))
    assert torch.isinf(s[0, 0, 1:]).all()


def test_snapkv_scores_mean_over_gqa_group():
    q, k = torch.randn(1, 4, 3, D), torch.randn(1, 2, 20, D)
    for pooling in ("avg", "max"):
        s = snapkv_scores(q, k, kernel=5, pooling=pooling)
        for h in range(2):
            per_q = [snapkv_scores(q[:, [g]], k[:, [h]], kernel=5, pooling=pooling) for g in (2 * h, 2 * h + 1)]
            assert torch.allclose(s[:, h], (per_q[0] + per_q[1])[:, 0] / 2)


def test_snapkv_scores_without_window_in_keys_scores_every_key():
    s = snapkv_scores(torch.randn(1, 1, 2, D), torch.zeros(1, 1, 3, D), kernel=1, window_in_keys=False)
    assert torch.allclose(s, torch.full((1, 1, 3), 2 / 3))


def test_reconstruction_scores_hand_computed():
    # Zero keys: repeat row 0 sees 2 chunk keys + itself (1/3 each), row 1 sees 4 keys (1/4): max = 1/3.
    s = reconstruction_scores(torch.randn(1, 2, 2, D), torch.zeros(1, 1, 2, D), torch.zeros(1, 1, 2, D))
    assert torch.allclose(s, torch.full((1, 1, 2), 1 / 3))


def test_pyramid_budgets():
    # mean 20.4 over a 68-token prefix, beta 20: top 1.02, bottom 39.78 -> 40, 20, 1 (mean 20.33).
    assert [pyramid_budget(20.4, 68, 32, layer, 3) for layer in range(3)] == [40, 20, 1]
    # bottom 58.5 > prefix 40: clamped to 40, top = 2*30 - 40 = 20.
    assert [pyramid_budget(30, 40, 32, layer, 3) for layer in range(3)] == [40, 30, 20]
    # prompt (10 + 4) shorter than 2*mean: the original's uniform SnapKV fallback.
    assert [pyramid_budget(8, 10, 4, layer, 3) for layer in range(3)] == [8, 8, 8]
    with pytest.raises(ValueError, match="beta"):
        pyramid_budget(8, 10, 4, 0, 3, beta=0.5)


def test_budget_and_topk_mask():
    assert [budget(0.3, n) for n in (0, 1, 3, 10, 68)] == [0, 1, 1, 3, 20]
    assert topk_mask(torch.tensor([[0.1, 0.9, 0.5, 0.7]]), 2).tolist() == [[False, True, False, True]]
    with pytest.raises(ValueError, match="k must be"):
        topk_mask(torch.zeros(3), 4)


# -- the evicting store ------------------------------------------------------------------------------
def test_evict_pads_uneven_heads(model):
    layer = EvictingLayer(SnapKVPress().new_cache(model).layers[0].ctx, None)
    keys = torch.arange(2 * 5 * D, dtype=torch.float32).view(1, 2, 5, D)
    layer._stored = KVView.dense(keys, -keys, torch.arange(5))
    keep = torch.tensor([[[True, False, True, False, False], [False, True, True, True, False]]])
    layer.evict(keep)
    assert layer._stored.positions.tolist() == [[[0, 2, PAD_POSITION], [1, 2, 3]]]
    assert torch.equal(layer._stored.keys[0, 0, :2], keys[0, 0, [0, 2]])
    assert torch.equal(layer._stored.values[0, 1], -keys[0, 1, [1, 2, 3]])
    assert not layer._stored.keys[0, 0, 2].any()
    assert layer.kept_counts().tolist() == [2, 3]
    assert layer.stored_bytes().full_layer == 5 * D * 2 * 2


# -- presses through the model -----------------------------------------------------------------------
@pytest.mark.parametrize("press", [SnapKVPress(keep=1.0), PyramidKVPress(keep=1.0),
                                   KVzipPress(ratio=1.0, tokenizer=CharTok()),
                                   # 0.999 of 3 layers x 2 heads x 40 tokens rounds to all 240: the
                                   # reconstruction pass runs and must leave the cache untouched.
                                   KVzipPress(ratio=0.999, tokenizer=CharTok())])
def test_keep_all_equals_full_cache(model, press):
    ids = ids_of(45)
    full, _ = two_chunks(model, Press(), ids, 40)
    out, cache = two_chunks(model, press, ids, 40)
    assert torch.allclose(out, full, atol=1e-5)
    assert len(cache.attended) == 2       # the scoring pass leaves no CR entries


def test_snapkv_kept_counts_and_bytes(model):
    _, cache = two_chunks(model, SnapKVPress(), ids_of(105), 100)
    # prefix 68 -> round(0.3 * 68) = 20, + window 32, + 5 question tokens, per KV head.
    assert [layer.kept_counts().tolist() for layer in cache.layers] == [[57, 57]] * 3
    assert [b.full_layer for b in cache.stored_bytes()] == [57 * 2 * D * 2 * 2] * 3
    assert cache.attended[-1] == [57, 57, 57]


def test_snapkv_keeps_window_and_differs_per_head(model):
    _, cache = two_chunks(model, SnapKVPress(keep=0.1), ids_of(105), 100)
    pos = cache.layers[1]._stored.positions[0]
    assert pos[:, -37:].tolist() == [list(range(68, 105))] * 2      # window + question, in order
    assert pos[0, :7].tolist() != pos[1, :7].tolist()               # per-KV-head selections


def test_pyramidkv_kept_counts(model):
    _, cache = two_chunks(model, PyramidKVPress(), ids_of(105), 100)
    assert [layer.kept_counts().tolist() for layer in cache.layers] == [[77, 77], [57, 57], [38, 38]]


def test_pyramidkv_authors_linear_schedule(model):
    """``least_ratio``: the ResidualKV authors' schedule, shares 0.5 -> 0.3 -> 0.1 of the 68-token prefix (mean keep
    0.3) on 3 layers: 34, 20, 7 (round(6.8)) kept + window 32 + question 5."""
    press = PyramidKVPress(keep=0.3, least_ratio=0.1, kernel=7, pooling="max")
    assert [round(linear_ratio(0.3, 0.1, i, 32), 4) for i in (0, 31)] == [0.5, 0.1]
    assert sum(linear_ratio(0.3, 0.1, i, 32) for i in range(32)) / 32 == pytest.approx(0.3)
    _, cache = two_chunks(model, press, ids_of(105), 100)
    assert [layer.kept_counts().tolist() for layer in cache.layers] == [[71, 71], [57, 57], [44, 44]]
    for kwargs, needle in [({"least_ratio": 0.4}, r"in \(0, keep=0.3\]"), ({"least_ratio": 0.0}, "least_ratio"),
                           ({"keep": 0.8, "least_ratio": 0.1}, "first layer's share at 1.5 > 1")]:
        with pytest.raises(ValueError, match=needle):
            PyramidKVPress(**kwargs)


def test_kvzip_kept_counts(model):
    _, cache = two_chunks(model, KVzipPress(level="pair-uniform", tokenizer=CharTok()), ids_of(45), 40)
    assert [layer.kept_counts().tolist() for layer in cache.layers] == [[12 + 5, 12 + 5]] * 3
    _, cache = two_chunks(model, KVzipPress(tokenizer=CharTok()), ids_of(45), 40)
    counts = torch.stack([layer.kept_counts() for layer in cache.layers]) - 5
    assert int(counts.sum()) == round(0.3 * 3 * 2 * 40)
    assert sum(b.full_layer for b in cache.stored_bytes()) == (72 + 3 * 2 * 5) * D * 2 * 2
    # Padding slots are never attended: the last question row reads kept + question keys, mean over heads.
    assert cache.attended[-1] == [(int(c.sum()) + 2 * 5) // 2 for c in counts]


def test_kvzip_repeat_inputs():
    press = KVzipPress(chunk_size=4, overlap=2, prompt="P", continue_prompt="C", suffix="S")
    ctx = torch.tensor([[10, 11, 12, 13, 14, 15]])
    (s0, e0, a), (s1, e1, b) = press.repeat_inputs(CharTok(), ctx)
    assert (s0, e0, s1, e1) == (0, 4, 4, 6)
    assert a.tolist() == [[ord("P"), ord("S"), 10, 11, 12, 13]]
    assert b.tolist() == [[ord("C"), 12, 13, ord("S"), 14, 15]]


@pytest.mark.parametrize("press", [SnapKVPress(), PyramidKVPress(), KVzipPress(tokenizer=CharTok()),
                                   KVzipPress(level="pair-uniform", tokenizer=CharTok())])
def test_tiny_context_through_greedy_generate(model, press):
    ids = ids_of(5)
    new, cache = greedy_generate(model, press, ids, 3, max_new_tokens=2, eos=set())
    assert len(new) == 2
    counts = [int(layer.kept_counts().sum()) for layer in cache.layers]
    if isinstance(press, KVzipPress):
        # 3 context tokens: uniform keeps round(0.9) = 1 per head; pair keeps round(0.3 * 18) = 5 in all.
        ctx = [c - 2 * 3 for c in counts]             # minus question (2) + first decoded token, x 2 heads
        assert (ctx == [2, 2, 2]) if press.level == "pair-uniform" else sum(ctx) == 5
    else:
        assert counts == [2 * 6] * 3                 # shorter than the window: nothing evicted


@pytest.mark.parametrize("make, match", [(lambda: SnapKVPress(keep=0.0), "keep"),
                                         (lambda: SnapKVPress(kernel=4), "kernel"),
                                         (lambda: SnapKVPress(pooling="mean"), "pooling"),
                                         (lambda: SnapKVPress(window=0), "window"),
                                         (lambda: PyramidKVPress(beta=0), "beta"),
                                         (lambda: KVzipPress(ratio=1.5), "ratio"),
                                         (lambda: KVzipPress(level="head"), "level"),
                                         (lambda: snapkv_scores(torch.zeros(1, 3, 1, D), torch.zeros(1, 2, 4, D)),
                                          "heads")])
def test_bad_settings_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_snapkv_scores_when_the_window_is_the_whole_context():
    """Bug: a context no longer than the window (no prefix) crashed in the pooling reshape."""
    from kvbench.compress.presses.snapkv import snapkv_scores

    q, k = torch.randn(1, 4, 4, 8), torch.randn(1, 2, 4, 8)
    assert torch.isinf(snapkv_scores(q, k)).all()


def test_snapkv_keep_03_on_200_tokens_reports_what_it_kept(model):
    """Issue #13 item 6: ``snapkv:keep=0.3`` on a 200-token context keeps 41%, not 30%: keep applies to the
    prefix (200 − 32 window = 168: round(50.4) = 50 tokens) and the 32-token window is kept on top, so 82 of 200.
    The press's target and the measured share both say 0.41; packed KR equals it (kept tokens at FP16)."""
    from kvbench.compress.accounting import keep_ratio_measured

    press = SnapKVPress(keep=0.3)
    cache = press.new_cache(model)
    with torch.inference_mode(), press_attention(model, cache):
        model(input_ids=ids_of(200), position_ids=torch.arange(200).view(1, -1), cache=cache, use_cache=True)
    assert [layer.kept_counts().tolist() for layer in cache.layers] == [[82, 82]] * 3
    kept = sum(layer.kept_share() for layer in cache.layers) / 3
    assert kept == press.kept_target(200, 200, 3) == 0.41 and press.keep == 0.3
    parts = cache.stored_bytes()
    assert keep_ratio_measured(parts, kind="packed", n_tokens=200, n_layers=3, n_kv_heads=2, head_dim=D) == 0.41
    assert keep_ratio_measured(parts, kind="resident", n_tokens=200, n_layers=3, n_kv_heads=2, head_dim=D) > 0.41
    assert press.compute_ratio(3) is None          # it returned keep (0.3), neither what is kept nor what is read
    # later tokens are never evicted: 10 more tokens -> (82 + 10) / 210 kept
    assert press.kept_target(200, 210, 3) == pytest.approx(92 / 210)


def test_padding_stays_masked_at_decode_steps(model):
    """A decode step builds no position mask when every key is visible; after KVzip's head-wise eviction some
    heads hold padding slots, so its decode steps still mask them (the count is per head, padding excluded)."""
    press = KVzipPress(tokenizer=CharTok())
    _, cache = greedy_generate(model, press, ids_of(45), 40, max_new_tokens=3, eos=set())
    counts = torch.stack([layer.kept_counts() for layer in cache.layers]) - 7   # kept context per head
    assert any(layer.hides_keys() for layer in cache.layers)
    # last decode step at position 46: kept context + 5 question tokens + 1 decoded + itself, mean over heads
    assert cache.attended[-1] == [(int(c.sum()) + 2 * 7) // 2 for c in counts]
