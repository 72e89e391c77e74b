"""CONDUIT over ResidualKV-compressed image caches (issue #17, deliverable 7): the compressed store's round trip,
its bytes, corrupt and mismatched entries, and its spec's errors."""
from __future__ import annotations

import json

import pytest
import torch
from _reuse_fixtures import random_image, tiny_vlm

from kvbench.beyond.compressed_store import CacheCodec, CompressedImageKVStore, stored_parts, summarize
from kvbench.compress.accounting import StoredBytes, full_cache_bytes
from kvbench.compress.residualkv import references
from kvbench.compress.residualkv.codec import ResidualCodec
from kvbench.eval.refresh import MissingCacheEntry, open_store
from kvbench.kernels import quant
from kvbench.kernels.group_quant import unpack_levels
from kvbench.kernels.reference_mean import mean_reference
from kvbench.reuse import CacheMismatchError, ImageKVStore, adapter_for

torch.set_num_threads(1)
GENERIC = "You are a helpful assistant."
LAYERS = 3


@pytest.fixture(scope="module")
def vlm(tokenizer):
    return adapter_for(*tiny_vlm(tokenizer, seed=0, num_hidden_layers=LAYERS))


@pytest.fixture(scope="module")
def codec_dir(vlm, tmp_path_factory):
    """A random codec of the 3-layer tiny VLM (d_kv = 96), the zoo VLM codec's settings."""
    out = tmp_path_factory.mktemp("codec")
    ResidualCodec.for_model(vlm.model, seed=0, d_c=32, d_ff=144, n_sink=4, stride=10, window=8).save(out)
    return out


def _spec(codec_dir, **kw):
    return CacheCodec(**{"codec_dir": str(codec_dir), "full_layers": (0,), "full_kv_bits": 4, **kw})


IMAGE = dict(h=280, w=280)   # 10 x 10 patches of 28 px: 100 visual tokens (a full 32-token KIVI key group and more)


def _stores(vlm, tmp_path, spec):
    raw = ImageKVStore(tmp_path / "raw", vlm, GENERIC)
    return raw, CompressedImageKVStore(tmp_path / "rkv", vlm, GENERIC, spec, source=raw)


def test_round_trip_shapes_dtypes_and_codes(vlm, codec_dir, tmp_path):
    spec = _spec(codec_dir)
    raw_store, store = _stores(vlm, tmp_path, spec)
    image = random_image(0, **IMAGE)
    raw = raw_store.get(image)
    got = store.get(image)
    assert store.stats["built"] == 1 and got.key == raw.key and got.grid_thw == raw.grid_thw
    for a, b in zip(got.keys + got.values, raw.keys + raw.values):
        assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(got.embeds, raw.embeds)
    # a later load restores exactly what the build returned
    again = CompressedImageKVStore(tmp_path / "rkv", vlm, GENERIC, spec).get(image)
    for a, b in zip(again.keys + again.values, got.keys + got.values):
        assert torch.equal(a, b)
    # layer 1 (sparse): the same codes decoded with the codec directly give the restored K‖V
    t = _tensors(store, got.key)
    codec = spec.codec
    cfg = codec.config
    n = raw.n_tokens
    refs = references.references_between(0, n, n_sink=0, stride=cfg.stride, alpha=cfg.alpha, grid=cfg.grid)
    coded = [p for p in range(n) if p not in set(refs)]
    assert refs[:2] == [0, cfg.stride] and t["ref.1"].dtype == torch.float8_e4m3fn and t["nbr.1"].dtype == torch.int16
    nbr = t["nbr.1"].long()
    z = quant.dequantize(quant.QuantizedCodes(unpack_levels(t["code.1"], 4), t["zmin.1"], t["scale.1"], 4, cfg.group))
    mean = mean_reference(t["ref.1"].float(), nbr.clamp(min=0), nbr >= 0)
    want = codec.layers[1].restore(z, mean).detach()
    kv = torch.cat([x.transpose(0, 1).reshape(n, -1) for x in (got.keys[1], got.values[1])], -1)
    assert torch.equal(kv[coded], want.to(kv.dtype))
    assert torch.equal(kv[refs], t["ref.1"].float().to(kv.dtype))
    # the restored tokens are close to the raw ones where stored exactly or nearly (references: FP8)
    raw_kv = torch.cat([x.transpose(0, 1).reshape(n, -1) for x in (raw.keys[1], raw.values[1])], -1)
    assert torch.allclose(kv[refs], raw_kv[refs], rtol=0.07, atol=1e-3)
    # layer 0 is a KIVI-4-bit full layer: 3 full key groups of 32 tokens quantised, the last 4 keys raw FP16
    assert t["full.kcode.0"].shape == (3 * 48, 16) and t["full.kraw.0"].shape == (4, 48)
    assert (got.keys[0] - raw.keys[0]).abs().max() < 0.2 * raw.keys[0].abs().max()


def _tensors(store, key):
    from safetensors.torch import load_file

    return load_file(store.paths(key)[0])


