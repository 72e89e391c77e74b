"""Keep ratio (KR) and compute ratio (CR), from the paper's formula and from bytes really stored.

ResidualKV (arXiv 2602.08005v2) §V-A:

- KR: KV storage relative to the full FP16 KV cache (not a token-keep fraction).
- CR: fraction of history tokens that take part in attention, averaged over layers.

With β = n_full / n_layers, q_b = b/16 + 2/g (b-bit payload plus two fp16 values per group of g):

    KR = β q_full + (1 − β)(ρ_ref · ref_bits/16 + q_b d_c / d_kv)      (ref_bits = 8: FP8 refs, ρ/2)
    CR = β + (1 − β) r

Measured KR (:func:`keep_ratio_measured`) comes in two accountings, never mixed (issue #13 item 6):

- **packed** (the paper's accounting, what a deployment would store): codes at their bit width
  (``ceil(numel · bits / 8)``), two fp16 values per quantisation group, references at their stored width
  (FP8: 1 byte), reference indices at the integer width the cache holds them (int16 below 2^15
  references, int32 above; the paper's formula omits them), raw window, sinks and uncompressed K/V at
  FP16 (2 bytes, the full cache's precision), by part (:class:`StoredBytes`). Validity masks, token
  positions and dequantised copies are not part of it (a deployment derives or never keeps them).
- **resident**: the bytes of every tensor the layer holds between steps, as held: unpacked ``uint8``
  codes, ``bool`` validity masks, ``int64`` positions, dequantised rows in the model's dtype, raw K/V in the model's
  dtype, and the whole storage of a tensor the layer keeps a view of (:func:`held_bytes`).

The paper's formula ignores reference indices, sinks, the raw window, the raw residual of KIVI-style
full layers, and charges every sparse-layer token a code (references have none); see
:func:`keep_ratio_formula` for when it matches the packed measurement.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from kvbench.kernels.quant import check_quant_config


def _check_fraction(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def _check_layers(n_layers: int, n_full: int) -> None:
    if n_layers < 1:
        raise ValueError(f"n_layers must be >= 1, got {n_layers}")
    if not 0 <= n_full <= n_layers:
        raise ValueError(f"n_full must be in [0, n_layers = {n_layers}], got {n_full}")


def q_bits(bits: int, group: int = 32) -> float:
    """Stored size of a b-bit group-quantised value relative to FP16: b/16 + 2/group (§V-A).

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
    full_group: int | None = None,
) -> float:
    """The paper's KR (§V-A): β q_full + (1 − β)(ρ_ref · ref_bits/16 + q_b d_c/d_kv).

    Parameters
    ----------
    n_layers, n_full : int — decoder layers; full-attention layers (β = n_full / n_layers).
    ref_density : float in [0, 1] — ρ_ref, reference tokens per token in a sparse layer.
    d_c : int — residual code width; d_kv : int — 2·d_k, the concatenated K‖V width per token.
    bits : residual code bits; full_bits : bits of the full layers' cache (paper: 4, KIVI-style);
    group : the codes' quantisation group; full_group : the full layers' (None: ``group``; KIVI's G = 32 for
    ResidualKV's 4-bit full layers); ref_bits : reference storage (8 = FP8, the paper; 16 = FP16).

    Example: Llama-3.1-8B, 32 layers, 5 full, ρ = 0.10, d_c/d_kv = 1/4, INT4 -> 0.156933... (15.69%).

    Against the packed measurement (:func:`keep_ratio_measured`, ``kind="packed"``) the formula omits, as
    fractions of the full cache: the sparse layers' sinks and raw window at FP16 ((1 − β)(n_sink + window)/T,
    minus the code/reference charge the formula gives those tokens), the reference indices ((1 − β)(1 − ρ)
    k · index bytes / (2 d_kv): 8 bytes per coded token with int16 indices and k = 4, so 6% of a tiny model's
    d_kv = 64 row but 0.2% of Llama's 2048), and the KIVI-style full layers' raw residual (up to 32 keys and
    32 values at FP16); it also charges every sparse-layer token a code while references have none
    (ρ q_b d_c/d_kv too much). On the parts it models (full layers, codes + scales, references) it agrees
    with the packed measurement within a point once T is large against the window
    (tests/test_rkv_accounting.py); the report prints the omitted parts beside it.
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
    return beta * q_bits(full_bits, group if full_group is None else full_group) + (1 - beta) * sparse


def compute_ratio_formula(*, n_layers: int, n_full: int, r: float) -> float:
    """The paper's CR (§V-A): β + (1 − β) r, with r the sparse layers' access ratio.

    Raises ValueError for n_full outside [0, n_layers] or r outside [0, 1].
    """
    _check_layers(n_layers, n_full)
    _check_fraction("r", r)
    beta = n_full / n_layers
    return beta + (1 - beta) * r


@dataclass
class StoredBytes:
    """Bytes one layer of a compressed cache holds: the packed parts (the paper's accounting) and, apart,
    the resident bytes (module docstring). Never summed together.

    Packed parts (int bytes, >= 0): codes (residual or quantised payload at its bit width), scales (two
    fp16 values per group), references (stored reference K‖V, FP8: 1 byte a value), indices (per-token
    reference indices at the held width: int16, or int32 from 2^15 references), raw_window (recent tokens
    kept raw, FP16), sinks (sink tokens kept raw, FP16), full_layer (uncompressed K/V at FP16: a
    full-attention layer, or an eviction press's kept tokens, or a KIVI-style full layer's codes, scales
    and raw residual). ``resident`` (int bytes): every tensor the layer holds, as held
    (:func:`held_bytes`). ``layer``: the layer index. Raises ValueError for a negative field.
    """

    #: the packed parts, in the order the report prints them
    PACKED: ClassVar[tuple[str, ...]] = ("full_layer", "codes", "scales", "references", "indices",
                                         "raw_window", "sinks")

    layer: int
    codes: int = 0
    scales: int = 0
    references: int = 0
    indices: int = 0
    raw_window: int = 0
    sinks: int = 0
    full_layer: int = 0
    resident: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"StoredBytes.{f.name} must be >= 0, got {getattr(self, f.name)}")

    def packed(self) -> int:
        """Sum of the packed parts (the paper's accounting; ``resident`` and ``layer`` excluded)."""
        return sum(getattr(self, name) for name in self.PACKED)


def held_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Resident bytes of ``tensors`` (None skipped): the whole storage of each tensor, once per storage.

    A view keeps its whole storage alive (a sliced window, an expanded position row), so the storage's
    ``nbytes`` is what is held; two views of one storage (sinks and window cut from one chunk) count once.
    """
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        key = (str(t.device), st.data_ptr())
        if key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


KINDS = ("packed", "resident")


def keep_ratio_measured(
    parts: list[StoredBytes], *, kind: str, n_tokens: int, n_layers: int, n_kv_heads: int, head_dim: int
) -> float:
    """Measured KR: Σ bytes of ``kind`` / full FP16 cache bytes, 2 bytes · 2 (K, V) · L · T · H · D.

    ``kind``: ``"packed"`` (Σ :meth:`StoredBytes.packed`, the paper's accounting) or ``"resident"``
    (Σ ``StoredBytes.resident``); no default, so a caller names the accounting it reports.
    ``parts`` must hold exactly one entry per layer 0..n_layers−1, so a forgotten layer cannot lower
    the ratio silently. Raises ValueError for an unknown kind, a missing/duplicate/out-of-range layer or
    a size < 1.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    for name, value in (("n_tokens", n_tokens), ("n_layers", n_layers), ("n_kv_heads", n_kv_heads),
                        ("head_dim", head_dim)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    layers = sorted(p.layer for p in parts)
    if layers != list(range(n_layers)):
        raise ValueError(f"parts must cover layers 0..{n_layers - 1} once each, got {layers}")
    held = sum(p.packed() if kind == "packed" else p.resident for p in parts)
    return held / full_cache_bytes(n_tokens=n_tokens, n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim)


def full_cache_bytes(*, n_tokens: int, n_layers: int, n_kv_heads: int, head_dim: int) -> int:
    """Bytes of the full FP16 cache, KR's denominator: 2 bytes · 2 (K, V) · L · T · H · D."""
    return 2 * 2 * n_layers * n_tokens * n_kv_heads * head_dim


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
