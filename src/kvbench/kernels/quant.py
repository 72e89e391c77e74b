"""Per-token group quantisation of residual codes and the FP8 reference cast (ResidualKV §IV-A, §V-A).

- Residual codes z_Δ [T, d_c] are quantised asymmetrically (min/max) per group of ``group`` consecutive
  latent coordinates of ONE token (ResidualKV §IV-A), so a single token can be restored without touching its
  neighbours. The paper's g = 32 is the default; the authors' `cache_pipeline.py` passes the whole code
  vector as one group (group = d_c), available by passing ``group=d_c``.
- References are stored as an unscaled float8 e4m3fn cast (§V-A; authors' code), with the explicit
  saturation policy of :func:`to_fp8`.

The torch quantiser shared by the packed kernels (:mod:`.group_quant`, :mod:`.kivi_attend`), KIVI
(:mod:`kvbench.compress.presses.kivi`), ResidualKV's cache and the byte accounting, so it lives in the lowest
package that uses it.

fp16 side information and the error bound: see :func:`quant_error_bound` and docs/decisions/residualkv.md,
"Quantisation".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn value
_FP16_MAX = 65504.0
_BITS = (2, 4, 8, 16)


@dataclass(frozen=True)
class QuantizedCodes:
    """Residual codes after per-token group quantisation (ResidualKV §IV-A).

    Fields
    ------
    q : torch.uint8 [T, d_c] — integer levels 0..2^bits−1, unpacked in memory.
    zmin : torch.float16 [T, d_c // group] — per-group offset (the stored, fp16-rounded group minimum).
    scale : torch.float16 [T, d_c // group] — per-group step Δ_s (0 for a constant group).
    bits : int — 2, 4 or 8.
    group : int — coordinates per group.
    """

    q: torch.Tensor
    zmin: torch.Tensor
    scale: torch.Tensor
    bits: int
    group: int

    def nbytes(self) -> int:
        """Bytes as really stored: the packed payload ceil(T·d_c·bits/8) plus two fp16 values
        (zmin, scale) = 4 bytes per group."""
        return math.ceil(self.q.numel() * self.bits / 8) + 2 * (self.zmin.numel() + self.scale.numel())

    def take(self, rows: torch.Tensor) -> QuantizedCodes:
        """The codes of the tokens ``rows`` ([n] long or [T] bool), e.g. those a sparse layer reads."""
        return QuantizedCodes(self.q[rows], self.zmin[rows], self.scale[rows], self.bits, self.group)


def check_quant_config(d_c: int, bits: int, group: int) -> None:
    """Validate a code width / bit width / group size triple.

    Raises ValueError when bits is not in {2, 4, 8, 16}, d_c < 1, group < 1, or (bits < 16) d_c is not a
    multiple of group. bits = 16 stores fp16 codes with no groups, so group is not checked then.
    """
    if bits not in _BITS:
        raise ValueError(f"bits must be one of {_BITS}, got {bits}")
    if d_c < 1:
        raise ValueError(f"d_c must be >= 1, got {d_c}")
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    if bits < 16 and d_c % group:
        raise ValueError(f"d_c = {d_c} must be a multiple of group = {group}")


def _check_codes(z: torch.Tensor, values: bool = True) -> None:
    if z.dim() != 2 or not z.dtype.is_floating_point:
        raise ValueError(f"expected z as a float [T, d_c] tensor, got {z.dtype} {tuple(z.shape)}")
    if not values:
        return
    if not torch.isfinite(z).all():
        raise ValueError("z must be finite (found NaN or inf)")
    if z.numel() and float(z.abs().max()) > _FP16_MAX:
        raise ValueError(f"|z| must be <= {_FP16_MAX} (fp16 side information), got max {float(z.abs().max())}")


def _fp16_round(x: torch.Tensor, direction: str) -> torch.Tensor:
    """x (float64) rounded to an fp16 value <= x ("down") or >= x ("up"); returns float16."""
    h = x.to(torch.float16)
    if direction == "down":
        off = h.to(torch.float64) > x
        target = torch.full_like(h, -math.inf)
    else:
        off = h.to(torch.float64) < x
        target = torch.full_like(h, math.inf)
    return torch.where(off, torch.nextafter(h, target), h)


def quantize(z: torch.Tensor, bits: int, group: int = 32, *, check: bool = True) -> QuantizedCodes | torch.Tensor:
    """Asymmetric min/max quantisation per group of ``group`` coordinates of one token (ResidualKV §IV-A).

    Δ_s = (z_max − z_min)/(2^b − 1), q = round((z − z_min)/Δ_s), clamped to [0, 2^b − 1]. Levels are
    computed with the fp16 zmin/scale actually stored, so decoding is consistent: zmin is rounded DOWN and
    the scale UP to fp16, so [zmin, zmin + (2^b−1)·scale] still covers the group and the rounding error
    stays within half a (stored) step. A constant group stores scale 0 and zmin = nearest fp16 value:
    dequantisation returns it exactly whenever it is fp16-representable (no division by zero, no NaN).

    Parameters
    ----------
    z : [T, d_c] float (any float dtype), finite, |z| <= 65504.
    bits : 2, 4, 8 (quantised) or 16 (no quantisation: z is returned as float16).
    group : int — coordinates per group; d_c % group == 0 (paper g = 32).

    check : bool — False skips the value checks (NaN/inf, |z| > 65504), which read z back to the host: a
        cache's per-step path (:mod:`kvbench.compress.checks`); shapes and the config are always checked.

    Returns :class:`QuantizedCodes`, or a float16 [T, d_c] tensor for bits = 16.
    Raises ValueError for a bad config (:func:`check_quant_config`), shape, dtype, NaN/inf or |z| > 65504.
    """
    _check_codes(z, values=check)
    check_quant_config(z.shape[1], bits, group)
    if bits == 16:
        return z.to(torch.float16)
    n_tok, d_c = z.shape
    levels = 2**bits - 1
    zg = z.to(torch.float64).reshape(n_tok, d_c // group, group)
    lo, hi = zg.amin(2), zg.amax(2)
    const = hi == lo
    zmin16 = torch.where(const, lo.to(torch.float16), _fp16_round(lo, "down"))
    zmin = zmin16.to(torch.float64)
    scale16 = torch.where(const, torch.zeros_like(zmin16), _fp16_round((hi - zmin) / levels, "up"))
    scale = scale16.to(torch.float64)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant groups: level 0
    q = ((zg - zmin[..., None]) / safe[..., None]).round().clamp(0, levels)
    q = torch.where(const[..., None], torch.zeros_like(q), q)
    return QuantizedCodes(q.to(torch.uint8).reshape(n_tok, d_c), zmin16, scale16, bits, group)


def dequantize(codes: QuantizedCodes | torch.Tensor) -> torch.Tensor:
    """z̃ = q·Δ_s + z_min per group (ResidualKV §IV-A) as float32 [T, d_c]; a float16 tensor (bits = 16) is
    returned as float32. Raises ValueError for any other input type."""
    if isinstance(codes, torch.Tensor):
        if codes.dtype != torch.float16:
            raise ValueError(f"unquantised codes must be float16 (bits = 16), got {codes.dtype}")
        return codes.to(torch.float32)
    if not isinstance(codes, QuantizedCodes):
        # ValueError, not TypeError: the project reports every bad input as ValueError.
        raise ValueError(f"expected QuantizedCodes or a float16 tensor, got {type(codes).__name__}")  # noqa: TRY004
    n_tok, d_c = codes.q.shape
    q = codes.q.to(torch.float32).reshape(n_tok, d_c // codes.group, codes.group)
    # q·scale is exact in float32 (<= 8 + 11 significant bits); one rounding in the addition.
    out = q * codes.scale.to(torch.float32)[..., None] + codes.zmin.to(torch.float32)[..., None]
    return out.reshape(n_tok, d_c)


def quant_error_bound(z: torch.Tensor, bits: int, group: int = 32, *, slack: bool = True) -> torch.Tensor:
    """Per-token bound on ||dequantize(quantize(z)) − z||_2 (ResidualKV §IV-B, Theorem IV.1, first inequality), [T] float32.

    slack=False gives the paper's bound sqrt(Σ_G |G| range_G²) / (2(2^b − 1)) exactly (which is itself
    <= sqrt(g/2)/(2^b − 1) · ||z||_2). slack=True (default) adds what fp16 side information and float32
    decoding cost, per coordinate of group G with M = max|z_G|, L = 2^b − 1:

        e <= (range_G + 2^-9·M + 2^-23)·(1 + 2^-9) / (2L) + 2^-24 + 2^-22·M      (non-constant group)
        e <= 2^-11·M + 2^-25                                                       (constant group)

    Derivation: zmin rounded down to fp16 moves it by <= 2^-10·|zmin| + 2^-24 (normal spacing, subnormal
    spacing); the step rounded up to fp16 grows by a factor <= 1 + 2^-10 plus <= 2^-24; rounding is then
    within half a stored step; the float32 addition in decoding adds <= 2^-24 relative to the result
    (<= 2^-23·M after the slack above). A constant group is rounded to the nearest fp16 value (half an
    ulp). The constants are rounded up to powers of two. bits = 16 gives the fp16 cast bound 2^-11·|z| +
    2^-25 per coordinate (0 with slack=False).

    Raises ValueError like :func:`quantize`.
    """
    _check_codes(z)
    check_quant_config(z.shape[1], bits, group)
    n_tok, d_c = z.shape
    za = z.to(torch.float64)
    if bits == 16:
        if not slack:
            return torch.zeros(n_tok, dtype=torch.float32)
        return (2.0**-11 * za.abs() + 2.0**-25).pow(2).sum(1).sqrt().to(torch.float32)
    levels = 2**bits - 1
    zg = za.reshape(n_tok, d_c // group, group)
    rng = zg.amax(2) - zg.amin(2)
    if not slack:
        return (group * rng.pow(2)).sum(1).sqrt().div(2 * levels).to(torch.float32)
    m = zg.abs().amax(2)
    per = (rng + 2.0**-9 * m + 2.0**-23) * (1 + 2.0**-9) / (2 * levels) + 2.0**-24 + 2.0**-22 * m
    per = torch.where(rng == 0, 2.0**-11 * m + 2.0**-25, per)
    return (group * per.pow(2)).sum(1).sqrt().to(torch.float32)


def to_fp8(x: torch.Tensor, overflow: str = "saturate") -> tuple[torch.Tensor, int]:
    """Unscaled float8_e4m3fn cast of reference KV (§V-A; authors' code casts without a scale).

    Overflow policy: e4m3fn has no inf and its largest finite value is 448; how a cast treats a larger
    value depends on the backend (NaN in some), so values with |x| > 448 are clamped to ±448 first and
    counted. overflow="saturate" (default) returns the count so the audit record can report it;
    overflow="error" raises instead. Values below the smallest subnormal (2^-9) round to 0 as in any cast.

    Parameters
    ----------
    x : float tensor, any shape, finite.
    overflow : "saturate" or "error".

    Returns (float8_e4m3fn tensor of x's shape, n_saturated: number of elements with |x| > 448).
    Raises ValueError for a non-float dtype, NaN/inf input, an unknown policy, or (overflow="error")
    any |x| > 448, naming the max |x|.
    """
    if overflow not in ("saturate", "error"):
        raise ValueError(f"overflow must be 'saturate' or 'error', got {overflow!r}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"expected a float tensor, got {x.dtype}")
    if not torch.isfinite(x).all():
        n_bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"cannot cast to FP8: {n_bad} NaN/inf value(s) in the input")
    out, over = cast_fp8(x)
    n_sat = int(over)
    if n_sat and overflow == "error":
        raise ValueError(f"{n_sat} value(s) exceed the FP8 e4m3fn range ±{FP8_MAX}: max |x| = "
                         f"{float(x.abs().max())}")
    return out, n_sat


def cast_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`to_fp8`'s saturating cast without its checks or host reads (a cache's per-block path).

    Returns (float8_e4m3fn tensor of x's shape, int64 0-d tensor: elements with |x| > 448, clamped to ±448).
    NaN/inf are not checked (see :mod:`kvbench.compress.checks`).
    """
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), (x.abs() > FP8_MAX).sum()


def from_fp8(x: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn tensor -> float32 (exact). Raises ValueError for any other dtype."""
    if x.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expected a float8_e4m3fn tensor, got {x.dtype}")
    return x.to(torch.float32)
