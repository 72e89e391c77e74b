"""The resumable CPU training loop shared by every zoo model.

Loss: cross-entropy on label tokens, normalised per sequence and averaged over
the batch (an earlier trial found that otherwise long copy spans swamp the
few retrieval answers; docs/log.md, "2026-11 One-thread LM trial"). AdamW, gradient
clipping at 1.0, per-phase warm-up + cosine schedule computed from the step (no
scheduler state to save).
State is saved every ``save_every_s`` seconds, at phase ends, on SIGTERM/SIGINT
and when an invocation's wall-clock slice ends; a rerun resumes from it and
reaches the same weights (``tests/test_train.py``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import signal
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F

from kvbench.models.prompting import IGNORE_INDEX
from kvbench.train.batches import BATCHES, PROBE_CLASSES, step_rng
from kvbench.train.heads import head_supervision_loss, skip_supervision_loss, supervise_heads
from kvbench.train.readthrough import hide_prompt
from kvbench.train.recipes import Phase, phase_fields
from kvbench.train.state import copy_state, load_state, save_state
from kvbench.utils.io import atomic_path
from kvbench.utils.steps import SliceEnded, StepProgress


def lr_at(phase: Phase, step: int) -> float:
    """Learning rate of ``phase`` at ``step`` (0-based): linear warm-up, then cosine to 10% (or constant)."""
    if step < phase.warmup:
        return phase.lr * (step + 1) / phase.warmup
    if not phase.decay:
        return phase.lr
    t = (step - phase.warmup) / max(1, phase.steps - phase.warmup)
    return phase.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def sequence_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Per-sequence-normalised next-token CE and answer-token accuracy.

    Args:
        logits: float ``[B, T, V]``.
        labels: int64 ``[B, T]``, ``-100`` where no loss applies; the label at
            position t is token t (the shift happens here).
    """
    lg, lb = logits[:, :-1].float(), labels[:, 1:]
    mask = lb != IGNORE_INDEX
    ce = F.cross_entropy(lg.transpose(1, 2), lb.clamp(min=0), reduction="none") * mask
    per_seq = ce.sum(1) / mask.sum(1).clamp(min=1)
    has = mask.any(1)
    loss = per_seq[has].mean() if has.any() else ce.sum() * 0
    acc = ((lg.argmax(-1) == lb) & mask).sum().item() / max(1, mask.sum().item())
    return loss, acc


