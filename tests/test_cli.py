"""The `kvbench` CLI: bad input ends in one clear line and exit status 2, not a traceback."""
from __future__ import annotations

import re

import pytest

from kvbench.cli import main


@pytest.mark.parametrize("argv,needle", [
    (["train", "--model", "tiny-qwen2-lm", "--tokenizer", "x", "--out", "o", "--workdir", "w", 
      "--overrides", "not json"], "--overrides must be a JSON object, got 'not json'"),
    (["train", "--model", "tiny-qwen2-lm", "--tokenizer", "x", "--out", "o", "--workdir", "w", 
      "--overrides", "[1, 2]"], "--overrides must be a JSON object"),
    (["train", "--model", "nope", "--tokenizer", "x", "--out", "o", "--workdir", "w"],
     "unknown zoo model 'nope'"),
    (["data", "--task", "nope", "--tokenizer", "x", "--out", "o"], "nope"),
    (["report", "zoo-figure", "--out", "x.png"], "must end in .pdf"),
    (["train", "--model", "tiny-qwen2-lm", "--tokenizer", "x", "--out", "o", "--workdir", "w", "--slice-s", "-5"],
     "slice_s must be a positive number of seconds (or None: no slice), got -5.0"),
    (["train", "--model", "tiny-qwen2-lm", "--tokenizer", "x", "--out", "o", "--workdir", "w",
      "--floors", '{"niah_1k": 1.5}'], "skill floor of 'niah_1k' must be a number in [0, 1], got 1.5"),
    (["train", "--model", "tiny-qwen2-lm", "--tokenizer", "nowhere", "--out", "o", "--workdir", "w"],
     "tokenizer directory 'nowhere' not found"),
    (["data", "--task", "kv_1k", "--tokenizer", "nowhere", "--out", "o"], "tokenizer directory 'nowhere' not found"),
    (["data", "--task", "kv_1k", "--tokenizer", ".", "--out", "o"], "tokenizer directory '.' holds no tokenizer.json"),
    (["report", "conduit/table1", "--spec", "{bad", "--out", "t.csv"], "--spec must be a JSON object"),
    (["report", "conduit/table9", "--spec", "{}", "--out", "t.csv"], "unknown table 'conduit/table9'"),
    (["report", "conduit-table1", "--out", "t.csv"], "unknown report 'conduit-table1'"),
    (["bench", "rkv-throughput", "--out", "x.csv", "--page-px", "1", "--tokens", "5"],
     "--page-px is not read by `bench rkv-throughput` (it is for: conduit-latency); --tokens is not read"),
    (["bench", "codec-cost", "--out", "x.csv", "--contexts", "512"],
     "--contexts is not read by `bench codec-cost` (it is for: rkv-throughput, rkv-variants)"),
])
def test_bad_input_is_one_line_and_exit_2(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and err[0].startswith(f"kvbench {argv[0]}: error:")


def test_eval_negative_limit_is_refused(lm_dir, tmp_path, capsys):
    split = tmp_path / "s.jsonl"
    split.write_text('{"id": "a", "task": "t", "split": "test", "kind": "text", "context": "x", "question": "y",'
                     ' "answer": "z", "max_new_tokens": 1, "metric": "exact_match", "chance": 0.1, "meta": {}}\n')
    assert main(["eval", "--model", str(lm_dir), "--split", str(split), "--out", str(tmp_path / "run"),
                 "--limit", "-1"]) == 2
    assert "limit must be >= 0" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_zero_threads_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "--model", "m", "--split", "s", "--out", "o", "--threads", "0"])
    assert e.value.code == 2 and "expected a positive integer, got 0" in capsys.readouterr().err


def test_data_needs_a_test_record(tokenizer_dir, tmp_path, capsys):
    assert main(["data", "--task", "kv_1k", "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "d"),
                 "--n-test", "0"]) == 2
    assert "n_test >= 1" in capsys.readouterr().err


def test_refresh_method_on_a_text_split_fails_before_loading(tmp_path, capsys):
    from _zoo_fixtures import text_record
    from kvbench.utils.io import write_jsonl

    split = tmp_path / "s.jsonl"
    write_jsonl(split, [text_record(0)])
    # the model path does not exist: the split check must come first
    assert main(["eval", "--model", str(tmp_path / "no-model"), "--split", str(split), "--out", str(tmp_path / "run"),
                 "--method", "conduit@0.1"]) == 2
    assert "cannot be served by 'conduit@0.1': refresh methods need VLM records" in capsys.readouterr().err


