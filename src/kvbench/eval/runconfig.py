"""``config.yaml`` of a run directory: the run's full resolved configuration, and the checks that repeat it.

Every run directory of ``kvbench eval`` (:mod:`kvbench.eval.runner`, the CONDUIT refresh runs and the
ResidualKV compression runs alike) holds ``config.yaml``, the single record of what its
``predictions.jsonl`` and ``metrics.json`` depend on, as NVIDIA kvpress's evaluation saves its
configuration beside its predictions and metrics (``evaluation/evaluate.py``,
``EvaluationConfig.save_config``). Sections (:data:`SECTIONS`):

- ``format``: :data:`FORMAT`;
- ``run``: the arguments of ``kvbench eval`` as given (:class:`RunArgs`); ``kvbench eval --from DIR``
  repeats the run from this section alone;
- ``cwd``: the working directory relative paths of ``run`` were given in;
- ``model``: the checkpoint the model spec resolved to (directory, transformers class, dtype, attention
  implementation, parameter count, revision when known, SHA-256 of ``config.json`` and of each weight file);
- ``split``: the split file (absolute path, SHA-256, records evaluated);
- ``method``: the evaluation method's resolved hyper-parameters, defaults filled in
  (:meth:`kvbench.eval.methods.EvalMethod.config`);
- ``protocol``: how a record meets the model (decoding, per-record seeds, prefill;
  :meth:`~kvbench.eval.methods.EvalMethod.protocol`);
- ``inputs``: files named by method parameters (a ResidualKV codec) with their SHA-256
  (:meth:`~kvbench.eval.methods.EvalMethod.input_files`);
- ``versions`` and ``git``: the software that made the run.

Nothing here depends on the clock or the host (``run_info.json`` holds those), so a repeated run with the
same code writes the same bytes. The file is written with ``yaml.safe_dump`` and read with
``yaml.safe_load`` only; :func:`read_config` refuses a missing, unknown or mistyped key, naming it.
Light on purpose: no torch at import.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import json
import os
import platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvbench.utils.io import sha256_file, write_text
from kvbench.utils.spec import is_int

CONFIG_FILE = "config.yaml"
FORMAT = "kvbench-run-config/1"
#: Top-level keys of ``config.yaml``, each required.
SECTIONS = ("format", "run", "cwd", "model", "split", "method", "protocol", "inputs", "versions", "git")
#: Keys of ``model``, ``split`` and of one file entry (``model.weights``, ``inputs``), each required.
MODEL_KEYS = ("spec", "checkpoint", "architecture", "dtype", "device", "attn_implementation", "n_params",
              "revision", "config_sha256", "weights", "files")
SPLIT_KEYS = ("path", "bytes", "sha256", "n_records")
FILE_KEYS = ("file", "bytes", "sha256")
#: Files above this size are identified by size only (hashing 15 GB of 7B weights per run costs minutes).
HASH_LIMIT_BYTES = 1 << 30

_VERSIONED = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "pillow", "kvbench")


@dataclass(frozen=True)
class RunArgs:
    """The arguments of one ``kvbench eval`` run (the ``run`` section of ``config.yaml``).

    Parameters:
        model: checkpoint directory or zoo name, as given.
        split: JSONL split file, as given.
        method: method spec, e.g. ``full``, ``conduit@0.1:lam=0.5``, ``residualkv+omnikv:full_layers=0+1,keep=0.2``.
        method_params: the method's parameters (``--method-params``), e.g. ``{"codec_dir": ...}``.
        seed: run seed (:func:`kvbench.eval.runner.record_seed`).
        limit: records evaluated (the first ``limit``; None: all).
        threads: ``torch.set_num_threads``.
        device: torch device the run used (``cpu``, ``cuda``, ``cuda:1``).

    Raises:
        ValueError: a field of the wrong type or range, naming it, the value and what is expected.
    """

    model: str
    split: str
    method: str
    method_params: dict = field(default_factory=dict)
    seed: int = 0
    limit: int | None = None
    threads: int = 1
    device: str = "cpu"

    def __post_init__(self):
        for name in ("model", "split", "method", "device"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"run.{name} must be a non-empty string, got {value!r}")
        if not isinstance(self.method_params, dict) or not all(isinstance(k, str) for k in self.method_params):
            raise ValueError(f"run.method_params must be a mapping of parameter names, got {self.method_params!r}")
        if not is_int(self.seed):
            raise ValueError(f"run.seed must be an integer, got {self.seed!r}")
        if self.limit is not None and (not is_int(self.limit) or self.limit < 0):
            raise ValueError(f"run.limit must be null or an integer >= 0 (records to evaluate), got {self.limit!r}")
        if not is_int(self.threads) or self.threads < 1:
            raise ValueError(f"run.threads must be an integer >= 1, got {self.threads!r}")

    def as_dict(self) -> dict:
        """The fields as a plain dict (the ``run`` section)."""
        return dataclasses.asdict(self)


# --- describing a run -------------------------------------------------------------------------

def sha256(path: str | os.PathLike, limit_bytes: int = HASH_LIMIT_BYTES) -> str | None:
    """Hex SHA-256 of a file, or ``None`` when it is larger than ``limit_bytes`` (real 7B weights).

    Memoised on the file's identity (resolved path, inode, size, mtime in ns): a run's identity and its
    config.yaml both describe the split and the checkpoint's files, and a file rewritten in place gets a new
    mtime, so a changed file is hashed again."""
    st = Path(path).stat()
    if st.st_size > limit_bytes:
        return None
    return _sha256_of(str(Path(path).resolve()), st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _sha256_of(path: str, inode: int, size: int, mtime_ns: int) -> str:
    return sha256_file(path)


def file_entry(path: str | os.PathLike, name: str | None = None) -> dict:
    """``{"file", "bytes", "sha256"}`` of one file (``sha256`` None above :data:`HASH_LIMIT_BYTES`)."""
    path = Path(path)
    return {"file": name or str(path), "bytes": path.stat().st_size, "sha256": sha256(path)}


def versions() -> dict:
    """Python's and the relevant packages' versions (None for one not installed)."""
    out = {"python": platform.python_version()}
    for pkg in _VERSIONED:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def git_revision() -> dict:
    """HEAD commit of the git work tree holding this package, or ``None`` values.

    ``dirty`` is true when files of the package itself (tracked or untracked) differ from that commit.
    """
    here = Path(__file__).resolve().parents[1]  # src/kvbench
    info: dict[str, Any] = {"commit": None, "dirty": None}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(here), *args], capture_output=True, text=True, timeout=10, check=False)

    try:
        head = run("rev-parse", "HEAD")
        if head.returncode == 0:
            info["commit"] = head.stdout.strip()
            status = run("status", "--porcelain", "--", ".")
            info["dirty"] = bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def model_section(spec: str | os.PathLike, checkpoint: Path, model: Any) -> dict:
    """The ``model`` section: what the spec resolved to and the loaded model's class, dtype and size.

    ``revision`` is the Hugging Face hub commit when the checkpoint came from the hub cache
    (``config._commit_hash``, or a ``snapshots/<commit>`` directory), else None (a local or zoo directory:
    its file hashes identify it).
    """
    path = Path(checkpoint).resolve()
    cfg = model.config
    revision = getattr(cfg, "_commit_hash", None) or (path.name if path.parent.name == "snapshots" else None)
    return {
        "spec": str(spec),
        "checkpoint": str(path),
        "architecture": (getattr(cfg, "architectures", None) or [type(model).__name__])[0],
        "dtype": str(model.dtype),
        "device": str(model.device),
        "attn_implementation": getattr(cfg, "_attn_implementation", None),
        "n_params": sum(p.numel() for p in model.parameters()),
        "revision": revision,
        "config_sha256": sha256(path / "config.json"),
        "weights": [file_entry(w, w.name) for w in weight_files(path)],
        # tokenizer, processor, chat template, generation config: they change the prompt ids and the decoding
        "files": [file_entry(f, f.name) for f in other_files(path)],
    }


def weight_files(checkpoint: Path) -> list[Path]:
    """The checkpoint's safetensors weight files, sorted."""
    return sorted(Path(checkpoint).glob("*.safetensors"))


