"""VLM records through the compressed cache (kvbench.compress.generate_vlm; ResidualKV Table II)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from _reuse_fixtures import record, tiny_vlm

from kvbench.compress.cache import Press, RopeTable, StoreLayer
from kvbench.compress.generate_vlm import MRopeTable, encode_vlm, greedy_generate_vlm, is_mrope, question_start
from kvbench.eval.compress import CompressMethod
from kvbench.eval.methods import FullCache, eos_ids


@pytest.fixture(scope="module")
def vlm(tokenizer):
    torch.set_num_threads(1)
    return tiny_vlm(tokenizer, seed=3, num_hidden_layers=4)


def _records(n: int = 3) -> list[dict]:
    # two pages each: visual tokens at two places, a caption between them, a question after
    return [dict(record([10 * i, 10 * i + 1], question=f"Page {1 + i % 2}, cell {'ABC'[i]}", rid=f"r{i}"),
                 max_new_tokens=3) for i in range(n)]


@pytest.mark.parametrize("protocol", ["shared_context", "one_pass"])
def test_fullkv_reproduces_the_full_vlm_eval(vlm, protocol):
    model, proc = vlm
    method = CompressMethod(spec=f"fullkv:protocol={protocol}")
    for i, rec in enumerate(_records()):
        method.start(i)
        assert method.predict(model, proc, rec, None) == FullCache().predict(model, proc, rec, None), rec["id"]
        audit = method.audit()
        assert audit["kr_packed"] == pytest.approx(1.0) and audit["kept"] == pytest.approx(1.0)


def test_fullkv_logits_match_the_model_on_the_whole_prompt(vlm):
    """The two-chunk prefill with explicit M-RoPE positions gives the model's own last-position logits."""
    model, proc = vlm
    rec = _records(1)[0]
    inputs = encode_vlm(model, proc, rec, None)
    with torch.inference_mode():
        ref = model(**inputs).logits[0, -1]
    seen = []
    split = question_start(proc, rec, inputs["input_ids"])
    handle = model.lm_head.register_forward_hook(lambda _m, _a, out: seen.append(out[0, -1].clone()))
    try:
        greedy_generate_vlm(model, Press(), inputs, split, 1, eos_ids(model, proc))
    finally:
        handle.remove()
    assert len(seen) == 2  # context chunk, question chunk
    torch.testing.assert_close(seen[-1], ref, rtol=1e-4, atol=1e-4)


def test_question_chunk_starts_at_the_question(vlm):
    model, proc = vlm
    rec = _records(1)[0]
    ids = encode_vlm(model, proc, rec, None)["input_ids"]
    split = question_start(proc, rec, ids)
    tok = proc.tokenizer
    assert tok.decode(ids[0, split:]).startswith(rec["question"])
    assert rec["question"] not in tok.decode(ids[0, :split])
    assert 0 < split < ids.shape[1]


