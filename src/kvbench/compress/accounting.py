"""Keep ratio (KR) and compute ratio (CR), from the paper's formula and from bytes really stored.

ResidualKV (arXiv 2602.08005v2) §V-A, notes §3.3:

- KR: KV storage relative to the full FP16 KV cache (not a token-keep fraction).
- CR: fraction of history tokens that take part in attention, averaged over layers.

With β = n_full / n_layers, q_b = b/16 + 2/g (b-bit payload plus two fp16 values per group of g):

    KR = β q_full + (1 − β)(ρ_ref · ref_bits/16 + q_b d_c / d_kv)      (ref_bits = 8: FP8 refs, ρ/2)
    CR = β + (1 − β) r

The formula ignores per-token reference indices, sinks, the raw window and transient tensors; the
measured KR (:func:`keep_ratio_measured`) counts them, part by part (:class:`StoredBytes`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvbench.compress.residualkv.quant import check_quant_config


def _check_fraction(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def _check_layers(n_layers: int, n_full: int) -> None:
    if n_layers < 1:
        raise ValueError(f"n_layers must be >= 1, got {n_layers}")
    if not 0 <= n_full <= n_layers:
        raise ValueError(f"n_full must be in [0, n_layers = {n_layers}], got {n_full}")


def q_bits(bits: int, group: int = 32) -> float:
    """Stored size of a b-bit group-quantised value relative to FP16: b/16 + 2/group (notes §3.3).

    Two fp16 values (min and scale) per group of ``group`` values: 32 bits / (16 · group) = 2/group.
    q_bits(4) = 0.3125, q_bits(2) = 0.1875; bits = 16 (unquantised FP16) gives 1.0.
    Raises ValueError for bits not in {2, 4, 8, 16} or group < 1.
    """
    check_quant_config(max(group, 1), bits, group)  # d_c = group: only bits and group >= 1 matter
    return 1.0 if bits == 16 else bits / 16 + 2 / group


def keep_ratio_formula(
    *,
    n_layers: int,
    n_full: int,
    ref_density: float,
    d_c: int,
    d_kv: int,
    bits: int = 4,
    full_bits: int = 4,
    group: int = 32,
    ref_bits: int = 8,
) -> float:
    """The paper's KR (§V-A, notes §3.3): β q_full + (1 − β)(ρ_ref · ref_bits/16 + q_b d_c/d_kv).

    Parameters
    ----------
    n_layers, n_full : int — decoder layers; full-attention layers (β = n_full / n_layers).
    ref_density : float in [0, 1] — ρ_ref, reference tokens per token in a sparse layer.
    d_c : int — residual code width; d_kv : int — 2·d_k, the concatenated K‖V width per token.
    bits : residual code bits; full_bits : bits of the full layers' cache (paper: 4, KIVI-style);
    group : quantisation group for both; ref_bits : reference storage (8 = FP8, the paper; 16 = FP16).

    Example: Llama-3.1-8B, 32 layers, 5 full, ρ = 0.10, d_c/d_kv = 1/4, INT4 -> 0.156933... (15.69%).
    Raises ValueError for n_full outside [0, n_layers], ρ outside [0, 1], d_c or d_kv < 1, bad bits/group,
    or ref_bits not in {8, 16}.
    """
    _check_layers(n_layers, n_full)
    _check_fraction("ref_density", ref_density)
    if d_c < 1 or d_kv < 1:
        raise ValueError(f"d_c and d_kv must be >= 1, got d_c = {d_c}, d_kv = {d_kv}")
    if ref_bits not in (8, 16):
        raise ValueError(f"ref_bits must be 8 (FP8) or 16 (FP16), got {ref_bits}")
    beta = n_full / n_layers
    sparse = ref_density * ref_bits / 16 + q_bits(bits, group) * d_c / d_kv
    return beta * q_bits(full_bits, group) + (1 - beta) * sparse


def compute_ratio_formula(*, n_layers: int, n_full: int, r: float) -> float:
    """The paper's CR (§V-A, notes §3.3): β + (1 − β) r, with r the sparse layers' access ratio.

    Raises ValueError for n_full outside [0, n_layers] or r outside [0, 1].
    """
    _check_layers(n_layers, n_full)
    _check_fraction("r", r)
    beta = n_full / n_layers
    return beta + (1 - beta) * r


@dataclass
class StoredBytes:
    """Bytes one layer of a compressed cache really holds, by part.

    Fields (all int bytes, >= 0): layer (index), codes (packed residual payload), scales (group
    min/scale side information), references (stored reference K‖V, e.g. FP8), indices (per-token
    neighbour indices), raw_window (recent tokens kept raw), sinks (sink tokens kept raw), full_layer
    (the whole cache of a full-attention layer). Raises ValueError for a negative field.
    """

    layer: int
    codes: int = 0
    scales: int = 0
    references: int = 0
    indices: int = 0
    raw_window: int = 0
    sinks: int = 0
    full_layer: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"StoredBytes.{f.name} must be >= 0, got {getattr(self, f.name)}")

    def total(self) -> int:
        """Sum of all byte parts (the layer index excluded)."""
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "layer")


def keep_ratio_measured(
    parts: list[StoredBytes], *, n_tokens: int, n_layers: int, n_kv_heads: int, head_dim: int
) -> float:
    """Measured KR: Σ stored bytes / full FP16 cache bytes, 2 bytes · 2 (K, V) · L · T · H · D.

    ``parts`` must hold exactly one entry per layer 0..n_layers−1, so a forgotten layer cannot lower
    the ratio silently. Raises ValueError for a missing/duplicate/out-of-range layer or a size < 1.
    """
    for name, value in (("n_tokens", n_tokens), ("n_layers", n_layers), ("n_kv_heads", n_kv_heads),
                        ("head_dim", head_dim)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    layers = sorted(p.layer for p in parts)
    if layers != list(range(n_layers)):
        raise ValueError(f"parts must cover layers 0..{n_layers - 1} once each, got {layers}")
    full = 2 * 2 * n_layers * n_tokens * n_kv_heads * head_dim
    return sum(p.total() for p in parts) / full


def compute_ratio_measured(attended: list[int], n_tokens: int) -> float:
    """Measured CR: mean over layers of attended[l] / n_tokens (history tokens in attention).

    Raises ValueError for n_tokens < 1, an empty list, or a count outside [0, n_tokens].
    """
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    if not attended:
        raise ValueError("attended must hold one count per layer, got an empty list")
    bad = [a for a in attended if not 0 <= a <= n_tokens]
    if bad:
        raise ValueError(f"attended counts must be in [0, {n_tokens}], got {bad[:5]}")
    return sum(attended) / (len(attended) * n_tokens)
