"""kvbench.eval: metrics, method registry, and run_eval end to end on random-weight tiny models."""
from __future__ import annotations

import json
import math

import pytest
from _zoo_fixtures import text_record, vlm_record, write_png, write_split

from kvbench.data.lcc import edit_sim, first_code_line, indel_ratio
from kvbench.eval import metrics
from kvbench.eval.methods import EvalMethod, FullCache
from kvbench.eval.registry import PLAIN, get_method
from kvbench.eval.metrics import aggregate, exact_match
from kvbench.eval.runconfig import read_config
from kvbench.eval.runner import run_eval
from kvbench.utils.io import read_jsonl


@pytest.fixture(scope="session")
def tiny_lm_dir(lm_dir):
    """The shared random-weight LM checkpoint of conftest.py."""
    return lm_dir


@pytest.fixture(scope="session")
def tiny_vlm_dir(vlm_dir):
    """The shared random-weight VLM checkpoint of conftest.py."""
    return vlm_dir


# -- metrics -------------------------------------------------------------------------------------
def test_exact_match_strips_both_sides():
    assert exact_match(" 42\n", "42") == 1.0
    assert exact_match("42", " 42 ") == 1.0
    assert exact_match("421", "42") == 0.0
    assert exact_match("", "42") == 0.0


def test_edit_sim_values():
    assert edit_sim("x = foo(1)", "x = foo(1)") == 1.0
    # fuzzywuzzy's documented example: fuzz.ratio("this is a test", "this is a test!") == 97 (rounded)
    assert edit_sim("this is a test", "this is a test!") == pytest.approx(28 / 29)
    assert indel_ratio("kitten", "sitting") == pytest.approx(2 * 4 / 13)
    assert edit_sim("abc", "xyz") == 0.0
    assert indel_ratio("", "") == 1.0 and indel_ratio("", "a") == 0.0


def test_edit_sim_skips_comment_lines_like_longbench():
    pred = "\n\n# a comment\n// another\n```python\nreturn x + 1\nsecond line"
    assert first_code_line(pred) == "return x + 1"
    assert edit_sim(pred, "return x + 1") == 1.0
    assert first_code_line("y = 1  # trailing comment\nz = 2") == "z = 2"  # '#' anywhere disqualifies a line
    assert first_code_line("#only\n#comments") == ""
    assert first_code_line("# c\n\nx") == ""  # LongBench skips leading newlines only, not inner empty lines


def test_indel_ratio_is_two_lcs_over_total_length():
    # "kitten" vs "sitting": LCS "ittn" = 4 -> 2*4 / 13
    assert indel_ratio("kitten", "sitting") == pytest.approx(8 / 13)


def test_aggregate_binary_uses_wilson():
    rows = [{"score": s, "status": "ok", "chance": 0.1} for s in [1, 1, 1, 0]] + [
        {"score": 0.0, "status": "error", "chance": 0.3}]
    agg = aggregate(rows)
    assert agg["score"] == pytest.approx(0.6)
    assert (agg["n"], agg["n_ok"], agg["n_error"]) == (5, 4, 1)
    assert agg["chance"] == pytest.approx(0.14)
    assert agg["ci95_method"] == "wilson"
    # Wilson 95% for 3/5: (0.2307, 0.8824)
    assert agg["ci95"] == pytest.approx([0.23072, 0.88236], abs=1e-4)
    assert aggregate([{"score": 0.0, "chance": 0.5}])["ci95"][0] == 0.0
    assert aggregate([{"score": 1.0, "chance": 0.5}] * 3)["ci95"][1] == 1.0


def test_aggregate_continuous_uses_normal_interval():
    scores = [0.2, 0.4, 0.6, 0.8]
    agg = aggregate([{"score": s, "status": "ok", "chance": 0.0} for s in scores])
    sd = math.sqrt(sum((s - 0.5) ** 2 for s in scores) / 3)
    half = metrics.Z95 * sd / 2
    assert agg["ci95_method"] == "normal"
    assert agg["ci95"] == pytest.approx([0.5 - half, 0.5 + half])


# -- methods -------------------------------------------------------------------------------------
def test_method_registry():
    assert PLAIN.classes["full"] is FullCache and issubclass(FullCache, EvalMethod)
    assert get_method("full").config() == {"name": "full"}
    with pytest.raises(ValueError, match=r"unknown method 'nope'.*full"):
        get_method("nope")


