"""Settings of the ResidualKV profiling verbs (kvbench.bench.settings): defaults, checks, config mappings and
the ``kvbench bench`` flags built from them; no model runs (the measuring functions are replaced)."""
from __future__ import annotations

import dataclasses
import importlib
import re
import shlex
import subprocess
import sys

import pytest

from kvbench.bench.settings import (
    BY_FIGURE,
    BY_VERB,
    CPU_CONTEXTS,
    METHODS,
    CodecCostConfig,
    DecodeThroughputConfig,
    VariantThroughputConfig,
)
from kvbench.cli import main


def test_defaults_are_the_verbs():
    assert (DecodeThroughputConfig() == DecodeThroughputConfig(
        model="timing-qwen2-lm-wide", tokenizer="tiny-qwen2-lm", contexts=CPU_CONTEXTS, methods=METHODS,
        decode_steps=32, repeats=3, warmup=4, codec_dir=None, prefill_chunk=2048, device="auto", dtype="auto",
        seed=0, threads=None))
    assert CPU_CONTEXTS == (1024, 2048, 4096, 8192, 16384, 32768)
    assert METHODS == ("full", "dynamic-cache-sdpa", "residualkv-omnikv", "residualkv-omnikv-unquantised",
                       "residualkv-omnikv-latent-v")
    c = CodecCostConfig()
    assert (c.codec_shape, c.tokens, c.restore_tokens, c.decode_steps, c.repeats, c.warmup) == (
        (2048, 512, 3072), 4096, None, 512, 5, 1)
    v = VariantThroughputConfig()
    assert (v.model, v.contexts, v.decode_steps, v.repeats, v.warmup) == ("timing-qwen2-lm-wide", (4096,), 16, 3, 2)
    assert {f: c.VERB for f, c in BY_FIGURE.items()} == {"fig8": "rkv-throughput", "fig6": "codec-cost",
                                                        "fig11": "rkv-variants"}
    assert BY_VERB["codec-cost"] is CodecCostConfig


