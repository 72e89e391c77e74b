"""Short content hashes of recipes: trained artefacts are keyed by what determines them.

A zoo model, a tokenizer, a smoke split or a codec lives in a directory named by
its profile and by :func:`recipe_hash` of everything that determines its bytes
(``zoo/<profile>/<model>-<hash>/``), so changing a config writes a new
directory instead of deleting a finished one, and switching back costs nothing.
The recipes of zoo models, the tokenizer and smoke splits also hold :func:`code_version`: a digest of the
``kvbench`` code that makes them and the versions of the libraries it calls, so a code change that can alter the
bytes renames the directory too. Wall-clock settings (slices, scheduler runtimes) are never part of a recipe.
"""
from __future__ import annotations

import ast
import hashlib
import json
import platform
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any


def recipe_hash(recipe: Any, length: int = 8) -> str:
    """First ``length`` hex digits of the SHA-256 of ``recipe`` as canonical JSON (sorted keys).

    Raises:
        TypeError: ``recipe`` holds a value JSON cannot encode.
    """
    text = json.dumps(recipe, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:length]


#: the ``kvbench`` package directory (this file is ``kvbench/utils/recipe.py``)
_PACKAGE = Path(__file__).resolve().parents[1]


def _module_file(name: str) -> Path | None:
    """Source file of ``kvbench`` module ``name`` (a package's ``__init__.py``), or None if there is none."""
    parts = name.split(".")[1:]
    base = _PACKAGE.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imported(name: str, path: Path, tree: ast.Module) -> set[str]:
    """``kvbench`` modules that module ``name`` imports anywhere in its body (function-local imports included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    out = set()
    for mod in found:
        if mod.split(".")[0] != "kvbench":
            continue
        while mod and _module_file(mod) is None:
            mod = mod.rpartition(".")[0]
        parts = mod.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))  # a submodule runs its packages' __init__
    return out


def _without_docstrings(tree: ast.Module) -> ast.Module:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                node.body = node.body[1:] or [ast.Pass()]
    return tree


@cache
def source_modules(root: str) -> dict[str, str]:
    """The code a ``kvbench`` module runs: ``root`` and every ``kvbench`` module it imports, transitively.

    Imports are found statically (function-local ones included; a submodule brings its packages' ``__init__``).
    Each module is its syntax tree with docstrings dropped, written back by :func:`ast.unparse`, so a comment,
    docstring or formatting change keeps it and any change to what runs alters it.

    Returns:
        module name -> normalised source, for every module reached.

    Raises:
        ValueError: ``root`` is not a ``kvbench`` module with a source file.
    """
    if _module_file(root) is None:
        raise ValueError(f"no kvbench module named {root!r} (expected a dotted name such as 'kvbench.train.zoo')")
    seen: dict[str, str] = {}
    todo = [root]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = _module_file(name)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        todo.extend(_imported(name, path, tree) - set(seen))
        seen[name] = ast.unparse(_without_docstrings(tree))
    return seen


def source_digest(root: str, length: int = 16) -> str:
    """First ``length`` hex digits of the SHA-256 over :func:`source_modules` of ``root`` (names and normalised
    sources, sorted by name): part of the recipe of every trained or generated artefact (:func:`code_version`), so
    that the recipe hash pins the bytes, not only the config (issue #33, item 3).

    Raises:
        ValueError: ``root`` is not a ``kvbench`` module with a source file.
    """
    h = hashlib.sha256()
    modules = source_modules(root)
    for name in sorted(modules):
        h.update(f"{name}\n{modules[name]}\n".encode("utf-8"))
    return h.hexdigest()[:length]


#: installed libraries whose versions can change the bytes of a trained or generated artefact: the model classes
#: and kernels, the tokenizer trainer, the digit scans (scikit-learn's bundled set) and the image and array code
ARTEFACT_LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "scikit-learn", "scikit-image",
                      "pillow")


#: CPU features (``/proc/cpuinfo`` flags) that select other floating-point kernels in torch (ATen's vectorised ops),
#: MKL or oneDNN: x86 vector and matrix extensions, and their Arm counterparts
KERNEL_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16",
                    "asimd", "sve", "sve2", "bf16", "i8mm")


@cache
def cpu_kernels() -> dict:
    """Which float kernels this machine's torch runs: ATen's vector instruction set
    (``torch.backends.cpu.get_cpu_capability()``, which the ``ATEN_CPU_CAPABILITY`` environment variable lowers),
    the architecture, the CPU vendor and which of :data:`KERNEL_CPU_FLAGS` it has (Linux ``/proc/cpuinfo``; none
    elsewhere). Part of :func:`code_version`: the same code and libraries trained the strong zoo VLM to other bytes on
    an AVX2 and an AVX-512 machine, and ``ATEN_CPU_CAPABILITY=avx2`` alone changes the weights within 20 steps
    (docs/decisions/workflow.md, "Recipe-hashed directories")."""
    import torch

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    fields = dict(line.split(":", 1) for line in info.split("\n\n")[0].splitlines() if ":" in line)  # CPU 0
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return {"aten": torch.backends.cpu.get_cpu_capability(), "machine": platform.machine(),
            "vendor": fields.get("vendor_id") or fields.get("CPU implementer") or "",
            "flags": [f for f in KERNEL_CPU_FLAGS if f in flags]}


def code_version(root: str) -> dict:
    """What code makes an artefact whose entry module is ``root``: its :func:`source_digest`, the Python version
    (the standard library is the zoo's text corpus), the versions of :data:`ARTEFACT_LIBRARIES` and the CPU's kernel
    selection (:func:`cpu_kernels`).

    Raises:
        ValueError: ``root`` is not a ``kvbench`` module.
        importlib.metadata.PackageNotFoundError: a library is not installed.
    """
    return {"sources": source_digest(root), "python": platform.python_version(),
            **{lib: metadata.version(lib) for lib in ARTEFACT_LIBRARIES}, "cpu": cpu_kernels()}
