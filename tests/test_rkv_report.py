"""ResidualKV press specs, the run plan and the tables computed from run directories (exact values)."""
from __future__ import annotations

import json
import re

import pandas as pd
import pytest

from kvbench.eval.compress import CompressMethod
from kvbench.eval.registry import get_method
from kvbench.report import tables
from kvbench.report.residualkv import tables as residualkv
from kvbench.report.residualkv import figure_entry as rkv_report
from kvbench.plan.residualkv import RKVPlan, press_spec
from kvbench.utils.io import write_jsonl

SECTION = {
    "model": "tiny-qwen2-lm", "tasks": ["kv_1k", "niah_1k"], "n_test": 2,
    "codec": {"d_c": 32, "d_ff": 192, "n_sink": 8, "stride": 10, "window": 32},
    "train": {"objective": "joint", "steps": 10, "seq_len": 64, "lr": 0.001, "data": "tasks"},
    "variants": {"norefs": {"overrides": {"references": False}}},
    "tableIII": [{"label": "Full cache", "method": "fullkv"},
                 {"label": "ResidualKV", "method": "residualkv+omnikv:full_layers=0+1,keep=0.2"}],
    "stride_sweep": {"method": "residualkv+omnikv:full_layers=0+1", "alpha": [0, 0.1], "stride": [5]},
}


#: What the workflow passes an RKVPlan that names codec directories (common.smk: SEED, model_dir()).
CODEC_KW = {"seed": 0, "model_dir": "zoo/tiny-qwen2-lm"}


def test_press_specs_parse_and_canonicalise():
    assert press_spec("snapkv:window=16,keep=0.3").canonical == "snapkv:keep=0.3,window=16"
    assert press_spec("residualkv:full_layers=0+1,use_codec=false").params == {"full_layers": (0, 1), "use_codec": False}
    assert press_spec("residualkv+omnikv:full_layers=0+1").slug == "residualkv.omnikv_full_layers-0.1"


@pytest.mark.parametrize("spec, match", [
    ("zip:keep=1", "unknown method 'zip'"),
    ("conduit@0.1", "unknown method 'conduit'"),  # a refresh policy is not a press
    ("snapkv@0.1", "takes no budget"),
    ("snapkv:kep=0.3", "unknown parameter 'kep'"),
    ("snapkv:keep", "is not key=value"),
    ("residualkv:use_codec=no", "must be true or false"),
    ("residualkv:codec_dir=/x", "unknown parameter 'codec_dir'"),
])
def test_bad_press_specs_are_named(spec, match):
    with pytest.raises(ValueError, match=match):
        press_spec(spec)


def test_get_method_routes_press_specs():
    m = get_method("snapkv:keep=0.5")
    assert isinstance(m, CompressMethod) and m.press().keep == 0.5
    with pytest.raises(ValueError, match="needs codec_dir"):
        get_method("residualkv").press()


def test_compress_method_refuses_records_it_cannot_serve():
    # VLM records are served since issue #17 (kvbench.compress.generate_vlm, tests/test_compress_vlm.py)
    get_method("fullkv").check_records([{"id": "a", "kind": "vlm"}])
    with pytest.raises(ValueError, match="'b'.*text records with a 'context' field"):
        get_method("fullkv").check_records([{"id": "b", "kind": "text"}])


def test_plan_maps_specs_to_runs_and_codecs():
    plan = RKVPlan(SECTION, "smoke")
    assert plan.codec_of("fullkv") is None and plan.codec_of("residualkv") == "main"
    with pytest.raises(ValueError, match="needs full_layers"):  # a spec is checked by constructing its press
        plan.codec_of("residualkv+omnikv")
    assert plan.run_dir("kv_1k", "fullkv") == "results/runs/smoke/tiny-qwen2-lm/kv_1k/residualkv/fullkv"
    assert [r.label for r in plan.rows("fig5")] == ["alpha = 0", "alpha = 0.1", "stride = 5"]
    assert plan.codecs.overrides("norefs")["references"] is False and plan.codecs.training("norefs")["data"] == "tasks"
    with pytest.raises(ValueError, match="codec variant 'other'"):
        RKVPlan({**SECTION, "tableIII": [{"label": "x", "method": "residualkv:codec=other"}]}, "smoke")