def test_method_that_does_not_fit_the_model_is_one_line(lm_dir, tmp_path, capsys):
    """Review finding: a FatalRunError (here filter layer 99 of an 8-layer LM) ended in a traceback, rc 1."""
    from _zoo_fixtures import text_record
    from kvbench.utils.io import write_jsonl

    split = tmp_path / "s.jsonl"
    write_jsonl(split, [text_record(0)])
    assert main(["eval", "--model", str(lm_dir), "--split", str(split), "--out", str(tmp_path / "run"),
                 "--method", "omnikv:filter_layers=99"]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # earlier lines: transformers' weight-loading progress
    assert "Traceback" not in err and last.startswith("kvbench eval: error: method 'omnikv:filter_layers=99' does not fit")
    assert "filter_layers [99]" in last


@pytest.mark.parametrize("params, needle", [
    ('{"codec_dir": "codecs/x"}', "takes no codec, but codec_dir='codecs/x' was given"),
    ('{"audit_requests": -1}', "audit_requests must be an int >= 0, got -1"),
])
def test_compress_method_params_are_checked(params, needle, lm_dir, tmp_path, capsys):
    from _zoo_fixtures import text_record
    from kvbench.utils.io import write_jsonl

    split = tmp_path / "s.jsonl"
    write_jsonl(split, [text_record(0)])
    assert main(["eval", "--model", str(lm_dir), "--split", str(split), "--out", str(tmp_path / "run"),
                 "--method", "fullkv", "--method-params", params]) == 2
    assert needle in capsys.readouterr().err


def test_profiling_figures_name_the_csv_they_need(tmp_path, capsys):
    """Review finding: Fig. 6's CSV given to Fig. 8 ended in `error: 'method'`."""
    fig6 = tmp_path / "fig6.csv"
    fig6.write_text("# header\ncodec,prefill_ms,restore_ms,total_ms\nswiglu+linear,1.0,2.0,3.0\n")
    assert main(["report", "residualkv-fig8", "--raw", str(fig6), "--out", str(tmp_path / "f.pdf")]) == 2
    err = capsys.readouterr().err
    assert ("lacks column(s) ['method', 'context', 'tokens_per_s', 'tps_lo95', 'tps_hi95', 'achieved_gb_s', "
            "'machine_read_gb_s', 'device']") in err
    assert "expected the CSV of `kvbench bench rkv-throughput`" in err
    assert main(["report", "residualkv-fig6", "--raw", str(fig6), "--out", str(tmp_path / "f.pdf")]) == 0
    assert (tmp_path / "f.pdf").stat().st_size > 0
    assert main(["report", "residualkv-fig6", "--raw", str(fig6), "--out", str(tmp_path / "g.pdf"),
                 "--data-out", str(tmp_path / "g.csv")]) == 2
    assert "reads only --raw (the profiling CSV); --data-out is not used" in capsys.readouterr().err


def test_bench_device_and_dtype_are_checked(capsys):
    """Review findings: `--dtype float7` and `--device tpu` ended in tracebacks."""
    import torch

    from kvbench.bench.latency import resolve_device

    for flag, value, needle in [("--dtype", "float7", "invalid choice: 'float7'"),
                                ("--device", "tpu", "expected auto, cpu, cuda or cuda:<index>, got 'tpu'")]:
        with pytest.raises(SystemExit) as e:
            main(["bench", "codec-cost", "--out", "x.csv", flag, value])
        assert e.value.code == 2 and needle in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda' requested, but this machine has no CUDA device"):
            resolve_device("cuda", "auto")
    assert resolve_device("cpu", "auto") == (torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("flag, value, needle", [
    ("--slice-s", "-1", "--slice-s must be a number of seconds >= 0 (0: no slice), got -1.0"),
    ("--lr", "0", "--lr must be > 0, got 0.0"),  # bug: checked only after the (possibly 8B) model had loaded
])
def test_codec_train_flags_are_checked_before_loading(flag, value, needle, tmp_path, capsys):
    assert main(["codec-train", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "c"), "--steps", "2",
                 flag, value]) == 2
    assert needle in capsys.readouterr().err


def test_codec_train_slice_fails_then_a_rerun_finishes(lm_dir, tmp_path, capsys):
    """Issue #11: a slice that ends before --steps saves the state and exits 3 saying how to resume, with no
    codec or summary written; the rerun (no slice: 0) finishes."""
    out = tmp_path / "c"
    argv = ["codec-train", "--model", str(lm_dir), "--out", str(out), "--steps", "2", "--seq-len", "32",
            "--overrides", '{"n_sink": 4, "stride": 5}']
    assert main([*argv, "--slice-s", "1e-9"]) == 3
    err = capsys.readouterr().err
    assert f"training codec {out}: the 1e-09 s wall-clock slice ended after 1 of 2 steps; state saved in" in err
    assert "rerun the same command" in err and "codec c:" not in err  # no tqdm bar (its prefix is "codec c:")
    assert not (out / "summary.json").exists() and not (out / "codec").exists()
    assert main([*argv, "--slice-s", "0"]) == 0
    err = capsys.readouterr().err
    assert "[codec c] step 2/2 (100%)" in err  # StepProgress lines on stderr, no tqdm bar
    assert (out / "summary.json").is_file() and (out / "codec" / "codec.json").is_file()


def test_report_help_lists_the_table_registry(capsys, monkeypatch):
    """`kvbench report -h` names every table of kvbench.report.tables and every figure, from the registry and
    REPORT_FIGURES: the help text itself spells no table name (a hand-written list went stale before)."""
    from kvbench.cli import REPORT_FIGURES, build_parser
    from kvbench.report.tables import TABLES

    report = build_parser()._subparsers._group_actions[0].choices["report"]
    what = next(a for a in report._actions if a.dest == "what")
    assert not any(name in what.help for name in TABLES)
    monkeypatch.setenv("COLUMNS", "10000")  # one line per help text: no name broken at a hyphen
    with pytest.raises(SystemExit):
        main(["report", "-h"])
    text = capsys.readouterr().out
    missing = [n for n in [*TABLES, *REPORT_FIGURES] if not re.search(rf"(?<![\w/]){re.escape(n)}(?![\w/])", text)]
    assert not missing, missing


def test_cli_lists_follow_their_registries():
    """The bench verbs are BENCH_FLAGS' keys and the model dtypes the ones residualkv.train maps (one list each)."""
    from kvbench.bench.settings import BY_VERB
    from kvbench.cli import BENCH_FLAGS, FLOAT_DTYPES, build_parser
    from kvbench.compress.residualkv.train import DTYPES

    assert set(FLOAT_DTYPES) == set(DTYPES) and set(BENCH_FLAGS) == {"conduit-latency", *BY_VERB}
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    assert next(a for a in bench._actions if a.dest == "what").choices == list(BENCH_FLAGS)
