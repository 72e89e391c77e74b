"""Every registered press through the same checks (driven by the registry: a new press is tested with no line here).

- its ``exact`` parameters keep everything, so greedy decoding equals the full cache (context + question chunk);
- a context shorter than any window, sink or page still runs, and still equals the full cache;
- its spec round-trips through the one grammar (parse, canonical, build);
- it runs at its defaults (or the paper's usual setting) on the tiny LM and returns the asked tokens.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvbench.compress.cache import Press
from kvbench.compress.generate import greedy_generate
from kvbench.compress.registry import PRESS, PRESSES
from kvbench.compress.residualkv.codec import ResidualCodec
from kvbench.utils.spec import fmt, parse


class CharTok:
    """Stand-in tokenizer for KVzip's reconstruction prompt: one id per character (vocab 256)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 256 for c in text]}

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 256 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


@pytest.fixture(scope="module")
def identity_codec(tiny_lm, tmp_path_factory):
    """Linear f_c, f_d = identity (d_c = d_kv): ResidualKV stores kv - mean_ref exactly."""
    codec = ResidualCodec.for_model(tiny_lm, d_c=64, d_ff=64, encoder="linear", decoder="linear", bits=16)
    with torch.no_grad():
        for layer in codec.layers:
            for p in layer.parameters():
                p.copy_(torch.eye(p.shape[0], p.shape[1]) if p.dim() == 2 else torch.zeros_like(p))
    path = tmp_path_factory.mktemp("codec")
    codec.save(path)
    return path


def resources(cls, identity_codec) -> dict:
    """The resources a press takes (PRESS.resources), as this test provides them."""
    have = {"codec_dir": str(identity_codec), "tokenizer": CharTok()}
    return {f.name: have[f.name] for f in dataclasses.fields(cls) if f.name in PRESS.resources}


def _generate(model, press, n_prompt, split, n_new=4, seed=0):
    ids = torch.randint(0, 256, (1, n_prompt), generator=torch.Generator().manual_seed(seed))
    press.load()
    new, _ = greedy_generate(model, press, ids, split, max_new_tokens=n_new, eos=set())
    return new


@pytest.mark.parametrize("name", sorted(PRESSES))
@pytest.mark.parametrize("n_prompt, split", [(60, 45), (3, 2)], ids=["context", "tiny-context"])
def test_keep_everything_equals_the_full_cache(tiny_lm, identity_codec, name, n_prompt, split):
    cls = PRESSES[name]
    press = cls(**cls.exact, **resources(cls, identity_codec))
    assert _generate(tiny_lm, press, n_prompt, split) == _generate(tiny_lm, Press(), n_prompt, split), name


@pytest.mark.parametrize("name", sorted(PRESSES))
def test_exact_spec_round_trips_through_the_grammar(name):
    cls = PRESSES[name]
    text = name + (":" + ",".join(f"{k}={fmt(v)}" for k, v in cls.exact.items()) if cls.exact else "")
    spec = parse(text, PRESS)
    assert spec.family == "press" and spec.cls is cls and parse(spec.canonical, PRESS) == spec
    assert isinstance(spec.build(), cls)  # constructing checks it: no resource is read before load()


@pytest.mark.parametrize("name", sorted(PRESSES))
def test_runs_on_the_tiny_lm(tiny_lm, identity_codec, name):
    cls = PRESSES[name]
    usual = {"residualkv": {"mode": "omnikv", "full_layers": (0,), "keep": 0.5}}.get(name, {})
    press = cls(**usual, **resources(cls, identity_codec))
    new = _generate(tiny_lm, press, 70, 60, n_new=5, seed=1)
    assert len(new) == 5 and all(0 <= t < 256 for t in new)
