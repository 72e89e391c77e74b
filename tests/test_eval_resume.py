"""kvbench.eval.resume: an interrupted ``run_eval`` resumes to the bytes of an uninterrupted run."""
from __future__ import annotations

import shutil

import csv
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from _zoo_fixtures import text_record, write_split

from kvbench.eval.methods import EvalMethod, FullCache
from kvbench.eval.registry import PLAIN
from kvbench.eval.resume import META, PARTIAL, TIMING_PARTIAL
from kvbench.eval.runner import run_eval
from kvbench.utils.io import AppendLog, read_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")

RESULTS = ("predictions.jsonl", "metrics.json")


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """A 4-record split shared by the module (metrics.json names the split path, so runs compared must share it)."""
    return write_split(tmp_path_factory.mktemp("data") / "test.jsonl", [text_record(i) for i in range(4)])


@pytest.fixture(scope="module")
def reference(lm_dir, split, tmp_path_factory):
    """An uninterrupted ``full`` run over ``split`` (its bytes are what every resume must give)."""
    out = tmp_path_factory.mktemp("ref") / "run"
    run_eval(lm_dir, split, out_dir=out)
    return out


def interrupt_at(monkeypatch, cls, record_id):
    """Make ``cls.predict`` raise KeyboardInterrupt (a Ctrl-C, not a sample error) on ``record_id``;
    returns the list of ids it was called with."""
    calls, predict = [], cls.predict

    def wrapped(self, model, proc, record, base_dir):
        calls.append(record["id"])
        if record["id"] == record_id:
            raise KeyboardInterrupt
        return predict(self, model, proc, record, base_dir)

    monkeypatch.setattr(cls, "predict", wrapped)
    return calls


def interrupted_run(monkeypatch, lm_dir, split, run, at):
    """``run_eval`` into ``run``, interrupted (KeyboardInterrupt) when record ``at`` starts."""
    with monkeypatch.context() as m:
        interrupt_at(m, FullCache, at)
        with pytest.raises(KeyboardInterrupt):
            run_eval(lm_dir, split, out_dir=run)


def assert_same_results(run, ref):
    for name in RESULTS:
        assert (run / name).read_bytes() == (ref / name).read_bytes(), name
    assert not any((run / f).exists() for f in (PARTIAL, META, TIMING_PARTIAL))


