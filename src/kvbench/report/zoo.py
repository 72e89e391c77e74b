"""The zoo report: model x task scores of finished runs, and the training curves.

- :func:`write_zoo_table`: ``results/<profile>/zoo.csv``, one row per (model,
  task) from each run directory's ``metrics.json`` and the model's training
  ``summary.json``. It holds no wall-clock figure, so two clean runs give the
  same bytes; training times go to ``results/<profile>/zoo.timing.csv``.
- :func:`plot_training_curves`: ``figures/<profile>/zoo_training.pdf``, training
  loss against optimiser steps, one panel per model, phases shaded.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from kvbench.utils.io import atomic_path

#: First line of the zoo table (read it back with ``pd.read_csv(path, comment="#")``).
ZOO_HEADER = "# kvbench {profile} profile: tiny zoo models trained here on bundled data; not the papers' numbers"

ZOO_COLUMNS = ["profile", "model", "checkpoint", "task", "metric", "score", "ci95_lo", "ci95_hi", "chance", "n", "n_error",
               "train_steps", "params"]

#: Columns of the timing file beside the zoo table (wall-clock: differs between runs).
TIMING_COLUMNS = ["model", "train_steps", "train_time_s", "threads"]


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (unfinished run or training?)")
    return json.loads(path.read_text())


def _run_row(run_dir: Path) -> dict:
    """Table fields of one run directory ``results/runs/<profile>/<model>/<task>/<method>/``.

    Model, task and metric come from ``metrics.json``; the path supplies the
    profile (and model/task only where the json lacks them).
    """
    m = _read_json(run_dir / "metrics.json")
    parts = run_dir.resolve().parts
    from_path = dict(zip(("profile", "model", "task", "method"), parts[-4:])) if len(parts) >= 4 else {}
    lo, hi = (m.get("ci95") or [None, None])[:2]
    return {
        "profile": m.get("profile", from_path.get("profile")),
        "model": m.get("model", from_path.get("model")),
        "task": m.get("task", from_path.get("task")),
        "metric": m.get("metric"),
        "score": m.get("score"),
        "ci95_lo": lo,
        "ci95_hi": hi,
        "chance": m.get("chance"),
        "n": m.get("n"),
        "n_error": m.get("n_error"),
    }


def _train_summaries(train_dirs: Iterable[str | os.PathLike]) -> dict[str, dict]:
    """``{model: summary}`` from each training directory's ``summary.json`` (model = basename)."""
    out = {}
    for d in map(Path, train_dirs):
        s = _read_json(d / "summary.json")
        out[s.get("model") or d.name] = s
        out.setdefault(d.name, s)
    return out


def write_zoo_table(run_dirs: Iterable[str | os.PathLike], train_dirs: Iterable[str | os.PathLike],
                    out_csv: str | os.PathLike, timing_csv: str | os.PathLike | None = None) -> pd.DataFrame:
    """Write the zoo table (columns :data:`ZOO_COLUMNS`, first line :data:`ZOO_HEADER`) atomically.

    Args:
        run_dirs: eval run directories (each with ``metrics.json``).
        train_dirs: training work directories ``zoo/<profile>/.train/<model>-<hash>/``
            (each with ``summary.json``: ``model``, ``steps``, ``params``; and
            ``timing.json``: ``train_time_s``). Models without one (real
            checkpoints) get empty training columns.
        out_csv: output path.
        timing_csv: optional path of the timing table (:data:`TIMING_COLUMNS`),
            one row per trained model.

    Returns:
        The table, sorted by model then task.

    Raises:
        FileNotFoundError: a run directory lacks ``metrics.json`` or a training
            directory lacks ``summary.json``.
        ValueError: no run directories, or two runs for the same (model, task).
    """
    rows = [_run_row(Path(d)) for d in run_dirs]
    if not rows:
        raise ValueError("write_zoo_table: no run directories given")
    summaries = _train_summaries(train_dirs)
    seen = set()
    for r in rows:
        key = (r["model"], r["task"])
        if key in seen:
            raise ValueError(f"write_zoo_table: two runs for model {key[0]!r}, task {key[1]!r}")
        seen.add(key)
        s = summaries.get(r["model"], {})
        # metrics.json names the checkpoint directory (zoo/<profile>/<model>-<recipe hash>); the table
        # names the zoo model and keeps the directory, so a row says which recipe it was measured on.
        r.update(model=s.get("model", r["model"]), checkpoint=r["model"], train_steps=s.get("steps"),
                 params=s.get("params"))
    df = pd.DataFrame(rows, columns=ZOO_COLUMNS).sort_values(["model", "task"], ignore_index=True)
    with atomic_path(out_csv) as tmp, open(tmp, "w", encoding="utf-8", newline="") as f:
        f.write(ZOO_HEADER.format(profile="/".join(sorted({str(r["profile"]) for r in rows}))) + "\n")
        df.to_csv(f, index=False)
    if timing_csv is not None:
        timing = []
        for d in map(Path, train_dirs):
            t = json.loads((d / "timing.json").read_text()) if (d / "timing.json").is_file() else {}
            s = _read_json(d / "summary.json")
            timing.append({"model": s.get("model") or d.name, "train_steps": s.get("steps"),
                           "train_time_s": t.get("train_time_s"), "threads": t.get("threads")})
        with atomic_path(timing_csv) as tmp:
            pd.DataFrame(timing, columns=TIMING_COLUMNS).to_csv(tmp, index=False)
    return df


