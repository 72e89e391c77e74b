"""Build and train one tiny zoo model: ``kvbench train --model NAME ...``.

The model is built from its zoo config with the real transformers class
(:mod:`kvbench.models.tiny`), seeded, trained by :func:`kvbench.train.loop.run_phases`
with its recipe (:mod:`kvbench.train.recipes`), and saved with
``save_pretrained`` next to its tokenizer (LM) or processor (VLM), so it loads
through :func:`kvbench.models.load_model` exactly like a real checkpoint.
"""
from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError, safe_open

import kvbench
from kvbench.data.tokenizer import load_tokenizer_dir
from kvbench.models.loader import save_checkpoint
from kvbench.models.tiny import build_config, build_processor, seed_replica, zoo_spec
from kvbench.train.batches import PROBE_CLASSES, check_mixtures
from kvbench.train.floors import Scorer, check_floor_values, check_floors, validation_scores
from kvbench.train.loop import run_phases
from kvbench.train.recipes import RECIPES, SHARED_WARMUP, apply_overrides, check_head_layers, warmup_steps
from kvbench.train.state import copy_state
from kvbench.utils.io import write_json
from kvbench.utils.recipe import cpu_kernels


def train_zoo_model(
    name: str, *, tokenizer_dir: str | Path, out_dir: str | Path, workdir: str | Path,
    slice_s: float | None = None, seed: int = 0, threads: int = 2, overrides: dict | None = None,
    floors: dict[str, float] | None = None, val_n: int = 100, feeds: str = "", score: Scorer | None = None,
    max_steps: int | None = None, warm_start: str | Path | None = None,
) -> dict:
    """Train zoo model ``name`` through every step of its recipe, check its floors, save it.

    Nothing final is written until all steps are done and every floor holds:
    ``out_dir`` (the checkpoint, atomically) and then ``workdir/summary.json``
    (deterministic: steps, losses, validation scores, versions; no wall-clock).
    Wall-clock figures go to ``workdir/timing.json``. The validation scores are
    also written to ``workdir/validation.json`` whether or not they pass.

    Args:
        name: a key of :data:`kvbench.models.tiny.ZOO`.
        tokenizer_dir: the zoo tokenizer (``kvbench tokenizer``).
        out_dir: final checkpoint directory (written atomically at the end).
        workdir: resumable state, ``curves.csv``, ``curves.timing.csv``;
            rerunning after an interruption or a slice continues from the last saved step.
        slice_s: optional wall-clock slice of this invocation, in seconds; when it
            ends first, state is saved and :class:`~kvbench.utils.steps.SliceEnded` raised.
        seed: model initialisation, batch and validation seed.
        threads: torch intra-op threads.
        overrides: recipe overrides (:func:`kvbench.train.recipes.apply_overrides`).
        floors: smoke task -> minimum validation score (:mod:`kvbench.train.floors`).
        val_n: validation records per floored task.
        feeds: the targets this model feeds, named when a floor fails.
        score: scores one validation record (:data:`kvbench.train.floors.Scorer`; the CLI passes
            :func:`kvbench.eval.methods.full_cache_score`); required with ``floors``.
        max_steps: steps of this invocation (tests; like a slice).
        warm_start: for a seed replica ``<entry>-s<k>`` of a recipe in :data:`~kvbench.train.recipes.SHARED_WARMUP`,
            the entry's kept warm-up state (``<entry workdir>/warmup``): training starts there, after the shared
            phases, and draws the later phases' batches from ``seed``. An entry of such a recipe keeps that state
            in its own ``workdir/warmup``.

    Raises:
        KeyError: unknown zoo name.
        ValueError: bad overrides, a slice <= 0, ``floors`` without ``score``, a phase's ``head_layers`` outside the
            model's layers, a mixture entry its generator refuses, a ``workdir`` state of another model or recipe,
            or ``warm_start`` for a model that is not a seed replica of a recipe with shared warm-up phases or
            holding the state of another step or recipe.
        BelowFloor: a validation score below its floor (nothing written).
        SliceEnded: the slice ended before the last step (state saved; rerun resumes).
        FileNotFoundError: ``tokenizer_dir`` is not a directory, or ``warm_start`` holds no saved state.
    """
    if slice_s is not None and not slice_s > 0:
        raise ValueError(f"slice_s must be a positive number of seconds (or None: no slice), got {slice_s!r}")
    check_floor_values(floors or {})  # before training, not after it
    if floors and score is None:
        raise ValueError(f"skill floors {sorted(floors)} need a scorer (score=; the CLI passes "
                         "kvbench.eval.methods.full_cache_score)")
    spec = zoo_spec(name)
    phases = apply_overrides(RECIPES[spec.recipe_name](), overrides or {})
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    tok = load_tokenizer_dir(tokenizer_dir)
    proc = build_processor(tok) if spec.kind == "vlm" else tok
    config = build_config(name, tok)
    check_head_layers(phases, config.get_text_config().num_hidden_layers)   # before any step, not at its phase
    check_mixtures(phases, proc)
    model = getattr(transformers, spec.architecture)(config)
    extra = {}
    if spec.kind == "vlm":
        # Linear head (digit, printed letter, printed page) on the vision tower's merged
        # tokens, used only by the vision_probe phase and discarded afterwards.
        extra["probe"] = torch.nn.Linear(config.vision_config.out_hidden_size, sum(PROBE_CLASSES.values()))
    shared = warmup_steps(spec.recipe_name, phases)
    workdir = Path(workdir)
    if warm_start is not None:  # checked before the work directory exists: a refused start leaves nothing behind
        start_from_warmup(name, spec.recipe_name, shared, Path(warm_start), workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    keep_at = shared if seed_replica(name) is None else None
    result = run_phases(model, proc, phases, workdir, seed=seed, slice_s=slice_s, extra_modules=extra,
                        max_steps=max_steps, progress=f"train {name}", keep_at=keep_at)
    scores = {}
    if floors:
        print(f"[train {name}] checking skill floors {floors} on {val_n} validation records per task",
              file=sys.stderr, flush=True)
        scores = validation_scores(model, proc, list(floors), seed=seed, n=val_n, score=score)
        write_json(workdir / "validation.json", {"floors": floors, "n": val_n, "scores": scores})
        check_floors(scores, floors, n=val_n, model_name=name, feeds=feeds)
    save_checkpoint(model, proc, out_dir)
    timing = {"train_time_s": result.pop("train_time_s"), "threads": threads}
    summary = {
        "model": name,
        "architecture": spec.architecture,
        "params": sum(p.numel() for p in model.parameters()),
        "seed": seed,
        "threads": threads,
        "phases": [p.__dict__ | {"mixture": [list(m) for m in p.mixture]} for p in phases],
        "overrides": overrides or {},
        "floors": floors or {},
        "validation": scores,
        "cpu": cpu_kernels(),  # the kernels that trained it (the recipe hash has those of the machine that built the DAG)
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "kvbench": kvbench.__version__, "python": platform.python_version()},
        **result,
    }
    if warm_start is not None:
        summary["warm_start"] = {"steps": shared}  # the first steps are the entry's, drawn from its seed
    write_json(workdir / "timing.json", timing)
    write_json(workdir / "summary.json", summary)
    return summary