def test_interrupted_run_resumes_to_identical_files(lm_dir, split, reference, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    interrupted_run(monkeypatch, lm_dir, split, run, at="t2")
    assert [r["id"] for r in read_jsonl(run / PARTIAL)] == ["t0", "t1"]
    assert not any((run / f).exists() for f in (*RESULTS, "config.yaml", "run_info.json", "timing.csv"))

    calls = interrupt_at(monkeypatch, FullCache, None)
    run_eval(lm_dir, split, out_dir=run)
    assert calls == ["t2", "t3"]  # resumed, not redone
    assert_same_results(run, reference)
    with open(run / "timing.csv", newline="") as f:
        timing = list(csv.DictReader(f))
    assert [t["id"] for t in timing] == ["t0", "t1", "t2", "t3"] and all(float(t["latency_ms"]) > 0 for t in timing)
    err = capsys.readouterr().err
    lines = [line for line in err.split("\n") if "[eval full" in line]  # transformers' own loading bar aside
    assert "resuming" in err and not any("\r" in line for line in lines)
    # both invocations together: one line per record (25% each), none repeated by the resume
    assert [line.split()[5] for line in lines] == ["1/4", "2/4", "3/4", "4/4"]


def test_no_wall_clock_value_in_result_files(reference):
    """Bug: latency_ms sat in predictions.jsonl, so two clean runs never gave identical files."""
    assert all(set(p) == {"id", "prediction", "gold", "score", "chance", "metric", "status", "error"}
               for p in read_jsonl(reference / "predictions.jsonl"))
    assert "latency" not in (reference / "metrics.json").read_text()
    assert (reference / "timing.csv").read_text().startswith("id,latency_ms\nt0,")


def test_truncated_last_line_is_dropped_and_redone(lm_dir, split, reference, tmp_path, monkeypatch):
    run = tmp_path / "run"
    interrupted_run(monkeypatch, lm_dir, split, run, at="t3")
    full = (run / PARTIAL).read_bytes()
    (run / PARTIAL).write_bytes(full[: full.rindex(b"\n", 0, len(full) - 1) + 20])  # a kill in the middle of t2's line
    assert not (run / PARTIAL).read_bytes().endswith(b"\n")
    calls = interrupt_at(monkeypatch, FullCache, None)
    run_eval(lm_dir, split, out_dir=run)
    assert calls == ["t2", "t3"]
    assert_same_results(run, reference)


@pytest.mark.parametrize("change, match", [
    ({"seed": 1}, r"args\.seed: 0 -> 1"),
    ({"limit": 3}, r"args\.limit: None -> 3"),
    ({"method": "fullkv"}, r"args\.method: 'full' -> 'fullkv'"),
    ({"method_params": {"audit_requests": 1}, "method": "fullkv"}, r"args\.method_params\.audit_requests"),
])
def test_resume_with_other_arguments_is_refused(lm_dir, split, tmp_path, monkeypatch, change, match):
    run = tmp_path / "run"
    interrupted_run(monkeypatch, lm_dir, split, run, at="t1")
    before = (run / PARTIAL).read_bytes()
    with pytest.raises(ValueError, match=match) as e:
        run_eval(lm_dir, split, out_dir=run, **change)
    assert f"delete {run / PARTIAL}" in str(e.value) and str(run / META) in str(e.value)
    assert (run / PARTIAL).read_bytes() == before and not (run / "predictions.jsonl").exists()


def test_resume_over_a_changed_split_is_refused(lm_dir, tmp_path, monkeypatch):
    """Snakemake reruns a job whose input changed but keeps hidden work files: their rows must not be reused."""
    split = write_split(tmp_path / "test.jsonl", [text_record(i) for i in range(4)])
    run = tmp_path / "run"
    interrupted_run(monkeypatch, lm_dir, split, run, at="t1")
    write_split(split, [text_record(i, answer=" 0") for i in range(4)])
    with pytest.raises(ValueError, match="split_sha256"):
        run_eval(lm_dir, split, out_dir=run)
    (run / META).unlink()
    with pytest.raises(ValueError, match=f"without its {META}"):
        run_eval(lm_dir, split, out_dir=run)


def test_resume_over_a_changed_tokenizer_is_refused(lm_dir, split, tmp_path, monkeypatch):
    """Review finding: the resume identity held config.json and the weights only, so an interrupted run resumed
    over a changed tokenizer.json mixed rows of both tokenizers; it now holds the files config.yaml records."""
    ckpt = tmp_path / "lm"
    shutil.copytree(lm_dir, ckpt)
    run = tmp_path / "run"
    interrupted_run(monkeypatch, ckpt, split, run, at="t1")
    tok = ckpt / "tokenizer.json"
    tok.write_text(tok.read_text() + " ")
    with pytest.raises(ValueError, match="tokenizer.json"):
        run_eval(ckpt, split, out_dir=run)


@dataclass
class Dice(EvalMethod):
    """A method that draws from torch's global generator (greedy ones do not; this one must still resume)."""

    name: ClassVar[str] = "dice"

    def predict(self, model, proc, record, base_dir):
        return str(torch.randint(0, 10**9, (1,)).item())


def test_random_method_resumes_to_identical_files(lm_dir, split, tmp_path, monkeypatch):
    """Bug: records were seeded once per process, so a resumed record drew other numbers than in one run."""
    monkeypatch.setitem(PLAIN.classes, "dice", Dice)
    run_eval(lm_dir, split, method="dice", out_dir=tmp_path / "ref")
    with monkeypatch.context() as m:
        interrupt_at(m, Dice, "t2")
        with pytest.raises(KeyboardInterrupt):
            run_eval(lm_dir, split, method="dice", out_dir=tmp_path / "run")
    run_eval(lm_dir, split, method="dice", out_dir=tmp_path / "run")
    assert_same_results(tmp_path / "run", tmp_path / "ref")
    assert len({p["prediction"] for p in read_jsonl(tmp_path / "ref" / "predictions.jsonl")}) == 4


def test_compress_audit_of_first_records_survives_a_resume(lm_dir, tmp_path, monkeypatch):
    """Bug: ``audit_requests`` counted predict calls of the process, so a run resumed at record 1 also kept
    OmniKV selections for record 2."""
    from kvbench.eval.compress import CompressMethod

    split = write_split(tmp_path / "test.jsonl", [text_record(i) for i in range(4)])
    spec, params = "omnikv:filter_layers=1,keep=0.5,n_sink=2,window=4", {"audit_requests": 2}
    run_eval(lm_dir, split, method=spec, method_params=params, out_dir=tmp_path / "ref")
    assert ["selections" in p["plan"] for p in read_jsonl(tmp_path / "ref" / "predictions.jsonl")] == [
        True, True, False, False]
    with monkeypatch.context() as m:
        interrupt_at(m, CompressMethod, "t1")
        with pytest.raises(KeyboardInterrupt):
            run_eval(lm_dir, split, method=spec, method_params=params, out_dir=tmp_path / "run")
    run_eval(lm_dir, split, method=spec, method_params=params, out_dir=tmp_path / "run")
    assert_same_results(tmp_path / "run", tmp_path / "ref")


def test_append_log_refuses_a_damaged_middle_line(tmp_path):
    log = AppendLog(tmp_path / "x.partial")
    log.append({"id": "a"})
    log.close()
    (tmp_path / "x.partial").write_bytes(b'{"id": "a"}\n[1, 2]\n{"id": "c"}\n{"id": "d", "tor')
    with pytest.raises(ValueError, match=r"x\.partial:2: damaged line.*delete"):
        log.recover()
    (tmp_path / "x.partial").write_bytes(b'{"id": "a"}\n{"id": "b"}\n{"id": "c", "tor')
    assert log.recover() == [{"id": "a"}, {"id": "b"}]
    assert (tmp_path / "x.partial").read_bytes() == b'{"id": "a"}\n{"id": "b"}\n'


def test_a_finished_run_is_not_overwritten_by_other_arguments(lm_dir, split, tmp_path):
    """Review finding: `kvbench eval` into the directory of a finished run with another spec replaced its results
    silently. Now it is refused, naming what differs; the same arguments rerun as before."""
    run = tmp_path / "run"
    run_eval(lm_dir, split, method="snapkv:keep=0.3", out_dir=run)
    before = {f: (run / f).read_bytes() for f in RESULTS}
    with pytest.raises(ValueError, match=r"holds a finished run made with other arguments \(method: 'snapkv:keep=0.3' -> 'snapkv:keep=0.5'"):
        run_eval(lm_dir, split, method="snapkv:keep=0.5", out_dir=run)
    assert {f: (run / f).read_bytes() for f in RESULTS} == before
    run_eval(lm_dir, split, method="snapkv:keep=0.3", out_dir=run)
    assert {f: (run / f).read_bytes() for f in RESULTS} == before


def test_replay_of_a_compression_run_says_it_is_not_a_refresh_run(lm_dir, split, tmp_path):
    from kvbench.eval.refresh import replay

    run = tmp_path / "run"
    run_eval(lm_dir, split, method="snapkv:keep=0.3", out_dir=run)
    rid = read_jsonl(run / "predictions.jsonl")[0]["id"]
    with pytest.raises(ValueError, match="is not a refresh policy; replay re-executes CONDUIT refresh plans only"):
        replay(run, rid)
    with pytest.raises(FileNotFoundError, match="config.yaml not found: not a run directory of `kvbench eval`"):
        replay(tmp_path / "nowhere", rid)
