"""Load a model + tokenizer/processor from a local checkpoint directory or a zoo name.

One path for everything: a real Hugging Face checkpoint (Qwen2.5-VL-3B, Llama-3.1-8B,
...) and a tiny zoo model are both directories in the ``save_pretrained`` layout,
read with ``local_files_only=True`` (never a download), safetensors only (no
pickle), and ``trust_remote_code`` off unless the caller asks for it.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoConfig, AutoProcessor, AutoTokenizer

from kvbench.models.tiny import ZOO

#: Files that mark a directory as a multimodal checkpoint (processor present).
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class CheckpointError(ValueError):
    """A checkpoint directory is missing, partial or corrupt (message names path and file)."""


def zoo_root() -> Path:
    """Directory holding zoo checkpoints: ``$KVBENCH_ZOO`` or ``./zoo``."""
    return Path(os.environ.get("KVBENCH_ZOO", "zoo"))


def resolve_spec(spec: str | os.PathLike) -> Path:
    """Map a model spec to a checkpoint directory.

    ``spec`` is a directory path, or a zoo name (``tiny-qwen2-lm``, optionally
    written ``zoo:tiny-qwen2-lm``) resolved under :func:`zoo_root`.

    Raises:
        CheckpointError: neither an existing directory nor a built zoo model.
    """
    s = str(spec)
    if s.startswith("zoo:"):
        s = s[4:]
        path = zoo_root() / s
    else:
        path = Path(s)
        if not path.exists() and "/" not in s:
            path = zoo_root() / s
    if not path.is_dir() and "/" not in s:
        # Trained zoo models live in zoo/<profile>/<name>-<recipe hash>/: a bare name resolves when exactly one exists.
        found = sorted(p.parent for p in zoo_root().glob(f"*/{s}-*/config.json"))
        if len(found) > 1:
            raise CheckpointError(f"model {spec!r} names {len(found)} trained zoo checkpoints "
                                  f"({', '.join(map(str, found))}); pass one directory")
        path = found[0] if found else path
    if not path.is_dir():
        hint = (f" (zoo models: {sorted(ZOO)}; `snakemake --cores 2` trains them into zoo/<profile>/<name>-<hash>/)"
                if s in ZOO else "")
        raise CheckpointError(f"model {spec!r}: checkpoint directory {path} does not exist{hint}")
    return path


def _check_safetensors(path: Path) -> None:
    """Read a safetensors header; raise CheckpointError if it is truncated or not JSON."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", raw)
            header = f.read(n)
            if len(header) != n:
                raise CheckpointError(f"{path}: truncated safetensors header")
            meta = json.loads(header)
            end = max((v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__"), default=0)
            f.seek(0, os.SEEK_END)
            if f.tell() < 8 + n + end:
                raise CheckpointError(f"{path}: truncated safetensors data ({f.tell()} bytes, header needs {8 + n + end})")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, struct.error) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from e


def check_checkpoint(path: str | os.PathLike) -> dict:
    """Validate a checkpoint directory before loading; returns its parsed ``config.json``.

    Checks: ``config.json`` exists and parses; weights exist as
    ``model.safetensors`` or a ``model.safetensors.index.json`` whose shards all
    exist; every weight file has an intact safetensors header and full length;
    a tokenizer file exists. Pickle-only checkpoints (``pytorch_model.bin``)
    are refused: loading them would unpickle an untrusted file.

    Raises:
        CheckpointError: naming the directory and the missing or corrupt file.
    """
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{path}: missing config.json (not a Hugging Face checkpoint directory)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: corrupt JSON ({e})") from e
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        shards = [single]
    elif index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: corrupt index ({e})") from e
        shards = [path / n for n in names]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise CheckpointError(f"{path}: missing weight shard(s) {missing} listed in {index.name}")
    elif any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise CheckpointError(
            f"{path}: only pickle weights (*.bin/*.pt) found; kvbench loads safetensors only "
            "(convert with `save_pretrained(..., safe_serialization=True)`)"
        )
    else:
        raise CheckpointError(f"{path}: missing weights (model.safetensors or model.safetensors.index.json)")
    for s in shards:
        _check_safetensors(s)
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise CheckpointError(f"{path}: missing tokenizer (one of {list(_TOKENIZER_FILES)})")
    return cfg


def is_multimodal(path: str | os.PathLike) -> bool:
    """True when the checkpoint directory ships an image processor."""
    return any((Path(path) / f).is_file() for f in _PROCESSOR_FILES)


def load_model(
    spec: str | os.PathLike,
    *,
    trust_remote_code: bool = False,
    dtype: Any = "auto",
    attn_implementation: str = "sdpa",
    device: str = "cpu",
) -> tuple[Any, Any]:
    """Load ``(model, processor_or_tokenizer)`` from a local checkpoint or zoo name.

    Args:
        spec: checkpoint directory, or zoo name (see :func:`resolve_spec`).
        trust_remote_code: allow the checkpoint's own Python code (off by default).
        dtype: torch dtype or ``"auto"`` (the checkpoint's).
        attn_implementation: transformers attention backend (``"sdpa"``, ``"eager"``, ...).
        device: torch device string.

    Returns:
        The model in eval mode (class from ``config.json``'s ``architectures``),
        and an ``AutoProcessor`` for multimodal checkpoints or an
        ``AutoTokenizer`` otherwise.

    Raises:
        CheckpointError: missing, partial or corrupt directory (see :func:`check_checkpoint`).
        ValueError: the architecture is not a transformers class and
            ``trust_remote_code`` is off.
    """
    path = resolve_spec(spec)
    cfg_json = check_checkpoint(path)
    config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    archs = cfg_json.get("architectures") or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None:
        if not trust_remote_code:
            raise ValueError(
                f"{path}: architecture {archs or '(none)'} is not a transformers class; "
                "pass trust_remote_code=True to run the checkpoint's own code"
            )
        cls = transformers.AutoModelForCausalLM
    model = cls.from_pretrained(
        path, config=config, dtype=dtype, local_files_only=True, use_safetensors=True,
        attn_implementation=attn_implementation, trust_remote_code=trust_remote_code,
    ).to(device)
    model.eval()
    loader = AutoProcessor if is_multimodal(path) else AutoTokenizer
    proc = loader.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    return model, proc


def save_checkpoint(model: Any, processor_or_tokenizer: Any, out_dir: str | os.PathLike) -> Path:
    """``save_pretrained`` model and tokenizer/processor into ``out_dir`` atomically.

    Written to a sibling temporary directory first and renamed, so a crash
    never leaves a half-written checkpoint that :func:`check_checkpoint` accepts.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; a checkpoint is read by other users on shared file systems
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        processor_or_tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out_dir
