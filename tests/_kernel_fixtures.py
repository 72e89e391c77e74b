"""Shared by the kernel tests: where kernels run, the interpreter switch, and the error record.

Without a GPU every Triton kernel runs in Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, set per
test: ``kvbench.kernels`` decorates kernels at first launch, so the variable is read then).
"""
from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: max abs error allowed between a kernel (float32 inside) and its reference, by the reference's dtype: float32
#: is summation order; float16/bfloat16 one or two roundings of the reference's restored K/V and attention
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture
def interpreter(monkeypatch):
    """Run the kernels of this test: on the GPU when there is one, else in Triton's interpreter."""
    pytest.importorskip("triton")
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| in float64."""
    return (got.double() - want.double()).abs().max().item() if got.numel() else 0.0


def assert_within(name: str, got: torch.Tensor, want: torch.Tensor, tol: float, record_property=None) -> float:
    """Assert max |got − want| <= tol, print it (``pytest -s`` / ``-rP``) and record it as a test property."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    err = max_err(got, want)
    print(f"{name}: max abs error {err:.3e} (tolerance {tol:.1e})")
    if record_property is not None:
        record_property("max_abs_error", err)
    assert err <= tol, f"{name}: max abs error {err:.3e} > tolerance {tol:.1e}"
    return err
