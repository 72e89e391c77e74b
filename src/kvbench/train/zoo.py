"""Build and train one tiny zoo model: ``kvbench train --model NAME ...``.

The model is built from its zoo config with the real transformers class
(:mod:`kvbench.models.tiny`), seeded, trained by :func:`kvbench.train.loop.run_phases`
with its recipe (:mod:`kvbench.train.recipes`), and saved with
``save_pretrained`` next to its tokenizer (LM) or processor (VLM), so it loads
through :func:`kvbench.models.load_model` exactly like a real checkpoint.
"""
from __future__ import annotations

import platform
import time
from pathlib import Path

import torch
import transformers

import kvbench
from kvbench.models.loader import save_checkpoint
from kvbench.models.tiny import build_config, build_processor, zoo_spec
from kvbench.models.tokenizer import load_tokenizer_dir
from kvbench.train.batches import PROBE_CLASSES
from kvbench.train.loop import run_phases
from kvbench.train.recipes import RECIPES, apply_overrides
from kvbench.utils.io import write_json


def train_zoo_model(
    name: str, *, tokenizer_dir: str | Path, out_dir: str | Path, workdir: str | Path,
    budget_s: float, seed: int = 0, threads: int = 2, overrides: dict | None = None,
) -> dict:
    """Train zoo model ``name`` and save it; returns the summary also written to ``workdir/summary.json``.

    Args:
        name: a key of :data:`kvbench.models.tiny.ZOO`.
        tokenizer_dir: the zoo tokenizer (``kvbench tokenizer``).
        out_dir: final checkpoint directory (written atomically at the end).
        workdir: resumable state and ``curves.csv``; rerunning after an
            interruption continues from the last saved step.
        budget_s: wall-clock cap in seconds over all resumes (recorded if hit).
        seed: model initialisation and batch seed.
        threads: torch intra-op threads.
        overrides: recipe overrides (:func:`kvbench.train.recipes.apply_overrides`).

    Raises:
        KeyError: unknown zoo name.
        ValueError: bad overrides, a budget <= 0, or a ``workdir`` state of another model or recipe.
        FileNotFoundError: ``tokenizer_dir`` is not a directory.
    """
    if not budget_s > 0:
        raise ValueError(f"budget_s must be a positive number of seconds, got {budget_s!r}")
    spec = zoo_spec(name)
    phases = apply_overrides(RECIPES[spec.kind](), overrides or {})
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    tok = load_tokenizer_dir(tokenizer_dir)
    proc = build_processor(tok) if spec.kind == "vlm" else tok
    config = build_config(name, tok)
    model = getattr(transformers, spec.architecture)(config)
    extra = {}
    if spec.kind == "vlm":
        # Linear head (digit, printed letter, printed page) on the vision tower's merged
        # tokens, used only by the vision_probe phase and discarded afterwards.
        extra["probe"] = torch.nn.Linear(config.vision_config.out_hidden_size, sum(PROBE_CLASSES.values()))
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    result = run_phases(model, proc, phases, workdir, seed=seed, budget_s=budget_s, extra_modules=extra)
    save_checkpoint(model, proc, out_dir)
    summary = {
        "model": name,
        "architecture": spec.architecture,
        "params": sum(p.numel() for p in model.parameters()),
        "seed": seed,
        "threads": threads,
        "budget_s": budget_s,
        "phases": [p.__dict__ | {"mixture": [list(m[:2]) for m in p.mixture]} for p in phases],
        "overrides": overrides or {},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "kvbench": kvbench.__version__, "python": platform.python_version()},
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        **result,
    }
    write_json(workdir / "summary.json", summary)
    return summary