def other_files(checkpoint: Path) -> list[Path]:
    """The checkpoint's files besides ``config.json`` and the weights (top level: tokenizer, processor, chat
    template, generation config), sorted."""
    return sorted(f for f in Path(checkpoint).iterdir() if f.is_file() and f.name != "config.json"
                  and f.suffix not in (".safetensors", ".bin", ".pt", ".pth") and not f.name.startswith("."))


def checkpoint_files(checkpoint: Path) -> list[Path]:
    """Every checkpoint file a run's rows depend on: ``config.json``, the weights and :func:`other_files` (the
    one list behind ``config.yaml``'s ``model`` section and a resumed run's identity)."""
    return [Path(checkpoint) / "config.json", *weight_files(checkpoint), *other_files(checkpoint)]


def plain(obj: Any) -> Any:
    """``obj`` as JSON would read it back (tuples as lists, other objects as strings): what YAML stores."""
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def describe(run: RunArgs, *, split_path: Path, n_records: int, method: dict, protocol: dict,
             input_files: list[Path], model: dict) -> dict:
    """The whole ``config.yaml`` mapping of a run (plain types only; key order is sorted when written)."""
    return plain({
        "format": FORMAT,
        "run": run.as_dict(),
        "cwd": os.getcwd(),
        "model": model,
        "split": {"path": str(Path(split_path).resolve()), "bytes": Path(split_path).stat().st_size,
                  "sha256": sha256(split_path), "n_records": n_records},
        "method": method,
        "protocol": protocol,
        "inputs": [file_entry(p) for p in input_files],
        "versions": versions(),
        "git": git_revision(),
    })


