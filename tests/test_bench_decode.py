"""ResidualKV Fig. 8 (decode throughput), Fig. 11's throughput panel and Fig. 6 (codec cost) benchmark code
on tiny shapes (seconds).

The real runs are pipeline targets (``kvbench bench rkv-throughput`` / ``codec-cost``), not tests."""
from __future__ import annotations

import pandas as pd
import transformers
import pytest
import torch

from kvbench.bench import bandwidth, codec_cost, codec_variants, decode
from kvbench.bench.timing_lm import (
    build_timing_lm,
    fixed_vocab_size,
    full_layers_for,
    full_layers_of,
    timing_lm_config,
)
from kvbench.compress.cache import Press
from kvbench.compress.residualkv.cache import ResidualKVPress
from kvbench.compress.residualkv.codec import CodecConfig, ResidualCodec

torch.set_num_threads(1)
TEST_LM = "timing-qwen2-lm-test"
#: Every method on two contexts: 40 (one ResidualKV window of 128 is not exceeded: all raw) and 300
#: (coded tokens exist, so the sparse layers restore).
CONTEXTS = [40, 300]


@pytest.fixture(scope="module")
def run():
    return decode.measure_decode_throughput(TEST_LM, CONTEXTS, decode_steps=2, warmup_steps=1, repeats=2,
                                            vocab_size=256, seed=0, copy_mib=4)


def test_timing_lm_shapes():
    cfg = timing_lm_config("timing-qwen2-lm-wide", 4096)
    assert cfg.architectures == ["Qwen2ForCausalLM"]
    assert 2 * cfg.num_key_value_heads * cfg.head_dim == 512            # d_kv
    assert cfg.num_hidden_layers == 12 and cfg.max_position_embeddings >= 524288 + 200
    assert full_layers_for(12) == (0, 1, 3) and full_layers_for(16) == (0, 1, 4) and full_layers_for(4) == (0, 1) and full_layers_for(2) == (0,)
    # Llama-3.1-8B's shape (its config.json) and Table I's full layers; vocabulary fixed, head untied
    llama = timing_lm_config("timing-llama-3.1-8b")
    assert llama.architectures == ["LlamaForCausalLM"] and not llama.tie_word_embeddings
    assert (llama.hidden_size, llama.num_hidden_layers, llama.num_attention_heads, llama.num_key_value_heads,
            llama.head_dim, llama.intermediate_size, llama.vocab_size) == (4096, 32, 32, 8, 128, 14336, 128256)
    assert full_layers_of("timing-llama-3.1-8b") == (0, 1, 2, 8, 18) and full_layers_of(TEST_LM) == (0, 1)
    assert fixed_vocab_size("timing-llama-3.1-8b") == 128256 and fixed_vocab_size(TEST_LM) is None
    with pytest.raises(ValueError, match="vocab_size must be >= 2, got None"):
        timing_lm_config(TEST_LM)
    with pytest.raises(KeyError, match="timing-qwen2-lm-wide"):
        timing_lm_config("nope", 4096)
    with pytest.raises(ValueError, match="n_layers"):
        full_layers_for(1)


def test_rows_columns_and_header(run, tmp_path):
    rows, header = run
    out = tmp_path / "fig8.csv"
    decode.write_csv(rows, header, decode.COLUMNS, out)
    first = out.read_text().splitlines()[0]
    assert first.startswith("# kvbench ResidualKV Fig. 8") and "RANDOM weights" in first
    assert "not the paper's numbers" in first
    df = pd.read_csv(out, skiprows=1)
    assert list(df.columns) == decode.COLUMNS
    assert len(df) == len(CONTEXTS) * len(decode.METHODS)
    assert df[["context", "method"]].values.tolist() == [[c, m] for c in CONTEXTS for m in decode.METHODS]
    assert (df["weights"] == "random").all() and (df["decode_steps"] == 2).all() and (df["repeats"] == 2).all()
    assert "2.5th/97.5th percentiles of the per-step times" in first
    assert (df["tokens_per_s"] > 0).all() and (df["tps_lo95"] <= df["tokens_per_s"]).all()
    assert (df["tokens_per_s"] <= df["tps_hi95"]).all()
    assert ((df["ms_per_token"] * df["tokens_per_s"] - 1000.0).abs() < 1e-6).all()
    assert (df["prefill_s"] > 0).all() and (df["peak_mem_gib"] > 0).all()


