"""Per-image KV caches stored in ResidualKV's form (beyond both papers: CONDUIT over compressed image caches).

CONDUIT's Limitations name the storage of the cached visual K/V as its remaining cost. This store keeps each
image's entry of :class:`~kvbench.reuse.cache_store.ImageKVStore` coded as ResidualKV codes a context
(arXiv 2602.08005v2 §IV-A/B, :class:`~kvbench.compress.residualkv.cache.ResidualKVLayer`), and restores every
token when a request reuses the image (the reuse engine and the refresh policies read the full visual K/V).

Per decoder layer, over the image's own visual tokens (image-local positions ``0..n-1``):

- **sparse layers** (not in ``full_layers``): K‖V (pre-RoPE K, the codec's key quantity, then V; ``[n, d_kv]``)
  as ResidualKV's cache stores it: the first ``n_sink`` tokens raw (FP16; default 0: an image stored at rest
  sits in the middle of every request that reuses it, so no token of it is an attention sink); references on
  the codec's stride schedule (:func:`~kvbench.compress.residualkv.references.references_between`) stored FP8
  e4m3 (§V-A); every other token as the quantised residual code ``z = f_c(kv) − f_c(mean of its k nearest
  earlier references)`` (the codec's ``residual_code``, :func:`~kvbench.kernels.quant.quantize`)
  with its ``k`` reference indices (int16, ``-1`` marks a slot without a visible reference: the validity mask
  is not stored). All tokens are coded: there is no raw recent window, since no token of a stored image is
  recent. Restored as ``kv̂ = f_d(z̃) + mean`` (the codec's ``restore``) from the SAME FP8 references;
- **full layers** (``full_layers``): FP16 at ``full_kv_bits = 16``; else KIVI-style in KIVI's rule
  (:class:`~kvbench.compress.residualkv.cache.QuantizedFullLayer`'s ``kivi`` form): keys per channel over groups of
  32 tokens, values per token in groups of ``min(32, head_dim)`` channels, at ``full_kv_bits``; the keys of the
  last incomplete 32-token group stay FP16 (KIVI's raw residual). No raw sinks or raw recent tokens as in the
  authors' serving form: a stored image has neither. Keys here are pre-RoPE (the image cache's form), where KIVI
  quantises post-RoPE keys.

Files (as the raw store): ``<root>/manifest.json`` (model, template, codec identity and storage settings),
``<root>/<key>.safetensors`` (packed codes ``code.<l>`` uint8, ``zmin.<l>``/``scale.<l>`` fp16, references
``ref.<l>`` float8_e4m3fn, indices ``nbr.<l>`` int16, sinks ``sink.<l>`` fp16, full layers ``full.<l>.*``,
and the vision embeds ``embeds`` at the model dtype, which a refresh needs and which are not K/V) and
``<root>/<key>.json`` (sha256 of the tensor file, bytes by part, restore error per layer). Entries are coded
from a raw store's entries (``source``); a store without a source only reads (the pipeline's runs).

Bytes (:mod:`kvbench.compress.accounting`, packed): ``raw_kv`` = FP16 K + V of every layer (KR's denominator,
:func:`~kvbench.compress.accounting.full_cache_bytes`), ``compressed_kv`` = the stored K/V tensors' bytes, by
part (:class:`~kvbench.compress.accounting.StoredBytes`); embeds are counted apart. :func:`stored_parts` reads the
parts back from a tensor file, so what is reported is what is stored.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvbench.compress.accounting import StoredBytes, full_cache_bytes
from kvbench.compress.residualkv import references
from kvbench.compress.residualkv.cache import FULL_KV_GROUP, ResidualKVPress
from kvbench.compress.residualkv.codec import CODEC_FILE, CONFIG_FILE, CodecConfig, LayerCodec
from kvbench.kernels import quant
from kvbench.kernels.group_quant import pack_levels, unpack_levels
from kvbench.kernels.reference_mean import mean_reference
from kvbench.reuse.adapter import VLMAdapter
from kvbench.reuse.cache_store import ImageKV, ImageKVStore
from kvbench.utils.io import atomic_path, sha256_file, write_json

FORMAT_VERSION = 1
#: Tensor-name prefix -> packed part (:class:`StoredBytes`) of the stored file.
PARTS = {"code": "codes", "zmin": "scales", "scale": "scales", "ref": "references", "nbr": "indices",
         "sink": "sinks", "full": "full_layer"}


@dataclass
class CacheCodec:
    """How an image cache is stored in ResidualKV's form (module docstring).

    Parameters:
        codec_dir: directory of the trained codec (``codec.safetensors`` + ``codec.json``; e.g. rule
            ``rkv_mm_codec``'s ``codecs/<profile>/<model>/mm-<hash>/codec``).
        full_layers: decoder layers stored as full-attention layers (as the ResidualKV row's ``full_layers``).
        full_kv_bits: 16 = FP16, 2/4/8 = KIVI-style (the paper's deployment: 4).
        bits: residual-code bits, 2/4/8 (packed) or 16 (fp16 codes).
        n_sink: leading image tokens stored raw (FP16), default 0 (module docstring).

    Raises:
        ValueError: naming the bad value: as :class:`~kvbench.compress.residualkv.cache.ResidualKVPress` for
            ``bits``, ``full_kv_bits`` and ``full_layers`` (whose checks are reused), ``bits`` 32 (not a storage
            form), a negative ``n_sink``, or (:meth:`codec`) a directory without a trained codec.
    """

    codec_dir: str
    full_layers: tuple[int, ...] = ()
    full_kv_bits: int = 16
    bits: int = 4
    n_sink: int = 0

    def __post_init__(self) -> None:
        if self.bits == 32:
            raise ValueError("bits must be 2, 4, 8 or 16 for a stored image cache, got 32 (the exact float32 "
                             "payload is a test invariant of the press, not a storage form)")
        if not isinstance(self.n_sink, int) or isinstance(self.n_sink, bool) or self.n_sink < 0:
            raise ValueError(f"n_sink (raw leading image tokens) must be an int >= 0, got {self.n_sink!r}")
        # the ResidualKV press's own checks of bits, full_kv_bits and full_layers (one place for them)
        self.full_layers = self.press.full_layers

    @classmethod
    def from_spec(cls, spec: dict) -> CacheCodec:
        """From a JSON mapping (``--compressed``, a run's method parameter ``compressed``).

        Raises:
            ValueError: not a mapping, an unknown or missing key (naming the expected ones), or a bad value.
        """
        if not isinstance(spec, dict):
            raise ValueError(f"a compressed image-cache spec must be a mapping {{codec_dir, full_layers, "
                             f"full_kv_bits, bits, n_sink}}, got {spec!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(spec) - set(names))
        if unknown:
            raise ValueError(f"compressed image-cache spec: unknown key(s) {unknown}; expected {names}")
        if "codec_dir" not in spec:
            raise ValueError(f"compressed image-cache spec: codec_dir is required (a trained codec); got {spec!r}")
        return cls(**spec)

    def to_spec(self) -> dict:
        return {**dataclasses.asdict(self), "full_layers": list(self.full_layers)}

    @functools.cached_property
    def press(self) -> ResidualKVPress:
        """The ResidualKV press of these settings (its checks, its cached codec loading)."""
        return ResidualKVPress(codec_dir=self.codec_dir, full_layers=self.full_layers, bits=self.bits,
                               full_kv_bits=self.full_kv_bits)

    @property
    def codec(self):
        """The trained :class:`~kvbench.compress.residualkv.codec.ResidualCodec` (loaded once per directory).

        Raises:
            ValueError: ``codec_dir`` holds no trained codec, or ``bits`` does not fit its ``d_c``/``group``.
        """
        self.press.load()
        return self.press.codec_model

    @functools.cached_property
    def codec_id(self) -> str:
        """sha256 of the codec's weights and config files: which codec coded an entry."""
        h = hashlib.sha256()
        for name in (CODEC_FILE, CONFIG_FILE):
            h.update(sha256_file(Path(self.codec_dir, name)).encode())
        return h.hexdigest()

    def identity(self) -> dict:
        """The fields that pin a compressed store and its entries: the codec and the storage settings."""
        return {"codec_id": self.codec_id,
                "storage": {k: v for k, v in self.to_spec().items() if k != "codec_dir"}}


# --- coding one image ---------------------------------------------------------------------------------

def _flat(x: torch.Tensor) -> torch.Tensor:
    """``[H, n, D]`` -> ``[n, H·D]`` float32 (heads flattened as the codec's K‖V halves)."""
    return x.transpose(0, 1).reshape(x.shape[1], -1).float()


def _heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``[n, H·D]`` -> ``[H, n, D]``."""
    return x.reshape(x.shape[0], n_heads, -1).transpose(0, 1).contiguous()


def _schedule(cfg: CodecConfig, n: int, n_sink: int) -> tuple[list[int], list[int], int]:
    """``(reference positions, coded positions, sinks)`` of an image of ``n`` tokens under ``cfg``'s schedule
    (its stride, alpha and grid; ``n_sink`` the store's), as the cache's ``_ref_offsets``."""
    s = min(n_sink, n)
    refs = (references.references_between(s, n, n_sink=n_sink, stride=cfg.stride, alpha=cfg.alpha, grid=cfg.grid)
            if cfg.references else [])
    ref_set = set(refs)
    return refs, [p for p in range(s, n) if p not in ref_set], s


def _pack(codes: quant.QuantizedCodes | torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """Stored form of quantised codes: levels packed ``8/bits`` per byte and fp16 min/scale; fp16 codes at 16."""
    if bits == 16:
        return {"code": codes}
    return {"code": pack_levels(codes.q, bits), "zmin": codes.zmin, "scale": codes.scale}


def _unpack(t: dict[str, torch.Tensor], bits: int, group: int) -> torch.Tensor:
    """Dequantised codes float32 ``[C, d]`` of :func:`_pack`'s tensors."""
    if bits == 16:
        return quant.dequantize(t["code"])
    return quant.dequantize(quant.QuantizedCodes(unpack_levels(t["code"], bits), t["zmin"], t["scale"], bits, group))


@torch.no_grad()
def _code_sparse(layer: LayerCodec, kv: torch.Tensor, cfg: CodecConfig, bits: int, n_sink: int) -> dict:
    """ResidualKV's stored form of one sparse layer of an image (``kv`` float32 ``[n, d_kv]``): the steps of
    :meth:`ResidualKVLayer._compress` on the image as one block (references FP8 first, then the codes against
    the k nearest earlier references as read back)."""
    refs, coded, s = _schedule(cfg, kv.shape[0], n_sink)
    out = {"sink": kv[:s].half()}
    ref8, _ = quant.cast_fp8(kv[refs])
    out["ref"] = ref8
    if not coded:
        return out
    x, x_pos = kv[coded], torch.tensor(coded)
    if refs:
        nbr, valid = references.nearest_references(x, x_pos, ref8.float(), torch.tensor(refs), cfg.k)
        mean = mean_reference(ref8.float(), nbr, valid)
        out["nbr"] = torch.where(valid, nbr, -1).to(torch.int16 if len(refs) < 2 ** 15 else torch.int32)
    else:  # a codec without references codes against a zero mean (Table VIII), no indices
        mean = torch.zeros_like(x)
    z = layer.residual_code(x, mean)
    out.update(_pack(quant.quantize(z.float(), bits, cfg.group), bits))
    return out


@torch.no_grad()
def _restore_sparse(layer: LayerCodec, t: dict[str, torch.Tensor], n: int, cfg: CodecConfig, bits: int,
                    n_sink: int) -> torch.Tensor:
    """kv̂ float32 ``[n, d_kv]`` of :func:`_code_sparse`'s tensors: sinks as stored, references read back from
    FP8, coded tokens ``f_d(z̃) + mean`` (the codec's ``restore``)."""
    refs, coded, s = _schedule(cfg, n, n_sink)
    out = torch.empty(n, cfg.d_kv)
    out[:s] = t["sink"].float()
    ref = t["ref"].float()
    out[refs] = ref
    if coded:
        z = _unpack(t, bits, cfg.group)
        if "nbr" in t:
            nbr = t["nbr"].long()
            mean = mean_reference(ref, nbr.clamp(min=0), nbr >= 0)
        else:
            mean = torch.zeros(len(coded), cfg.d_kv)
        out[coded] = layer.restore(z, mean).float()
    return out


def _code_full(k: torch.Tensor, v: torch.Tensor, bits: int, head_dim: int) -> dict:
    """A full layer's K, V (``[n, d_k]`` float32): FP16 at ``bits`` 16, else KIVI's layout
    (:class:`~kvbench.compress.presses.kivi.KIVILayer`: keys per channel over :data:`FULL_KV_GROUP` tokens, the
    incomplete last group raw; values per token in groups of ``min(32, head_dim)``)."""
    if bits == 16:
        return {"full.k": k.half(), "full.v": v.half()}
    g = FULL_KV_GROUP
    nb = k.shape[0] // g
    out = {"full.kraw": k[nb * g:].half()}
    if nb:
        blocks = k[: nb * g].reshape(nb, g, -1).transpose(1, 2).reshape(-1, g)   # rows = (block, channel)
        out.update({f"full.k{name}": x for name, x in _pack(quant.quantize(blocks, bits, g), bits).items()})
    vg = min(g, head_dim)
    out.update({f"full.v{name}": x for name, x in _pack(quant.quantize(v, bits, vg), bits).items()})
    return out


def _restore_full(t: dict[str, torch.Tensor], n: int, d_k: int, bits: int, head_dim: int):
    """``(k, v)`` float32 ``[n, d_k]`` of :func:`_code_full`'s tensors."""
    if bits == 16:
        return t["full.k"].float(), t["full.v"].float()
    g = FULL_KV_GROUP
    nb = n // g
    parts = []
    if nb:
        kq = {name: t[f"full.k{name}"] for name in ("code", "zmin", "scale")}
        parts.append(_unpack(kq, bits, g).reshape(nb, d_k, g).transpose(1, 2).reshape(nb * g, d_k))
    parts.append(t["full.kraw"].float())
    vq = {name: t[f"full.v{name}"] for name in ("code", "zmin", "scale")}
    return torch.cat(parts), _unpack(vq, bits, min(g, head_dim))


def encode_image(kv: ImageKV, spec: CacheCodec) -> dict[str, torch.Tensor]:
    """The stored tensors of ``kv`` in ResidualKV's form (module docstring): per layer ``<name>.<l>`` (contiguous,
    on the CPU), plus ``embeds`` as given.

    Raises:
        ValueError: the codec does not fit the entry (its ``n_layers`` / ``d_kv`` against the entry's), or
            ``full_layers`` outside the model.
    """
    codec = spec.codec
    cfg = codec.config
    n_layers = len(kv.keys)
    h, n, d = kv.keys[0].shape
    if (cfg.n_layers, cfg.d_kv) != (n_layers, 2 * h * d):
        raise ValueError(f"codec {spec.codec_dir!r} does not fit this image cache: codec (n_layers, d_kv) = "
                         f"{(cfg.n_layers, cfg.d_kv)}, cache {(n_layers, 2 * h * d)}")
    spec.press.check_layers(n_layers)
    out: dict[str, torch.Tensor] = {}
    for i in range(n_layers):
        k, v = _flat(kv.keys[i].cpu()), _flat(kv.values[i].cpu())
        if i in spec.full_layers:
            coded = _code_full(k, v, spec.full_kv_bits, d)
        else:
            coded = _code_sparse(codec.layers[i].cpu(), torch.cat([k, v], -1), cfg, spec.bits, spec.n_sink)
        out.update({f"{name}.{i}": x.contiguous() for name, x in coded.items()})
    out["embeds"] = kv.embeds.detach().cpu().contiguous()
    return out


def decode_image(tensors: dict[str, torch.Tensor], meta: dict, spec: CacheCodec, dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Every token's K and V restored from :func:`encode_image`'s tensors: per layer ``[n_kv_heads, n, head_dim]``
    in ``dtype`` on ``device`` (``meta``: the sidecar's ``n_layers``, ``n_tokens``, ``n_kv_heads``, ``head_dim``)."""
    codec = spec.codec
    cfg = codec.config
    L, n, h, d = meta["n_layers"], meta["n_tokens"], meta["n_kv_heads"], meta["head_dim"]
    keys, values = [], []
    for i in range(L):
        mine = {name[: -len(f".{i}")]: x.cpu() for name, x in tensors.items() if name.endswith(f".{i}")}
        if i in spec.full_layers:
            k, v = _restore_full(mine, n, h * d, spec.full_kv_bits, d)
        else:
            kv = _restore_sparse(codec.layers[i].cpu(), mine, n, cfg, spec.bits, spec.n_sink)
            k, v = kv.split(h * d, -1)
        keys.append(_heads(k, h).to(device=device, dtype=dtype))
        values.append(_heads(v, h).to(device=device, dtype=dtype))
    return tuple(keys), tuple(values)


def stored_parts(tensors: dict[str, torch.Tensor] | str | Path, n_layers: int) -> list[StoredBytes]:
    """Packed bytes per layer and part (:data:`PARTS`) of stored tensors (a dict, or a safetensors file read
    lazily): each tensor's ``numel · element_size``; ``embeds`` is not K/V and is left out.

    Raises:
        ValueError: a tensor name that is neither ``embeds`` nor ``<part>[.<sub>].<layer>``.
    """
    parts = [StoredBytes(layer=i) for i in range(n_layers)]

    def add(name: str, nbytes: int) -> None:
        if name == "embeds":
            return
        prefix, _, layer = name.rpartition(".")
        part = PARTS.get(prefix.split(".")[0])
        if part is None or not layer.isdigit() or int(layer) >= n_layers:
            raise ValueError(f"stored image cache tensor {name!r} is not <part>.<layer> (parts {sorted(PARTS)}, "
                             f"layers 0..{n_layers - 1})")
        setattr(parts[int(layer)], part, getattr(parts[int(layer)], part) + nbytes)

    if isinstance(tensors, dict):
        for name, x in tensors.items():
            add(name, x.numel() * x.element_size())
    else:
        with safe_open(str(tensors), framework="pt") as f:
            for name in f.keys():
                x = f.get_slice(name)
                add(name, math.prod(x.get_shape()) * torch.empty(0, dtype=_DTYPES[x.get_dtype()]).element_size())
    return parts


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn,
           "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64}


def rel_error(restored: tuple[torch.Tensor, ...], raw: tuple[torch.Tensor, ...]) -> list[float]:
    """Per layer ``‖restored − raw‖ / ‖raw‖`` (Frobenius, float32): the restore error diagnostic."""
    return [float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm().clamp_min(1e-12))
            for a, b in zip(restored, raw)]


# --- the store -----------------------------------------------------------------------------------------

class CompressedImageKVStore(ImageKVStore):
    """An :class:`ImageKVStore` whose entries are stored in ResidualKV's form and restored on load.

    Args:
        root: directory of the compressed entries (created if missing; its own, never the raw store's).
        adapter, generic_system: as :class:`ImageKVStore`.
        spec: the :class:`CacheCodec`.
        source: the raw store entries are coded from (same adapter and generic prefix); None: read only, a
            missing entry goes to :meth:`missing`.

    Raises:
        CacheMismatchError: ``root`` holds entries of another model, template, codec or storage setting.
        ValueError: ``source`` is another model's or prefix's store.
    """

    def __init__(self, root: str | Path, adapter: VLMAdapter, generic_system: str, spec: CacheCodec,
                 source: ImageKVStore | None = None):
        self.spec = spec
        if source is not None and (source.model_id, source.generic_system) != (adapter.fingerprint(), generic_system):
            raise ValueError(f"the raw source store {source.root} holds another model or generic prefix than the "
                             f"compressed store {root}")
        if source is not None and Path(source.root).resolve() == Path(root).resolve():
            raise ValueError(f"the compressed store needs its own directory, got the raw store's {root}")
        self.source = source
        super().__init__(root, adapter, generic_system)

    def identity(self) -> dict:
        return {**super().identity(), "compressed_format": FORMAT_VERSION, **self.spec.identity()}

    def _load(self, key: str) -> ImageKV | None:
        entry = self._read(key)
        if entry is None:
            return None
        meta, t = entry
        return self._entry(key, meta, t)

    def _entry(self, key: str, meta: dict, t: dict[str, torch.Tensor]) -> ImageKV:
        keys, values = decode_image(t, meta, self.spec, self.adapter.dtype, self.adapter.device)
        return ImageKV(key=key, grid_thw=tuple(meta["grid_thw"]) if meta.get("grid_thw") else None,
                       keys=keys, values=values, embeds=t["embeds"].to(self.adapter.device))

    def missing(self, key: str) -> ImageKV:
        """A read-only store (no ``source``) lacks ``key``. Raises FileNotFoundError (a subclass may raise its own)."""
        raise FileNotFoundError(f"compressed image cache {self.root} has no valid entry {key[:12]} and no raw "
                                "source store to code it from")

    def _build(self, enc: dict, key: str) -> ImageKV:
        if self.source is None:
            return self.missing(key)
        raw = self.source._load(key) or self.source._build(enc, key)
        tensors = encode_image(raw, self.spec)
        h, n, d = raw.keys[0].shape
        L = len(raw.keys)
        parts = stored_parts(tensors, L)
        path, sidecar = self.paths(key)
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp))
        meta = {**self.identity(), "key": key, "sha256": sha256_file(path), "n_layers": L, "n_tokens": n,
                "n_kv_heads": h, "head_dim": d, "grid_thw": list(raw.grid_thw) if raw.grid_thw else None,
                "dtype": str(self.adapter.dtype)}
        entry = self._entry(key, meta, tensors)   # what a later load restores: the run reads exactly that
        meta["bytes"] = {"raw_kv": full_cache_bytes(n_tokens=n, n_layers=L, n_kv_heads=h, head_dim=d),
                         "compressed_kv": sum(p.packed() for p in parts),
                         "parts": {name: sum(getattr(p, name) for p in parts) for name in StoredBytes.PACKED},
                         "embeds": raw.embeds.numel() * raw.embeds.element_size()}
        meta["rel_err_k"] = rel_error(entry.keys, raw.keys)
        meta["rel_err_v"] = rel_error(entry.values, raw.values)
        write_json(sidecar, meta)
        self.stats["built"] += 1
        return entry

    def sidecar(self, key: str) -> dict:
        """The sidecar of entry ``key`` (bytes, restore error). Raises FileNotFoundError when it has none."""
        return json.loads(self.paths(key)[1].read_text())


def summarize(sidecars: list[dict]) -> dict[str, Any]:
    """Bytes per image (mean over ``sidecars``, one per distinct image) raw vs compressed, by part, KR, and the
    restore error (mean over images and layers; the worst layer's mean over images).

    Raises:
        ValueError: no sidecar (no image).
    """
    if not sidecars:
        raise ValueError("no compressed image entry to summarize")
    n = len(sidecars)
    mean = lambda xs: sum(xs) / n   # noqa: E731
    b = [s["bytes"] for s in sidecars]
    L = len(sidecars[0]["rel_err_k"])
    err = {}
    for kind in ("k", "v"):
        per_layer = [mean([s[f"rel_err_{kind}"][i] for s in sidecars]) for i in range(L)]
        err[f"rel_err_{kind}_mean"] = sum(per_layer) / L
        err[f"rel_err_{kind}_worst_layer"] = max(range(L), key=per_layer.__getitem__)
        err[f"rel_err_{kind}_worst"] = max(per_layer)
    raw, comp = mean([x["raw_kv"] for x in b]), mean([x["compressed_kv"] for x in b])
    return {"n_images": n, "tokens_per_image": mean([s["n_tokens"] for s in sidecars]),
            "raw_kv_bytes": raw, "compressed_kv_bytes": comp, "kr": comp / raw,
            "parts": {p: mean([x["parts"][p] for x in b]) for p in StoredBytes.PACKED},
            "embeds_bytes": mean([x["embeds"] for x in b]), **err}