def test_visual_tokens_are_set_before_the_prefill(vlm):
    """cache.visual holds the placeholder positions, the model's input embeddings there and the merged grids, and
    is already set when layer 0's store first commits."""
    model, proc = vlm
    rec = _records(1)[0]
    inputs = encode_vlm(model, proc, rec, None)
    seen = []

    class Probe(StoreLayer):
        def commit(self, chunk, query):
            if self.ctx.layer_idx == 0:
                seen.append(self.cache.visual)
            super().commit(chunk, query)

    @dataclasses.dataclass
    class ProbePress(Press):
        def make_layer(self, ctx, cache):
            return Probe(ctx, cache)

    _, cache = greedy_generate_vlm(model, ProbePress(), inputs, 0, 1, set())
    vis = cache.visual
    assert seen and seen[0] is vis
    ids = inputs["input_ids"][0]
    assert torch.equal(vis.positions, (ids == model.config.image_token_id).nonzero().flatten())
    feats = torch.cat(model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"],
                                                     return_dict=True).pooler_output)
    torch.testing.assert_close(vis.embeds, feats.to(vis.embeds.dtype))
    merge = model.config.vision_config.spatial_merge_size
    assert vis.grids == [(int(t), int(h) // merge, int(w) // merge) for t, h, w in inputs["image_grid_thw"].tolist()]


def test_the_cache_rope_table_is_the_models_3d_rotation(vlm):
    """ResidualKV/Palu invert RoPE on the keys they are given (LayerContext.unrotate) and rotate restored keys by the
    cache's table: on M-RoPE that table must give, at every sequence position (image tokens, the text after them,
    decode steps), the model's own 3-D rotation, so unrotating the stored keys gives k_proj's output. A 1-D table
    (sequence positions) fails this at the image tokens and everything after them."""
    model, proc = vlm
    assert is_mrope(model)
    inputs = encode_vlm(model, proc, _records(1)[0], None)
    raw = []
    attn = model.model.language_model.layers[0].self_attn
    handle = attn.k_proj.register_forward_hook(lambda _m, _a, out: raw.append(out[0]))
    try:
        _, cache = greedy_generate_vlm(model, Press(), inputs, 0, 3, set())
    finally:
        handle.remove()
    k_pre = torch.cat(raw)                                         # [T + 2, H_kv * D]: prompt, then 2 decode steps
    layer = cache.layers[0]
    view = layer.history()
    assert isinstance(layer.ctx.rope, MRopeTable) and len(view) == k_pre.shape[0]
    layer.ctx.rope.reach(layer.seen)
    got = layer.ctx.unrotate(view.keys, view.positions[0, 0])      # [1, H_kv, n, D]
    torch.testing.assert_close(got[0].transpose(0, 1).reshape(k_pre.shape), k_pre, atol=1e-5, rtol=1e-4)
    one_d = RopeTable(layer.ctx.rotary_emb, layer.ctx.dtype)
    one_d.reach(layer.seen)
    cos, sin = one_d(view.positions[0, 0])
    wrong = layer.ctx.apply_rope(view.keys[:, :1, :1], view.keys, cos, -sin)[1]
    assert not torch.allclose(wrong[0].transpose(0, 1).reshape(k_pre.shape), k_pre, atol=1e-3)


def test_residualkv_with_an_identity_codec_reproduces_the_full_cache_on_the_vlm(vlm, tmp_path):
    """A press that stores pre-RoPE codes and restores keys (ResidualKV) runs on the M-RoPE VLM: with an identity
    codec it answers as the full cache."""
    from kvbench.compress.residualkv.cache import ResidualKVPress
    from kvbench.compress.residualkv.codec import ResidualCodec

    model, proc = vlm
    cfg = model.config.get_text_config()
    d_kv = 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    # linear f_c, f_d = identity (d_c = d_kv): restore = (kv - mean_ref) + mean_ref, as tests/test_rkv_cache.py
    codec = ResidualCodec.for_model(model, d_c=d_kv, d_ff=d_kv, encoder="linear", decoder="linear", bits=16,
                                    n_sink=2, window=4, stride=5)
    with torch.no_grad():
        for p in codec.parameters():
            p.copy_(torch.eye(*p.shape) if p.dim() == 2 else torch.zeros_like(p))
    codec_dir = codec.save(tmp_path / "id") or tmp_path / "id"
    inputs = encode_vlm(model, proc, _records(1)[0], None)
    split = question_start(proc, _records(1)[0], inputs["input_ids"])
    press = ResidualKVPress(codec_dir=str(codec_dir), bits=32, ref_fp8=False)
    press.load()
    got, cache = greedy_generate_vlm(model, press, inputs, split, 4, set())
    want, _ = greedy_generate_vlm(model, Press(), inputs, split, 4, set())
    assert got == want
    assert len(cache.layers[1].codes.positions()) > 0   # tokens were coded and restored, not kept raw


def test_a_context_pass_press_is_refused_on_vlm_records(vlm):
    model, proc = vlm
    with pytest.raises(ValueError, match="token ids"):
        CompressMethod(spec="kvzip:ratio=0.5").predict(model, proc, _records(1)[0], None)


def test_check_records_accepts_vlm_and_names_a_bad_text_record():
    method = CompressMethod(spec="snapkv:keep=0.5")
    method.check_records(_records(1))
    with pytest.raises(ValueError, match="'t0'.*kind 'text'"):
        method.check_records([{"id": "t0", "kind": "text", "question": "q"}])


def test_snapkv_on_vlm_records_evicts_and_answers(vlm):
    model, proc = vlm
    method = CompressMethod(spec="snapkv:keep=0.3,window=2,protocol=shared_context")
    method.start(0)
    assert isinstance(method.predict(model, proc, _records(1)[0], None), str)
    audit = method.audit()
    assert audit["kept"] < 0.9 and audit["kr_packed"] < 0.9
