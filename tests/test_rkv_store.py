"""ResidualKV storage: block coding, the contiguous code store and reference pool, restoring a selection by
gathers, and a decode step that reads nothing back to the host (compress/residualkv/{cache,store}.py)."""
from __future__ import annotations

import pytest
import torch
from test_rkv_cache import IDS, _run

from kvbench.compress import checks
from kvbench.compress.cache import Press, press_attention
from kvbench.compress.presses.omnikv import OmniKVPress
from kvbench.compress.registry import PRESS
from kvbench.compress.residualkv import references
from kvbench.compress.residualkv.cache import ResidualKVLayer, ResidualKVPress
from kvbench.compress.residualkv.codec import ResidualCodec
from kvbench.compress.residualkv.store import CodeStore, PositionMap, RefPool, restore_mean
from kvbench.kernels import quant
from kvbench.kernels.reference_mean import mean_reference, mean_rows
from kvbench.utils.spec import parse

pytestmark = pytest.mark.usefixtures("one_thread")

#: context chunk, question chunk, then decode steps (one token each)
CUTS = [30, 45, *range(46, 60)]


@pytest.fixture(scope="module")
def codec_dir(tiny_lm, tmp_path_factory):
    """A random codec (d_c 32 of d_kv 64, INT4 in groups of 32), 2 sinks, a 4-token window, stride 5."""
    path = tmp_path_factory.mktemp("codec")
    ResidualCodec.for_model(tiny_lm, seed=3, d_c=32, d_ff=64, n_sink=2, window=4, stride=5).save(path)
    return path


def _expected_codes(layer: ResidualKVLayer, kv: torch.Tensor, cuts: list[int], n_tokens: int) -> dict:
    """The per-token form (what the cache did before block coding), written out: after each chunk, every token
    that left the 4-token window is coded in one batch, references join the FP8 pool first; ``kv`` ``[n, d_kv]``
    the layer's pre-RoPE K‖V."""
    cfg, codec = layer.cfg, layer.codec
    pool, pool_pos, out = [], [], {"q": [], "zmin": [], "scale": [], "nbr": [], "pos": []}
    flushed = cfg.n_sink
    for end in [*cuts, n_tokens]:
        pos = torch.arange(flushed, max(flushed, end - cfg.window))
        flushed = max(flushed, end - cfg.window)
        is_ref = references.reference_mask(pos, n_sink=cfg.n_sink, stride=cfg.stride)
        for p in pos[is_ref].tolist():
            pool.append(quant.to_fp8(kv[p:p + 1])[0])
            pool_pos.append(p)
        tok = pos[~is_ref]
        if not len(tok):
            continue
        refs, rpos = torch.cat(pool).float(), torch.tensor(pool_pos)
        nbr, valid = references.nearest_references(kv[tok], tok, refs, rpos, cfg.k)
        with torch.no_grad():
            z = codec.residual_code(kv[tok], mean_reference(refs, nbr, valid))
        codes = quant.quantize(z, 4, cfg.group)
        for key, value in (("q", codes.q), ("zmin", codes.zmin), ("scale", codes.scale), ("nbr", nbr), ("pos", tok)):
            out[key].append(value)
    return {key: torch.cat(v) for key, v in out.items()}


def test_block_one_codes_each_token_as_it_leaves_the_window(tiny_lm, codec_dir):
    """block=1 is the per-token form: the same tokens, in the same batches, with the same references, codes
    and indices, bit for bit. Layer 0's K/V depend on the input ids only, so the full cache's are its."""
    _, cache = _run(tiny_lm, ResidualKVPress(codec_dir=str(codec_dir), block=1), IDS, CUTS)
    _, full = _run(tiny_lm, Press(), IDS, CUTS)
    layer = cache.layers[0]
    want = _expected_codes(layer, layer._kv_pre(full.layers[0]._stored), CUTS, IDS.shape[1])
    got = layer.codes
    assert torch.equal(got.positions(), want["pos"]) and len(layer.window) == 4
    assert torch.equal(got.q.view(), want["q"]) and torch.equal(got.nbr.view().long(), want["nbr"])
    assert torch.equal(got.zmin.view(), want["zmin"]) and torch.equal(got.scale.view(), want["scale"])


