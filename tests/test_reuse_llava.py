"""A second VLM class with 1-D RoPE (LLaVA: CLIP tower + Qwen2 LM): rotation and r=1 / r=0 invariants."""
from __future__ import annotations

import pytest
import torch
from _reuse_fixtures import prepared_request, tiny_llava
from _tolerance import arith_atol

from kvbench.reuse import adapter_for, refresh
from kvbench.reuse.executor import LayerSchedule, execute


@pytest.fixture(scope="module")
def llava(tokenizer):
    return adapter_for(*tiny_llava(tokenizer))


@pytest.fixture(scope="module")
def req(llava, tmp_path_factory):
    return prepared_request(llava, tmp_path_factory.mktemp("llava"), [1, 2], system="A serving prefix of some length.")


def test_1d_positions_and_rotation(llava, req):
    assert not llava.mrope and req.position_ids.shape == (1, req.seq_len)
    out = llava.full_forward(req.enc)
    vi = req.visual_index
    want = out.cache.layers[0].keys[:, :, vi]  # k_proj over the hidden size in two batch shapes, then a rotation
    depth = llava.model.config.get_text_config().hidden_size + 2
    torch.testing.assert_close(req.stale_k[0][:, :, vi], want, rtol=0, atol=arith_atol(want, depth))


@pytest.mark.parametrize("policy", ["conduit", "prophetkv", "mpic-first", "cacheblend", "cacheblend-conduit",
                                    "kvshare-conduit"])
def test_r1_full_and_r0_reuse(llava, req, policy):
    full = refresh(llava, req, "full", 1.0).output
    reuse = refresh(llava, req, "reuse", 0.0).output
    assert (full.logits - reuse.logits).abs().max() > 1e-3
    torch.testing.assert_close(refresh(llava, req, policy, 1.0).output.logits, full.logits, rtol=1e-4, atol=1e-4)
    if policy == "cacheblend":  # the paper form keeps every visual token's new K/V up to its check layer (1)
        vis, L = req.visual_index, llava.n_layers
        reuse = execute(llava, req, LayerSchedule([vis, vis] + [vis[:0]] * (L - 2)))
    torch.testing.assert_close(refresh(llava, req, policy, 0.0).output.logits, reuse.logits, rtol=1e-5, atol=1e-5)