def test_fig8_figure_reads_the_bench_csv(run, tmp_path):
    from kvbench.report.residualkv import figures as rkv_figures

    rows, header = run
    decode.write_csv(rows, header, decode.COLUMNS, tmp_path / "fig8.csv")
    df = rkv_figures.fig8(tmp_path / "fig8.csv", tmp_path / "fig8.pdf")
    assert (tmp_path / "fig8.pdf").read_bytes().startswith(b"%PDF") and len(df) == len(rows)
    old = tmp_path / "old.csv"                          # a CSV of the former bench: quartiles, no bandwidth
    old.write_text("# old\nmethod,context,tokens_per_s,q1,q3,device\nfull,1024,5.0,4.0,6.0,cpu\n")
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['tps_lo95', 'tps_hi95', 'achieved_gb_s'"):
        rkv_figures.fig8(old, tmp_path / "old.pdf")


def test_bandwidth_columns(run):
    rows, _ = run
    by = {(r["context"], r["method"]): r for r in rows}
    model = build_timing_lm(TEST_LM, 256)
    for r in rows:
        assert r["weight_bytes"] == bandwidth.weight_bytes(model)
        assert r["bytes_per_step"] == r["weight_bytes"] + r["kv_read_bytes"]
        assert r["achieved_gb_s"] == pytest.approx(r["bytes_per_step"] / (r["ms_per_token"] / 1000) / 1e9)
        assert r["share_of_measured_bw"] == pytest.approx(r["achieved_gb_s"] / r["machine_read_gb_s"])
        assert r["peak_gb_s"] is None and r["share_of_peak"] is None           # CPU: no datasheet peak
        assert r["kv_read_source"] in (("tensors",) if r["method"] == "dynamic-cache-sdpa" else ("audit", "estimate"))
    for c in CONTEXTS:
        # our exact cache and transformers' hold the same float32 K/V of every token written (context, warm-up
        # and timed steps): 4 layers x 2 (K, V) x 2 heads x 16 x 4 bytes per token
        n = c + 1 + 2 * 2
        assert by[c, "dynamic-cache-sdpa"]["kv_read_bytes"] == 4 * 2 * 2 * 16 * 4 * n
        if by[c, "full"]["kv_read_source"] == "estimate":
            assert by[c, "full"]["kv_read_bytes"] == by[c, "dynamic-cache-sdpa"]["kv_read_bytes"]
    # coded and selected: ResidualKV reads less KV than the full cache, 4-bit less than 16-bit
    assert (by[300, "residualkv-omnikv"]["kv_read_bytes"] < by[300, "residualkv-omnikv-unquantised"]["kv_read_bytes"]
            < by[300, "full"]["kv_read_bytes"])


def test_speed_ratios_name_their_reference(run):
    rows, header = run
    by = {(r["context"], r["method"]): r for r in rows}
    for c in CONTEXTS:
        assert by[c, "full"]["vs_full"] == 1.0 and by[c, "dynamic-cache-sdpa"]["vs_dynamic_cache"] == 1.0
        q = by[c, "residualkv-omnikv"]
        assert q["vs_full"] == q["tokens_per_s"] / by[c, "full"]["tokens_per_s"]
    slow = decode.slower_than_reference(rows)
    assert slow == [c for c in CONTEXTS if by[c, "full"]["vs_dynamic_cache"] < 1.0]
    assert ("NOTE: our full cache is slower than transformers' DynamicCache+SDPA" in header) == bool(slow)
    fake = [{"context": 64, "method": "full", "tokens_per_s": 1.0}, {"context": 64, "method": "dynamic-cache-sdpa",
                                                                     "tokens_per_s": 2.0}]
    decode.add_ratios(fake)
    assert fake[0]["vs_dynamic_cache"] == 0.5 and fake[1]["vs_full"] == 2.0 and decode.slower_than_reference(fake) == [64]
    assert "context(s) 64 (vs_dynamic_cache < 1)" in decode.header_line("m", "random", "RANDOM", [64], 1, 0, 1, fake)


def test_each_context_gets_a_fresh_cache(run):
    """A context's cache does not carry an earlier context's tokens: 300 alone measures what it measured
    after 40 (same ids, same selections; a grown cache would hold 40 + 5 more tokens)."""
    rows, _ = run
    alone, _ = decode.measure_decode_throughput(TEST_LM, [300], ["residualkv-omnikv", "full"], decode_steps=2,
                                                warmup_steps=1, repeats=2, vocab_size=256, seed=0, copy_mib=4)
    by = {(r["context"], r["method"]): r for r in rows}
    for r in alone:
        for col in ("kr_measured", "cr_measured", "kv_read_bytes"):
            assert r[col] == by[300, r["method"]][col], (r["method"], col)


def test_full_cache_ratios_are_one_and_residualkv_compresses(run):
    rows, _ = run
    by = {(r["context"], r["method"]): r for r in rows}
    for c in CONTEXTS:
        assert by[c, "full"]["kr_measured"] == 1.0 and by[c, "full"]["cr_measured"] == 1.0
    # 40 tokens + 5 decoded < sink 8 + window 128: nothing is coded, every layer reads every token
    assert by[40, "residualkv-omnikv"]["cr_measured"] == 1.0
    q, u = by[300, "residualkv-omnikv"], by[300, "residualkv-omnikv-unquantised"]
    assert q["cr_measured"] < 1.0 and q["cr_measured"] == u["cr_measured"]   # same selection budget
    assert q["kr_measured"] < u["kr_measured"] < 1.0      # 4-bit codes + FP8 refs < fp16 codes + fp32 refs


def test_methods_build_their_presses(tmp_path):
    model = build_timing_lm(TEST_LM, 256)
    ResidualCodec.for_model(model).save(tmp_path)
    assert type(decode.make_press("full", tmp_path, (0, 1))) is Press
    q = decode.make_press("residualkv-omnikv", tmp_path, (0, 1))
    u = decode.make_press("residualkv-omnikv-unquantised", tmp_path, (0, 1))
    assert isinstance(q, ResidualKVPress) and (type(q.selector).name, q.bits, q.ref_fp8, q.selector.keep, q.full_kv_bits) == ("omnikv", 4, True, 0.17, 4)
    assert (u.bits, u.ref_fp8, u.full_layers, u.full_kv_bits) == (16, False, (0, 1), 16)
    with pytest.raises(ValueError, match="'h2o'"):
        decode.make_press("h2o", tmp_path, (0, 1))


@pytest.mark.parametrize("kw, match", [
    ({"contexts": [4]}, r"\[4\] shorter than n_sink = 8"),
    ({"methods": []}, "methods is empty"),
    ({"methods": ["full", "quest"]}, r"unknown method\(s\) \['quest'\]"),
    ({"contexts": []}, "contexts is empty"),
    ({"contexts": [64, 64]}, "repeat a length"),
    ({"repeats": 0}, "repeats=0"),
    ({"contexts": [70000]}, "max_position_embeddings = 65536"),
])
def test_bad_input_names_the_value(kw, match):
    args = {"contexts": [64], "methods": ["full"], "decode_steps": 1, "warmup_steps": 0, "repeats": 1, "vocab_size": 256}
    with pytest.raises(ValueError, match=match):
        decode.measure_decode_throughput(TEST_LM, **{**args, **kw})


def test_misfit_codec_is_refused_before_timing(tmp_path):
    _zoo_shaped_codec(tmp_path)                      # d_kv 128; the test LM's is 64
    with pytest.raises(ValueError, match=r"does not fit the model: codec \(n_layers, d_kv\) = \(4, 128\), model \(4, 64\)"):
        decode.measure_decode_throughput(TEST_LM, [64], ["full"], decode_steps=1, warmup_steps=0, repeats=1,
                                         vocab_size=256, codec_dir=str(tmp_path))


def test_codec_pair_matches_parameters_within_one_percent():
    assert codec_cost.reverse_d_ff(2048, 512, 3072) == 4608           # Table I Llama shape: exact match
    for d_kv, d_c, d_ff in [(2048, 512, 3072), (1024, 256, 3072), (512, 128, 768), (64, 16, 96)]:
        n = {k: sum(p.numel() for p in c.parameters()) for k, c in codec_cost.codec_pair(d_kv, d_c, d_ff).items()}
        assert abs(n["reverse"] / n["residualkv"] - 1) < 0.01, (d_kv, d_c, d_ff, n)
    # the released Qwen2.5-7B-1M codec shape gives the paper's 7.34M
    assert 2 * 1024 * 3072 + 3072 * 256 + 256 * 1024 == 7_340_032


def test_codec_cost_rows(tmp_path):
    rows, header = codec_cost.measure_codec_cost(d_kv=64, d_c=16, d_ff=96, tokens=400, decode_steps=7, repeats=2)
    decode.write_csv(rows, header, codec_cost.COLUMNS, tmp_path / "fig6.csv")
    df = pd.read_csv(tmp_path / "fig6.csv", skiprows=1)
    assert list(df.columns) == codec_cost.COLUMNS and df["codec"].tolist() == ["residualkv", "reverse"]
    assert df[["encoder", "decoder"]].values.tolist() == [["swiglu", "linear"], ["linear", "swiglu"]]
    assert df["params"].tolist() == [2 * 64 * 96 + 96 * 16 + 16 * 64, 64 * 16 + 2 * 16 * 144 + 144 * 64]
    assert (df["restore_tokens"] == 68).all()                           # ceil(0.17 * 400)
    assert ((df["total_ms"] - df["prefill_ms"] - 7 * df["restore_ms"]).abs() < 1e-9).all()
    assert (df["codec_restore_ms"] > 0).all()
    assert header.startswith("# kvbench ResidualKV Fig. 6") and "RANDOM weights" in header
    assert "ResidualKVLayer.history" in header
    with pytest.raises(ValueError, match="restore_tokens = 200 exceeds tokens = 100"):
        codec_cost.measure_codec_cost(d_kv=64, d_c=16, d_ff=96, tokens=100, restore_tokens=200)
    with pytest.raises(ValueError, match="restore_tokens = 300 exceeds the 256 candidates of a 400-token context"):
        codec_cost.measure_codec_cost(d_kv=64, d_c=16, d_ff=96, tokens=400, restore_tokens=300)
    with pytest.raises(ValueError, match="d_c must be >= 1, got 0"):
        codec_cost.measure_codec_cost(d_kv=64, d_c=0, d_ff=96)
    with pytest.raises(ValueError, match=r"d_kv must be a positive multiple of 4 \(.*\), got 66"):
        codec_cost.measure_codec_cost(d_kv=66, d_c=16, d_ff=96, tokens=400)


def test_codec_cost_restore_is_the_caches_history(tmp_path):
    """Fig. 6's restore runs the cache's own read: the layer it times returns the selected candidates (coded ones
    restored, references read), its sinks and its raw window, post-RoPE, as a decode step's attention reads them."""
    codec = codec_cost.codec_pair(64, 16, 96)["residualkv"]
    layer, cache = codec_cost.filled_layer(codec, 400, str(tmp_path), torch.device("cpu"), torch.float32)
    selected = [20, 21, 100, 200]                      # references (every 10th) and coded tokens among them
    cache.step = codec_cost.StepState(selected=torch.tensor(selected))
    view = layer.history()
    pos = view.positions[0, 0].tolist()
    # block coding (block = window = 128): 392 tokens after the 8 sinks, the oldest 256 coded, 136 raw
    assert sorted(pos) == list(range(8)) + selected + list(range(400 - 136, 400))
    assert view.keys.shape == (1, 1, 8 + 4 + 136, 32)


def _zoo_shaped_codec(directory, **over):
    """A codec of the zoo LM's shape (d_kv 128; Table I ratios d_c 32, d_ff 192), random weights."""
    cfg = CodecConfig(**{"n_layers": 4, "d_kv": 128, "d_c": 32, "d_ff": 192, "window": 32, **over})
    ResidualCodec(cfg).save(directory)
    return str(directory)


def test_variant_throughput_scales_widths_and_keeps_schedule(tmp_path):
    dirs = {"base": _zoo_shaped_codec(tmp_path / "a"), "dc_high": _zoo_shaped_codec(tmp_path / "b", d_c=64),
            "s_low": _zoo_shaped_codec(tmp_path / "c", stride=5, k=2)}
    rows, header = codec_variants.measure_variant_throughput(dirs, "base", TEST_LM, context=300, decode_steps=2,
                                                             warmup_steps=1, repeats=2, vocab_size=256, copy_mib=4)
    by = {r["variant"]: r for r in rows}
    # the test LM's d_kv is 64 = half the codecs' 128: widths halve, the schedule is kept
    assert [(by[v]["d_c"], by[v]["d_ff"], by[v]["k"], by[v]["stride"]) for v in dirs] == [
        (16, 96, 4, 10), (32, 96, 4, 10), (16, 96, 2, 5)]
    assert by["base"]["relative_throughput"] == 1.0 and by["base"]["default"]
    assert all(r["kv_read_bytes"] > 0 and r["bytes_per_step"] > r["weight_bytes"] for r in rows)
    for r in rows:
        assert r["relative_throughput"] == r["tokens_per_s"] / by["base"]["tokens_per_s"]
        assert r["d_kv"] == 64 and r["codec_d_kv"] == 128 and r["cr_measured"] < 1.0
    assert header.startswith("# kvbench ResidualKV Fig. 11 throughput") and "RANDOM codecs" in header
    decode.write_csv(rows, header, codec_variants.COLUMNS, tmp_path / "t.csv")
    assert list(pd.read_csv(tmp_path / "t.csv", comment="#").columns) == codec_variants.COLUMNS


def test_variant_throughput_bad_input(tmp_path):
    d = _zoo_shaped_codec(tmp_path / "a")
    with pytest.raises(ValueError, match="default variant 'main' is not among the codec variants"):
        codec_variants.measure_variant_throughput({"a": d}, "main", TEST_LM, vocab_size=256)
    with pytest.raises(ValueError, match="codec variant 'b': .* holds no trained codec"):
        codec_variants.measure_variant_throughput({"a": d, "b": str(tmp_path)}, "a", TEST_LM, vocab_size=256)
    with pytest.raises(ValueError, match="shorter than n_sink = 8"):
        codec_variants.measure_variant_throughput({"a": d}, "a", TEST_LM, context=4, vocab_size=256)
    # review finding: a variant whose scaled d_c misfits (96 at d_kv 128 -> 48 at 64) is named before any timing
    wide = _zoo_shaped_codec(tmp_path / "w", d_c=96)
    with pytest.raises(ValueError, match=r"variant 'w' \(trained d_c 96, d_ff 192 at d_kv 128\) .* gives d_c 48"):
        codec_variants.measure_variant_throughput({"a": d, "w": wide}, "a", TEST_LM, vocab_size=256,
                                                  log=lambda m: pytest.fail(f"timed before checking: {m}"))
    assert codec_variants.parse_codec_dirs(["a=/x", "b=y=z"]) == {"a": "/x", "b": "y=z"}
    for bad, match in [(["a"], "is not LABEL=DIR"), (["=x"], "is not LABEL=DIR"), (["a=x", "a=y"], "given twice")]:
        with pytest.raises(ValueError, match=match):
            codec_variants.parse_codec_dirs(bad)


def test_default_tokenizer_is_the_zoo_tokenizer_alone(tokenizer_dir, tmp_path, monkeypatch):
    """A timing LM needs only the vocabulary size: the default finds the zoo tokenizer without a trained zoo LM, and
    says what to pass when there is none (a fresh clone once named the untrained LM and suggested training it)."""
    import shutil

    from kvbench.bench.timing_lm import zoo_vocab_size

    monkeypatch.setenv("KVBENCH_ZOO", str(tmp_path / "zoo"))
    with pytest.raises(ValueError, match="needs a tokenizer only for its vocabulary size: pass --tokenizer DIR"):
        zoo_vocab_size()
    for profile in ("smoke", "ci"):   # two profiles, one tokenizer recipe
        shutil.copytree(tokenizer_dir, tmp_path / "zoo" / profile / "tokenizer-abcd1234")
    assert zoo_vocab_size() == len(transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    with pytest.raises(ValueError, match="tokenizer 'nope'"):
        zoo_vocab_size("nope")


def test_rows_record_kernels_and_checks_and_bad_switches_fail_before_timing(run, monkeypatch):
    rows, _ = run
    assert {r["kernels"] for r in rows} == {"torch"} and {r["checks"] for r in rows} == {False}
    timed = []
    monkeypatch.setattr(decode, "time_decode", lambda *a, **k: timed.append(a) or {})
    monkeypatch.setenv("KVBENCH_KERNELS", "bogus")
    with pytest.raises(ValueError, match="KVBENCH_KERNELS must be one of"):
        decode.measure_decode_throughput(TEST_LM, [64], ["full"], decode_steps=1, warmup_steps=0, repeats=1,
                                         vocab_size=256)
    assert not timed


def test_checks_switch_refuses_a_misspelt_value():
    from kvbench.compress import checks

    assert checks._read("1") and checks._read("True") and not checks._read("") and not checks._read("off")
    with pytest.raises(ValueError, match="KVBENCH_CHECKS must be one of"):
        checks._read("bogus")


def test_rows_of_finished_contexts_survive_an_out_of_memory(monkeypatch, tmp_path):
    """The CSV is written after every context; memory running out later names the context and keeps those rows."""
    real = decode.time_decode

    def fails_at_long(model, press, context, *args):
        if context > 100:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp] DefaultCPUAllocator: can't allocate memory: 17 GB")
        return real(model, press, context, *args)
    monkeypatch.setattr(decode, "time_decode", fails_at_long)
    out = tmp_path / "fig8.csv"
    with pytest.raises(decode.OutOfMemory, match="context 160, method full: out of memory on cpu"):
        decode.measure_decode_throughput(TEST_LM, [64, 160], ["full"], decode_steps=1, warmup_steps=0, repeats=1,
                                         vocab_size=256, copy_mib=4,
                                         on_context=lambda part, head: decode.write_csv(part, head, decode.COLUMNS, out))
    text = out.read_text()
    assert "PARTIAL: 1 of 2 contexts" in text.splitlines()[0]
    assert pd.read_csv(out, comment="#")["context"].tolist() == [64]


def test_unreadable_codec_json_is_named(tmp_path):
    (tmp_path / "codec.json").write_text("not json")
    with pytest.raises(ValueError, match=r"codec.json: not a codec config"):
        decode.measure_decode_throughput(TEST_LM, [64], ["full"], decode_steps=1, warmup_steps=0, repeats=1,
                                         vocab_size=256, codec_dir=str(tmp_path))
