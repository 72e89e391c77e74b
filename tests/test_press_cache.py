"""The shared compressed-cache machinery: the base Press (full cache) is exact, chunked or not."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvbench.compress.buffers import MIN_GROWTH, Growable
from kvbench.compress.cache import Press, press_attention
from kvbench.compress.generate import greedy_generate, split_prompt


def _chunked_logits(model, cache, ids, cuts):
    outs, start = [], 0
    for end in [*cuts, ids.shape[1]]:
        pos = torch.arange(start, end).view(1, -1)
        outs.append(model(input_ids=ids[:, start:end], position_ids=pos, cache=cache, use_cache=True).logits)
        start = end
    return torch.cat(outs, 1)


@pytest.mark.parametrize("cuts", [[], [17], [5, 6, 30]])
def test_full_press_equals_plain_model(tiny_lm, cuts):
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    ref = tiny_lm(input_ids=ids).logits
    cache = Press().new_cache(tiny_lm)
    with torch.inference_mode(), press_attention(tiny_lm, cache):
        got = _chunked_logits(tiny_lm, cache, ids, cuts)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == 40
    assert tiny_lm.config._attn_implementation == "sdpa"      # restored on exit


def test_greedy_generate_matches_dynamic_cache(tiny_lm):
    ids = torch.randint(0, 256, (1, 25), generator=torch.Generator().manual_seed(2))
    new, cache = greedy_generate(tiny_lm, Press(), ids, 20, max_new_tokens=6, eos=set())
    dyn, seq, want = DynamicCache(config=tiny_lm.config), ids, []
    with torch.inference_mode():
        logits = tiny_lm(input_ids=seq, cache=dyn, use_cache=True).logits
        for _ in range(6):
            nxt = int(logits[0, -1].argmax())
            want.append(nxt)
            logits = tiny_lm(input_ids=torch.tensor([[nxt]]), cache=dyn, use_cache=True).logits
    assert new == want
    # every forward recorded one attended count per layer; the last decode step reads all 30 earlier + itself
    assert len(cache.attended) == 2 + 5 and cache.attended[-1] == [30, 30, 30]


def test_stop_at_eos(tiny_lm):
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(3))
    first, _ = greedy_generate(tiny_lm, Press(), ids, 5, max_new_tokens=4, eos=set())
    new, _ = greedy_generate(tiny_lm, Press(), ids, 5, max_new_tokens=4, eos={first[0]})
    assert new == first[:1]


def test_split_prompt_puts_the_question_in_the_second_chunk(tokenizer):
    rec = {"id": "r", "context": "Pairs: QJS rhr, FJM qhz.", "question": "\nQuery: QJS"}
    ids, split = split_prompt(tokenizer, rec)
    assert ids[0].tolist() == tokenizer(rec["context"] + rec["question"], add_special_tokens=False)["input_ids"]
    assert "QJS" in tokenizer.decode(ids[0, split:].tolist()) and "Query" not in tokenizer.decode(ids[0, :split].tolist())


def test_split_prompt_refuses_a_record_without_context(tokenizer):
    with pytest.raises(ValueError, match="'context' and 'question'"):
        split_prompt(tokenizer, {"id": "x", "question": "q"})


def test_growable_writes_in_place_and_grows_by_an_eighth():
    x = torch.arange(12.0).view(2, 6)
    g = Growable(dim=1)
    g.append(x[:, :2])
    assert g.capacity == 2
    g.append(x[:, 2:3])                      # grows: by MIN_GROWTH rows at this size
    storage = g.data.data_ptr()
    g.append(x[:, 3:4])                      # fits: written in place
    assert g.capacity == 2 + MIN_GROWTH and g.data.data_ptr() == storage and torch.equal(g.view(), x[:, :4])
    g.drop_front(3)                          # the kept row moves to a storage of twice its number
    assert torch.equal(g.view(), x[:, 3:4]) and g.capacity == 2
    g.append(x[:, 4:])
    g.keep(torch.tensor([True, False, True]))
    assert torch.equal(g.view(), x[:, [3, 5]]) and g.capacity == 2   # rebuilt at the kept size
    big = Growable(dim=0)
    big.append(torch.zeros(4096, 1))
    big.append(torch.zeros(1, 1))            # a long context's first decode step: an eighth more, not double
    assert big.capacity == 4096 + 512


def test_full_cache_decodes_in_place_and_counts_its_capacity(tiny_lm):
    """The full cache (every method's reference) writes a step's token into spare capacity and attention reads a
    view of that buffer: no copy of the cache per step. Its resident bytes count the capacity allocated."""
    ids = torch.randint(0, 256, (1, 23), generator=torch.Generator().manual_seed(4))
    cache = Press().new_cache(tiny_lm)
    layer = cache.layers[0]
    caps, storages = [], []
    with torch.inference_mode(), press_attention(tiny_lm, cache):
        for start, end in ((0, 20), (20, 21), (21, 22), (22, 23)):
            tiny_lm(input_ids=ids[:, start:end], position_ids=torch.arange(start, end).view(1, -1), cache=cache,
                    use_cache=True)
            caps.append(layer._buf.keys.capacity)
            storages.append(layer._stored.keys.untyped_storage().data_ptr())
    cap = 20 + MIN_GROWTH
    assert caps == [20, cap, cap, cap] and len(set(storages[1:])) == 1
    assert torch.equal(layer._stored.positions[0, 0], torch.arange(23))
    b = layer.stored_bytes()
    assert b.full_layer == 23 * 2 * 32 * 2                       # FP16 K and V of the 23 stored tokens
    assert b.resident == cap * 2 * 32 * 4 + cap * 8              # float32 K, V and int64 positions, at capacity
    assert cache.attended[-1] == [23, 23, 23]                   # no mask built: every key, itself included


def test_a_sliding_window_does_not_keep_its_first_chunk_s_capacity():
    """Review finding: a raw window that first takes a whole prefill chunk (300 rows) and then keeps 40 held
    300 rows of capacity for the rest of the request; dropping now reallocates at twice the rows kept."""
    g = Growable(dim=0)
    g.append(torch.zeros(300, 4))
    g.drop_front(260)
    assert len(g) == 40 and g.capacity == 80
    g.drop_front(0)
    assert g.capacity == 80