def write_config(run_dir: str | os.PathLike, config: dict) -> Path:
    """Write ``config`` as ``run_dir/config.yaml`` atomically (``yaml.safe_dump``, keys sorted, block style)."""
    head = ("# kvbench run configuration (kvbench.eval.runconfig): the full resolved run.\n"
            "# `kvbench eval --from <this directory> --out <new directory>` repeats it from this file alone.\n")
    body = yaml.safe_dump(config, sort_keys=True, default_flow_style=False, allow_unicode=True, width=100)
    path = Path(run_dir) / CONFIG_FILE
    write_text(path, head + body)
    return path


# --- reading and checking ---------------------------------------------------------------------

def _keys(where: str, value: Any, expected: tuple[str, ...]) -> dict:
    """``value`` as a mapping with exactly the keys ``expected`` (ValueError naming an unknown or missing key)."""
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a mapping with keys {list(expected)}, got {type(value).__name__} "  # noqa: TRY004
                         f"{value!r}")
    unknown = sorted(set(value) - set(expected), key=str)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; expected exactly {list(expected)}")
    missing = [k for k in expected if k not in value]
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}; expected exactly {list(expected)}")
    return value


def _file_list(where: str, value: Any) -> None:
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list of files {{{', '.join(FILE_KEYS)}}}, got {value!r}")  # noqa: TRY004
    for i, entry in enumerate(value):
        e = _keys(f"{where}[{i}]", entry, FILE_KEYS)
        if not isinstance(e["file"], str) or not is_int(e["bytes"]) or not (
                e["sha256"] is None or isinstance(e["sha256"], str)):
            raise ValueError(f"{where}[{i}] must be {{file: str, bytes: int, sha256: str or null}}, got {e!r}")


def validate(config: Any, where: str = CONFIG_FILE) -> RunArgs:
    """Check a loaded ``config.yaml`` mapping; returns its ``run`` section as :class:`RunArgs`.

    Raises:
        ValueError: naming ``where`` and the key: not a mapping, an unknown or missing key at the top level
            or in ``run``/``model``/``split``/a file entry, another ``format``, a value of the wrong type.
    """
    cfg = _keys(where, config, SECTIONS)
    if cfg["format"] != FORMAT:
        raise ValueError(f"{where}: format must be {FORMAT!r}, got {cfg['format']!r}")
    run = _keys(f"{where}: run", cfg["run"], tuple(f.name for f in dataclasses.fields(RunArgs)))
    try:
        args = RunArgs(**run)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if not isinstance(cfg["cwd"], str):
        raise ValueError(f"{where}: cwd must be a directory path, got {cfg['cwd']!r}")  # noqa: TRY004 (one type)
    model = _keys(f"{where}: model", cfg["model"], MODEL_KEYS)
    if not (model["config_sha256"] is None or isinstance(model["config_sha256"], str)):
        raise ValueError(f"{where}: model.config_sha256 must be a hex string or null, got {model['config_sha256']!r}")
    _file_list(f"{where}: model.weights", model["weights"])
    _file_list(f"{where}: model.files", model["files"])
    split = _keys(f"{where}: split", cfg["split"], SPLIT_KEYS)
    if not isinstance(split["path"], str) or not is_int(split["bytes"]) or not is_int(split["n_records"]) \
            or not (split["sha256"] is None or isinstance(split["sha256"], str)):
        raise ValueError(f"{where}: split must be {{path: str, bytes: int, sha256: str or null, n_records: int}}, "
                         f"got {split!r}")
    _file_list(f"{where}: inputs", cfg["inputs"])
    for name in ("method", "protocol", "versions", "git"):
        if not isinstance(cfg[name], dict):
            raise ValueError(f"{where}: {name} must be a mapping, got {cfg[name]!r}")  # noqa: TRY004
    return args


