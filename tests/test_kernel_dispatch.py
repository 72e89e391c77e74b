"""kvbench.kernels: the KVBENCH_KERNELS switch, available(), dispatch, and kernels decorated at first launch."""
from __future__ import annotations

import pytest
import torch

from kvbench import kernels
from kvbench.kernels import _triton, flash_decode
from kvbench.kernels.group_quant import group_quant_ref

triton = pytest.importorskip("triton")


def test_kernel_mode_reads_the_environment(monkeypatch):
    monkeypatch.delenv("KVBENCH_KERNELS", raising=False)
    assert kernels.mode() == "auto"
    monkeypatch.setenv("KVBENCH_KERNELS", " Torch ")
    assert kernels.mode() == "torch"
    monkeypatch.setenv("KVBENCH_KERNELS", "cuda")
    with pytest.raises(ValueError, match="KVBENCH_KERNELS must be one of"):
        kernels.mode()


def test_kernel_available_and_use_triton_on_the_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not kernels.available("cpu")
    monkeypatch.setenv("KVBENCH_KERNELS", "triton")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        kernels.use_triton("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.available("cpu") and kernels.use_triton("cpu")
    monkeypatch.setenv("KVBENCH_KERNELS", "auto")         # the interpreter is for tests: auto keeps torch
    assert not kernels.use_triton("cpu")
    monkeypatch.setenv("KVBENCH_KERNELS", "torch")
    assert not kernels.use_triton("cpu")


@pytest.mark.parametrize("chosen", ["torch", "triton"])
def test_kernel_dispatch_calls_the_chosen_implementation(monkeypatch, chosen):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("KVBENCH_KERNELS", chosen)
    calls = []
    for name in ("_group_dequant_triton", "group_dequant_ref", "_restore_attend_triton", "restore_attend_ref",
                 "_kivi_attend_triton", "kivi_attend_ref"):
        monkeypatch.setattr(kernels, name, lambda *a, _n=name, **k: calls.append(_n))
    q = torch.zeros(4, 8)
    kernels.group_dequant(group_quant_ref(torch.randn(3, 16), 4, 16))
    kernels.restore_attend(q, None, None, None)
    kernels.kivi_attend(q, None)
    triton_side = chosen == "triton"
    assert [c.startswith("_") for c in calls] == [triton_side] * 3


def test_kernel_group_dequant_dispatch_runs_the_interpreted_kernel(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("KVBENCH_KERNELS", "triton")
    codes = group_quant_ref(torch.randn(5, 32), 2, 16)
    assert torch.equal(kernels.group_dequant(codes, torch.tensor([4, 0])), kernels.group_dequant_ref(codes)[[4, 0]])


def test_kernel_interpreter_mode_is_read_at_first_launch(monkeypatch):
    """A kernel is decorated per TRITON_INTERPRET value when first launched, not when kvbench.kernels was
    imported (torch imports Triton early, and a compiled kernel cannot run on CPU tensors)."""
    lazy = _triton.LazyJit(flash_decode._combine_kernel.fn)     # a fresh copy: no mode decorated yet
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interpreted = lazy.resolve()
    monkeypatch.delenv("TRITON_INTERPRET")
    compiled = lazy.resolve()
    assert type(interpreted).__name__ == "InterpretedFunction" and type(compiled).__name__ == "JITFunction"
    assert lazy.resolve() is compiled
