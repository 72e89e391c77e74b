"""kvbench.utils.jobstats.recorded, the one place `kvbench` and the GPU script's preparation jobs write their
stats line (the CLI's line: tests/test_gpu_paper.py)."""
from __future__ import annotations

import json

import pytest

from kvbench.utils.jobstats import ENV, recorded


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_recorded_writes_the_exit_status_and_null_when_an_exception_escapes(tmp_path, monkeypatch):
    stats = tmp_path / "stats.jsonl"
    monkeypatch.setenv(ENV, str(stats))
    with recorded("ok-verb") as job:
        job["rc"] = 0
    with pytest.raises(RuntimeError), recorded("bad-verb"):
        raise RuntimeError("boom")
    first, second = _lines(stats)
    assert (first["verb"], first["rc"], second["verb"], second["rc"]) == ("ok-verb", 0, "bad-verb", None)
    assert first["wall_s"] >= 0 and first["cuda_max_allocated"] is None  # no CUDA on this machine


def test_nothing_is_written_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    with recorded("verb") as job:
        job["rc"] = 0
    assert list(tmp_path.iterdir()) == []

