"""Resumable training state on disk: safetensors for tensors, JSON for the rest.

Nothing is pickled: model and optimizer tensors go to safetensors files and
scalars (step counters, elapsed time, optimizer hyper-parameters) to JSON, so
a state directory can be inspected and never executes code when loaded.
Each save writes a fresh directory and renames it over the old one, so an
interruption mid-save leaves the previous state intact.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model, save_file, save_model


def save_state(state_dir: str | Path, modules: dict[str, torch.nn.Module], optimizer: torch.optim.Optimizer, meta: dict) -> None:
    """Write ``modules`` (name -> module), the AdamW state and ``meta`` to ``state_dir`` atomically."""
    state_dir = Path(state_dir)
    state_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{state_dir.name}.", dir=state_dir.parent))
    try:
        for name, module in modules.items():
            save_model(module, str(tmp / f"{name}.safetensors"))  # handles tied weights
        sd = optimizer.state_dict()
        tensors = {}
        for idx, st in sd["state"].items():
            for key, val in st.items():
                tensors[f"{idx}.{key}"] = val.detach().clone().contiguous() if torch.is_tensor(val) else torch.tensor(val)
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "optimizer.json").write_text(json.dumps(sd["param_groups"]))
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        _swap_in(tmp, state_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _swap_in(tmp: Path, state_dir: Path) -> None:
    """Rename the finished directory ``tmp`` over ``state_dir``, the old one kept as ``<state_dir>.old`` until the
    new one is in place (:func:`load_state` falls back to it)."""
    old = state_dir.with_name(state_dir.name + ".old")
    if state_dir.exists():
        os.replace(state_dir, old)
    os.replace(tmp, state_dir)
    if old.exists():
        shutil.rmtree(old)


def copy_state(src: str | Path, dst: str | Path, **meta: object) -> None:
    """Copy the state directory ``src`` to ``dst`` atomically (a fresh directory renamed over ``dst``), with the
    keys of ``meta`` replacing those of its ``meta.json``: how an entry keeps its warm-up state and a seed replica
    starts from it (:data:`kvbench.train.recipes.SHARED_WARMUP`).

    Raises:
        FileNotFoundError: ``src`` holds no saved state (no ``meta.json``).
    """
    src, dst = Path(src), Path(dst)
    if not (src / "meta.json").is_file():
        raise FileNotFoundError(f"{src} holds no saved training state (no meta.json)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        for f in src.iterdir():
            shutil.copy2(f, tmp / f.name)
        (tmp / "meta.json").write_text(json.dumps({**json.loads((src / "meta.json").read_text()), **meta}, indent=2))
        _swap_in(tmp, dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def load_state(state_dir: str | Path, modules: dict[str, torch.nn.Module], optimizer: torch.optim.Optimizer) -> dict | None:
    """Restore modules and optimizer from ``state_dir``; returns ``meta`` or ``None`` if absent.

    Falls back to ``<state_dir>.old`` when a crash happened between the two
    renames of :func:`save_state`.

    Raises:
        ValueError: the saved tensors do not match the modules (another model's state).
    """
    state_dir = Path(state_dir)
    if not (state_dir / "meta.json").is_file():
        old = state_dir.with_name(state_dir.name + ".old")
        if not (old / "meta.json").is_file():
            return None
        state_dir = old
    for name, module in modules.items():
        path = str(state_dir / f"{name}.safetensors")
        # Shapes first: a tensor of another shape makes load_model raise a RuntimeError deep in torch instead
        # of naming the state directory (a state of a same-named model of another width).
        own = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                saved = tuple(f.get_slice(key).get_shape())
                if key in own and own[key] != saved:
                    raise ValueError(f"{state_dir}: saved state of {name!r} does not match the model ({key}: saved "
                                     f"shape {list(saved)}, model {list(own[key])})")
        missing, unexpected = load_model(module, path, strict=False)
        if missing or unexpected:
            raise ValueError(f"{state_dir}: saved state of {name!r} does not match the model "
                             f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
    flat = load_file(str(state_dir / "optimizer.safetensors"))
    state: dict[int, dict] = {}
    for key, val in flat.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = val
    groups = json.loads((state_dir / "optimizer.json").read_text())
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return json.loads((state_dir / "meta.json").read_text())
