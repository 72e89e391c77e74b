"""Bandwidth accounting of a decode step (ResidualKV Figs. 8 and 11): bytes read, achieved GB/s, share of
what the machine moves.

At batch 1 a decode step is memory-bound: it reads every weight once and the KV its attention needs, and
computes little on each byte. So tokens/s is best judged as bytes per step over step time against the
machine's bandwidth, which tells a slow method (few GB/s: overhead, not bytes) from a method that reads much
(near the machine's GB/s). Columns (:func:`step_columns`), GB = 1e9 bytes:

- ``weight_bytes`` (:func:`weight_bytes`): every parameter once; the input embedding as the one row a token
  reads; the LM head in full (also when tied to the embedding: the head reads the whole matrix);
- ``kv_read_bytes``: the KV the step read: for a kvbench cache each layer's own audit
  (``StoreLayer.read_bytes()``: the bytes its latest step must read in the stored form, e.g. KIVI's and
  ResidualKV's packed codes as a kernel reads them, while their CPU torch path reads wider rows) where the
  layer has one, else :func:`estimate_layer_read`; for transformers' ``DynamicCache`` its tensors' bytes
  (:func:`tensor_bytes`; SDPA reads all of them). ``kv_read_source`` says which: ``audit``, ``estimate`` (any
  layer estimated) or ``tensors``;
- ``bytes_per_step`` = weights + KV; ``achieved_gb_s`` = bytes_per_step / median step time;
- ``machine_read_gb_s`` (:func:`copy_gb_s`): a ``dst.copy_(src)`` benchmark in the same process and thread
  count, bytes read + written per copy (STREAM's copy convention); ``share_of_measured_bw`` = achieved /
  machine;
- on CUDA ``peak_gb_s`` (:data:`PEAK_GB_S`, the datasheet) and ``share_of_peak``; empty elsewhere.

Not counted: activations, the positions and masks a step builds, the copies a cache makes (a cache that
copies its whole store per step moves more bytes than it reads: its achieved GB/s then overstates nothing,
it just stays low).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from kvbench.bench import clock
from kvbench.compress.accounting import StoredBytes

#: Peak memory bandwidth (GB/s) by a substring of ``torch.cuda.get_device_name`` (first match wins; NVIDIA
#: datasheets: H200 4.8 TB/s; H100 SXM 3.35, NVL 3.9, PCIe 2.0; A100 80GB SXM 2.039, PCIe 1.935; A100 40GB 1.555).
PEAK_GB_S: tuple[tuple[str, float], ...] = (
    ("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0),
    ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0), ("A100", 1555.0),
)
#: Bytes per value of the packed accounting's raw parts (FP16, :mod:`kvbench.compress.accounting`).
PACKED_RAW_BYTES = 2
COLUMNS = ["weight_bytes", "kv_read_bytes", "kv_read_source", "bytes_per_step", "achieved_gb_s",
           "machine_read_gb_s", "share_of_measured_bw", "peak_gb_s", "share_of_peak"]


def peak_gb_s(device: torch.device | str) -> float | None:
    """Datasheet peak bandwidth (GB/s) of CUDA ``device`` from :data:`PEAK_GB_S`; None on the CPU or for a GPU
    not in the table."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((gb for key, gb in PEAK_GB_S if key in name), None)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters one decode step reads (int): every parameter once, the input embedding as one row
    (a token reads its own), the LM head in full, also when tied (its matmul reads the whole matrix).

    Raises:
        ValueError: ``model`` has no input embedding (``get_input_embeddings``) to discount.
    """
    emb = model.get_input_embeddings()
    if emb is None or not hasattr(emb, "weight"):
        raise ValueError(f"{type(model).__name__} has no input embedding weight to count as one row")
    w = emb.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())   # each shared tensor once
    row = w.shape[-1] * w.element_size()
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == w.data_ptr()
    return total - w.numel() * w.element_size() + row + (w.numel() * w.element_size() if tied else 0)


def copy_gb_s(device: torch.device | str, mib: int = 256, repeats: int = 7, warmup: int = 2) -> float:
    """The machine's copy bandwidth (GB/s): median over ``repeats`` timed ``dst.copy_(src)`` of a ``mib`` MiB
    float32 tensor on ``device`` after ``warmup`` untimed ones, counting bytes read + written (2 x the size).
    Runs with torch's current thread count, as the decode steps it is compared with.

    Raises:
        ValueError: ``mib`` or ``repeats`` below 1, ``warmup`` negative.
    """
    if mib < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"mib and repeats must be >= 1 and warmup >= 0, got mib={mib}, repeats={repeats}, "
                         f"warmup={warmup}")
    device = torch.device(device)
    src = torch.ones(mib * 2 ** 18, device=device)   # 2^18 float32 = 1 MiB
    dst = torch.empty_like(src)
    ms = []
    for i in range(warmup + repeats):
        t0 = clock.now(device)
        dst.copy_(src)
        t1 = clock.now(device)
        if i >= warmup:
            ms.append((t1 - t0) * 1000)
    return 2 * src.numel() * src.element_size() / (clock.summarise(ms)["median"] / 1000) / 1e9


def estimate_layer_read(sb: StoredBytes, *, attended: int, visible: int, seen: int, kv_width: int,
                        element_size: int) -> int:
    """Estimated bytes one layer of a kvbench cache read in a step (int), from its stored parts.

    Raw parts are read in full at the width they are held (the packed accounting counts them FP16:
    :data:`PACKED_RAW_BYTES`; held at the model's ``element_size``): raw window, sinks, and ``full_layer``
    when it is the exact store (``2 x kv_width x seen`` packed bytes); a quantised full layer (KIVI-style) is
    read in full as packed. Codes, scales, indices and references are scaled by the layer's measured compute
    ratio ``attended / visible`` (sparse attention restores only what it selects). The audit, where a layer
    has one (every ``StoreLayer``), counts the stored form a kernel reads instead (``read_bytes``).

    Args:
        sb: the layer's :class:`StoredBytes` after the step. attended: keys the step's last query may attend
            (``PressCache.attended``). visible: tokens visible to it. seen: tokens written to the layer.
        kv_width: K plus V values per token (``2 x H_kv x head_dim``). element_size: bytes per raw value held.

    Raises:
        ValueError: ``attended`` outside ``[0, visible]`` or ``visible < 1`` (naming them).
    """
    if visible < 1 or not 0 <= attended <= visible:
        raise ValueError(f"attended must be in [0, visible] with visible >= 1, got attended={attended}, "
                         f"visible={visible}")
    scale = element_size / PACKED_RAW_BYTES
    exact_full = sb.full_layer == PACKED_RAW_BYTES * kv_width * seen
    raw = scale * (sb.raw_window + sb.sinks + (sb.full_layer if exact_full else 0))
    coded = sb.codes + sb.scales + sb.indices + sb.references
    return round(raw + (0 if exact_full else sb.full_layer) + attended / visible * coded)


def press_read_bytes(cache: Any, visible: int, kv_width: int, element_size: int) -> tuple[int, str]:
    """``(bytes, source)`` the latest forward of kvbench ``cache`` (a ``PressCache``) read from its stores:
    each layer's ``read_bytes()`` where it has one, else :func:`estimate_layer_read` (``kv_width``,
    ``element_size``: the model's, as there); ``source`` is ``audit`` when every layer audited itself, else
    ``estimate``. ``visible``: tokens the step's last query saw.

    Raises:
        ValueError: the cache recorded no forward (``attended`` empty).
    """
    if not cache.attended or not cache.attended[-1]:
        raise ValueError("the cache recorded no forward; run a decode step before reading its bytes")
    total, audited = 0, True
    for layer, attended in zip(cache.layers, cache.attended[-1]):
        audit = getattr(layer, "read_bytes", None)
        if audit is not None:
            total += int(audit())
            continue
        audited = False
        total += estimate_layer_read(layer.stored_bytes(), attended=attended, visible=visible, seen=layer.seen,
                                     kv_width=kv_width, element_size=element_size)
    return total, "audit" if audited else "estimate"


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of ``tensors`` as held (None skipped): a ``DynamicCache``'s keys and values, all read by SDPA."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def step_columns(weights: int, kv: int, source: str, median_ms: float, machine_gb_s: float,
                 peak: float | None) -> dict[str, Any]:
    """The :data:`COLUMNS` of one row from its byte counts, median step time (ms), the machine's copy GB/s and
    the device's datasheet peak (None: not a known GPU, the peak columns stay empty).

    Raises:
        ValueError: ``median_ms`` or ``machine_gb_s`` not positive.
    """
    if not median_ms > 0 or not machine_gb_s > 0:
        raise ValueError(f"median_ms and machine_gb_s must be > 0, got {median_ms}, {machine_gb_s}")
    total = weights + kv
    achieved = total / (median_ms / 1000) / 1e9
    return {"weight_bytes": weights, "kv_read_bytes": kv, "kv_read_source": source, "bytes_per_step": total,
            "achieved_gb_s": achieved, "machine_read_gb_s": machine_gb_s,
            "share_of_measured_bw": achieved / machine_gb_s,
            "peak_gb_s": peak, "share_of_peak": None if peak is None else achieved / peak}
