"""RoPE of one decoder stack: cos/sin at arbitrary positions, rotation and its inverse.

Shared by both families, so it lives with the models rather than in either:
the reuse engine stores keys *pre-RoPE* and rotates them to the positions of
the serving request (CONDUIT §3.1; the authors' ``model_runner_priori.py`` /
``layers/rotary_embedding.py`` do the same), and compressed caches
(:class:`kvbench.compress.cache.LayerContext`: ResidualKV, Palu) restore
pre-RoPE keys at their own positions. Nothing here re-derives the
rotation: cos/sin come from the model's own rotary-embedding module (for
Qwen2.5-VL it folds the M-RoPE sections [t, h, w] into per-token cos/sin), and
the rotation is the modelling file's own ``apply_rotary_pos_emb``.

Shapes: ``position_ids`` int64 ``[1, T]`` (1-D RoPE) or ``[3, 1, T]`` (M-RoPE);
``cos``/``sin`` ``[1, T, head_dim]`` in the model dtype; keys
``[1, n_kv_heads, T, head_dim]``.
"""
from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn


def rotation_fn(attn: nn.Module) -> Callable:
    """The ``apply_rotary_pos_emb`` of the modelling file that defines ``attn``'s class.

    Raises:
        TypeError: that module has no ``apply_rotary_pos_emb`` (unsupported architecture).
    """
    mod = sys.modules[type(attn).__module__]
    fn = getattr(mod, "apply_rotary_pos_emb", None)
    if fn is None:
        raise TypeError(f"{type(attn).__name__}: its module {mod.__name__} has no apply_rotary_pos_emb")
    return fn


def cos_sin(rotary_emb: nn.Module, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[1, T, head_dim]`` for ``position_ids`` from the model's rotary module."""
    probe = torch.empty(0, dtype=dtype, device=position_ids.device)  # only its dtype/device are read
    return rotary_emb(probe, position_ids)


def rotate(apply_fn: Callable, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE-rotate keys ``k`` ``[1, H, T, hd]`` with per-token ``cos``/``sin`` ``[1, T, hd]``."""
    _, out = apply_fn(k, k, cos, sin)
    return out


def unrotate(apply_fn: Callable, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`rotate`: RoPE is a rotation per frequency pair, so R(θ)⁻¹ = R(−θ) (sin → −sin).

    Exact in real arithmetic; in float32 it matches pre-RoPE keys to ~1e-6.
    """
    _, out = apply_fn(k, k, cos, -sin)
    return out