def test_block_coding_waits_for_window_plus_block_then_codes_whole_blocks(tiny_lm, codec_dir):
    """Default block = the codec's window (4): nothing is coded until 8 tokens are raw, then floor((raw - 4) /
    4) * 4 at once, so the raw window holds 4..7 tokens; the block's tokens get the references block=1 gives
    them (the pool is causal, so coding later changes no neighbour)."""
    cuts = [10, *range(11, 40)]
    press = ResidualKVPress(codec_dir=str(codec_dir))
    assert press.coding_block() == 4 and parse("residualkv:block=16", PRESS).build().block == 16
    cache = press.new_cache(tiny_lm)
    raw, calls = [], []
    layer = cache.layers[0]   # its K/V depend on the ids only, so both runs code the same vectors
    compress = layer._compress
    layer._compress = lambda old, k_in=None: (calls.append(len(old)), compress(old, k_in))
    with torch.inference_mode(), press_attention(tiny_lm, cache):
        start = 0
        for end in [*cuts, 40]:
            tiny_lm(input_ids=IDS[:, start:end], position_ids=torch.arange(start, end).view(1, -1), cache=cache,
                    use_cache=True)
            raw.append(len(layer.window))
            start = end
    # 10 tokens: 2 sinks + 8 raw -> one block of 4 coded; then one token a step, a block every 4 steps
    assert raw[:9] == [4, 5, 6, 7, 4, 5, 6, 7, 4] and set(calls) == {4} and len(calls) == 8
    _, per_token = _run(tiny_lm, ResidualKVPress(codec_dir=str(codec_dir), block=1), IDS[:, :40], cuts)
    one = per_token.layers[0].codes
    n = len(layer.codes)
    assert torch.equal(layer.codes.positions(), one.positions()[:n])
    assert torch.equal(layer.codes.nbr.view(), one.nbr.view()[:n])
    assert torch.equal(layer.ref_pos, per_token.layers[0].ref_pos[:len(layer.ref_pos)])


@pytest.mark.parametrize("kw, match", [({"block": 0}, "block .* int >= 1"), ({"block": 2.5}, "block"),
                                       ({"block": True}, "block")])
def test_bad_block_is_refused(codec_dir, kw, match):
    with pytest.raises(ValueError, match=match):
        ResidualKVPress(codec_dir=str(codec_dir), **kw)


def test_omnikv_candidates_are_the_coded_tokens(tiny_lm, codec_dir):
    """With block coding, OmniKV's candidates end where the sparse layers' coded tokens end, so every selected
    position is a reference or a coded token there (none is raw: a raw token is always read anyway)."""
    press = ResidualKVPress(codec_dir=str(codec_dir), selector=OmniKVPress(keep=1.0), full_layers=(0,))
    _, cache = _run(tiny_lm, press, IDS, CUTS)
    layer = cache.layers[1]
    sel = cache.step.selected
    coded = torch.cat([layer.ref_pos, layer.codes.positions()]).sort().values
    assert torch.equal(sel, coded)                   # keep 1.0: every coded token and reference, nothing else
    assert cache.attended[-1][1:] == [len(IDS[0])] * 2   # sinks + all coded + raw window + itself