def test_lists_are_stored_as_tuples():
    s = DecodeThroughputConfig(contexts=[512, 1024], methods=["full"])
    assert s.contexts == (512, 1024) and s.methods == ("full",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.repeats = 5  # type: ignore[misc]


@pytest.mark.parametrize("cls, field, value, match", [
    (DecodeThroughputConfig, "repeats", 0, "repeats must be a positive integer, got 0"),
    (DecodeThroughputConfig, "repeats", "many", "repeats must be a positive integer, got 'many'"),
    (DecodeThroughputConfig, "repeats", True, "repeats must be a positive integer, got True"),
    (DecodeThroughputConfig, "repeats", 2.0, r"repeats must be a positive integer, got 2\.0"),
    (DecodeThroughputConfig, "decode_steps", -1, "decode_steps must be a positive integer, got -1"),
    (DecodeThroughputConfig, "prefill_chunk", 0, "prefill_chunk must be a positive integer, got 0"),
    (DecodeThroughputConfig, "warmup", -1, "warmup must be an integer >= 0, got -1"),
    (DecodeThroughputConfig, "threads", 0, r"threads must be a positive integer or None \(torch's default\), got 0"),
    (DecodeThroughputConfig, "seed", "x", "seed must be an integer, got 'x'"),
    (DecodeThroughputConfig, "device", "tpu", "device must be auto, cpu, cuda or cuda:<index>, got 'tpu'"),
    (DecodeThroughputConfig, "device", "cuda:x", "device must be auto, cpu, cuda or cuda:<index>, got 'cuda:x'"),
    (DecodeThroughputConfig, "dtype", "float7", r"dtype must be one of \['auto', 'float32', .*\], got 'float7'"),
    (DecodeThroughputConfig, "model", "nope-lm", r"model 'nope-lm' is neither a timing LM \[.*\] nor a checkpoint dir"),
    (DecodeThroughputConfig, "model", "", "model must be a non-empty string, got ''"),
    (DecodeThroughputConfig, "tokenizer", 3, "tokenizer must be a non-empty string, got 3"),
    (DecodeThroughputConfig, "codec_dir", "", "codec_dir must be a non-empty string, got ''"),
    (DecodeThroughputConfig, "contexts", 512, "contexts must be a list of context lengths in tokens, got 512"),
    (DecodeThroughputConfig, "contexts", [], r"contexts is empty; expected context lengths in tokens"),
    (DecodeThroughputConfig, "contexts", [512, 0, "x"], r"contexts must be .* integers\), got \[0, 'x'\] in \[512, 0, 'x'\]"),
    (DecodeThroughputConfig, "contexts", [64, 64], r"contexts \[64, 64\] repeat a length; expected distinct lengths"),
    (DecodeThroughputConfig, "methods", "full", "methods must be a list of methods, some of .*, got 'full'"),
    (DecodeThroughputConfig, "methods", [], r"methods is empty; expected some of \['full'"),
    (DecodeThroughputConfig, "methods", ["full", "quest"], r"methods: unknown method\(s\) \['quest'\]; expected some of"),
    (VariantThroughputConfig, "contexts", [1024, 2048], r"contexts must be one context length .* got \[1024, 2048\]"),
    (VariantThroughputConfig, "warmup", "2", "warmup must be an integer >= 0, got '2'"),
    (CodecCostConfig, "codec_shape", [2048, 512], r"codec_shape must be three positive integers .* got \[2048, 512\]"),
    (CodecCostConfig, "codec_shape", [2048, 0, 3072], r"codec_shape must be three .* got \[2048, 0, 3072\]"),
    (CodecCostConfig, "tokens", 0, "tokens must be a positive integer, got 0"),
    (CodecCostConfig, "restore_tokens", 0, r"restore_tokens must be a positive integer or None .*, got 0"),
    (CodecCostConfig, "restore_tokens", 5000, "restore_tokens = 5000 exceeds tokens = 4096"),
])
def test_each_bad_value_is_refused_naming_it(cls, field, value, match):
    with pytest.raises(ValueError, match=match):
        cls(**{field: value})
    if field in cls.config_keys():
        with pytest.raises(ValueError, match=match):     # the same check for a config mapping
            cls.from_config({field: value})


def test_a_checkpoint_directory_is_a_model(tmp_path):
    with pytest.raises(ValueError, match="neither a timing LM"):
        DecodeThroughputConfig(model=str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert DecodeThroughputConfig(model=str(tmp_path)).model == str(tmp_path)


@pytest.mark.parametrize("cls, key", [
    (DecodeThroughputConfig, "contxts"), (DecodeThroughputConfig, "tokenizer"), (DecodeThroughputConfig, "threads"),
    (DecodeThroughputConfig, "out"), (CodecCostConfig, "model"), (CodecCostConfig, "threads"),
    (VariantThroughputConfig, "codecs"), (VariantThroughputConfig, "default"), (VariantThroughputConfig, "methods"),
])
def test_config_keys_outside_the_verb_or_set_by_the_rule_are_refused(cls, key):
    keys = cls.config_keys()
    assert key not in keys
    with pytest.raises(ValueError, match=rf"unknown key\(s\) \['{key}'\]; `kvbench bench {cls.VERB}` takes "
                                         + re.escape(str(keys))):
        cls.from_config({key: 1, "repeats": 2})


def test_config_keys():
    assert DecodeThroughputConfig.config_keys() == ["device", "dtype", "seed", "model", "contexts", "methods",
                                                    "decode_steps", "repeats", "warmup", "codec_dir", "prefill_chunk"]
    assert CodecCostConfig.config_keys() == ["device", "dtype", "seed", "codec_shape", "tokens", "restore_tokens",
                                             "decode_steps", "repeats", "warmup"]
    assert VariantThroughputConfig.config_keys() == ["device", "dtype", "seed", "model", "contexts", "decode_steps",
                                                     "repeats", "warmup"]
    with pytest.raises(ValueError, match=r"expected a mapping of `kvbench bench codec-cost` flags, got \[1\]"):
        CodecCostConfig.from_config([1])


def test_flags_are_the_mapping_s_keys_in_order_shell_quoted(tmp_path):
    ckpt = tmp_path / "m dir"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    mapping = {"contexts": [512, 1024], "device": "cuda:0", "model": str(ckpt)}
    assert (DecodeThroughputConfig.from_config(mapping).flags(mapping)
            == f"--contexts 512 1024 --device cuda:0 --model '{ckpt}'")
    mapping = {"warmup": 2, "decode_steps": 16, "contexts": [4096], "repeats": 3}   # defaults given still are flags
    assert (VariantThroughputConfig.from_config(mapping).flags(mapping)
            == "--warmup 2 --decode-steps 16 --contexts 4096 --repeats 3")
    mapping = {"codec_shape": [1024, 256, 3072], "restore_tokens": None, "tokens": 2048}  # None: the verb's default
    assert CodecCostConfig.from_config(mapping).flags(mapping) == "--codec-shape 1024 256 3072 --tokens 2048"
    assert CodecCostConfig.from_config({}).flags({}) == ""


@pytest.mark.parametrize("verb, mapping, call", [
    ("rkv-throughput", {}, ("decode", "measure_decode_throughput")),
    ("rkv-throughput", {"contexts": [64, 128], "methods": ["full"], "decode_steps": 2, "repeats": 1, "warmup": 0,
                        "device": "cpu", "dtype": "float32", "seed": 3, "codec_dir": "c d", "prefill_chunk": 512},
     ("decode", "measure_decode_throughput")),
    ("codec-cost", {}, ("codec_cost", "measure_codec_cost")),
    ("codec-cost", {"codec_shape": [64, 16, 96], "tokens": 100, "restore_tokens": 10, "decode_steps": 7},
     ("codec_cost", "measure_codec_cost")),
    ("rkv-variants", {}, ("codec_variants", "measure_variant_throughput")),
    ("rkv-variants", {"contexts": [300], "decode_steps": 2, "warmup": 1}, ("codec_variants", "measure_variant_throughput")),
])
def test_cli_measures_with_the_settings_of_its_flags(verb, mapping, call, tmp_path, monkeypatch):
    """The flags a config mapping gives reach the measuring function as its settings; flags left out take the
    settings' defaults (defined once, in kvbench.bench.settings)."""
    cfg = BY_VERB[verb].from_config(mapping)
    seen = {}

    def fake(*args, **kwargs):
        seen.update(args=args, kwargs=kwargs)
        return [], "# fake"

    monkeypatch.setattr(importlib.import_module(f"kvbench.bench.{call[0]}"), call[1], fake)
    argv = ["bench", verb, "--out", str(tmp_path / "x.csv"), *shlex.split(cfg.flags(mapping))]
    if verb == "rkv-variants":
        argv += ["--codecs", "base=dir", "--default", "base"]
    assert main(argv) == 0
    kw = seen["kwargs"]
    timing = {"repeats": cfg.repeats, "device": cfg.device, "dtype": cfg.dtype, "seed": cfg.seed, "threads": None}
    assert {k: kw[k] for k in timing} == timing
    if verb == "rkv-throughput":
        assert seen["args"] == (cfg.model, cfg.contexts, cfg.methods)
        assert (kw["decode_steps"], kw["warmup_steps"], kw["codec_dir"], kw["tokenizer"], kw["prefill_chunk"]) == (
            cfg.decode_steps, cfg.warmup, cfg.codec_dir, "tiny-qwen2-lm", cfg.prefill_chunk)
    elif verb == "codec-cost":
        assert seen["args"] == cfg.codec_shape
        assert (kw["tokens"], kw["restore_tokens"], kw["decode_steps"], kw["warmup"]) == (
            cfg.tokens, cfg.restore_tokens, cfg.decode_steps, cfg.warmup)
    else:
        assert seen["args"] == ({"base": "dir"}, "base", cfg.model, cfg.contexts[0])
        assert (kw["decode_steps"], kw["warmup_steps"]) == (cfg.decode_steps, cfg.warmup)


@pytest.mark.parametrize("argv, needle", [
    (["rkv-throughput", "--model", "nope-lm"], "model 'nope-lm' is neither a timing LM"),
    (["rkv-variants", "--contexts", "1024", "2048", "--codecs", "a=x", "--default", "a"],
     "contexts must be one context length (Fig. 11 times one), got [1024, 2048]"),
    (["codec-cost", "--tokens", "100", "--restore-tokens", "200"], "restore_tokens = 200 exceeds tokens = 100"),
])
def test_cli_refuses_bad_settings_before_measuring(argv, needle, tmp_path, capsys):
    assert main(["bench", argv[0], "--out", str(tmp_path / "x.csv"), *argv[1:]]) == 2
    assert f"kvbench bench: error: {needle}" in capsys.readouterr().err
    assert not (tmp_path / "x.csv").exists()


def test_report_plan_and_settings_import_neither_the_cli_nor_torch():
    """Issue #12: the report checked bench flags through kvbench.cli (an import cycle); the settings are light."""
    code = ("import sys, kvbench.bench.settings; assert 'torch' not in sys.modules, 'torch'; "
            "import kvbench.plan.residualkv; assert 'kvbench.cli' not in sys.modules, 'kvbench.cli'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
