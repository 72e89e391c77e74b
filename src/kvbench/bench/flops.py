"""Prefill FLOPs: measured with ``torch.utils.flop_counter`` and an analytic count to check it.

Measured (:func:`count_flops`): ``FlopCounterMode`` over the actual computation
(matmuls, convolutions, attention kernels). PyTorch has no formula for the CPU
flash-attention kernel that ``scaled_dot_product_attention`` dispatches to on
CPU (``aten._scaled_dot_product_flash_attention_for_cpu``), so it would count 0
there; we register the library's own dense SDPA formula for it. As in PyTorch's
formulas, causal masking is not discounted: a query row over ``n_k`` keys costs
``2·n_k·head_dim`` multiply-adds per head for QKᵀ and again for AV.

Analytic (:func:`layer_flops` and friends): matmul FLOPs (2 per multiply-add) of
one decoder layer for ``n_q`` computed rows attending over ``n_k`` keys:

    QKV projections  2·n_q·d·(H + 2·H_kv)·hd
    QKᵀ and AV       2·2·n_q·n_k·H·hd
    output proj.     2·n_q·H·hd·d
    gated MLP        2·3·n_q·d·d_ff

plus the LM head (2·d·V per output position) and the scoring pass's extras:
query recomputation of the query span (2·n_q·d·H·hd) and attention mass (2·n_q·n_k·H·hd, QKᵀ only).
Norms, RoPE, softmax and elementwise ops are not counted (nor by the counter).
Units: FLOPs as Python ints; divide by 1e12 for TFLOPs.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

_aten = torch.ops.aten


def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


#: Formulas missing from PyTorch's registry (shape-based, as ``register_flop_formula`` expects).
EXTRA_FORMULAS = {_aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop}


@dataclass(frozen=True)
class FlopCount:
    """Measured FLOPs of one call.

    Attributes:
        total: all counted FLOPs.
        by_module: FLOPs per module path as ``FlopCounterMode`` attributes them
            (a parent's count includes its children's; ``"Global"`` = total).
    """

    total: int
    by_module: dict[str, int]

    def under(self, fragment: str) -> int:
        """FLOPs of the outermost module whose path ends with ``fragment`` (0 if none ran)."""
        hits = [k for k in self.by_module if k.endswith(fragment)]
        return self.by_module[min(hits, key=len)] if hits else 0


def count_flops(fn: Callable[[], Any]) -> tuple[Any, FlopCount]:
    """Run ``fn()`` under ``FlopCounterMode`` (with :data:`EXTRA_FORMULAS`); returns ``(result, FlopCount)``."""
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS) as fc:
        out = fn()
    by_module = {k: int(sum(v.values())) for k, v in fc.get_flop_counts().items()}
    return out, FlopCount(total=int(fc.get_total_flops()), by_module=by_module)


@dataclass(frozen=True)
class DecoderShape:
    """Text-decoder shape for the analytic count.

    Attributes:
        n_layers, hidden (d), n_heads (H), n_kv_heads (H_kv), head_dim (hd), intermediate (d_ff), vocab (V).
    """

    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> DecoderShape:
        """Shape of ``model``'s text decoder (reads ``config.get_text_config()``)."""
        c = model.config.get_text_config()
        hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(n_layers=c.num_hidden_layers, hidden=c.hidden_size, n_heads=c.num_attention_heads,
                   n_kv_heads=c.num_key_value_heads, head_dim=hd, intermediate=c.intermediate_size,
                   vocab=c.vocab_size)


def layer_flops(s: DecoderShape, n_q: int, n_k: int) -> int:
    """Matmul FLOPs of one decoder layer: ``n_q`` computed rows, attention over ``n_k`` keys."""
    qkv = 2 * n_q * s.hidden * (s.n_heads + 2 * s.n_kv_heads) * s.head_dim
    attn = 2 * 2 * n_q * n_k * s.n_heads * s.head_dim
    out = 2 * n_q * s.n_heads * s.head_dim * s.hidden
    mlp = 2 * 3 * n_q * s.hidden * s.intermediate
    return qkv + attn + out + mlp


def lm_head_flops(s: DecoderShape, n_positions: int = 1) -> int:
    """LM-head FLOPs for ``n_positions`` output positions (prefill needs only the last)."""
    return 2 * n_positions * s.hidden * s.vocab


def query_flops(s: DecoderShape, n: int) -> int:
    """Recomputing the queries of ``n`` rows (the scoring hook's ``q_proj``)."""
    return 2 * n * s.hidden * s.n_heads * s.head_dim


def mass_flops(s: DecoderShape, n_q: int, n_k: int) -> int:
    """Attention-mass matmul QKᵀ of ``n_q`` queries over ``n_k`` keys (all query heads)."""
    return 2 * n_q * n_k * s.n_heads * s.head_dim


def executor_flops(s: DecoderShape, seq_len: int, rows_per_layer: list[int]) -> int:
    """One Phase-2 / Stage-I execution: rows ``rows_per_layer[l]`` at layer l over all ``seq_len`` keys, + LM head."""
    if len(rows_per_layer) != s.n_layers:
        raise ValueError(f"rows_per_layer has {len(rows_per_layer)} entries, the decoder {s.n_layers} layers")
    return sum(layer_flops(s, n, seq_len) for n in rows_per_layer) + lm_head_flops(s)


def scoring_flops(s: DecoderShape, seq_len: int, n_text: int, n_query: int) -> int:
    """The CONDUIT scoring pass: text rows at every layer over the stale cache, plus per layer the
    query span's queries again (``n_query`` rows; ``LayerSchedule.query_mask``) and their attention mass over
    all keys. ``n_text`` rows are computed."""
    extra = s.n_layers * (query_flops(s, n_query) + mass_flops(s, n_query, seq_len))
    return executor_flops(s, seq_len, [n_text] * s.n_layers) + extra


def full_prefill_flops(s: DecoderShape, seq_len: int) -> int:
    """Full prefill of the text decoder (every token at every layer), LM head on the last position only."""
    return executor_flops(s, seq_len, [seq_len] * s.n_layers)