def test_restoring_a_selection_equals_restoring_everything(tiny_lm, codec_dir):
    """The decode path (slots from the position maps, one gather of codes and of the references read) gives the
    K/V that restoring every token gives at those positions, references and coded tokens mixed."""
    _, cache = _run(tiny_lm, ResidualKVPress(codec_dir=str(codec_dir)), IDS, CUTS)
    layer = cache.layers[2]
    views = layer._restore_all()
    keys = torch.cat([v.keys for v in views], 2)
    values = torch.cat([v.values for v in views], 2)
    pos = torch.cat([v.positions[0, 0] for v in views])
    sel = torch.tensor([3, 7, 8, 22, 27, 40, 51])            # 7, 22, 27 are references (stride 5 from 2)
    got = layer._restore_selected(sel)
    at = torch.stack([(pos == p).nonzero()[0, 0] for p in got.positions[0, 0]])
    assert sorted(got.positions[0, 0].tolist()) == sel.tolist()
    assert got.positions[0, 0][:3].tolist() == [7, 22, 27]   # references first, as in the full restore
    torch.testing.assert_close(got.keys, keys[..., at, :], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got.values, values[..., at, :], atol=1e-6, rtol=1e-6)


def test_snapkv_drop_keeps_the_map_and_the_bytes(tiny_lm, codec_dir):
    """``+snapkv`` rebuilds the store at the kept size: the map still finds every kept token, packed bytes count
    only kept tokens, resident bytes the storage held."""
    press = parse("residualkv+snapkv:keep=0.5,window=8", PRESS).build(codec_dir=str(codec_dir))
    _, cache = _run(tiny_lm, press, IDS, [50])
    store = cache.layers[1].codes
    pos = store.positions()
    assert torch.equal(store.slot(pos), torch.arange(len(pos)))
    assert store.nbytes() == (len(pos) * 32 // 2, len(pos) * 4, len(pos) * 4 * 2)   # INT4, 1 group of 32, int16 x 4
    assert store.slot(torch.tensor([0, 1])).tolist() == [-1, -1]                    # sinks are not coded


def test_position_map_grows_and_answers_minus_one():
    m = PositionMap()
    assert m(torch.tensor([5])).tolist() == [-1]
    m.set(torch.tensor([2, 4]), torch.tensor([0, 1]), end=5)
    m.set(torch.tensor([9]), torch.tensor([2]), end=12)
    assert m(torch.tensor([4, 2, 3, 9, 11])).tolist() == [1, 0, -1, 2, -1]


def test_a_cpu_fp8_pool_reads_an_exact_float32_copy():
    """FP8 is what is stored (and counted packed); on CPU the rows are read from a float32 copy, value for value the
    FP8 ones, since torch converts FP8 one value at a time there."""
    kv = torch.randn(5, 4, generator=torch.Generator().manual_seed(0)) * 400
    pool = RefPool(4, fp8=True)
    pool.add(kv, torch.arange(3, 8), end=8)
    want = quant.to_fp8(kv)[0].float()
    assert pool.stored().dtype == torch.float8_e4m3fn and pool.kv32.view().dtype == torch.float32
    assert torch.equal(pool.all(), want) and torch.equal(pool.rows(torch.tensor([[4, 0]])), want[[4, 0]].view(1, 2, 4))
    assert int(pool.saturated) == int((kv.abs() > 448).sum()) > 0
    assert pool.slot(torch.tensor([2, 3, 7])).tolist() == [-1, 0, 4]


def test_code_store_widens_indices_past_2_15_references():
    store = CodeStore(bits=16, group=32)
    z = torch.zeros(1, 4, dtype=torch.float16)
    store.add(z, torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool), torch.tensor([3]), 10, 4)
    assert store.nbr.data.dtype == torch.int16 and store.nbytes() == (8, 0, 4)
    store.add(z, torch.full((1, 2), 40000), torch.ones(1, 2, dtype=torch.bool), torch.tensor([5]), 2 ** 15, 6)
    assert store.nbr.data.dtype == torch.int32 and store.nbr.view()[:, 0].tolist() == [0, 40000]
    assert store.nbytes() == (16, 0, 16)


def _refuse(name):
    def method(*args, **kwargs):
        raise AssertionError(f"a decode step read a tensor back to the host: Tensor.{name}")
    return method


