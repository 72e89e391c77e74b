"""Triton kernels of the compressed caches, each with a pure-torch reference of the same signature.

Each kernel ships with its reference, and ``tests/test_kernel_*.py`` compare the two on the CPU under
Triton's interpreter (``TRITON_INTERPRET=1``; ``pytest tests/ -k kernel``). Modules:

- :mod:`.quant`: the torch quantiser (per-token groups, fp16 side information) and the FP8 cast, shared with KIVI,
  ResidualKV and the accounting;
- :mod:`.group_quant`: per-token group quantisation of ResidualKV's residual codes with packed 2/4/8-bit
  levels (``group_quant``, ``group_dequant``; ``pack_levels`` / ``unpack_levels`` for the CPU path);
- :mod:`.reference_mean`: the mean of a token's nearest references (torch), shared with the ResidualKV cache;
- :mod:`.restore_attend`: a sparse layer's decode attention over raw tokens, references and coded tokens,
  restoring the coded ones in registers (ResidualKV §IV-B/C), optionally with V kept latent;
- :mod:`.kivi_attend`: decode attention over a KIVI-quantised layer (ResidualKV's 4-bit full layers);
- :mod:`.flash_decode`: the split online softmax and combine step the two attention kernels share.

Each also has a ``*_bytes`` helper: the bytes a call reads, for the benchmarks' bandwidth columns.

Choosing the implementation: the functions below dispatch on the environment variable ``KVBENCH_KERNELS``:

- ``auto`` (default): the Triton kernel for CUDA tensors when Triton is installed, the torch reference
  otherwise (also on the CPU under the interpreter, which is for tests, not for speed);
- ``torch``: always the torch reference;
- ``triton``: always the kernel; it fails where none can run (:func:`available`).

Wired: a ResidualKV sparse layer's one-token decode step calls :func:`restore_attend` over its stores when
``use_triton`` says so for the device (``ResidualKVLayer._kernel_step``), and a KIVI layer's (KIVI, ResidualKV's
quantised full layers) calls :func:`kivi_attend` over a packed mirror of its codes (``KIVILayer._kernel_step``);
``KVBENCH_KERNELS=torch`` keeps the caches' own torch paths for comparison. Not wired: :func:`group_dequant` (the
torch path dequantises only the selected rows; the restore kernel dequantises inside).
"""
import os

import torch

from kvbench.kernels import _triton
from kvbench.kernels.group_quant import PackedCodes, group_dequant_ref, pack_levels, unpack_levels
from kvbench.kernels.group_quant import group_dequant as _group_dequant_triton
from kvbench.kernels.kivi_attend import KIVILayout, kivi_attend_ref
from kvbench.kernels.kivi_attend import kivi_attend as _kivi_attend_triton
from kvbench.kernels.restore_attend import CodedLayer, linear_decoder, restore_attend_ref
from kvbench.kernels.restore_attend import restore_attend as _restore_attend_triton

__all__ = ["MODES", "CodedLayer", "KIVILayout", "PackedCodes", "available", "describe", "group_dequant", "kivi_attend",
           "linear_decoder", "mode", "pack_levels", "restore_attend", "unpack_levels", "use_triton"]

#: values of ``KVBENCH_KERNELS``
MODES = ("auto", "torch", "triton")


def mode() -> str:
    """``KVBENCH_KERNELS`` (read at every call; default ``auto``).

    Raises ValueError for a value not in :data:`MODES`.
    """
    value = os.environ.get("KVBENCH_KERNELS", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"KVBENCH_KERNELS must be one of {MODES}, got {value!r}")
    return value


def available(device: torch.device | str) -> bool:
    """True when a Triton kernel can run on ``device``: Triton is importable and the device is CUDA, or
    ``TRITON_INTERPRET=1`` is set (kernels then run on the CPU in Triton's interpreter)."""
    return _triton.HAVE_TRITON and (torch.device(device).type == "cuda" or _triton.interpreting())


def use_triton(device: torch.device | str) -> bool:
    """Whether the dispatching functions run the Triton kernel for tensors on ``device`` (module docstring).

    Raises ValueError for a bad ``KVBENCH_KERNELS``, or when it is ``triton`` and no kernel can run there.
    """
    chosen = mode()
    if chosen == "torch":
        return False
    if chosen == "triton":
        if not available(device):
            why = "Triton is not installed" if not _triton.HAVE_TRITON else "set TRITON_INTERPRET=1 to run on the CPU"
            raise ValueError(f"KVBENCH_KERNELS=triton, but no Triton kernel can run on {torch.device(device)} ({why})")
        return True
    return torch.device(device).type == "cuda" and available(device)


def describe(device: torch.device | str) -> str:
    """What the caches' decode steps run on ``device``, for a benchmark's record: ``torch`` (the references),
    ``triton`` or ``triton-interpreter`` (``TRITON_INTERPRET=1``: the kernels on the CPU, for tests, far slower).

    Raises ValueError as :func:`use_triton` (checked before any measurement).
    """
    if not use_triton(device):
        return "torch"
    return "triton-interpreter" if _triton.interpreting() else "triton"


def group_dequant(codes: PackedCodes, rows: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`.group_quant.group_dequant` or its reference (same signature and result)."""
    fn = _group_dequant_triton if use_triton(codes.packed.device) else group_dequant_ref
    return fn(codes, rows)


def restore_attend(q, k_raw, v_raw, layer: CodedLayer, ref_sel=None, code_sel=None, **kw) -> torch.Tensor:
    """:func:`.restore_attend.restore_attend` or its reference (same signature; results within the tolerances
    of ``tests/test_kernel_restore_attend.py``)."""
    fn = _restore_attend_triton if use_triton(q.device) else restore_attend_ref
    return fn(q, k_raw, v_raw, layer, ref_sel, code_sel, **kw)


def kivi_attend(q, layout: KIVILayout, **kw) -> torch.Tensor:
    """:func:`.kivi_attend.kivi_attend` or its reference (same signature)."""
    fn = _kivi_attend_triton if use_triton(q.device) else kivi_attend_ref
    return fn(q, layout, **kw)