def _phase_spans(curve: pd.DataFrame) -> list[tuple[str, float, float]]:
    """Contiguous ``(phase, first_step, last_step)`` spans of a curve sorted by step."""
    spans: list[tuple[str, float, float]] = []
    for phase, t in zip(curve["phase"].astype(str), curve["step"]):
        if spans and spans[-1][0] == phase:
            spans[-1] = (phase, spans[-1][1], t)
        else:
            start = spans[-1][2] if spans else 0.0
            spans.append((phase, start, t))
    return spans


def plot_training_curves(train_dirs: Iterable[str | os.PathLike], out_pdf: str | os.PathLike) -> Path:
    """Plot training loss against optimiser steps, one panel per model; save a PDF atomically.

    Steps, not wall-clock time: the curve is then a function of the recipe and
    seed alone (wall-clock times are in ``curves.timing.csv``). Reads
    ``curves.csv`` (columns ``step``, ``loss``, ``phase``, ``seq_len``; optional
    ``eval_<task>`` columns, drawn as markers on a right-hand axis) from each
    training directory; the model name is ``summary.json``'s ``model`` when
    present, else the directory name. Curriculum phases are shaded and labelled.

    Raises:
        FileNotFoundError: a directory lacks ``curves.csv``.
        ValueError: no training directories.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    dirs = [Path(d) for d in train_dirs]
    if not dirs:
        raise ValueError("plot_training_curves: no training directories given")
    sns.set_theme(style="whitegrid", context="paper")
    fig, axes = plt.subplots(1, len(dirs), figsize=(4.5 * len(dirs), 3.2), squeeze=False)
    palette = sns.color_palette("pastel")
    for ax, d in zip(axes[0], dirs):
        if not (d / "curves.csv").is_file():
            raise FileNotFoundError(f"{d / 'curves.csv'} not found (training not run?)")
        curve = pd.read_csv(d / "curves.csv").sort_values("step")
        summary = d / "summary.json"
        name = (json.loads(summary.read_text()).get("model") if summary.is_file() else None) or d.name
        phases = list(dict.fromkeys(curve["phase"].astype(str)))
        for phase, t0, t1 in _phase_spans(curve):
            ax.axvspan(t0, t1, color=palette[phases.index(phase) % len(palette)], alpha=0.35, lw=0)
            ax.text((t0 + t1) / 2, 0.98, phase, transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=7)
        ax.plot(curve["step"], curve["loss"], color="C0", lw=1.0, label="train loss")
        ax.set(title=name, xlabel="optimiser step", ylabel="loss (nats/token)")
        evals = [c for c in curve.columns if c.startswith("eval_")]
        if evals:
            ax2 = ax.twinx()
            for i, c in enumerate(evals):
                pts = curve[["step", c]].dropna()
                ax2.plot(pts["step"], pts[c], "o--", ms=3, lw=0.8, color=f"C{i + 1}", label=c[5:])
            ax2.set(ylabel="eval score", ylim=(-0.02, 1.02))
            ax2.grid(False)
            ax2.legend(loc="center right", fontsize=7)
    fig.tight_layout()
    with atomic_path(out_pdf) as tmp:
        fig.savefig(tmp, format="pdf", metadata={"CreationDate": None})  # no timestamp: same bytes on a rerun
    plt.close(fig)
    return Path(out_pdf)