def _fake_run(root, plan, task, spec, scores, kr, cr, n_tokens=1000, resident=None, old=False):
    """A run's predictions: audit rows with ``kr_packed = kr`` split over two layers' packed parts (full layer 1/2,
    codes 1/4, scales 1/8, references 1/16, indices 1/32, raw window and sinks 1/64 each, of kr), ``kr_resident``
    (``resident``, default 2·kr); ``old``: a row as written before the resident accounting (``kr`` only)."""
    full = 1 << 20
    part = lambda f: int(kr * full * f)  # noqa: E731  exact: kr in 1/64ths of a power of two below
    layers = [{"layer": 0, "full_layer": part(1 / 2)},
              {"layer": 1, "codes": part(1 / 4), "scales": part(1 / 8), "references": part(1 / 16),
               "indices": part(1 / 32), "raw_window": part(1 / 64), "sinks": part(1 / 64)}]
    audit = ({"kr": kr} if old else
             {"kr_packed": kr, "kr_resident": 2 * kr if resident is None else resident, "full_bytes": full})
    rows = [{"id": str(i), "score": s, "status": "ok",
             "plan": {**audit, "cr": cr, "n_tokens": n_tokens, "bytes": layers}}
            for i, s in enumerate(scores)]
    write_jsonl(root / plan.run_dir(task, spec) / "predictions.jsonl", rows)


def test_table_iii_cells_kr_and_cr(tmp_path):
    plan = RKVPlan(SECTION, "smoke")
    full, rkv = (r.spec for r in plan.rows("tableIII"))
    _fake_run(tmp_path, plan, "kv_1k", full, [1, 1], 1.0, 1.0, resident=2.0)
    _fake_run(tmp_path, plan, "niah_1k", full, [1, 0], 1.0, 1.0, resident=2.0)
    _fake_run(tmp_path, plan, "kv_1k", rkv, [1, 0], 0.5, 0.5, resident=0.9)
    _fake_run(tmp_path, plan, "niah_1k", rkv, [0, 0], 0.25, 0.3, resident=0.5)
    df = residualkv.score_table(plan, "tableIII", tmp_path, shape=(8, 128))
    assert df["kv_1k"].tolist() == [100.0, 50.0] and df["niah_1k"].tolist() == [50.0, 0.0]
    assert df["avg"].tolist() == [75.0, 25.0]
    assert df["KR_packed %"].tolist() == [100.0, 37.5] and df["CR %"].tolist() == [100.0, 40.0]
    assert df["KR_resident %"].tolist() == [200.0, 70.0] and "KR %" not in df.columns
    # the packed bytes by part, in % of the full cache, add up to KR_packed (each part here a power-of-two share)
    parts = list(residualkv.BREAKDOWN)
    assert df.loc[1, parts].tolist() == [18.8, 14.1, 2.3, 1.2, 1.2]   # 37.5 x (1/2, 3/8, 1/16, 1/32, 1/32)
    assert df.loc[0, parts].sum() == pytest.approx(100.0, abs=0.3)
    assert df.loc[1, parts].sum() == pytest.approx(df.loc[1, "KR_packed %"], abs=0.3)
    # formula: 2 of 8 layers full (q = 1), 99 refs in 1000 tokens (sinks 8, stride 10) FP8, d_c/d_kv = 1/4 at INT4
    want = 0.25 * 1 + 0.75 * (99 / 1000 * 0.5 + 0.3125 * 0.25)
    assert df["KR formula %"].tolist()[1] == round(100 * want, 1) and pd.isna(df["KR formula %"].tolist()[0])
    # a run written before the resident accounting: its `kr` was the packed accounting; no resident KR, said so
    _fake_run(tmp_path, plan, "niah_1k", rkv, [0, 0], 0.25, 0.3, old=True)
    old = residualkv.score_table(plan, "tableIII", tmp_path, shape=(8, 128))
    assert old.loc[1, "KR_packed %"] == 37.5 and pd.isna(old.loc[1, "KR_resident %"])
    assert "KR_resident: a run predates the resident accounting" in old.loc[1, "notes"]
    assert old.loc[1, parts].tolist() == df.loc[1, parts].tolist()   # its bytes give the same breakdown
    _fake_run(tmp_path, plan, "niah_1k", rkv, [0, 0], 0.25, 0.3, resident=0.5)
    # the table target as the workflow builds it: no shape given, so the zoo model's shape by name (was a TypeError)
    tables.write("residualkv/tableIII", {"profile": "smoke", "residualkv": SECTION, "seed": 0,
                                         "model_dir": str(tmp_path / "absent")}, tmp_path / "t3.csv", root=tmp_path)
    assert pd.read_csv(tmp_path / "t3.csv", comment="#")["KR formula %"].tolist()[1] == round(100 * want, 1)


def test_missing_run_is_named(tmp_path):
    plan = RKVPlan(SECTION, "smoke")
    with pytest.raises(FileNotFoundError, match="fullkv_protocol-one_pass has no predictions.jsonl"):
        residualkv.score_table(plan, "tableIII", tmp_path, shape=(8, 128))