def head_loss(model: Any, hidden: torch.Tensor, targets: torch.Tensor,
              output_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """Per-sequence-normalised CE of the LM head at the positions that have a target.

    Args:
        model: its output embeddings are the LM head.
        hidden: float ``[B, T, d]``, final hidden states.
        targets: int64 ``[B, T]``, the token predicted *from* each position
            (no shift here), ``-100`` where no loss applies.
        output_ids: optional int64 ``[V']``: the softmax runs over these vocabulary
            rows only, and ``targets`` index into them (``Phase.restrict_softmax``).

    Returns:
        (loss, accuracy at the targeted positions); loss 0 (with a graph) if none.
    """
    mask = targets != IGNORE_INDEX
    if not mask.any():
        return hidden.sum() * 0, 0.0
    head = model.get_output_embeddings()
    weight = head.weight if output_ids is None else head.weight[output_ids]
    bias = head.bias if output_ids is None or head.bias is None else head.bias[output_ids]
    logits = F.linear(hidden[mask], weight, bias).float()
    target = targets[mask]
    ce = F.cross_entropy(logits, target, reduction="none")
    rows = mask.nonzero()[:, 0]
    per_seq = torch.zeros(targets.shape[0], dtype=ce.dtype, device=ce.device).index_add(0, rows, ce) / mask.sum(1).clamp(min=1)
    loss = per_seq[mask.any(1)].mean()
    acc = (logits.argmax(-1) == target).float().mean().item()
    return loss, acc


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    """Next-token labels (token t+1 is predicted from position t) as per-position targets."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def task_loss(model: Any, batch: dict, labels: torch.Tensor, phase: Phase,
              output_ids: torch.Tensor | None = None,
              cell_labels: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """One LM-phase loss: answer tokens, plus the phase's auxiliary terms.

    The LM head is applied only where a target applies (:func:`head_loss`): task
    batches label a few answer tokens per sequence, so projecting every position
    onto the 4,096-token vocabulary would be most of a step's memory traffic; the
    answer term equals :func:`sequence_loss` on full logits (``tests/test_train.py``).

    ``loss = CE(answers) + phase.head_supervision * attention term
    + phase.skip_supervision * skip-head attention term + phase.cell_reading * CE(cell_labels)`` (:mod:`kvbench.train.heads`,
    :func:`kvbench.train.batches.cell_reading_labels`). The accuracy is the
    answer tokens'.

    Raises:
        ValueError: ``phase.cell_reading`` is set but the batch has no ``cell_labels``.
    """
    if phase.head_supervision and phase.hide_prompt:
        raise ValueError(f"phase {phase.name!r}: head_supervision (text models) and hide_prompt (VLMs) "
                         "cannot be combined")
    if phase.cell_reading and cell_labels is None:
        raise ValueError(f"phase {phase.name!r}: cell_reading needs cell_labels in the batch "
                         "(VLM grid records only)")
    hide = batch.pop("hide_block", None)
    with contextlib.ExitStack() as stack:
        if phase.head_supervision:
            stack.enter_context(supervise_heads(model, skip=bool(phase.skip_supervision), layers=phase.head_layers))
        if hide is not None:
            stack.enter_context(hide_prompt(model, hide, batch.get("attention_mask")))
        hidden = model.model(**batch).last_hidden_state
        loss, acc = head_loss(model, hidden, _shifted(labels), output_ids)
        if phase.head_supervision:
            loss = loss + phase.head_supervision * head_supervision_loss(batch["input_ids"], batch["attention_mask"])
        if phase.skip_supervision:
            loss = loss + phase.skip_supervision * skip_supervision_loss(batch["input_ids"], batch["attention_mask"])
    if phase.cell_reading:
        loss = loss + phase.cell_reading * head_loss(model, hidden, cell_labels)[0]
    return loss, acc


class StopOnSignal:
    """Context manager that turns SIGTERM/SIGINT into a flag (``requested``) a training loop checks, so
    state is saved before exit (the loop then raises :class:`Interrupted`); the previous handlers are
    restored on exit."""

    def __init__(self) -> None:
        self.requested = False
        self._old = {}

    def __enter__(self) -> StopOnSignal:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


class Interrupted(RuntimeError):
    """Training stopped by a signal after saving its state; rerun to resume."""


def probe_loss(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, float]:
    """Summed cross-entropy of the vision probe's three heads; accuracy of the digit head.

    ``logits``: float ``[n_tokens, sum(PROBE_CLASSES)]`` laid out as
    :data:`kvbench.train.batches.PROBE_CLASSES` (digit, letter, page).
    """
    parts = torch.split(logits, list(PROBE_CLASSES.values()), dim=-1)
    loss = sum(F.cross_entropy(p, batch[f"{k}_labels"]) for p, k in zip(parts, PROBE_CLASSES))
    acc = (parts[0].argmax(-1) == batch["digit_labels"]).float().mean().item()
    return loss, acc


def hold_identity_layers(model: Any, layers: tuple, zero: bool) -> None:
    """Make decoder ``layers`` of ``model`` identity blocks (:attr:`Phase.identity_layers`) and release the others.

    With ``zero`` the attention ``o_proj`` and MLP ``down_proj`` weights (and biases) of ``layers`` are set to 0;
    every parameter of those layers stops receiving gradients (AdamW skips parameters without one, weight decay
    included), and every parameter of the other decoder layers receives them again.
    """
    decoder = model.model.language_model if hasattr(model.model, "language_model") else model.model
    for i, layer in enumerate(decoder.layers):
        held = i in layers
        if held and zero:
            with torch.no_grad():
                for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
                    lin.weight.zero_()
                    if lin.bias is not None:
                        lin.bias.zero_()
        for p in layer.parameters():
            p.requires_grad_(not held)


def run_phases(
    model: Any, proc: Any, phases: list[Phase], workdir: str | Path, *, seed: int,
    slice_s: float | None = None, extra_modules: dict[str, torch.nn.Module] | None = None,
    save_every_s: float = 60.0, log_every: int = 5, max_steps: int | None = None,
    progress: str | None = None, keep_at: int | None = None,
) -> dict:
    """Train ``model`` through every step of ``phases``, resuming from ``workdir/state`` if present.

    Work is counted in optimiser steps: the returned model has done all
    ``sum(p.steps)`` steps, whatever the wall-clock. ``slice_s`` (seconds of
    this invocation) and ``max_steps`` (steps of this invocation, for tests)
    only end the *invocation*: state is saved and :class:`SliceEnded` raised,
    and a rerun resumes to the same weights as an unsliced run (batches come
    from :func:`step_rng`, the schedule from the step, AdamW state is saved).

    Writes ``workdir/curves.csv`` (step, phase, seq_len, lr, loss, acc: no
    wall-clock, so two runs give identical bytes) and ``workdir/curves.timing.csv``
    (step, wall_s). ``progress``: label of the console progress lines
    (:class:`~kvbench.utils.steps.StepProgress`, every 5%); ``None`` prints none.
    ``keep_at``: a global step at a phase end; the state saved there is also kept as ``workdir/warmup``, the
    warm-up state seed replicas start from (:data:`kvbench.train.recipes.SHARED_WARMUP`). A state is always saved
    at a phase end, also when a slice or a signal ends the invocation there.

    Returns:
        dict with ``steps`` (= ``total_steps``), ``total_steps``, ``train_time_s``
        (summed over resumes; wall-clock, for timing files only), ``last_loss``
        and ``last_acc`` (of the last step ever done, also after a no-op resume).

    Raises:
        SliceEnded: the slice or ``max_steps`` ended this invocation first (state saved).
        Interrupted: SIGTERM/SIGINT arrived (state saved first).
        ValueError: ``workdir`` holds the state of another recipe (changed phases or overrides).
    """
    workdir = Path(workdir)
    extra = extra_modules or {}
    modules = {"model": model, **extra}
    params = [p for m in modules.values() for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=phases[0].lr, betas=(0.9, 0.98), weight_decay=0.01)
    recipe = json.loads(json.dumps([dataclasses.asdict(p) for p in phases]))  # tuples -> lists, as saved
    meta = load_state(workdir / "state", modules, opt) or {"global_step": 0, "train_time_s": 0.0, "recipe": recipe}
    # compared without later fields at their old value: a state saved before a field was added still resumes
    if [phase_fields(p) for p in meta.get("recipe", recipe)] != [phase_fields(p) for p in recipe]:
        changed = sorted({p["name"] for p in recipe if p not in meta["recipe"]}
                         | {p["name"] for p in meta["recipe"] if p not in recipe})
        raise ValueError(f"{workdir / 'state'} was trained with another recipe (phases differing: {changed}); "
                         "resuming would mix the two. Use a new --workdir, or delete that one to start over")
    curves_path, timing_path = workdir / "curves.csv", workdir / "curves.timing.csv"
    rows, times = [], []
    if meta["global_step"] and curves_path.exists():
        rows = pd.read_csv(curves_path).query(f"step < {meta['global_step']}").to_dict("records")
        if timing_path.exists():
            times = pd.read_csv(timing_path).query(f"step < {meta['global_step']}").to_dict("records")
    done, elapsed0 = meta["global_step"], meta["train_time_s"]
    total = sum(p.steps for p in phases)
    t0 = time.monotonic()
    last_save = t0
    last = meta.get("last", {"loss": float("nan"), "acc": float("nan")})
    bar = StepProgress(progress or "train", total, done) if progress else None

    def save() -> None:
        m = {**meta, "global_step": g, "train_time_s": elapsed0 + time.monotonic() - t0, "recipe": recipe,
             "last": last}  # other keys of a loaded state (a replica's warm_start) are kept
        save_state(workdir / "state", modules, opt, m)
        if g == keep_at:
            copy_state(workdir / "state", workdir / "warmup")
        with atomic_path(curves_path) as tmp:
            pd.DataFrame(rows).to_csv(tmp, index=False)
        with atomic_path(timing_path) as tmp:
            pd.DataFrame(times).to_csv(tmp, index=False)

    if keep_at is not None and done == keep_at and not (workdir / "warmup" / "meta.json").is_file():
        copy_state(workdir / "state", workdir / "warmup")  # a stop between the phase end's save and its copy
    model.train()
    g = 0
    with StopOnSignal() as stop:
        for phase in phases:
            if phase.freeze_vision:  # also on resume, before any skipped step
                for p in model.model.visual.parameters():
                    p.requires_grad_(False)
            # also on resume, before any skipped step; zeroed only in a phase not yet finished
            hold_identity_layers(model, phase.identity_layers, zero=g + phase.steps > done)
            for s in range(phase.steps):
                if g < done:
                    g += 1
                    continue
                for group in opt.param_groups:
                    group["lr"] = lr_at(phase, s)
                batch = BATCHES[phase.kind](step_rng(seed, phase.name, s), phase, proc)
                if phase.kind == "vision_probe":
                    feats = model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output
                    logits = extra["probe"](torch.cat(list(feats)))
                    loss, acc = probe_loss(logits, batch)
                else:
                    labels = batch.pop("labels")
                    output_ids = batch.pop("output_ids", None)
                    cell_labels = batch.pop("cell_labels", None)
                    loss, acc = task_loss(model, batch, labels, phase, output_ids, cell_labels)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_([p for p in params if p.requires_grad], 1.0)
                opt.step()
                g += 1
                last = {"loss": loss.item(), "acc": acc}
                wall = elapsed0 + time.monotonic() - t0
                if bar:
                    bar.update(g, phase=phase.name, loss=last["loss"], acc=acc)
                if s % log_every == 0 or s == phase.steps - 1:
                    rows.append({"step": g - 1, "phase": phase.name, "seq_len": phase.seq_len,
                                 "lr": opt.param_groups[0]["lr"], "loss": last["loss"], "acc": acc})
                    times.append({"step": g - 1, "wall_s": round(wall, 2)})
                if stop.requested:
                    save()
                    raise Interrupted(f"training interrupted at step {g}; state saved in {workdir / 'state'}")
                this_call = time.monotonic() - t0
                if g < total and ((slice_s is not None and this_call >= slice_s)
                                  or (max_steps is not None and g - done >= max_steps)):
                    save()
                    raise SliceEnded(f"training {workdir.name}", g, total, str(workdir / "state"),
                                     slice_s if slice_s is not None and this_call >= slice_s else this_call)
                if time.monotonic() - last_save >= save_every_s or s == phase.steps - 1:
                    save()
                    last_save = time.monotonic()
    if g > done or not (workdir / "state" / "meta.json").is_file():
        save()
    model.eval()
    return {"steps": g, "total_steps": total, "train_time_s": round(elapsed0 + time.monotonic() - t0, 1),
            "last_loss": last["loss"], "last_acc": last["acc"]}