def start_from_warmup(name: str, recipe_name: str, shared: int | None, warm_start: Path, workdir: Path) -> None:
    """Seed ``workdir/state`` of seed replica ``name`` with its entry's warm-up state (unless it already holds a
    state: a resumed replica), its wall-clock zeroed so ``timing.json`` holds the replica's own time.

    Every file of the warm-up state is checked before anything is copied (meta.json readable with its step, each
    safetensors header readable), so a bad state never lands in ``workdir``; a replica resumed with another
    ``warm_start`` than the one it started from is refused.

    Raises:
        ValueError: ``name`` is not a seed replica, or its recipe shares no warm-up phases (not in
            :data:`SHARED_WARMUP`, or the overrides dropped the shared phase); the state was saved at another step
            than the shared phases' end, or a file of it is unreadable; ``workdir`` was started from another state.
        FileNotFoundError: ``warm_start`` is not a directory or lacks a file of a saved state.
    """
    if seed_replica(name) is None:
        raise ValueError(f"--warm-start is for a seed replica <entry>-s<k>; {name!r} is not one (a zoo entry trains "
                         "from step 0 and keeps its own warm-up state)")
    if shared is None:
        raise ValueError(f"--warm-start: the recipe {recipe_name!r} of {name!r} shares no warm-up phases with its entry "
                         f"(recipes that do: {SHARED_WARMUP}; an override that drops that phase removes the sharing), "
                         "so the replica trains from step 0 without --warm-start")
    if not warm_start.is_dir():
        raise FileNotFoundError(f"--warm-start {warm_start}: no such directory; the entry keeps its warm-up state in "
                                "<entry workdir>/warmup when it trains")
    missing = [f for f in ("meta.json", "model.safetensors", "optimizer.safetensors", "optimizer.json")
               if not (warm_start / f).is_file()]
    if missing:
        raise FileNotFoundError(f"--warm-start {warm_start} is not a saved training state (missing {missing}); the "
                                "entry keeps it in <entry workdir>/warmup when it trains")
    try:
        step = json.loads((warm_start / "meta.json").read_text())["global_step"]
        for f in sorted(warm_start.glob("*.safetensors")):
            with safe_open(str(f), framework="pt"):
                pass
    except (ValueError, KeyError, TypeError, SafetensorError) as e:
        raise ValueError(f"--warm-start {warm_start}: an unreadable training state ({type(e).__name__}: {e})") from e
    if step != shared:
        raise ValueError(f"--warm-start {warm_start} was saved at step {step}, but {name!r} shares the first "
                         f"{shared} steps of recipe {recipe_name!r} with its entry")
    state, source = workdir / "state" / "meta.json", str(warm_start.resolve())
    if not state.is_file():
        copy_state(warm_start, workdir / "state", train_time_s=0.0, warm_start=source)
        return
    started = json.loads(state.read_text()).get("warm_start")
    if started != source:
        raise ValueError(f"{workdir} holds a replica started from {started}, not from --warm-start {warm_start}; "
                         "use a new --workdir, or delete that one to start over")