def test_report_rejects_bad_json(tmp_path):
    with pytest.raises(ValueError, match=r"report spec \(--spec, --residualkv\) must be JSON"):
        rkv_report.report("tableIII", "{bad", tmp_path / "t.csv")
    with pytest.raises(ValueError, match="unknown ResidualKV figure"):
        rkv_report.report("tableIX", json.dumps({"profile": "smoke", "residualkv": SECTION}), tmp_path / "t.csv")
    # a table is built by `kvbench report residualkv/<table>` only (one route per table)
    with pytest.raises(ValueError, match=r"tables are `kvbench report residualkv/tableIII --spec"):
        rkv_report.report("tableIII", json.dumps({"profile": "smoke", "residualkv": SECTION}), tmp_path / "t.csv")
    with pytest.raises(ValueError, match="with `profile` and a `residualkv` mapping"):
        tables.write("residualkv/tableIII", {"profile": "smoke"}, tmp_path / "t.csv")
    with pytest.raises(ValueError, match="--allow-missing applies to CONDUIT"):
        tables.write("residualkv/tableIII", {"profile": "smoke", "residualkv": SECTION, "allow_missing": True},
                     tmp_path / "t.csv")


def test_a_single_layer_index_is_one_layer():
    """Bug: `omnikv:filter_layers=1` (a spec's single value) crashed with 'int' object is not iterable."""
    assert get_method("omnikv:filter_layers=1").press().filter_layers == (1,)
    with pytest.raises(ValueError, match="layer indices >= 0"):
        get_method("omnikv:filter_layers=-2").press()


def test_press_that_does_not_fit_the_model_stops_the_run(tiny_lm):
    from kvbench.eval.methods import FatalRunError

    m = get_method("omnikv:filter_layers=0+99")
    rec = {"id": "a", "kind": "text", "context": "x y z", "question": " q", "max_new_tokens": 1}
    with pytest.raises(FatalRunError, match="does not fit the model"):
        m.predict(tiny_lm, _ByteTok(), rec, None)


class _ByteTok:
    """A stand-in tokenizer with offsets (one id per character)."""

    eos_token_id = 0
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        return {"input_ids": [ord(c) % 256 for c in text], "offset_mapping": [(i, i + 1) for i in range(len(text))]}


@pytest.mark.parametrize("section, match", [
    ({"codec": {"dc": 48}}, "unknown CodecConfig field"),
    ({"variants": {"x": {"overrides": {"dc": 16}}}}, "variant 'x': unknown CodecConfig field"),
    ({"tableIII": [{"label": "r", "method": "residualkv:mode=omnikv"}]}, "unknown parameter 'mode'"),
    ({"tableIII": [{"label": "r", "method": "residualkv+quest"}]}, r"takes the selectors \['omnikv', 'snapkv'\], not 'quest'"),
    ({"tableIII": [{"label": "r", "method": "residualkv+omnikv:full_layers=0+1,window=4"}]}, r"takes \['window'\] from the storage"),
    ({"tableIII": [{"label": "k", "method": "kivi:bits=3"}]}, "kivi:bits=3"),
    # review findings: codec settings that only failed once training started, and bench flags that only
    # failed (or were silently mangled) when the profiling job ran
    ({"codec": {"d_c": 48, "d_ff": 192}}, r"variant 'main'.*d_c=48 must be a multiple of group=32"),
    ({"variants": {"k0": {"overrides": {"k": 0}}}}, r"variant 'k0'.*k \(references per token\) must be an int >= 1"),
    ({"variants": {"s0": {"overrides": {"stride": 0}}}}, r"variant 's0'.*stride must be a positive int, got 0"),
    ({"tableIII": [{"label": "r", "method": "residualkv+omnikv:full_layers=0+1,stride=0"}]}, "stride .* >= 1, got 0"),
    ({"tableIII": [{"label": "r", "method": "residualkv:full_kv_bits=4"}]}, "full_layers is empty"),
    ({"fig8": {"contxts": [512]}}, r"residualkv.fig8: unknown key\(s\) \['contxts'\]"),
    ({"fig8": {"repeats": "many"}}, "residualkv.fig8: repeats must be a positive integer, got 'many'"),
    # review findings: values the parser took but the bench refused only after Snakemake removed the old CSV
    ({"fig8": {"repeats": -1}}, "residualkv.fig8: repeats must be a positive integer, got -1"),
    ({"fig8": {"methods": ["nope"]}}, r"residualkv.fig8: methods: unknown method\(s\) \['nope'\]"),
    ({"fig8": {"model": "nope-lm"}}, "residualkv.fig8: model 'nope-lm' is neither a timing LM"),
    ({"fig8": {"dtype": "float7"}}, "residualkv.fig8: dtype must be one of .*, got 'float7'"),
    ({"fig11": {"device": "tpu"}}, "residualkv.fig11: device must be auto, cpu, cuda or cuda:<index>, got 'tpu'"),
    ({"tableIII": [{"label": "x", "method": "fullkv"}, {"label": "x", "method": "snapkv"}]}, r"label\(s\) \['x'\] given twice"),
    ({"fig11": {"contexts": [1024, 2048]}}, r"residualkv.fig11: contexts must be one context length \(Fig. 11 times one\), got \[1024, 2048\]"),
    ({"fig6": {"codec_shape": [2048, 512]}}, r"residualkv.fig6: codec_shape must be three positive integers \(d_kv, d_c, d_ff\), got \[2048, 512\]"),
])
def test_plan_refuses_bad_sections_before_any_job(section, match):
    with pytest.raises(ValueError, match=match):
        RKVPlan({**SECTION, **section}, "smoke")


