"""The ResidualKV cache's decode steps through the Triton restore kernel (``KVBENCH_KERNELS=triton``; on the CPU in
Triton's interpreter) against the cache's torch path (``KVBENCH_KERNELS=torch``): same logits within the kernel
tolerance, same selections, same CR record. On CUDA ``auto`` takes the kernel path; here ``auto`` stays in torch."""
from __future__ import annotations

import pytest
import torch
from _kernel_fixtures import DEVICE, TOL, assert_within, interpreter  # noqa: F401
from test_rkv_cache import IDS, _run

from kvbench.compress.presses.kivi import KIVILayer, KIVIPress
from kvbench.compress.presses.omnikv import OmniKVPress
from kvbench.compress.residualkv.cache import ResidualKVLayer, ResidualKVPress
from kvbench.compress.residualkv.codec import ResidualCodec


@pytest.mark.skipif(DEVICE != "cpu", reason="runs the tiny LM on the CPU under the interpreter; on a GPU the kernel "
                    "tests of kernels/ cover the kernel")
@pytest.mark.parametrize("latent_v", [False, True])
@pytest.mark.parametrize("selector,bits", [(OmniKVPress(keep=0.4), 4), (None, 16)])
def test_kernel_cache_path_equals_the_torch_path(tiny_lm, tmp_path, monkeypatch, interpreter, selector, bits,  # noqa: F811
                                                 latent_v, record_property):
    ResidualCodec.for_model(tiny_lm, seed=3, d_c=32, d_ff=64, n_sink=2, window=4, stride=5).save(tmp_path / "c")
    press = lambda: ResidualKVPress(codec_dir=str(tmp_path / "c"), bits=bits, selector=selector,  # noqa: E731
                                    full_layers=(0,) if selector else (), latent_v=latent_v)
    ids, cuts = IDS[:, :49], [30, 45, 46, 47, 48]   # context, question, then 4 one-token steps (the interpreter is slow)
    monkeypatch.setenv("KVBENCH_KERNELS", "torch")
    want, ref_cache = _run(tiny_lm, press(), ids, cuts)
    monkeypatch.setenv("KVBENCH_KERNELS", "triton")
    layer_steps = []
    original = ResidualKVLayer._attend_kernel

    def counted(self, query, scaling):
        layer_steps.append(self.ctx.layer_idx)
        return original(self, query, scaling)
    monkeypatch.setattr(ResidualKVLayer, "_attend_kernel", counted)
    got, cache = _run(tiny_lm, press(), ids, cuts)
    n_sparse = sum(isinstance(layer, ResidualKVLayer) for layer in cache.layers)
    assert len(layer_steps) == n_sparse * 4   # every one-token step of every sparse layer of every sparse layer
    torch.testing.assert_close(got[:, :45], want[:, :45], atol=0, rtol=0)   # prefill: the torch path in both
    assert_within("cache logits, kernel vs torch path", got, want, 10 * TOL[torch.float32], record_property)
    assert cache.attended == ref_cache.attended
    if selector is not None:
        assert cache.selections == ref_cache.selections


@pytest.mark.skipif(DEVICE != "cpu", reason="runs the tiny LM on the CPU under the interpreter; on a GPU the kernel "
                    "tests of kernels/ cover the kernel")
@pytest.mark.parametrize("make", [
    lambda codec_dir: KIVIPress(bits=2, group=8, residual=8),
    lambda codec_dir: KIVIPress(bits=4, group=8, residual=16),
    lambda codec_dir: ResidualKVPress(codec_dir=codec_dir, bits=4, selector=OmniKVPress(keep=0.4), full_layers=(0, 1),
                                      full_kv_bits=4, full_kv_form="kivi", latent_v=False),
], ids=["kivi2", "kivi4-r16", "residualkv-full-layers-4bit-kivi-form"])
def test_kivi_kernel_path_equals_the_torch_path(tiny_lm, tmp_path, monkeypatch, interpreter, make,  # noqa: F811
                                                record_property):
    """The KIVI layers' one-token steps through ``kivi_attend`` (packed codes dequantised in the kernel) give the
    logits of the dequantised store's SDPA, and every one-token step of every KIVI layer takes the kernel."""
    ResidualCodec.for_model(tiny_lm, seed=3, d_c=32, d_ff=64, n_sink=2, window=4, stride=5).save(tmp_path / "c")
    ids, cuts = IDS[:, :49], [30, 45, 46, 47, 48]
    monkeypatch.setenv("KVBENCH_KERNELS", "torch")
    want, ref_cache = _run(tiny_lm, make(str(tmp_path / "c")), ids, cuts)
    monkeypatch.setenv("KVBENCH_KERNELS", "triton")
    monkeypatch.setattr(ResidualKVLayer, "_kernel_step", lambda self, chunk: False)   # this test is about KIVI layers
    steps = []
    original = KIVILayer._layout

    def counted(self, chunk):
        steps.append(self.ctx.layer_idx)
        return original(self, chunk)
    monkeypatch.setattr(KIVILayer, "_layout", counted)
    got, cache = _run(tiny_lm, make(str(tmp_path / "c")), ids, cuts)
    n_kivi = sum(isinstance(layer, KIVILayer) for layer in cache.layers)
    assert n_kivi and len(steps) == n_kivi * 4
    torch.testing.assert_close(got[:, :45], want[:, :45], atol=0, rtol=0)   # multi-token chunks: SDPA in both
    assert_within("KIVI cache logits, kernel vs torch path", got, want, 10 * TOL[torch.float32], record_property)
    assert cache.attended == ref_cache.attended
    mirror = cache.layers[0]._mirror
    assert mirror is not None and len(mirror["kc"]) == len(cache.layers[0].kq.codes)


@pytest.mark.skipif(DEVICE != "cpu", reason="runs the tiny LM on the CPU under the interpreter")
@pytest.mark.parametrize("form", ["after", "before"])
def test_the_authors_full_layer_forms_read_the_store_not_the_kernel(tiny_lm, tmp_path, monkeypatch, interpreter,  # noqa: F811
                                                                    form):
    """The kernel's layout has no raw-sink segment (and ``before`` has quantised a step's own rows): the authors'
    forms never take it, even where Triton is chosen, and give the torch path's logits exactly."""
    ResidualCodec.for_model(tiny_lm, seed=3, d_c=32, d_ff=64, n_sink=2, window=4, stride=5).save(tmp_path / "c")
    make = lambda: ResidualKVPress(codec_dir=str(tmp_path / "c"), bits=4, selector=OmniKVPress(keep=0.4),  # noqa: E731
                                   full_layers=(0, 1), full_kv_bits=4, full_kv_form=form)
    ids, cuts = IDS[:, :49], [30, 45, 46, 47, 48]
    monkeypatch.setenv("KVBENCH_KERNELS", "torch")
    want, _ = _run(tiny_lm, make(), ids, cuts)
    monkeypatch.setenv("KVBENCH_KERNELS", "triton")
    monkeypatch.setattr(ResidualKVLayer, "_kernel_step", lambda self, chunk: False)   # the sparse layers' own kernel
    monkeypatch.setattr(KIVILayer, "_layout", lambda self, chunk: pytest.fail("the kernel ran"))
    got, _ = _run(tiny_lm, make(), ids, cuts)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
