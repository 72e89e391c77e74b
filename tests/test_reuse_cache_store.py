"""Per-image KV store: keys, reuse, corruption, model/template mismatch, atomic files."""
from __future__ import annotations

import json

import pytest
import torch
from _reuse_fixtures import random_image, tiny_vlm

from kvbench.reuse import CacheMismatchError, ImageKVStore, adapter_for
from kvbench.reuse.cache_store import template_hash

torch.set_num_threads(1)
GENERIC = "You are a helpful assistant."


@pytest.fixture(scope="module")
def vlm(tokenizer):
    return adapter_for(*tiny_vlm(tokenizer, seed=0))


@pytest.fixture(scope="module")
def vlm_other(tokenizer):
    """Same config, different weights: a different model identity."""
    return adapter_for(*tiny_vlm(tokenizer, seed=1))


def test_entry_shapes_and_files(vlm, tmp_path):
    store = ImageKVStore(tmp_path, vlm, GENERIC)
    e = store.get(random_image(0))
    assert e.n_tokens == 6 and e.grid_thw == (1, 4, 6)
    assert len(e.keys) == len(e.values) == vlm.n_layers
    assert e.keys[0].shape == (vlm.n_kv_heads, 6, vlm.head_dim)
    assert e.embeds.shape == (6, vlm.model.config.text_config.hidden_size)
    meta = json.loads((tmp_path / f"{e.key}.json").read_text())
    assert meta["model_id"] == vlm.fingerprint() and meta["n_tokens"] == 6
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # atomic writes leave no temp files


def test_different_images_never_share_a_key_and_same_image_is_reused(vlm, tmp_path):
    store = ImageKVStore(tmp_path, vlm, GENERIC)
    a, b = store.get(random_image(0)), store.get(random_image(1))
    assert a.key != b.key
    again = store.get(random_image(0))
    assert again.key == a.key and store.stats == {"built": 2, "reused": 1, "rebuilt_corrupt": 0}
    for x, y in zip(again.keys + again.values, a.keys + a.values):
        assert torch.equal(x, y)
    # a one-pixel change is a different image
    im = random_image(0)
    im.putpixel((0, 0), (0, 0, 0) if im.getpixel((0, 0)) != (0, 0, 0) else (1, 1, 1))
    assert store.get(im).key != a.key


def test_same_image_under_two_models_or_templates_never_collides(vlm, vlm_other, tmp_path):
    k1 = ImageKVStore(tmp_path / "m1", vlm, GENERIC).get(random_image(0)).key
    k2 = ImageKVStore(tmp_path / "m2", vlm_other, GENERIC).get(random_image(0)).key
    k3 = ImageKVStore(tmp_path / "m3", vlm, "Another generic prefix.").get(random_image(0)).key
    assert len({k1, k2, k3}) == 3
    assert vlm.fingerprint() != vlm_other.fingerprint()
    assert template_hash(vlm.processor, GENERIC) != template_hash(vlm.processor, "Another generic prefix.")


def test_corrupt_file_is_detected_and_rebuilt(vlm, tmp_path):
    store = ImageKVStore(tmp_path, vlm, GENERIC)
    e = store.get(random_image(0))
    path = tmp_path / f"{e.key}.safetensors"
    good = path.read_bytes()
    data = bytearray(good)
    data[-5] ^= 0xFF  # flip bits inside the tensor payload: still a loadable file, wrong numbers
    path.write_bytes(bytes(data))
    store2 = ImageKVStore(tmp_path, vlm, GENERIC)
    e2 = store2.get(random_image(0))
    assert store2.stats["rebuilt_corrupt"] == 1 and store2.stats["built"] == 1
    assert path.read_bytes() == good
    for x, y in zip(e2.keys + e2.values, e.keys + e.values):
        assert torch.equal(x, y)
    # a missing sidecar also means "not a finished entry": rebuilt
    (tmp_path / f"{e.key}.json").unlink()
    store3 = ImageKVStore(tmp_path, vlm, GENERIC)
    store3.get(random_image(0))
    assert store3.stats["built"] == 1


def test_cache_built_for_another_model_or_template_is_a_clear_error(vlm, vlm_other, tmp_path):
    ImageKVStore(tmp_path, vlm, GENERIC).get(random_image(0))
    with pytest.raises(CacheMismatchError, match="model_id"):
        ImageKVStore(tmp_path, vlm_other, GENERIC)
    with pytest.raises(CacheMismatchError, match="template_id"):
        ImageKVStore(tmp_path, vlm, "Another generic prefix.")


def test_entry_sidecar_naming_another_model_is_an_error(vlm, tmp_path):
    store = ImageKVStore(tmp_path, vlm, GENERIC)
    e = store.get(random_image(0))
    side = tmp_path / f"{e.key}.json"
    meta = json.loads(side.read_text())
    meta["model_id"] = "0" * 64
    side.write_text(json.dumps(meta))
    with pytest.raises(CacheMismatchError, match="built for model"):
        store.get(random_image(0))


def test_record_without_images_is_refused(vlm, tmp_path):
    store = ImageKVStore(tmp_path, vlm, GENERIC)
    with pytest.raises(ValueError, match="no image part"):
        store.entries({"id": "t", "content": [{"type": "text", "text": "hi"}]})