@pytest.mark.skipif(checks.ENABLED, reason="KVBENCH_CHECKS=1 reads values back by design")
@pytest.mark.parametrize("spec", ["full", "residualkv+omnikv:full_layers=0,keep=0.5,full_kv_bits=4"])
def test_a_decode_step_reads_nothing_back(tiny_lm, codec_dir, monkeypatch, spec):
    """No .item()/.tolist()/bool()/int()/float()/nonzero on a decode step's path (docs/decisions/residualkv.md, "No host
    synchronisation in a decode step"): those calls raise while steps run; every step codes a block here
    (block=1), so coding is covered too. CR counts and selections are read afterwards."""
    press = (Press() if spec == "full"
             else parse(spec + ",block=1", PRESS).build(codec_dir=str(codec_dir)))
    press.load()
    cache = press.new_cache(tiny_lm)
    with torch.inference_mode(), press_attention(tiny_lm, cache):
        tiny_lm(input_ids=IDS[:, :40], position_ids=torch.arange(40).view(1, -1), cache=cache, use_cache=True)
        with monkeypatch.context() as m:
            for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
                m.setattr(torch.Tensor, name, _refuse(name))
            m.setattr(torch, "nonzero", _refuse("nonzero"))
            for p in range(40, 44):
                tiny_lm(input_ids=IDS[:, p:p + 1], position_ids=torch.tensor([[p]]), cache=cache, use_cache=True)
    assert len(cache.attended) == 5 and cache.attended[-1][0] == 44
    if spec != "full":
        assert len(cache.selections) == 4 and len(cache.layers[1].codes) > 0


@pytest.mark.parametrize("form, n_quantised", [("kivi", 64), ("after", 32)])
def test_a_quantised_filter_layer_scores_the_keys_its_attention_read(tiny_lm, codec_dir, form, n_quantised):
    """KIVI-style full layers overwrite quantised rows of the store attention reads; the overwrite waits for the
    next step, so OmniKV's filter step (after the commit) scores the keys this step's attention read, also at the
    step whose commit quantises a key block (KIVI's rule, token 63: 32 raw keys 32..63; the authors' engine form,
    token 65: 2 raw sinks and 64 raw tokens, of which the oldest 32 are quantised)."""
    press = ResidualKVPress(codec_dir=str(codec_dir), selector=OmniKVPress(keep=0.5), full_layers=(0,), full_kv_bits=4,
                            full_kv_form=form)
    cache = press.new_cache(tiny_lm)
    layer, same = cache.layers[0], []
    commit, hook = layer.commit, layer.after_commit
    layer.commit = lambda chunk, q: (same.append(layer._view.keys.clone()), commit(chunk, q))
    layer.after_commit = lambda lay, chunk, q: (same.append(torch.equal(same.pop(), lay._view.keys)), hook(lay, chunk, q))
    ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode(), press_attention(tiny_lm, cache):
        for start, end in ((0, 30), *((p, p + 1) for p in range(30, 70))):
            tiny_lm(input_ids=ids[:, start:end], position_ids=torch.arange(start, end).view(1, -1), cache=cache,
                    use_cache=True)
    assert len(same) == 41 and all(same) and len(layer.kq) == n_quantised


@pytest.mark.parametrize("fp8", [True, False])
def test_restore_mean_is_bitwise_mean_rows(fp8):
    """The fused k-reference mean (embedding_bag over the float32 rows) equals gathering the rows and summing them
    slot by slot (``mean_rows``), bit for bit, with invalid slots and counts 1..4 (3: not a power of two)."""
    g = torch.Generator().manual_seed(0)
    pool = RefPool(16, fp8=fp8)
    pool.add(torch.randn(40, 16, generator=g) * 3, torch.arange(40), end=40)
    nbr = torch.randint(0, 40, (200, 4), generator=g)
    valid = torch.rand(200, 4, generator=g) > 0.4
    valid[:, 0] = True
    extra = torch.tensor([3, 0, 39])
    mean, rows = restore_mean(pool, nbr, valid, extra)
    table = pool.all()
    want = mean_rows(table[nbr], valid)
    assert torch.equal(mean, want) and torch.equal(rows, table[extra])
    assert set(valid.sum(1).tolist()) == {1, 2, 3, 4}

