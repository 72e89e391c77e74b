"""The GPU Fig. 8 entry point (kvbench.bench.gpu_fig8, run by scripts/gpu_fig8.sh) in its CPU dry-run mode on
tiny shapes, and its budget rule; the GPU plan itself runs only on a lent GPU machine."""
from __future__ import annotations

import pandas as pd
import pytest

from kvbench.bench import decode, gpu_fig8


def test_dry_run_writes_every_method_at_each_context(tmp_path, capsys):
    assert gpu_fig8.main(["--device", "cpu", "--out", str(tmp_path), "--contexts", "160"]) == 0
    out = tmp_path / "fig8_cpu.csv"
    first = out.read_text().splitlines()[0]
    assert first.startswith("# kvbench ResidualKV Fig. 8") and "contexts 160 " in first
    df = pd.read_csv(out, comment="#")
    assert list(df.columns) == decode.COLUMNS
    assert df["method"].tolist() == list(gpu_fig8.METHODS) and (df["context"] == 160).all()
    assert (df["model"] == "timing-qwen2-lm-test").all() and (df["dtype"] == "float32").all()
    assert df["share_of_peak"].isna().all() and (df["achieved_gb_s"] > 0).all()
    assert f"fig8_cpu.csv holds {len(gpu_fig8.METHODS)} rows" in capsys.readouterr().out


def test_budget_skips_contexts_that_would_overrun(tmp_path, capsys):
    assert gpu_fig8.next_fits(10.0, 1000, 2000, 40.0) and not gpu_fig8.next_fits(10.0, 1000, 2000, 39.0)
    gpu_fig8.run("cpu", tmp_path, budget_s=1e-6, contexts=[160, 320])
    assert "skipping contexts [320]" in capsys.readouterr().out
    assert set(pd.read_csv(tmp_path / "fig8_cpu.csv", comment="#")["context"]) == {160}


def test_plans_and_bad_input():
    cuda = gpu_fig8.PLANS["cuda"]
    assert cuda.model == "timing-llama-3.1-8b" and cuda.dtype == "bfloat16" and min(cuda.contexts) == 32768
    assert max(cuda.contexts) == 262144 and "dynamic-cache-sdpa" in cuda.methods and "residualkv-omnikv" in cuda.methods
    with pytest.raises(ValueError, match="device must be cpu, cuda or cuda:<index>, got 'tpu'"):
        gpu_fig8.run("tpu", "x", 10)
    with pytest.raises(ValueError, match="budget_s must be a positive number of seconds, got 0"):
        gpu_fig8.run("cpu", "x", 0)
    with pytest.raises(ValueError, match="got nan"):
        gpu_fig8.run("cpu", "x", float("nan"))
    with pytest.raises(ValueError, match="got 'cpu:0'"):   # `kvbench bench` refuses it too
        gpu_fig8.run("cpu:0", "x", 10)
    with pytest.raises(ValueError, match=r"repeat a length"):
        gpu_fig8.run("cpu", "x", 10, contexts=[512, 512])


def test_cli_bad_input_is_one_line(tmp_path, capsys):
    assert gpu_fig8.main(["--device", "cpu", "--out", str(tmp_path), "--contexts", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu_fig8: error: contexts must be context lengths") and "Traceback" not in err


def test_out_of_memory_ends_the_sweep_and_no_stale_csv_counts(tmp_path, monkeypatch, capsys):
    """A CSV from an earlier run does not make a run that measured nothing look successful."""
    (tmp_path / "fig8_cpu.csv").write_text("# an earlier run\n")

    def oom(*args, **kwargs):
        raise decode.OutOfMemory("context 160, method full: out of memory on cpu")
    monkeypatch.setattr(decode, "measure_decode_throughput", oom)
    assert gpu_fig8.main(["--device", "cpu", "--out", str(tmp_path), "--contexts", "160"]) == 1
    assert "ran out of memory, sweep ended" in capsys.readouterr().out
    assert not (tmp_path / "fig8_cpu.csv").exists()