def read_config(run_dir: str | os.PathLike) -> dict:
    """Load and validate ``run_dir/config.yaml`` (``yaml.safe_load`` only).

    Raises:
        FileNotFoundError: no ``config.yaml`` (not a run directory, or one made before kvbench wrote it).
        ValueError: not YAML, or as :func:`validate`.
    """
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a run directory of `kvbench eval`, or one made before "
                                f"runs recorded their {CONFIG_FILE} (rerun it with its original arguments)")
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not readable YAML ({e})") from None
    validate(config, str(path))
    return config


def _missing(what: str, path_as_given: str, config: dict) -> FileNotFoundError:
    here, there = os.getcwd(), config["cwd"]
    hint = (f"; relative paths were recorded in {there}: run `kvbench eval --from` there"
            if not Path(path_as_given).is_absolute() and Path(here).resolve() != Path(there).resolve() else "")
    return FileNotFoundError(f"{what} {path_as_given!r} named by the run's {CONFIG_FILE} does not exist{hint}")


def _check_file(what: str, path: Path, entry: dict) -> None:
    """Compare one file with its recorded entry (SHA-256, or the size where no hash was recorded)."""
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} named by the run's {CONFIG_FILE} does not exist")
    if entry["sha256"] is None:
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise ValueError(f"{what} {path} changed since the run: {size} bytes, recorded {entry['bytes']} "
                             f"(no SHA-256 recorded above {HASH_LIMIT_BYTES} bytes)")
        return
    actual = sha256(path, limit_bytes=1 << 62)
    if actual != entry["sha256"]:
        raise ValueError(f"{what} {path} changed since the run: sha256 {actual}, recorded {entry['sha256']}")


def check_inputs(config: dict) -> None:
    """Check that the files a validated ``config`` names still exist with their recorded hashes, from the
    current directory (before any model work).

    Checked: the split file, the model checkpoint's ``config.json``, weight files and other files (tokenizer,
    processor, chat template, generation config; the spec resolved again,
    :func:`kvbench.models.loader.resolve_spec`), and every file of ``inputs`` (a codec).

    Raises:
        FileNotFoundError: a file is gone (for relative paths, naming the directory they were recorded in).
        ValueError: a file's SHA-256 (or size, above :data:`HASH_LIMIT_BYTES`) differs, naming the file, the
            actual and the recorded value.
    """
    from kvbench.models.loader import CheckpointError, resolve_spec   # imports transformers: this module is light

    run = config["run"]
    split = Path(run["split"])
    if not split.is_file():
        raise _missing("split", run["split"], config)
    _check_file("split", split, config["split"])
    try:
        ckpt = resolve_spec(run["model"])
    except CheckpointError:
        raise _missing("model", run["model"], config) from None
    model = config["model"]
    if model["config_sha256"] is not None:
        _check_file("model file", ckpt / "config.json", {"sha256": model["config_sha256"], "bytes": None})
    for w in model["weights"]:
        _check_file("model file", ckpt / w["file"], w)
    now = [p.name for p in weight_files(ckpt)]
    if now != sorted(w["file"] for w in model["weights"]):
        raise ValueError(f"model {ckpt}: weight files {now}, recorded {[w['file'] for w in model['weights']]}")
    for f in model["files"]:
        if not (ckpt / f["file"]).is_file():
            raise _missing("model file", str(ckpt / f["file"]), config)
        _check_file("model file", ckpt / f["file"], f)
    for f in config["inputs"]:
        if not Path(f["file"]).is_file():
            raise _missing("method input", f["file"], config)
        _check_file("method input", Path(f["file"]), f)


def differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """``key: old -> new`` for every leaf that differs between two mappings (nested ones walked, dotted keys)."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [] if old == new else [f"{prefix.rstrip('.') or '<value>'}: {old!r} -> {new!r}"]
    out = []
    for k in sorted(set(old) | set(new), key=str):
        out += differences(old.get(k, "<absent>"), new.get(k, "<absent>"), f"{prefix}{k}.")
    return out