# -- run_eval ------------------------------------------------------------------------------------
def test_run_eval_text_end_to_end(tiny_lm_dir, tmp_path):
    recs = [text_record(0), text_record(1, metric="edit_sim"), text_record(2)]
    split = write_split(tmp_path / "data" / "test.jsonl", recs)
    out = tmp_path / "run"
    m = run_eval(tiny_lm_dir, split, method="full", out_dir=out, seed=0, threads=1)
    assert {p.name for p in out.iterdir()} == {"predictions.jsonl", "metrics.json", "config.yaml", "run_info.json",
                                               "timing.csv"}
    assert json.loads((out / "metrics.json").read_text()) == m
    assert (m["n"], m["n_ok"], m["n_error"], m["task"], m["method"], m["model"]) == (3, 3, 0, "toy", "full", "tiny-qwen2-lm")
    assert 0.0 <= m["score"] <= 1.0 and m["chance"] == pytest.approx(0.1)
    preds = read_jsonl(out / "predictions.jsonl")
    assert [p["id"] for p in preds] == ["t0", "t1", "t2"]
    for p, r in zip(preds, recs):
        assert set(p) >= {"id", "prediction", "gold", "score", "chance", "status", "error"}
        assert p["status"] == "ok" and p["error"] is None and isinstance(p["prediction"], str)
        assert p["gold"] == r["answer"] and 0.0 <= p["score"] <= 1.0
    timing = (out / "timing.csv").read_text().splitlines()
    assert timing[0] == "id,latency_ms" and [t.split(",")[0] for t in timing[1:]] == ["t0", "t1", "t2"]
    assert all(float(t.split(",")[1]) > 0 for t in timing[1:])
    cfg = read_config(out)  # the resolved configuration (tests/test_eval_runconfig.py); run_info: the invocation
    assert cfg["run"]["seed"] == 0 and cfg["run"]["threads"] == 1 and cfg["run"]["method"] == "full"
    assert cfg["model"]["attn_implementation"] == "sdpa" and len(cfg["model"]["config_sha256"]) == 64
    assert cfg["versions"]["torch"] and cfg["versions"]["transformers"] and cfg["versions"]["python"]
    assert "commit" in cfg["git"] and cfg["method"] == {"name": "full"}
    info = json.loads((out / "run_info.json").read_text())
    assert info["wall_s"] > 0 and info["hostname"] and info["started_at"] <= info["ended_at"]
    # same seed, same predictions (greedy)
    run_eval(tiny_lm_dir, split, out_dir=tmp_path / "run2", limit=2)
    assert [p["prediction"] for p in read_jsonl(tmp_path / "run2" / "predictions.jsonl")] == [
        p["prediction"] for p in preds[:2]]


def test_run_eval_vlm(tiny_vlm_dir, tmp_path):
    data = tmp_path / "vl"
    recs = [vlm_record(i, f"images/{write_png(data / 'images' / f'p{i}.png', seed=i)}") for i in range(2)]
    split = write_split(data / "test.jsonl", recs)
    m = run_eval(tiny_vlm_dir, split, out_dir=tmp_path / "run")
    preds = read_jsonl(tmp_path / "run" / "predictions.jsonl")
    assert [p["status"] for p in preds] == ["ok", "ok"], preds
    assert m["n"] == 2 and m["model"] == "tiny-qwen2.5-vl" and 0.0 <= m["score"] <= 1.0


def test_failing_sample_is_recorded_not_fatal(tiny_vlm_dir, tmp_path):
    data = tmp_path / "vl"
    ok = vlm_record(0, f"images/{write_png(data / 'images' / 'p0.png', seed=0)}")
    bad = vlm_record(1, "images/missing.png")
    m = run_eval(tiny_vlm_dir, write_split(data / "test.jsonl", [ok, bad]), out_dir=tmp_path / "run")
    preds = {p["id"]: p for p in read_jsonl(tmp_path / "run" / "predictions.jsonl")}
    assert preds["v1"]["status"] == "error" and preds["v1"]["score"] == 0.0
    assert "FileNotFoundError" in preds["v1"]["error"] and preds["v0"]["status"] == "ok"
    assert (m["n"], m["n_ok"], m["n_error"]) == (2, 1, 1)
    with pytest.raises(RuntimeError, match="all 1 samples failed"):
        run_eval(tiny_vlm_dir, write_split(data / "bad.jsonl", [bad]), out_dir=tmp_path / "run_bad")
    assert not any((tmp_path / "run_bad").iterdir())  # nor work files: a rerun after the fix starts over