def test_plan_checks_layers_and_default_codec_size_against_a_known_shape():
    with pytest.raises(ValueError, match=r"full_layers \[9\] outside the model's 8 layers"):
        RKVPlan({**SECTION, "tableIII": [{"label": "r", "method": "residualkv+omnikv:full_layers=0+9"}]},
                "smoke", shape=(8, 128))
    with pytest.raises(ValueError, match=r"filter_layers \[8\] outside"):
        RKVPlan({**SECTION, "tableIII": [{"label": "o", "method": "omnikv:filter_layers=8"}]}, "smoke", shape=(8, 128))
    # review finding: OmniKV whose only full layer is the last has no filter layer (it ran with CR 1.0)
    with pytest.raises(ValueError, match=r"needs a full layer followed by a sparse one .* full_layers \[7\]"):
        RKVPlan({**SECTION, "tableIII": [{"label": "r", "method": "residualkv+omnikv:full_layers=7"}]},
                "smoke", shape=(8, 128))
    with pytest.raises(ValueError, match="keep all 8 layers full: nothing is compressed"):
        RKVPlan({**SECTION, "tableIII": [{"label": "r", "method": "residualkv:full_layers=0+1+2+3+4+5+6+7"}]},
                "smoke", shape=(8, 128))
    with pytest.raises(ValueError, match="d_c=256 is wider than d_kv=128"):
        RKVPlan({**SECTION, "codec": {"d_c": 256, "d_ff": 192}}, "smoke", shape=(8, 128))
    # default d_c = d_kv / 4 = 48 at d_kv = 192: not a multiple of 32, refused before training
    with pytest.raises(ValueError, match="d_c=48 must be a multiple"):
        RKVPlan({**SECTION, "codec": {"d_ff": 192}}, "smoke", shape=(8, 192))
    assert RKVPlan(SECTION, "smoke", shape=(8, 128)).shape == (8, 128)


def test_bench_args_are_quoted_flags(tmp_path):
    ckpt = tmp_path / "m dir"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    plan = RKVPlan({**SECTION, "fig8": {"contexts": [512, 1024], "device": "cuda:0", "model": str(ckpt)}}, "smoke")
    assert plan.bench_args("fig8") == f"--contexts 512 1024 --device cuda:0 --model '{ckpt}'"
    assert plan.bench_args("fig6") == ""


def test_known_model_shape(tmp_path):
    from kvbench.plan.residualkv import known_model_shape

    assert known_model_shape("tiny-qwen2-lm", {"kind": "lm", "zoo": {}}) == (8, 128)
    assert known_model_shape("llama", {"kind": "lm", "checkpoint": "x"}, str(tmp_path / "absent")) is None
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8}))
    assert known_model_shape("llama", {"kind": "lm"}, str(tmp_path)) == (32, 2048)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4096}))
    with pytest.raises(ValueError, match="lacks 'num_attention_heads'"):
        known_model_shape("llama", {"kind": "lm"}, str(tmp_path))


def test_plan_names_missing_keys():
    with pytest.raises(ValueError, match=r"misses key\(s\) \['model'"):
        RKVPlan({k: v for k, v in SECTION.items() if k != "model"}, "smoke")


def test_full_cache_cr_is_exactly_one_with_or_without_a_question_chunk(tiny_lm):
    """Bug: a record whose question was empty (one prompt chunk) gave the full cache CR 100.1%."""
    m = get_method("fullkv")
    for question in (" q", ""):
        rec = {"id": "a", "kind": "text", "context": "abcdefgh", "question": question, "max_new_tokens": 4}
        m.predict(tiny_lm, _ByteTok(), rec, None)
        assert m.audit()["cr"] == 1.0


