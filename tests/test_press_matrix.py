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
from _docstrings import parameters_section

from kvbench.compress.cache import Press, VisualTokens
from kvbench.compress.generate import greedy_generate
from kvbench.compress.presses.snapkv import SnapKVPress
from kvbench.compress.registry import PRESS, PRESSES
from kvbench.compress.residualkv.cache import ResidualKVPress
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
    have = {"codec_dir": str(identity_codec), "tokenizer": CharTok(),
            "calib_ids": torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(7))}
    return {f.name: have[f.name] for f in dataclasses.fields(cls) if f.name in PRESS.resources}


def _visual(press, model, ids, split):
    """A press that acts on visual tokens only (``serves`` no text: FastV, PACT, DivPrune) reads ``cache.visual``,
    which the VLM path sets before the prefill; here its caches get the middle half of the first chunk
    ``ids[:, :split]`` as the "image" (input embeddings at those positions). Other presses are returned as given."""
    if "text" in press.serves:
        return press
    pos = torch.arange(split // 4, max(1, 3 * split // 4))
    make = press.new_cache

    def new_cache(model):
        cache = make(model)
        with torch.no_grad():
            cache.visual = VisualTokens(pos, model.get_input_embeddings()(ids)[0, pos])
        return cache

    press.new_cache = new_cache
    return press


def _generate(model, press, n_prompt, split, n_new=4, seed=0):
    ids = torch.randint(0, 256, (1, n_prompt), generator=torch.Generator().manual_seed(seed))
    press.load()
    press = _visual(press, model, ids, split)
    new, _ = greedy_generate(model, press, ids, split, max_new_tokens=n_new, eos=set())
    return new


@pytest.mark.parametrize("name", sorted(PRESSES))
@pytest.mark.parametrize("n_prompt, split", [(60, 45), (3, 2)], ids=["context", "tiny-context"])
def test_keep_everything_equals_the_full_cache(tiny_lm, identity_codec, name, n_prompt, split):
    cls = PRESSES[name]
    press = cls(**cls.exact, **resources(cls, identity_codec))
    assert _generate(tiny_lm, press, n_prompt, split) == _generate(tiny_lm, Press(), n_prompt, split), name


@pytest.mark.parametrize("name", sorted(PRESSES))
def test_every_press_documents_its_source_and_parameters(name):
    """Each registered press's class docstring names the paper (or code) it implements and has a Parameters section."""
    parameters_section(PRESSES[name])


@pytest.mark.parametrize("name", sorted(PRESSES))
def test_exact_spec_round_trips_through_the_grammar(name):
    cls = PRESSES[name]
    text = name + (":" + ",".join(f"{k}={fmt(v)}" for k, v in cls.exact.items()) if cls.exact else "")
    spec = parse(text, PRESS)
    assert spec.family == "press" and spec.cls is cls and parse(spec.canonical, PRESS) == spec
    assert isinstance(spec.build(), cls)  # constructing checks it: no resource is read before load()


#: every press alone and composed with each selector it takes (``<storage>+<selector>``)
SPECS = sorted(PRESSES) + [f"{n}+{s}" for n, cls in sorted(PRESSES.items()) for s in getattr(cls, "selectors", ())]
USUAL = {"residualkv+omnikv": ":full_layers=0,keep=0.5", "residualkv+snapkv": ":keep=0.5,window=8",
         "pact": ":layer=1"}   # PACT's default layer 4 is past the tiny LM's 3 layers


@pytest.mark.parametrize("name", SPECS)
def test_runs_on_the_tiny_lm(tiny_lm, identity_codec, name):
    spec = parse(name + USUAL.get(name, ""), PRESS)
    press = spec.build(**resources(spec.cls, identity_codec))
    new = _generate(tiny_lm, press, 70, 60, n_new=5, seed=1)
    assert len(new) == 5 and all(0 <= t < 256 for t in new)


# -- composition: <storage>+<selector> (kvbench.utils.spec) ----------------------------------------------
def test_composed_spec_routes_each_parameter_to_its_method():
    spec = parse("residualkv+snapkv:keep=0.4,full_layers=0+1,kernel=7,pooling=max", PRESS)
    assert spec.name == "residualkv+snapkv" and spec.cls is ResidualKVPress and spec.selector_cls is SnapKVPress
    assert spec.canonical == "residualkv+snapkv:full_layers=0+1,keep=0.4,kernel=7,pooling=max"
    assert spec.slug == "residualkv.snapkv_full_layers-0.1_keep-0.4_kernel-7_pooling-max"
    press = spec.build(codec_dir="c")
    assert press.full_layers == (0, 1) and press.codec_dir == "c"
    assert (press.selector.keep, press.selector.kernel, press.selector.pooling, press.selector.window) == (0.4, 7, "max", 32)
    assert parse(spec.canonical, PRESS) == spec
    # the standalone storage is the plain name: no selector
    assert parse("residualkv:full_layers=0+1", PRESS).build().selector is None


def test_omnikv_selection_form_is_set_by_spec_standalone_and_composed():
    """The authors' form is the default (decode-only selection, rows averaged); the former form stays a spec away,
    and in ``residualkv+omnikv`` these are the selector's fields (not the storage's), kept by its filter step."""
    press = parse("omnikv", PRESS).build()
    assert (press.sparse_prefill, press.row_agg) == (False, "mean")
    spec = parse("omnikv:sparse_prefill=true,row_agg=max", PRESS)
    assert spec.canonical == "omnikv:row_agg=max,sparse_prefill=true" and parse(spec.canonical, PRESS) == spec
    assert (spec.build().sparse_prefill, spec.build().row_agg) == (True, "max")
    spec = parse("residualkv+omnikv:full_layers=0+1,keep=0.2,sparse_prefill=true,row_agg=max", PRESS)
    sel = spec.build(codec_dir="c").selector
    assert (sel.keep, sel.sparse_prefill, sel.row_agg) == (0.2, True, "max")
    assert "sparse_prefill" not in ResidualKVPress.storage_owns["omnikv"]


@pytest.mark.parametrize("text, needle", [
    ("omnikv:row_agg=sum", r"row_agg must be one of \('mean', 'max'\)"),
    ("residualkv+omnikv:full_layers=0+1,row_agg=median", "row_agg must be one of"),
    ("residualkv+quest:keep=0.3", r"'residualkv' takes the selectors \['omnikv', 'snapkv'\], not 'quest'"),
    ("snapkv+omnikv", "'snapkv' takes no selector, not 'omnikv'"),
    ("residualkv+nope", "not 'nope'"),
    ("residualkv:selector=omnikv", "unknown parameter 'selector'"),
    ("residualkv+omnikv:keep=0.2", "needs full_layers"),
    ("residualkv+omnikv:full_layers=0,n_sink=2", r"takes \['n_sink'\] from the storage"),
    ("residualkv+snapkv:keep=2", "keep"),
    ("residualkv+snapkv:bogus=1", "unknown parameter 'bogus' for 'residualkv\\+snapkv'"),
])
def test_bad_composed_specs_name_what_is_wrong(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse(text, PRESS)


def test_storage_and_selector_never_share_a_parameter_name():
    """A spec routes a parameter by its name, so a storage and any selector it takes declare none in common;
    the only names they share are fields both inherit from ``Press`` (the run's ``protocol``)."""
    base = {f.name for f in dataclasses.fields(Press)}
    for name, cls in PRESSES.items():
        for sel in getattr(cls, "selectors", ()):
            shared = set(PRESS.parameters(cls)) & set(PRESS.parameters(PRESSES[sel]))
            assert shared == base, (name, sel, shared)


@pytest.mark.parametrize("protocol", ["one_pass", "shared_context"])
def test_the_protocol_of_a_composed_spec_is_the_storage_s(protocol):
    """``protocol`` is a field every press inherits; in ``residualkv+omnikv`` it is the run's, so the storage
    holds it (the selector never runs a request) and the canonical spec names it once."""
    spec = parse(f"residualkv+omnikv:full_layers=0+1,keep=0.2,protocol={protocol}", PRESS)
    press = spec.build(codec_dir="x")
    assert press.protocol == protocol and press.selector.protocol == "shared_context"
    assert spec.canonical.count("protocol=") == 1


def test_a_bad_protocol_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"protocol must be one of \('one_pass', 'shared_context'\), got 'two_pass'"):
        parse("snapkv:keep=0.3,protocol=two_pass", PRESS)
    with pytest.raises(ValueError, match="protocol must be one of"):
        parse("residualkv+omnikv:full_layers=0+1,protocol=x", PRESS)


def test_the_first_chunk_follows_the_protocol():
    """one_pass: the whole prompt is one chunk; shared_context: the context alone; KVzip scores the context
    before the question exists, so it always prefills the context alone."""
    assert PRESSES["snapkv"](protocol="one_pass").first_chunk(100, 80) == 100
    assert PRESSES["snapkv"](protocol="shared_context").first_chunk(100, 80) == 80
    assert PRESSES["kvzip"](protocol="one_pass").first_chunk(100, 80) == 80


def test_an_int_for_a_float_parameter_is_the_same_run():
    """``keep=1`` and ``keep=1.0`` were two canonical forms, so two runs of one setting."""
    assert parse("snapkv:keep=1", PRESS).canonical == parse("snapkv:keep=1.0", PRESS).canonical == "snapkv:keep=1.0"
    assert parse("residualkv:alpha=0", PRESS).slug == "residualkv_alpha-0.0"
    assert parse("residualkv:stride=5", PRESS).canonical == "residualkv:stride=5"   # ints stay ints


def test_layer_lists_are_sorted_and_repeats_refused():
    """``full_layers=1+0`` was a second run of ``0+1``; ``0+0+1`` counted layer 0 twice in KR."""
    assert parse("residualkv:full_layers=1+0", PRESS).canonical == "residualkv:full_layers=0+1"
    with pytest.raises(ValueError, match="lists a layer twice"):
        parse("residualkv+omnikv:full_layers=0+0+1,keep=0.2", PRESS)
    with pytest.raises(ValueError, match="lists a layer twice"):
        parse("omnikv:filter_layers=2+2", PRESS)


@pytest.mark.parametrize("text", ["residualkv+omnikv:full_layers=0+1,window=128",   # OmniKV's default, still refused
                                  "residualkv+omnikv:full_layers=0+1,n_sink=8"])
def test_a_composed_spec_may_not_set_what_the_storage_owns(text):
    with pytest.raises(ValueError, match="from the storage 'residualkv'"):
        parse(text, PRESS)


def test_old_mode_form_points_at_the_composed_name():
    with pytest.raises(ValueError, match=r"a selector is named with the method: residualkv\+omnikv:\.\.\., residualkv\+snapkv"):
        parse("residualkv:mode=omnikv,full_layers=0+1", PRESS)
    with pytest.raises(ValueError, match=r"expected <name>\[\+<selector>\]"):
        parse("residualkv+omnikv+snapkv", PRESS)


def test_one_pass_prefills_the_question_with_the_context(tiny_lm):
    """one_pass: one exact prefill forward (its first token is the full cache's), then decoding reads the
    compressed cache; shared_context: a second, question, forward reads it too."""
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(3))
    full, _ = greedy_generate(tiny_lm, Press(), ids, 60, max_new_tokens=3, eos=set())
    one = SnapKVPress(keep=0.1, protocol="one_pass")
    new, cache = greedy_generate(tiny_lm, one, ids, one.first_chunk(60, 45), max_new_tokens=3, eos=set())
    assert len(cache.attended) == 3 and new[0] == full[0]
    two = SnapKVPress(keep=0.1, protocol="shared_context")
    _, cache = greedy_generate(tiny_lm, two, ids, two.first_chunk(60, 45), max_new_tokens=3, eos=set())
    assert len(cache.attended) == 4


@pytest.mark.parametrize("name", SPECS)
def test_resident_bytes_cover_the_packed_bytes(tiny_lm, identity_codec, name):
    """Issue #13 item 6: every layer of every press reports its resident bytes (every tensor held, as held) beside
    the packed ones; on the float32 tiny LM resident >= packed layer by layer (unpacked codes, masks, positions,
    float32 K/V), and the step's working view is not held between steps."""
    spec = parse(name + USUAL.get(name, ""), PRESS)
    press = spec.build(**resources(spec.cls, identity_codec))
    press.load()
    ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(1))
    _, cache = greedy_generate(tiny_lm, _visual(press, tiny_lm, ids, 60), ids, 60, max_new_tokens=3, eos=set())
    for layer, b in zip(cache.layers, cache.stored_bytes()):
        assert b.packed() > 0 and b.resident >= b.packed(), (name, b)
        assert layer._view is None
        assert 0 < layer.kept_share() <= 1
