"""``StoreLayer.read_bytes()``: the K/V bytes a decode step read from each layer in the form it holds them, the
audit behind Fig. 8's bandwidth columns (kvbench.bench.bandwidth), counted by hand on the tiny LM."""
from __future__ import annotations

import math

import torch
from test_rkv_cache import IDS, _run

from kvbench.bench import bandwidth
from kvbench.compress.cache import Press
from kvbench.compress.presses.kivi import KIVIPress
from kvbench.compress.presses.omnikv import OmniKVPress
from kvbench.compress.residualkv.cache import ResidualKVLayer, ResidualKVPress
from kvbench.compress.residualkv.codec import ResidualCodec

H_KV, D = 2, 16          # the tiny LM's KV heads and head size
C = H_KV * D             # K (or V) values per token


def test_full_cache_reads_its_whole_view_at_the_model_width(tiny_lm):
    _, cache = _run(tiny_lm, Press(), IDS, [30, 45, 59])   # the last forward: one token seeing 60
    assert [layer.read_bytes() for layer in cache.layers] == [2 * 60 * C * 4] * 3
    assert bandwidth.press_read_bytes(cache, 60, 2 * C, 4) == (3 * 2 * 60 * C * 4, "audit")


def test_kivi_reads_packed_codes_scales_and_the_raw_residual_held(tiny_lm):
    ids = torch.randint(0, 256, (1, 71), generator=torch.Generator().manual_seed(1))
    _, cache = _run(tiny_lm, KIVIPress(bits=2, group=32, residual=32), ids, [70])
    layer = cache.layers[1]
    # 71 tokens: keys 64 quantised (2 blocks of 32, per channel) + 7 raw; values 39 quantised + 32 raw
    keys = 64 * C * 2 // 8 + 2 * C * 2 * 2          # 2-bit levels, fp16 (zmin, scale) per block and channel
    values = 39 * C * 2 // 8 + 39 * (C // 16) * 2 * 2   # value groups of min(32, head_dim) = 16 channels
    raw = (7 + 32) * C * 4                          # float32 raw keys and values
    assert layer.read_bytes() == keys + values + raw
    _, exact = _run(tiny_lm, KIVIPress(bits=16, group=32, residual=32), ids, [70])
    assert exact.layers[1].read_bytes() == 2 * 71 * C * 4   # nothing packed: the view, as the full cache


def test_residualkv_reads_the_selection_in_its_stored_form(tiny_lm, tmp_path):
    codec = ResidualCodec.for_model(tiny_lm, seed=3, d_c=32, d_ff=64, encoder="linear", n_sink=2, window=4, stride=5)
    codec.save(tmp_path / "codec")
    press = ResidualKVPress(codec_dir=str(tmp_path / "codec"), bits=4, selector=OmniKVPress(keep=0.3),
                            full_layers=(0,))
    _, cache = _run(tiny_lm, press, IDS, [30, 45, 59])
    layer = cache.layers[1]
    assert isinstance(layer, ResidualKVLayer)
    selected = cache.step.selected
    n_ref = int(torch.isin(selected, layer.ref_pos).sum())
    n_coded = len(selected) - n_ref
    assert n_ref > 0 and n_coded > 0
    cfg = layer.cfg
    code_row = 32 * 4 // 8 + 2 * 2 * math.ceil(32 / cfg.group)     # INT4 levels, fp16 (zmin, scale) per group
    refs = (n_coded * cfg.k + n_ref) * cfg.d_kv                     # FP8 rows gathered
    decoder = sum(p.numel() * 4 for b in layer.codec.branches for p in b.decoder.parameters())
    # the step at position 59 read the 2 sinks, the raw window and its own token: chunks [0, 30), [30, 45),
    # [45, 59) left 4, 7, then 21 raw tokens after the sinks, the last coded down to 5 (blocks of 4 once 8 are
    # raw), so 2 + 5 + 1 raw tokens at float32
    raw = 2 * (2 + 5 + 1) * C * 4
    assert layer.read_bytes() == n_coded * (code_row + cfg.k * (2 + 1)) + refs + decoder + raw
    # the cache's count is the layers' audits summed (full layer 0: its view at float32)
    assert bandwidth.press_read_bytes(cache, 60, 2 * C, 4) == (sum(x.read_bytes() for x in cache.layers), "audit")
    assert cache.layers[0].read_bytes() == 2 * 60 * C * 4


def test_residualkv_standalone_raw_residual_reads_every_code_at_full_width(tiny_lm, tmp_path):
    """Standalone (every coded token and reference restored) with ``use_codec=false``: a code is kv − mean at
    d_kv = 64 values, 4-bit, groups of 32 (the codec's group), so 32 bytes + 2 groups x 2 fp16 per token."""
    codec = ResidualCodec.for_model(tiny_lm, seed=3, d_c=32, d_ff=64, encoder="linear", n_sink=2, window=4, stride=5)
    codec.save(tmp_path / "codec")
    press = ResidualKVPress(codec_dir=str(tmp_path / "codec"), bits=4, use_codec=False)
    _, cache = _run(tiny_lm, press, IDS, [30, 45, 59])
    layer = cache.layers[1]
    n_ref, n_coded = len(layer.ref_pos), len(layer.codes.positions())
    assert (n_ref, n_coded) == (11, 41)   # 52 tokens left the window by position 58: refs 2, 7, ..., 52
    k = layer.cfg.k
    want = (n_coded * (64 * 4 // 8 + 2 * 2 * 2 + k * (2 + 1))   # codes, scales, int16 indices + validity
            + (n_coded * k + n_ref) * 64                      # FP8 reference rows gathered
            + 2 * (2 + 5 + 1) * C * 4)                          # sinks, window, the step's token (float32)
    assert layer.read_bytes() == want