def test_fig5_counts_references_of_each_schedule(tmp_path):
    from kvbench.report.residualkv import figures as rkv_figures

    plan = RKVPlan(SECTION, "smoke")
    for row in plan.rows("fig5"):
        for task in plan.tasks:
            _fake_run(tmp_path, plan, task, row.spec, [1, 0], 0.4, 0.5)
    df = rkv_figures.fig5(plan, tmp_path / "f.pdf", tmp_path / "f.csv", tmp_path)
    # 1000 tokens, 8 sinks: stride 10 -> positions 8, 18, ..., 998 (100); stride 5 -> 199; alpha 0.1 grows the stride
    assert df["references"].tolist() == [100, 26, 199] and df["score"].tolist() == [50.0] * 3
    assert (tmp_path / "f.pdf").stat().st_size > 0


def test_fig11_merges_throughput_per_variant(tmp_path):
    from kvbench.report.residualkv import figures as rkv_figures

    from kvbench.plan.codecs import FIGURE_VARIANTS

    names = FIGURE_VARIANTS["fig11"]
    over = {"dc_low": {"d_c": 16}, "dc_high": {"d_c": 64}, "dff_low": {"d_ff": 96}, "dff_high": {"d_ff": 384}, "k_low": {"k": 1},
            "k_high": {"k": 8}, "s_low": {"stride": 5}, "s_high": {"stride": 20}}
    plan = RKVPlan({**SECTION, "variants": {v: {"overrides": over.get(v, {}), "steps": 3} for v in names}}, "smoke",
                   **CODEC_KW)
    for i, v in enumerate(names):
        _fake_variant(tmp_path, plan, v, steps_done=3, i=i)
    tp = tmp_path / "tp.csv"
    tp.write_text("# timing header\nvariant,tokens_per_s,relative_throughput\n"
                  + "".join(f"{v},{10 + i},{(10 + i) / 10}\n" for i, v in enumerate(names)))
    df = rkv_figures.fig11(plan, tmp_path / "f.pdf", tmp_path / "f.csv", tmp_path, throughput=tp)
    dc = df[df["parameter"] == "d_c"]
    assert dc["value"].tolist() == [16, 32, 64] and dc["relative_throughput"].tolist() == [1.0, 1.1, 1.2]
    assert df[df["parameter"] == "s"]["value"].tolist() == [5, 10, 20]
    assert "timing header" in (tmp_path / "f.csv").read_text()
    tp.write_text("variant,tokens_per_s,relative_throughput\nbase,10,1.0\n")
    with pytest.raises(ValueError, match=r"no throughput row for variant\(s\) \['dc_high', 'dc_low'"):
        rkv_figures.fig11(plan, tmp_path / "f.pdf", tmp_path / "f.csv", tmp_path, throughput=tp)
    with pytest.raises(ValueError, match="--raw is not read by residualkv-tableIII"):
        rkv_report.report("tableIII", {"profile": "smoke", "residualkv": SECTION}, tmp_path / "t.csv", raw=tp)
    # review findings: the value column is what the codec was trained with (codec.json); a missing variant names
    # the figure that needs it
    assert df["steps"].tolist() == [3] * len(df)
    (tmp_path / plan.codecs.dir("dc_low") / "codec" / "codec.json").write_text(
        (tmp_path / plan.codecs.dir("dc_high") / "codec" / "codec.json").read_text())
    df = rkv_figures.fig11(plan, tmp_path / "f.pdf", tmp_path / "f.csv", tmp_path)
    assert df[df["parameter"] == "d_c"]["value"].tolist() == [64, 32, 64]
    (tmp_path / plan.codecs.dir("s_high") / "summary.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"Fig. 11 needs codec variant 's_high'.*summary.json is missing"):
        rkv_figures.fig11(plan, tmp_path / "f.pdf", tmp_path / "f.csv", tmp_path)


def _fake_variant(root, plan, variant, steps_done, i):
    """A trained variant's files as rkv_codec writes them (codec.json, summary.json, curves.csv), no weights."""
    from kvbench.compress.residualkv.codec import codec_config_for_shape

    d = root / plan.codecs.dir(variant)
    (d / "codec").mkdir(parents=True, exist_ok=True)
    (d / "codec" / "codec.json").write_text(codec_config_for_shape(8, 128, **plan.codecs.overrides(variant)).to_json())
    (d / "summary.json").write_text(json.dumps({"codec_params": 100 + i, "steps": steps_done,
                                                "eval_final": {"eval_ntp": 4.0 + i, "eval_rec": 1.0}}))
    (d / "curves.csv").write_text("step,loss,ntp,rec,lr,eval_ntp,eval_rec\n"
                                  + "".join(f"{s},{7 - s},{5 - s},{2},0.1,{5.5 - s},{2.5}\n" for s in range(1, steps_done + 1)))


def test_fig10_curves(tmp_path):
    from kvbench.report.residualkv import figures as rkv_figures

    plan = RKVPlan({**SECTION, "variants": {"base": {"steps": 3}, "separate": {"overrides": {"joint": False}, "steps": 3}}},
                   "smoke", **CODEC_KW)
    _fake_variant(tmp_path, plan, "base", steps_done=3, i=0)
    _fake_variant(tmp_path, plan, "separate", steps_done=3, i=1)
    ev = rkv_figures.fig10(plan, tmp_path / "f.pdf", tmp_path / "f.csv", tmp_path)
    assert ev.groupby("variant")["step"].max().to_dict() == {"base": 3, "separate": 3}
    text = (tmp_path / "f.csv").read_text()
    assert [l for l in text.splitlines() if not l.startswith("#")][0] == "variant,params,step,eval_ntp,eval_rec,ntp,rec" and "elapsed" not in text


def test_codec_figures_refuse_an_unfinished_codec(tmp_path):
    """Training can no longer end early; a summary of an unfinished codec (an older kvbench's budget cap) fails
    the figure, naming the directory to delete, instead of drawing it with an UNEQUAL TRAINING note."""
    from kvbench.report.residualkv import figures as rkv_figures

    plan = RKVPlan({**SECTION, "variants": {"base": {"steps": 3}, "separate": {"overrides": {"joint": False}, "steps": 3}}},
                   "smoke", **CODEC_KW)
    _fake_variant(tmp_path, plan, "base", steps_done=3, i=0)
    _fake_variant(tmp_path, plan, "separate", steps_done=3, i=1)
    path = tmp_path / plan.codecs.dir("separate") / "summary.json"
    path.write_text(json.dumps({"steps_done": 2, "steps": 3, "finished": False, "codec_params": 1}))
    with pytest.raises(ValueError, match=r"separate-[0-9a-f]{8}/summary.json: an unfinished codec \(2 of 3 steps.*delete"):
        rkv_figures.fig10(plan, tmp_path / "f.pdf", tmp_path / "f.csv", tmp_path)


def test_plan_refuses_figure_variants_with_unequal_steps():
    with pytest.raises(ValueError, match="fig12 compares its codec variants at equal training steps, but they train "
                                         "ntp 200, mse 100 steps"):
        RKVPlan({**SECTION, "variants": {"ntp": {"objective": "ntp", "steps": 200}, "mse": {"objective": "mse", "steps": 100}}},
                "smoke")


def test_codec_dirs_are_keyed_by_recipe_hash():
    """Issue #11 item 4: a config change trains into a new directory (never over a finished codec); slice_s,
    which only cuts invocations, keeps the directory."""
    plan = RKVPlan(SECTION, "smoke", **CODEC_KW)
    main, norefs = plan.codecs.dir("main"), plan.codecs.dir("norefs")
    assert re.fullmatch(r"codecs/smoke/tiny-qwen2-lm/main-[0-9a-f]{8}", main) and norefs.startswith("codecs/smoke/tiny-qwen2-lm/norefs-")
    assert plan.codecs.names() == {main.rsplit("/", 1)[1]: "main", norefs.rsplit("/", 1)[1]: "norefs"}
    assert plan.codecs.recipe("norefs") == {"codec": {**SECTION["codec"], "references": False}, **SECTION["train"],
                                           "seed": 0, "model": "zoo/tiny-qwen2-lm"}
    assert RKVPlan(SECTION, "smoke", **CODEC_KW).codecs.dir("main") == main  # stable
    same = [{**SECTION, "train": {**SECTION["train"], "slice_s": 60}},
            {**SECTION, "variants": {"norefs": {"overrides": {"references": False}, "slice_s": 5}}}]
    assert all(RKVPlan(s, "smoke", **CODEC_KW).codecs.dir("main") == main for s in same)
    changed = [({**SECTION, "codec": {**SECTION["codec"], "d_c": 64}}, {}),
               *(({**SECTION, "train": {**SECTION["train"], k: v}}, {}) for k, v in
                 [("steps", 11), ("seq_len", 128), ("lr", 0.002), ("objective", "ntp"), ("data", "text")]),
               (SECTION, {"seed": 1}), (SECTION, {"model_dir": "zoo/tiny-qwen2-lm-0123abcd"})]
    dirs = {RKVPlan(s, "smoke", **{**CODEC_KW, **kw}).codecs.dir("main") for s, kw in changed}
    assert len(dirs) == len(changed) and main not in dirs
    assert RKVPlan(SECTION, "paper", **CODEC_KW).codecs.dir("main").startswith("codecs/paper/")
    with pytest.raises(ValueError, match="needs seed= and model_dir="):
        RKVPlan(SECTION, "smoke").codecs.dir("main")


def test_codec_slice_and_runtime():
    plan = RKVPlan({**SECTION, "train": {**SECTION["train"], "steps": 600, "seq_len": 512, "slice_s": 900},
                    "variants": {"norefs": {"slice_s": None}, "x": {"steps": 200, "slice_s": 61}}}, "smoke", **CODEC_KW)
    assert [plan.codecs.slice_s(v) for v in ("main", "norefs", "x")] == [900, None, 61]
    assert plan.codecs.runtime_min("main") == 15 + 30 and plan.codecs.runtime_min("x") == 2 + 30
    # no slice: 4 x 600 x 512 tokens at 930 tokens/s = 22.02 min -> 23, plus 10
    assert plan.codecs.runtime_min("norefs") == 23 + 10
    assert RKVPlan({**plan.s, "model": "llama"}, "paper", zoo=False, **CODEC_KW).codecs.runtime_min("norefs") == 24 * 60


def test_header_describes_zoo_or_checkpoint():
    """Review finding: tables from real checkpoints were headed 'tiny zoo LM trained here'."""
    assert "tiny zoo LM trained here" in RKVPlan(SECTION, "smoke").header("Table III")[0]
    head = RKVPlan({**SECTION, "model": "llama-3.1-8b"}, "paper", zoo=False).header("Table III")[0]
    assert "model llama-3.1-8b (local checkpoint)" in head and "zoo" not in head and "smoke" not in head


def test_table_i_settings_are_checked_against_the_checkpoint():
    """Review finding: paper.yaml's Table I entries were required but never compared with config.json."""
    from kvbench.plan.residualkv import check_table_i

    entry = {"codec": {"two_d_k": 2048, "d_c": 512, "d_ff": 3072, "full_attention_layers": [0, 1, 2, 8, 18]}}
    check_table_i("llama", entry, (32, 2048))
    check_table_i("llama", entry, None)  # checkpoint not there yet (a dry run): nothing to compare
    with pytest.raises(ValueError, match="codec.two_d_k = 2048 .* has 2 d_k = 1024"):
        check_table_i("llama", entry, (28, 1024))
    with pytest.raises(ValueError, match=r"full_attention_layers \[18\] outside its checkpoint's 16 layers"):
        check_table_i("llama", entry, (16, 2048))


def test_kr_formula_reads_the_press_fields():
    """Bugs: a standalone spec's full layers were counted as 0 (the cache keeps them full), and ``full_layers=0``
    (one index) crashed the formula with ``TypeError: object of type 'int' has no len()``."""
    plan = RKVPlan(SECTION, "smoke")
    shape = (8, 128)
    with_full = residualkv.kr_formula(plan, "residualkv:full_layers=0+1", 1024.0, shape)
    without = residualkv.kr_formula(plan, "residualkv", 1024.0, shape)
    assert with_full > without  # β = 2/8 of the layers at 100%
    assert residualkv.kr_formula(plan, "residualkv+omnikv:full_layers=0", 1024.0, shape) is not None
    assert residualkv.kr_formula(plan, "snapkv:keep=0.3", 1024.0, shape) is None  # measured only


def test_config_errors_name_the_table_and_the_row():
    """A bad spec in one row of a long table names that row, not only the section."""
    rows = [{"label": "ok", "method": "fullkv"}, {"label": "bad row", "method": "snapkv:keep=2"}]
    with pytest.raises(ValueError, match=r"tableIII, row 'bad row': method spec 'snapkv:keep=2'"):
        RKVPlan({**SECTION, "tableIII": rows}, "smoke")
    rows = [{"label": "deep", "method": "residualkv:full_layers=0+9"}]
    with pytest.raises(ValueError, match=r"tableIII, row 'deep': .*full_layers \[9\] outside"):
        RKVPlan({**SECTION, "tableIII": rows}, "smoke", shape=(8, 128))
    with pytest.raises(ValueError, match=r"stride_sweep.method: method spec 'residualkv\+quest"):
        RKVPlan({**SECTION, "stride_sweep": {**SECTION["stride_sweep"], "method": "residualkv+quest"}}, "smoke")


def test_table_header_names_the_omnikv_selection_form():
    """The CSV header says how the OmniKV rows selected: the authors' form by default, a spec's form otherwise."""
    section = {**SECTION, "tableIII": [
        {"label": "Full cache", "method": "fullkv"},
        {"label": "OmniKV", "method": "omnikv:keep=0.2,filter_layers=1"},
        {"label": "ResidualKV", "method": "residualkv+omnikv:full_layers=0+1,keep=0.2"},
        {"label": "ResidualKV (chunk)", "method": "residualkv+omnikv:full_layers=0+1,keep=0.2,sparse_prefill=true,row_agg=max"}]}
    lines = residualkv.selection_header(RKVPlan(section, "smoke"), "tableIII")
    assert lines == [
        "# OmniKV selection (OmniKV, ResidualKV): decode steps only (a multi-token chunk reads every token); "
        "raw q·k, max over query heads; int(keep·n) candidates",
        "# OmniKV selection (ResidualKV (chunk)): decode steps and multi-token chunks (query rows: max); "
        "raw q·k, max over query heads; int(keep·n) candidates"]
    assert residualkv.selection_header(RKVPlan({**SECTION, "tableIII": section["tableIII"][:1]}, "smoke"), "tableIII") == []


def test_audit_row_reports_packed_resident_and_what_was_kept(tiny_lm):
    """Issue #13 item 6: the audit row carries kr_packed and kr_resident (never one ``kr``), the full cache's bytes,
    and the measured share kept beside the press's target: 41% for snapkv:keep=0.3 on a 200-token context."""
    m = get_method("snapkv:keep=0.3")
    rec = {"id": "a", "kind": "text", "context": "".join(chr(97 + i % 26) for i in range(200)), "question": " q?",
           "max_new_tokens": 2}
    m.predict(tiny_lm, _ByteTok(), rec, None)
    row = m.audit()
    assert "kr" not in row and row["n_tokens"] == 200 + 3 + 1     # the last generated token is never written
    # 82 of the 200 context tokens kept per head and layer (50 of the 168-token prefix + the 32-token window),
    # the 3 question tokens and the first generated one never evicted
    assert row["kept"] == row["kept_target"] == pytest.approx((82 + 4) / 204)
    assert row["kr_packed"] == pytest.approx(row["kept"])          # kept tokens at FP16: packed KR = kept share
    assert row["kr_resident"] > row["kr_packed"]                   # float32 K/V and int64 per-head positions
    assert row["full_bytes"] == 2 * 2 * 3 * 204 * 2 * 16
    assert sum(b["resident"] for b in row["bytes"]) == pytest.approx(row["kr_resident"] * row["full_bytes"])


def test_attribution_and_full_layer_headers_name_what_each_row_changes():
    """Each ResidualKV-family row's header line names exactly the parameters it changes against the row labelled
    ResidualKV (issue #32: no header claims more than a row shows), and the 4-bit rows' full-layer form."""
    from kvbench.plan.residualkv import Row, press_spec
    from kvbench.report.residualkv.tables import attribution_header, full_layer_header

    spec = lambda s: press_spec(s).canonical  # noqa: E731
    rows = [Row("Full cache", spec("fullkv")),
            Row("ResidualKV", spec("residualkv+omnikv:full_layers=0+1,keep=0.2,full_kv_bits=4,protocol=one_pass")),
            Row("FP16", spec("residualkv+omnikv:full_layers=0+1,keep=0.2,protocol=one_pass")),
            Row("HF", spec("residualkv+omnikv:full_layers=0+1,keep=0.2,full_kv_bits=4,full_kv_form=before")),
            Row("alone", spec("residualkv:full_layers=0+1,full_kv_bits=4"))]
    got = attribution_header(rows)
    assert got == ["# FP16 vs ResidualKV: changes only full_kv_bits=16 (ResidualKV: 4)",
                   "# HF vs ResidualKV: changes only full_kv_form=before (ResidualKV: after)",
                   # the selector's parameters go with the selector (they read "keep=None (ResidualKV: 0.2)")
                   "# alone vs ResidualKV: changes only method residualkv (ResidualKV: residualkv+omnikv)"]
    assert attribution_header(rows[:1]) == []   # no ResidualKV row: nothing to attribute
    forms = full_layer_header(rows)
    assert [line.split(":")[0] for line in forms] == ["# full-attention layers (ResidualKV, alone)",
                                                      "# full-attention layers (HF)"]
    assert "engine form" in forms[0] and "HF-reference form" in forms[1]