def test_unknown_method_raises(tmp_path):
    split = write_split(tmp_path / "test.jsonl", [text_record(0)])
    with pytest.raises(ValueError, match=r"unknown method 'notamethod'.*plain: \['full'\].*refresh: .*press: "):
        run_eval("does-not-matter", split, method="notamethod", out_dir=tmp_path / "run")


@pytest.mark.parametrize("field", ["answer", "metric", "context"])
def test_missing_field_raises_before_loading(tmp_path, field):
    bad = text_record(1)
    del bad[field]
    split = write_split(tmp_path / "test.jsonl", [text_record(0), bad])
    with pytest.raises(ValueError, match=rf"'t1'.*missing required field '{field}'"):
        run_eval("does-not-matter", split, out_dir=tmp_path / "run")


def test_invalid_records_raise(tmp_path):
    for bad, msg in [([text_record(0), text_record(0)], "duplicate"),
                     ([text_record(0, metric="bleu")], "metric"),
                     ([text_record(0, max_new_tokens=0)], "max_new_tokens"),
                     ([text_record(0, kind="audio")], "kind")]:
        with pytest.raises(ValueError, match=msg):
            run_eval("does-not-matter", write_split(tmp_path / "t.jsonl", bad), out_dir=tmp_path / "run")


@pytest.mark.parametrize("chance", [1.5, -0.1, "x", None, True, float("nan")])
def test_chance_outside_unit_interval_is_refused(tmp_path, chance):
    split = write_split(tmp_path / "t.jsonl", [text_record(0), text_record(1, chance=chance)])
    with pytest.raises(ValueError, match=rf"'t1': field 'chance' must be a number in \[0, 1\].*got {chance!r}"):
        run_eval("does-not-matter", split, out_dir=tmp_path / "run")


@pytest.mark.parametrize("line, kind", [("[1, 2]", "an array"), ("3", "a number"), ('"t"', "a string"),
                                        ("null", "null")])
def test_jsonl_line_that_is_not_an_object_is_named(tmp_path, line, kind):
    """Bug: a line such as ``[1, 2]`` passed read_jsonl and failed later with an AttributeError far from the file."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(text_record(0)) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=rf"t\.jsonl:2: expected a JSON object .*got {kind}"):
        read_jsonl(path)


def test_jsonl_that_is_not_utf8_is_named(tmp_path, capsys):
    """Bug: a Latin-1 split gave a bare UnicodeDecodeError with neither file nor line."""
    from kvbench.cli import main

    first = (json.dumps(text_record(0)) + "\n").encode()
    path = tmp_path / "t.jsonl"
    path.write_bytes(first + '{"id": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=rf"t\.jsonl:2: not UTF-8 text \(byte {len(first) + 11} of the file is b'\\xe9'\)"):
        read_jsonl(path)
    assert main(["eval", "--model", "x", "--split", str(path), "--out", str(tmp_path / "run")]) == 2
    assert "t.jsonl:2: not UTF-8" in capsys.readouterr().err


def test_lmms_task_checks_its_split(tmp_path):
    """Bug: write_task read only the first line with json.loads, so ``[1, 2]`` gave an AttributeError."""
    from kvbench.lmms.task import write_task

    bad = tmp_path / "t.jsonl"
    bad.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"t\.jsonl:1: expected a JSON object"):
        write_task(tmp_path / "tasks", bad)


def test_eval_cli_verb(tiny_lm_dir, tmp_path, capsys):
    from kvbench.cli import main

    split = write_split(tmp_path / "test.jsonl", [text_record(0), text_record(1)])
    out = tmp_path / "results" / "runs" / "smoke" / "tiny-qwen2-lm" / "toy" / "full"
    assert main(["eval", "--model", str(tiny_lm_dir), "--split", str(split), "--out", str(out), "--limit", "1"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["n"] == 1 and json.loads((out / "metrics.json").read_text()) == printed
