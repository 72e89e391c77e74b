"""ResidualKV Table V, long generation: compression during decoding (SnapKV's decoding form, ResidualKV coding the
generated tokens), the chain task, the final-answer metric and seeded sampling."""
from __future__ import annotations

import random

import pytest
import torch

from kvbench.compress.cache import Press
from kvbench.compress.generate import greedy_generate
from kvbench.compress.presses.snapkv import SnapKVPress
from kvbench.compress.presses.snapkv_decoding import SnapKVDecodingPress
from kvbench.compress.registry import PRESS
from kvbench.compress.residualkv.cache import ResidualKVPress
from kvbench.utils.spec import parse

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(3))


def _decode(model, press, n_new):
    """Greedy decoding of ``n_new`` tokens after the one-chunk prompt; returns (new ids, cache)."""
    return greedy_generate(model, press, PROMPT, PROMPT.shape[1], n_new, eos=set())


def test_snapkv_decoding_cache_stays_at_target_size(tiny_lm):
    press = SnapKVDecodingPress(keep=1.0, target_size=20, interval=4)
    new, cache = _decode(tiny_lm, press, 41)
    # 48 prompt tokens + 40 decode forwards: compressions after decode steps 4, 8, ..., 40
    for layer in cache.layers:
        assert layer.compressions == 10
        assert layer.kept_counts().tolist() == [20, 20]        # at the target right after the 10th compression
        assert layer.seen == 48 + 40
    assert len(new) == 41


def test_snapkv_decoding_never_exceeds_target_plus_interval(tiny_lm):
    press = SnapKVDecodingPress(keep=1.0, target_size=20, interval=4)
    cache = press.new_cache(tiny_lm)
    sizes = []
    from kvbench.compress.cache import press_attention
    with torch.inference_mode(), press_attention(tiny_lm, cache):
        tiny_lm(input_ids=PROMPT, position_ids=torch.arange(48).view(1, -1), cache=cache, use_cache=True)
        for step in range(30):
            ids = torch.tensor([[step % 256]])
            tiny_lm(input_ids=ids, position_ids=torch.tensor([[48 + step]]), cache=cache, use_cache=True)
            sizes.append(int(cache.layers[1].kept_counts().max()))
    # the prompt (48) is kept whole until the 4th decode step, then the cache is 20 + steps since the last compression
    assert sizes[:3] == [49, 50, 51]
    assert sizes[3:] == [20 + (s % 4) for s in range(27)]


def test_snapkv_decoding_keeps_the_buffered_steps_tokens(tiny_lm):
    press = SnapKVDecodingPress(keep=1.0, target_size=8, interval=8)
    _, cache = _decode(tiny_lm, press, 17)   # 16 decode forwards: compressions after steps 8 and 16
    positions = cache.layers[2]._stored.positions[0]
    assert positions.tolist() == [list(range(48 + 8, 48 + 16))] * 2


def test_snapkv_decoding_equals_snapkv_when_the_interval_is_never_reached(tiny_lm):
    got, cache = _decode(tiny_lm, SnapKVDecodingPress(keep=0.5, window=8, target_size=64, interval=64), 30)
    want, ref = _decode(tiny_lm, SnapKVPress(keep=0.5, window=8), 30)
    assert got == want
    for a, b in zip(cache.layers, ref.layers):
        assert a.compressions == 0
        assert torch.equal(a._stored.positions, b._stored.positions)


def test_snapkv_decoding_is_the_full_cache_while_nothing_is_evicted(tiny_lm):
    got, _ = _decode(tiny_lm, SnapKVDecodingPress(keep=1.0, target_size=1000, interval=4), 30)
    want, _ = _decode(tiny_lm, Press(), 30)
    assert got == want


@pytest.mark.parametrize("kw, match", [
    ({"interval": 0}, "interval must be >= 1"), ({"target_size": 4, "interval": 8}, "target_size must be >= interval"),
    ({"interval": 2.5}, "interval must be an int"), ({"target_size": True}, "target_size must be an int"),
    ({"keep": 0.0}, "keep must be in"),
])
def test_snapkv_decoding_bad_parameters_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        SnapKVDecodingPress(**kw)


def test_snapkv_decoding_is_a_press_spec():
    spec = parse("snapkv_decoding:keep=1.0,target_size=128,interval=8", PRESS)
    press = spec.build()
    assert isinstance(press, SnapKVDecodingPress) and (press.target_size, press.interval) == (128, 8)


def test_residualkv_codes_generated_tokens_as_they_leave_the_window(tiny_lm, tmp_path):
    from test_rkv_cache import _identity_codec

    codec_dir = _identity_codec(tiny_lm, tmp_path / "id", n_sink=2, window=4, stride=5)
    press = ResidualKVPress(codec_dir=str(codec_dir), block=1)
    coded = []
    for n_new in (1, 11, 21):
        _, cache = _decode(tiny_lm, press, n_new)
        layer = cache.layers[1]
        coded.append(len(layer.codes) + len(layer.pool))
        assert len(layer.window) == 4
    # 48 prompt tokens: 2 sinks, 4 raw, 42 coded or references; each decode forward codes one more token
    assert coded == [42, 52, 62]
