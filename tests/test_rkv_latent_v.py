"""ResidualKV's latent V (``ResidualKVPress.latent_v``, beyond the paper): at decode steps W_V is applied to the
attention-weighted codes instead of decoding V per restored token. Same logits as decoding V, up to rounding."""
from __future__ import annotations

import pytest
import torch
from test_rkv_cache import CUTS, IDS, _run

from kvbench.compress.presses.omnikv import OmniKVPress
from kvbench.compress.residualkv.cache import ResidualKVLayer, ResidualKVPress
from kvbench.compress.residualkv.codec import ResidualCodec


def _codec(model, path, **kw):
    ResidualCodec.for_model(model, seed=3, d_c=32, d_ff=64, n_sink=2, window=4, stride=5, **kw).save(path)
    return str(path)


@pytest.mark.parametrize("selector", [None, OmniKVPress(keep=0.4)])
@pytest.mark.parametrize("bits,bias", [(4, True), (16, False)])
def test_latent_v_logits_equal_decoding_v(tiny_lm, tmp_path, selector, bits, bias):
    """With and without a bias (without one, selected references are restored as zero codes on their own row)."""
    codec_dir = _codec(tiny_lm, tmp_path / "c", bias=bias)
    kw = dict(codec_dir=codec_dir, bits=bits, selector=selector, full_layers=(0,) if selector else ())
    want, ref_cache = _run(tiny_lm, ResidualKVPress(**kw), IDS, CUTS)
    got, cache = _run(tiny_lm, ResidualKVPress(**kw, latent_v=True), IDS, CUTS)
    assert any(isinstance(layer, ResidualKVLayer) for layer in cache.layers)
    # prefill chunks run the same path; decode steps differ only in rounding
    torch.testing.assert_close(got[:, :45], want[:, :45], atol=0, rtol=0)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # the latent path ran: each sparse layer split f_d for it (at its first decode step)
    assert all(layer._f_d is not None for layer in cache.layers if isinstance(layer, ResidualKVLayer))
    assert all(layer._f_d is None for layer in ref_cache.layers if isinstance(layer, ResidualKVLayer))
    if selector is not None:
        assert cache.selections[:3] == ref_cache.selections[:3]


def test_latent_v_is_refused_without_a_linear_codec(tiny_lm, tmp_path):
    with pytest.raises(ValueError, match="latent_v applies f_d's V part after attention; it needs the codec"):
        ResidualKVPress(codec_dir="x", latent_v=True, mean_only=True)
    with pytest.raises(ValueError, match="latent_v .* needs the codec"):
        ResidualKVPress(codec_dir="x", latent_v=True, use_codec=False)
    press = ResidualKVPress(codec_dir=_codec(tiny_lm, tmp_path / "rev", encoder="linear", decoder="swiglu"),
                            latent_v=True)
    with pytest.raises(ValueError, match="latent_v needs a linear f_d; codec .* has decoder 'swiglu'"):
        press.load()


def test_reset_empties_the_layers_for_a_new_request(tiny_lm, tmp_path):
    """transformers' ``Cache.reset`` on a ResidualKV+OmniKV cache with KIVI-style 4-bit full layers: the same
    request run again on the reset cache gives the logits of a fresh cache (nothing of the first run is left)."""
    press = ResidualKVPress(codec_dir=_codec(tiny_lm, tmp_path / "c"), bits=4, selector=OmniKVPress(keep=0.4),
                            full_layers=(0,), full_kv_bits=4, latent_v=True)
    want, cache = _run(tiny_lm, press, IDS, CUTS)
    cache.reset()
    assert all(layer.seen == 0 for layer in cache.layers)
    again, same = _run(tiny_lm, press, IDS, CUTS, cache=cache)
    assert same is cache
    torch.testing.assert_close(again, want, atol=0, rtol=0)