def test_bytes_by_part_are_the_stored_tensors(vlm, codec_dir, tmp_path):
    spec = _spec(codec_dir)
    _, store = _stores(vlm, tmp_path, spec)
    e = store.get(random_image(1, **IMAGE))
    meta = store.sidecar(e.key)
    path = store.paths(e.key)[0]
    from_file = stored_parts(path, LAYERS)
    assert meta["bytes"]["parts"] == {p: sum(getattr(s, p) for s in from_file) for p in StoredBytes.PACKED}
    n, h, d = e.n_tokens, vlm.n_kv_heads, vlm.head_dim
    assert meta["bytes"]["raw_kv"] == full_cache_bytes(n_tokens=n, n_layers=LAYERS, n_kv_heads=h, head_dim=d)
    cfg = spec.codec.config
    refs = len(references.references_between(0, n, n_sink=0, stride=cfg.stride, grid=cfg.grid))
    coded = n - refs
    sparse = [s for s in from_file if s.layer != 0]
    # ResidualKV's packed accounting per sparse layer: FP8 references, 4-bit codes + 2 fp16 per group, int16 indices
    assert all(s.references == refs * cfg.d_kv and s.codes == coded * cfg.d_c // 2 for s in sparse)
    assert all(s.scales == coded * 2 * 2 * (cfg.d_c // cfg.group) and s.indices == coded * cfg.k * 2 for s in sparse)
    assert all(s.sinks == s.full_layer == s.raw_window == 0 for s in sparse) and from_file[0].codes == 0
    assert meta["bytes"]["compressed_kv"] < 0.4 * meta["bytes"]["raw_kv"]
    assert len(meta["rel_err_k"]) == LAYERS and all(0 <= x < 10 for x in meta["rel_err_k"] + meta["rel_err_v"])
    s = summarize([meta])
    assert s["kr"] == meta["bytes"]["compressed_kv"] / meta["bytes"]["raw_kv"] and s["n_images"] == 1


def test_fp16_full_layers_and_sinks(vlm, codec_dir, tmp_path):
    spec = _spec(codec_dir, full_kv_bits=16, n_sink=4)
    raw_store, store = _stores(vlm, tmp_path, spec)
    image = random_image(2)   # 6 tokens: 4 sinks, the reference at 4, one coded token
    raw, got = raw_store.get(image), store.get(image)
    assert torch.equal(got.keys[0], raw.keys[0].half().to(raw.keys[0].dtype))
    assert torch.equal(got.keys[1][:, :4], raw.keys[1][:, :4].half().to(raw.keys[1].dtype))
    parts = store.sidecar(got.key)["bytes"]["parts"]
    assert parts["sinks"] == (LAYERS - 1) * 4 * 96 * 2 and parts["full_layer"] == 6 * 96 * 2


def test_corrupt_entry_is_rebuilt_and_read_only_store_refuses(vlm, codec_dir, tmp_path):
    spec = _spec(codec_dir)
    _, store = _stores(vlm, tmp_path, spec)
    image = random_image(3)
    e = store.get(image)
    path = store.paths(e.key)[0]
    good = path.read_bytes()
    data = bytearray(good)
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    _, store2 = _stores(vlm, tmp_path, spec)
    store2.get(image)
    assert store2.stats["rebuilt_corrupt"] == 1 and store2.stats["built"] == 1 and path.read_bytes() == good
    # the pipeline's runs read it through open_store(build_missing=False): a missing entry stops the run
    with pytest.raises(MissingCacheEntry, match="has not been built"):
        open_store(tmp_path / "nowhere", vlm, GENERIC, build_missing=False, compressed=spec)
    ro = CompressedImageKVStore(tmp_path / "rkv", vlm, GENERIC, spec)
    with pytest.raises(FileNotFoundError, match="no raw source"):
        ro.get(random_image(4))


def test_entry_of_another_codec_or_storage_is_a_mismatch(vlm, codec_dir, tmp_path):
    spec = _spec(codec_dir)
    _stores(vlm, tmp_path, spec)[1].get(random_image(0))
    with pytest.raises(CacheMismatchError, match="storage"):
        CompressedImageKVStore(tmp_path / "rkv", vlm, GENERIC, _spec(codec_dir, bits=2))
    other = tmp_path / "other_codec"
    ResidualCodec.for_model(vlm.model, seed=1, d_c=32, d_ff=144).save(other)
    with pytest.raises(CacheMismatchError, match="codec_id"):
        CompressedImageKVStore(tmp_path / "rkv", vlm, GENERIC, _spec(other))
    # an entry whose sidecar names another codec (manifest rewritten by hand) is refused, not restored wrongly
    store = CompressedImageKVStore(tmp_path / "rkv", vlm, GENERIC, spec)
    key = next(p.stem for p in (tmp_path / "rkv").glob("*.safetensors"))
    side = store.paths(key)[1]
    meta = json.loads(side.read_text())
    meta["codec_id"] = "0" * 64
    side.write_text(json.dumps(meta))
    with pytest.raises(CacheMismatchError, match="codec_id"):
        store.get(random_image(0))


def test_source_must_be_another_directory(vlm, codec_dir, tmp_path):
    raw = ImageKVStore(tmp_path, vlm, GENERIC)
    with pytest.raises(ValueError, match="its own directory"):
        CompressedImageKVStore(tmp_path, vlm, GENERIC, _spec(codec_dir), source=raw)


@pytest.mark.parametrize("spec, match", [
    ({"codec_dir": "x", "bits": 3}, "bits must be"),
    ({"codec_dir": "x", "bits": 32}, "bits must be 2, 4, 8 or 16"),
    ({"codec_dir": "x", "full_kv_bits": 4}, "full_layers is empty"),
    ({"codec_dir": "x", "full_layers": [0, 0]}, "full_layers"),
    ({"codec_dir": "x", "n_sink": -1}, "n_sink"),
    ({"codec_dir": "x", "stride": 3}, "unknown key"),
    ({"bits": 4}, "codec_dir is required"),
    ("codec_dir=x", "must be a mapping"),
])
def test_bad_spec_values_are_clear_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        CacheCodec.from_spec(spec)


def test_missing_codec_is_named(tmp_path, vlm):
    spec = CacheCodec(codec_dir=str(tmp_path))
    with pytest.raises(ValueError, match="holds no trained codec"):
        spec.codec  # noqa: B018
