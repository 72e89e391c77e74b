"""kvbench.report.zoo: the zoo table and the training-curve figure, from fake run and training dirs."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from kvbench.report.zoo import ZOO_COLUMNS, ZOO_HEADER, plot_training_curves, write_zoo_table


def _run(root: Path, model: str, task: str, score: float, ci: list[float], n: int, n_error: int = 0) -> Path:
    d = root / "results" / "runs" / "smoke" / model / task / "full"
    d.mkdir(parents=True)
    metric = "edit_sim" if task == "lcc" else "exact_match"
    (d / "metrics.json").write_text(json.dumps({
        "score": score, "ci95": ci, "ci95_method": "wilson", "n": n, "n_ok": n - n_error, "n_error": n_error,
        "chance": 0.1, "task": task, "method": "full", "model": f"{model}-0123abcd", "metric": metric}))
    return d  # metrics.json names the checkpoint directory, zoo/<profile>/<model>-<recipe hash>, as the runner does


def _train(root: Path, model: str, time_s: float, steps: int, params: int, evals: bool = False) -> Path:
    d = root / "zoo" / "smoke" / ".train" / f"{model}-0123abcd"
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({"model": model, "steps": steps, "params": params}))
    (d / "timing.json").write_text(json.dumps({"train_time_s": time_s, "threads": 2}))
    rows = []
    for step in range(40):
        row = {"step": step, "loss": 8.0 / (1 + step), "phase": "copy" if step < 20 else "retrieval",
               "seq_len": 256 if step < 20 else 512}
        if evals:
            row["eval_niah_1k"] = (step / 40) if step % 10 == 9 else None
        rows.append(row)
    pd.DataFrame(rows).to_csv(d / "curves.csv", index=False)
    return d


def test_zoo_table_round_trips(tmp_path):
    runs = [_run(tmp_path, "tiny-qwen2-lm", "niah_1k", 0.123456789, [0.05, 0.2345678901234], 200, 1),
            _run(tmp_path, "tiny-qwen2-lm", "lcc", 0.4, [0.35, 0.45], 50),
            _run(tmp_path, "tiny-qwen2.5-vl", "docpages", 1 / 3, [0.2, 0.5], 30)]
    trains = [_train(tmp_path, "tiny-qwen2-lm", 1234.5, 1500, 1_600_000),
              _train(tmp_path, "tiny-qwen2.5-vl", 99.25, 80, 1_767_872)]
    out = tmp_path / "results" / "smoke" / "zoo.csv"
    write_zoo_table(runs, trains, out, timing_csv=tmp_path / "zoo.timing.csv")
    assert out.read_text().splitlines()[0] == ZOO_HEADER.format(profile="smoke")
    assert "time" not in out.read_text()  # wall-clock lives in the timing file only
    timing = pd.read_csv(tmp_path / "zoo.timing.csv").set_index("model")
    assert timing.loc["tiny-qwen2-lm", "train_time_s"] == 1234.5 and timing.loc["tiny-qwen2.5-vl", "train_steps"] == 80
    df = pd.read_csv(out, comment="#")
    assert list(df.columns) == ZOO_COLUMNS
    assert list(zip(df["model"], df["task"])) == [
        ("tiny-qwen2-lm", "lcc"), ("tiny-qwen2-lm", "niah_1k"), ("tiny-qwen2.5-vl", "docpages")]
    r = df.set_index(["model", "task"]).loc[("tiny-qwen2-lm", "niah_1k")]
    assert r["profile"] == "smoke" and r["metric"] == "exact_match"
    assert r["score"] == 0.123456789 and r["ci95_lo"] == 0.05 and r["ci95_hi"] == 0.2345678901234
    assert (r["n"], r["n_error"], r["chance"]) == (200, 1, 0.1)
    assert (r["train_steps"], r["params"]) == (1500, 1_600_000)
    assert r["checkpoint"] == "tiny-qwen2-lm-0123abcd"  # regression: the model column showed the hashed directory
    vl = df.set_index(["model", "task"]).loc[("tiny-qwen2.5-vl", "docpages")]
    assert vl["score"] == 1 / 3 and vl["train_steps"] == 80


def test_zoo_table_errors(tmp_path):
    run = _run(tmp_path, "tiny-qwen2-lm", "niah_1k", 0.5, [0.4, 0.6], 10)
    with pytest.raises(ValueError, match="two runs"):
        write_zoo_table([run, run], [], tmp_path / "z.csv")
    with pytest.raises(FileNotFoundError, match="metrics.json"):
        write_zoo_table([tmp_path / "nowhere"], [], tmp_path / "z.csv")
    # a model without a training dir (a real checkpoint) gets empty training columns
    write_zoo_table([run], [], tmp_path / "z.csv")
    assert pd.read_csv(tmp_path / "z.csv", comment="#")["train_steps"].isna().all()


def test_training_figure_written(tmp_path):
    trains = [_train(tmp_path, "tiny-qwen2-lm", 120.0, 40, 1_600_000, evals=True),
              _train(tmp_path, "tiny-qwen2.5-vl", 120.0, 40, 1_767_872)]
    out = tmp_path / "figures" / "smoke" / "zoo_training.pdf"
    plot_training_curves(trains, out)
    data = out.read_bytes()
    assert data.startswith(b"%PDF") and len(data) > 1000
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp files left
    with pytest.raises(FileNotFoundError, match="curves.csv"):
        plot_training_curves([tmp_path / "missing"], tmp_path / "x.pdf")


def test_report_cli_verbs(tmp_path):
    from kvbench.cli import main

    run = _run(tmp_path, "tiny-qwen2-lm", "niah_1k", 0.5, [0.4, 0.6], 10)
    train = _train(tmp_path, "tiny-qwen2-lm", 10.0, 40, 1_600_000)
    assert main(["report", "zoo", "--runs", str(run), "--train", str(train), "--out", str(tmp_path / "z.csv")]) == 0
    assert pd.read_csv(tmp_path / "z.csv", comment="#")["train_steps"].tolist() == [40]
    assert main(["report", "zoo-figure", "--train", str(train), "--out", str(tmp_path / "f.pdf")]) == 0
    assert (tmp_path / "f.pdf").stat().st_size > 1000
