"""The ResidualKV authors' compressor checkpoints (DeltaKV layout) in and out of :class:`ResidualCodec`.

Their layout (``CURRENTF/Sparse-vLLM`` ``src/deltakv/``, read at: ``modeling/compressor.py`` b7038f5,
``configs/model_config_cls.py`` 1a4f8ed, ``save_trainable_trainer.py`` (trainable parameters through
``save_pretrained``), ``get_chat_api.py`` 072904a ``load_compressor`` (reads ``<dir>/model.safetensors``,
config from ``<dir>/config.json``), ``modeling/hf_common.py`` 1b1c848, ``modeling/cache_pipeline.py`` 1f315e9):

- ``model.safetensors``: per decoder layer ``i``, with ``P = model.layers.{i}.self_attn.``:
  ``P compress_down.w12.weight [2 d_ff, d_kv]`` (SwiGLU: the first ``d_ff`` output rows are the gate,
  ``silu(x1) * x2``), ``P compress_down.w3.weight [d_c, d_ff]`` (or ``P compress_down.weight [d_c, d_kv]`` for a
  linear down-projection), ``P compress_up.weight [d_kv, d_c]``, and a ``.bias`` beside each weight when
  ``compressor_linear_bias`` is true.
- ``config.json``: the whole backbone config (e.g. a ``LlamaConfig``) extended with their fields.

Key map (ours: ``layers.{i}.branches.0.``): ``encoder.w1`` = ``w12[:d_ff]``, ``encoder.w2`` = ``w12[d_ff:]``,
``encoder.w3`` = ``w3``; a linear encoder = ``compress_down``; ``decoder`` = ``compress_up``.

Field map (theirs -> :class:`CodecConfig`): ``kv_compressed_size`` -> ``d_c``; the down intermediate size
(``compressor_down_intermediate_size``, else ``compressor_intermediate_size``, else ``(d_kv + d_c) // 2``, as their
``create_compressor``) -> ``d_ff``; ``compressor_down_type`` / ``compressor_up_type`` (``auto`` = ``mlp_gelu`` if
``use_nonlinear_compressor`` else ``linear``) -> ``encoder`` / ``decoder``; ``compressor_linear_bias`` -> ``bias``;
``deltakv_neighbor_count`` (legacy ``k_neighbors``) -> ``k``; ``1 / cluster_ratio`` -> ``stride``; ``stride_alpha``
-> ``alpha``; ``num_sink_tokens`` -> ``n_sink``; ``num_recent_tokens`` -> ``window``; ``kv_quant_bits`` (2/4/8) ->
``bits``. A field their ``config.json`` lacks takes their config class's default (the value their loader would use).
Fields their checkpoint does not fix (``group``, ``grid``, ``references``; ``bits`` when ``kv_quant_bits`` is 0,
their unquantised default, which their training never sets) come from the caller's overrides, else
:func:`~kvbench.compress.residualkv.codec.codec_config_for_shape`'s defaults. An override may replace any
inference-time field; a structural one (``d_c``, ``d_ff``, ``bias``, ``encoder``, ``decoder``, ``joint``) must equal
the checkpoint's. :attr:`ImportPlan.sources` says where each field came from.

Refused (never approximated): a GELU MLP compressor, a non-linear up-projection (the paper's f_d is linear),
``split_kv`` (their K and V compressors each take ``d_kv/2`` to a full ``kv_compressed_size`` latent and rank K's
and V's references separately; our ``joint=False`` halves the latent, derives its ``d_ff`` and ranks references on
K‖V, so no exact mapping exists), a reference metric other than L2 on K‖V (``cluster_metric``, ``cluster_on_kv``),
``collect_kv_before_rope`` false, ``use_compression``/``use_cluster`` false, a ``cluster_ratio`` whose inverse is not
an integer, missing or extra tensors, a shape that differs from the config or from the target model, and weights
only in a pickle file (``*.bin``/``*.pt``: never unpickled) or sharded.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvbench.compress.residualkv.codec import (
    CODEC_FILE,
    CodecConfig,
    ResidualCodec,
    codec_config_for_shape,
    config_kv_shape,
)
from kvbench.utils.io import atomic_path, sha256_file, write_json
from kvbench.utils.spec import is_int

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
#: Written beside ``codec.safetensors``/``codec.json`` by :func:`write_import`.
PROVENANCE_FILE = "provenance.json"
SOURCE = "CURRENTF/Sparse-vLLM src/deltakv (compressor.py b7038f5, model_config_cls.py 1a4f8ed, get_chat_api.py 072904a)"
#: Their config class's defaults (``CustomConfigMixin.__init__``, model_config_cls.py 1a4f8ed) of the fields read here.
THEIR_DEFAULTS: dict[str, Any] = {
    "kv_compressed_size": 128, "deltakv_neighbor_count": 1, "use_nonlinear_compressor": True,
    "compressor_intermediate_size": 2048, "compressor_down_type": "auto", "compressor_up_type": "auto",
    "compressor_down_intermediate_size": -1, "compressor_up_intermediate_size": -1, "collect_kv_before_rope": True,
    "compressor_linear_bias": True, "split_kv": False, "cluster_metric": "l2", "cluster_on_kv": True,
    "cluster_ratio": 0.1, "stride_alpha": 0.0, "num_sink_tokens": 8, "num_recent_tokens": 128,
    "use_compression": False, "use_cluster": True, "kv_quant_bits": 0,
}
#: Their compressor type names and aliases (``_normalize_compressor_type``) -> canonical.
_TYPES = {"": "auto", "auto": "auto", "linear": "linear", "mlp": "mlp_gelu", "gelu": "mlp_gelu",
          "mlp_gelu": "mlp_gelu", "swiglu": "mlp_swiglu", "mlp_swiglu": "mlp_swiglu"}
_KIND = {"mlp_swiglu": "swiglu", "linear": "linear"}  # theirs -> CodecConfig.encoder/decoder
STRUCTURAL = ("d_c", "d_ff", "bias", "encoder", "decoder", "joint")
#: Their fields :func:`export_deltakv` writes (and :func:`import_deltakv` reads back unchanged).
EXPORTED_FIELDS = (
    "kv_compressed_size", "compressor_down_type", "compressor_up_type", "use_nonlinear_compressor",
    "compressor_intermediate_size", "compressor_down_intermediate_size", "compressor_up_intermediate_size",
    "compressor_linear_bias", "split_kv", "collect_kv_before_rope", "use_compression", "use_cluster",
    "cluster_metric", "cluster_on_kv", "deltakv_neighbor_count", "cluster_ratio", "stride_alpha",
    "num_sink_tokens", "num_recent_tokens", "tail_token_size", "kv_quant_bits",
)
_PICKLES = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt")


def model_config_dict(model: Any) -> dict:
    """The backbone config as a dict: ``model`` is a checkpoint directory (its ``config.json``), a dict, a HF
    ``PretrainedConfig`` or a model with ``.config``.

    Raises:
        FileNotFoundError: a directory without ``config.json``.
        ValueError: ``config.json`` is not a JSON object.
    """
    if isinstance(model, (str, os.PathLike)):
        path = Path(model) / CONFIG_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found (the target model's config)")
        return _read_json(path)
    if isinstance(model, dict):
        return dict(model)
    cfg = getattr(model, "config", model)
    return cfg.to_dict()


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def weights_file(src_dir: str | os.PathLike) -> Path:
    """``<src_dir>/model.safetensors``, the file their loader reads.

    Raises:
        FileNotFoundError: ``src_dir`` or the file is missing (and no other weight file is there).
        ValueError: only pickle weights (``*.bin``, ``*.pt``, ...; never unpickled here) or shards are there.
    """
    src = Path(src_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"DeltaKV compressor directory {src} does not exist")
    path = src / WEIGHTS_FILE
    if path.is_file():
        return path
    pickles = sorted(p.name for pat in _PICKLES for p in src.glob(pat) if p.name != "training_args.bin")
    if pickles:
        raise ValueError(f"{src} holds compressor weights only as pickle file(s) {pickles}; kvbench never unpickles "
                         f"weights. Convert them to {WEIGHTS_FILE} first, where you trust the file (e.g. "
                         f"safetensors.torch.save_file(torch.load(f, weights_only=True), '{WEIGHTS_FILE}'))")
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    if shards:
        raise ValueError(f"{src} has {shards} but no {WEIGHTS_FILE}; their loader (get_chat_api.load_compressor) "
                         f"reads {WEIGHTS_FILE} only: merge the shards into it")
    raise FileNotFoundError(f"{src} has no {WEIGHTS_FILE} (the compressor weights)")


def _kind(cfg: dict, direction: str) -> str:
    """Their resolved compressor type of ``direction`` ("down"/"up"): linear, mlp_gelu or mlp_swiglu."""
    name = f"compressor_{direction}_type"
    raw = cfg.get(name, THEIR_DEFAULTS[name])
    key = "auto" if raw is None else str(raw).lower().strip()
    if key not in _TYPES:
        raise ValueError(f"config.json {name}={raw!r} is not a DeltaKV compressor type "
                         f"(expected one of {sorted(set(_TYPES) - {''})})")
    kind = _TYPES[key]
    if kind == "auto":
        kind = "mlp_gelu" if cfg.get("use_nonlinear_compressor", THEIR_DEFAULTS["use_nonlinear_compressor"]) else "linear"
    return kind


def _intermediate(cfg: dict, direction: str, d_in: int, d_out: int) -> int:
    """Their intermediate width of an MLP compressor (``create_compressor``'s order of fallbacks)."""
    for name in (f"compressor_{direction}_intermediate_size", "compressor_intermediate_size"):
        v = int(cfg.get(name, THEIR_DEFAULTS[name]) or 0)
        if v > 0:
            return v
    return (d_in + d_out) // 2


def _their_keys(i: int, cfg: CodecConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{their key: (our key, expected shape)}`` of layer ``i``; the w12 key maps to the pair w1/w2 ("w1|w2")."""
    p, o = f"model.layers.{i}.self_attn.", f"layers.{i}.branches.0."
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    if cfg.encoder == "swiglu":
        out[p + "compress_down.w12.weight"] = (o + "encoder.w1|w2.weight", (2 * cfg.d_ff, cfg.d_kv))
        out[p + "compress_down.w3.weight"] = (o + "encoder.w3.weight", (cfg.d_c, cfg.d_ff))
        if cfg.bias:
            out[p + "compress_down.w12.bias"] = (o + "encoder.w1|w2.bias", (2 * cfg.d_ff,))
            out[p + "compress_down.w3.bias"] = (o + "encoder.w3.bias", (cfg.d_c,))
    else:
        out[p + "compress_down.weight"] = (o + "encoder.weight", (cfg.d_c, cfg.d_kv))
        if cfg.bias:
            out[p + "compress_down.bias"] = (o + "encoder.bias", (cfg.d_c,))
    out[p + "compress_up.weight"] = (o + "decoder.weight", (cfg.d_kv, cfg.d_c))
    if cfg.bias:
        out[p + "compress_up.bias"] = (o + "decoder.bias", (cfg.d_kv,))
    return out


def key_map(cfg: CodecConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of a checkpoint of ``cfg``: ``{their key: (our key, shape)}`` (module doc's key map)."""
    return {k: v for i in range(cfg.n_layers) for k, v in _their_keys(i, cfg).items()}


@dataclass
class ImportPlan:
    """What :func:`import_deltakv` will build, checked without reading any weight data.

    Attributes:
        config: the :class:`CodecConfig` of the imported codec.
        sources: CodecConfig field -> where its value came from (``checkpoint config.json: <their field>=<value>``,
            ``their default: <field>=<value>``, ``override``, ``kvbench default``, ``target model``).
        weights: the safetensors file read.
        deltakv: their config fields as read (with their defaults filled in), for the provenance record.
    """

    config: CodecConfig
    sources: dict[str, str]
    weights: Path
    deltakv: dict[str, Any] = field(default_factory=dict)


_KINDS = {int: "an integer", bool: "true or false", float: "a finite number"}


def _their(cfg: dict, name: str, sources_key: str, sources: dict, kind: type | None = None) -> Any:
    """``cfg[name]`` (else their default), recorded in ``sources``; with ``kind``, a JSON value of that type
    (a string "false" is not false: their loader would take it as true).

    Raises:
        ValueError: the value is not of ``kind``, naming the field.
    """
    if name in cfg:
        sources[sources_key] = f"checkpoint config.json: {name}={cfg[name]!r}"
        value = cfg[name]
    else:
        sources[sources_key] = f"their default: {name}={THEIR_DEFAULTS[name]!r}"
        value = THEIR_DEFAULTS[name]
    ok = {int: is_int,
          bool: lambda v: isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    if kind is not None and not ok[kind](value):
        raise ValueError(f"config.json field {name}={value!r}: expected {_KINDS[kind]}")
    return value


def _stride(ratio: Any) -> int:
    """``1 / cluster_ratio`` as their code uses it (``max(1, int(1 / ratio))``), only where it is an integer."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"config.json cluster_ratio={ratio!r}: expected a number in (0, 1] (reference stride "
                         f"= 1/cluster_ratio)")
    inv = 1.0 / ratio
    if abs(inv - round(inv)) > 1e-9 * inv or int(inv) != round(inv):
        raise ValueError(f"config.json cluster_ratio={ratio!r}: 1/cluster_ratio = {inv!r} is not an integer stride "
                         f"(their code truncates it to {max(1, int(inv))}); pass the stride you mean as an override "
                         f"(e.g. {{\"stride\": {max(1, round(inv))}}})")
    return int(round(inv))


def plan_import(src_dir: str | os.PathLike, model: Any = None, **overrides: Any) -> ImportPlan:
    """Check a DeltaKV compressor directory against its own ``config.json``, the target ``model`` and
    ``overrides``, reading only the config and the safetensors header (cheap enough for DAG time).

    Args:
        src_dir: holds ``config.json`` and ``model.safetensors`` (module doc).
        model: the target backbone (see :func:`model_config_dict`) or its ``(n_layers, d_kv)``; None: the
            checkpoint's own backbone config.
        overrides: :class:`CodecConfig` fields (not ``n_layers``/``d_kv``); inference-time ones replace the
            checkpoint's, structural ones (:data:`STRUCTURAL`) must equal it.

    Raises:
        FileNotFoundError: the directory, ``config.json`` or ``model.safetensors`` is missing.
        ValueError: anything of the module doc's refusals, naming the key or field, its value and what was
            expected.
    """
    src = Path(src_dir)
    weights = weights_file(src)
    cfg_path = src / CONFIG_FILE
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found (a DeltaKV compressor directory holds config.json beside "
                                f"{WEIGHTS_FILE})")
    cfg = _read_json(cfg_path)
    bad_over = sorted(set(overrides) - ({f.name for f in dataclasses.fields(CodecConfig)} - {"n_layers", "d_kv"}))
    if bad_over:
        raise ValueError(f"unknown CodecConfig override(s) {bad_over} (n_layers and d_kv come from the model)")
    for name, want in (("use_compression", True), ("use_cluster", True), ("collect_kv_before_rope", True),
                       ("split_kv", False), ("cluster_metric", "l2"), ("cluster_on_kv", True)):
        got = cfg.get(name, THEIR_DEFAULTS[name])
        if got != want:
            why = {"use_compression": "their inference builds no learned compressor without it",
                   "use_cluster": "their inference is reference-based (cluster) only",
                   "collect_kv_before_rope": "the codec codes pre-RoPE K‖V (their inference refuses it too)",
                   "split_kv": "separate K/V compressors with a full latent each and K-only / V-only reference "
                               "ranking have no exact joint=False equivalent here (module doc)",
                   "cluster_metric": "references are ranked by L2 distance here",
                   "cluster_on_kv": "references are ranked on K‖V here, not on K alone"}[name]
            raise ValueError(f"{cfg_path}: {name}={got!r} is not supported (expected {want!r}): {why}")
    if "k_neighbors" in cfg and "deltakv_neighbor_count" in cfg and cfg["k_neighbors"] != cfg["deltakv_neighbor_count"]:
        raise ValueError(f"{cfg_path}: k_neighbors={cfg['k_neighbors']!r} and deltakv_neighbor_count="
                         f"{cfg['deltakv_neighbor_count']!r} differ (their loader refuses this too)")

    sources: dict[str, str] = {}
    own_shape = config_kv_shape(cfg, f"{cfg_path} (their backbone config)")
    if model is not None:
        target = tuple(model) if isinstance(model, tuple) else config_kv_shape(model_config_dict(model), "target model")
        if target != own_shape:
            raise ValueError(f"{src}: the compressor was saved for a backbone with (n_layers, d_kv) = {own_shape} "
                             f"(its config.json), the target model has {target}")
        sources["n_layers"] = sources["d_kv"] = "target model (equal to the checkpoint's backbone config)"
    else:
        sources["n_layers"] = sources["d_kv"] = "checkpoint config.json (backbone fields)"
    n_layers, d_kv = own_shape

    down, up = _kind(cfg, "down"), _kind(cfg, "up")
    if down not in _KIND:
        raise ValueError(f"{cfg_path}: the down-projection is {down!r} (compressor_down_type="
                         f"{cfg.get('compressor_down_type', 'auto')!r}, use_nonlinear_compressor="
                         f"{cfg.get('use_nonlinear_compressor', THEIR_DEFAULTS['use_nonlinear_compressor'])!r}); "
                         f"only mlp_swiglu or linear map onto the codec's encoder (no GELU MLP here)")
    if up != "linear":
        raise ValueError(f"{cfg_path}: the up-projection is {up!r} (compressor_up_type="
                         f"{cfg.get('compressor_up_type', 'auto')!r}); the codec's f_d is linear (paper §IV-B)")
    d_c = _their(cfg, "kv_compressed_size", "d_c", sources, int)
    kw: dict[str, Any] = {"d_c": d_c, "encoder": _KIND[down], "decoder": "linear", "joint": True}
    sources["encoder"] = f"checkpoint config.json: compressor_down_type resolves to {down!r}"
    sources["decoder"] = "checkpoint config.json: compressor_up_type resolves to 'linear'"
    sources["joint"] = "checkpoint config.json: split_kv false"
    kw["d_ff"] = _intermediate(cfg, "down", d_kv, d_c)
    sources["d_ff"] = ("checkpoint config.json: down intermediate size" if down == "mlp_swiglu"
                       else "unused by a linear encoder: their fallback width")
    kw["bias"] = _their(cfg, "compressor_linear_bias", "bias", sources, bool)
    # the legacy name only when the current one is absent (their config class migrates it the same way)
    k_name = "k_neighbors" if "deltakv_neighbor_count" not in cfg and "k_neighbors" in cfg else "deltakv_neighbor_count"
    kw["k"] = max(1, _their(cfg, k_name, "k", sources, int))  # their get_cluster_neighbor_count
    kw["alpha"] = float(_their(cfg, "stride_alpha", "alpha", sources, float))
    kw["n_sink"] = _their(cfg, "num_sink_tokens", "n_sink", sources, int)
    kw["window"] = _their(cfg, "num_recent_tokens", "window", sources, int)
    bits = cfg.get("kv_quant_bits", THEIR_DEFAULTS["kv_quant_bits"])
    if bits not in (0, 2, 4, 8) or isinstance(bits, bool):
        raise ValueError(f"{cfg_path}: kv_quant_bits={bits!r}: expected 0 (unquantised), 2, 4 or 8")
    if bits:
        kw["bits"] = int(bits)
        sources["bits"] = f"checkpoint config.json: kv_quant_bits={bits!r}"
    if "stride" not in overrides:
        ratio = _their(cfg, "cluster_ratio", "stride", sources)
        kw["stride"] = _stride(ratio)
    for name in STRUCTURAL:
        if name in overrides and overrides[name] != kw[name] and not (name == "d_ff" and kw["encoder"] == "linear"):
            raise ValueError(f"override {name}={overrides[name]!r} contradicts the checkpoint {src}, which has "
                             f"{name}={kw[name]!r} ({sources.get(name, 'checkpoint')}); drop it or set it equal")
    kw.update(overrides)
    for name in overrides:
        sources[name] = "override"
    try:
        config = codec_config_for_shape(n_layers, d_kv, **kw)
    except ValueError as e:
        raise ValueError(f"{src}: the imported settings are not a valid codec: {e}") from None
    for f in dataclasses.fields(CodecConfig):
        sources.setdefault(f.name, "kvbench default")
    _check_tensors(weights, config)
    deltakv = {k: cfg.get(k, THEIR_DEFAULTS[k]) for k in THEIR_DEFAULTS}
    deltakv.update({k: cfg[k] for k in ("k_neighbors", "cluster_soft_assignment", "tail_token_size") if k in cfg})
    return ImportPlan(config, dict(sorted(sources.items())), weights, deltakv)


def _check_tensors(weights: Path, config: CodecConfig) -> None:
    """The safetensors header holds exactly :func:`key_map`'s keys at their shapes (no data is read)."""
    try:
        with safe_open(str(weights), "pt", "cpu") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error type for a corrupt or truncated file
        raise ValueError(f"{weights} is not a readable safetensors file ({e})") from None
    want = key_map(config)
    missing, extra = sorted(set(want) - set(shapes)), sorted(set(shapes) - set(want))
    if missing or extra:
        hint = ""
        if any(".compress_down.0." in k or ".compress_down.2." in k for k in extra):
            hint = " (compress_down.0/.2 are a GELU MLP's: not supported)"
        elif any("k_compress_" in k or "v_compress_" in k for k in extra):
            hint = " (k_/v_compress_* are a split_kv checkpoint's: not supported)"
        elif any(k.endswith(".bias") for k in extra) and not config.bias:
            hint = " (biases present: is compressor_linear_bias false in config.json by mistake?)"
        raise ValueError(f"{weights}: tensors do not match its config.json "
                         f"(d_c={config.d_c}, d_ff={config.d_ff}, bias={config.bias}, encoder={config.encoder}, "
                         f"{config.n_layers} layers): missing {missing[:4]}{' ...' if len(missing) > 4 else ''} "
                         f"({len(missing)}), unexpected {extra[:4]}{' ...' if len(extra) > 4 else ''} "
                         f"({len(extra)}){hint}")
    for k, (_, shape) in want.items():
        if shapes[k] != shape:
            raise ValueError(f"{weights}: tensor {k} has shape {list(shapes[k])}, expected {list(shape)} "
                             f"(d_kv={config.d_kv}, d_c={config.d_c}, d_ff={config.d_ff})")


def import_deltakv(src_dir: str | os.PathLike, model: Any = None, **overrides: Any) -> ResidualCodec:
    """A :class:`ResidualCodec` holding a DeltaKV compressor's weights, bit for bit, in their dtype.

    Args and checks: :func:`plan_import`. The returned codec's parameters have the checkpoint's dtype (bf16 for
    the authors' releases); ``ResidualCodec.load`` of a saved copy gives float32 with the same values.

    Raises:
        FileNotFoundError, ValueError: see :func:`plan_import`.
    """
    plan = plan_import(src_dir, model, **overrides)
    return _build(plan)


def _build(plan: ImportPlan) -> ResidualCodec:
    state = load_file(str(plan.weights))
    dtypes = {t.dtype for t in state.values()}
    if any(not d.is_floating_point for d in dtypes):
        raise ValueError(f"{plan.weights}: non-float tensors {sorted(map(str, dtypes))}")
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    ours: dict[str, torch.Tensor] = {}
    d_ff = plan.config.d_ff
    for theirs, (key, _) in key_map(plan.config).items():
        t = state[theirs]
        if "w1|w2" in key:  # their fused w12: gate (w1) is the first d_ff rows
            ours[key.replace("w1|w2", "w1")], ours[key.replace("w1|w2", "w2")] = t[:d_ff], t[d_ff:]
        else:
            ours[key] = t
    with torch.random.fork_rng(devices=[]):  # the init is overwritten; leave the caller's RNG alone
        codec = ResidualCodec(plan.config).to(dtype)
    codec.load_state_dict({k: v.to(dtype) for k, v in ours.items()}, strict=True)
    return codec


def write_import(src_dir: str | os.PathLike, out_dir: str | os.PathLike, model: Any = None,
                 **overrides: Any) -> dict:
    """:func:`import_deltakv`, then ``ResidualCodec.save(out_dir)`` and ``provenance.json`` (source directory,
    sha256 of its weight file, their fields as read, where each CodecConfig field came from). Returns the
    provenance record.

    Raises:
        FileNotFoundError, ValueError: see :func:`plan_import`.
    """
    plan = plan_import(src_dir, model, **overrides)
    codec = _build(plan)
    out = Path(out_dir)
    record = {
        "kind": "deltakv-import", "source_dir": str(Path(src_dir).resolve()), "weights_file": plan.weights.name,
        "weights_sha256": sha256_file(plan.weights),
        "config_sha256": sha256_file(Path(src_dir) / CONFIG_FILE), "dtype": str(codec.layers[0].dtype),
        "overrides": overrides, "sources": plan.sources, "deltakv_fields": plan.deltakv, "format": SOURCE,
    }
    codec.save(out)
    write_json(out / PROVENANCE_FILE, record)
    return record


def export_deltakv(codec: ResidualCodec, out_dir: str | os.PathLike, model_config: Any,
                   dtype: torch.dtype | None = None) -> dict:
    """Write ``codec`` as a DeltaKV compressor directory their loader accepts: ``model.safetensors`` (their keys,
    w12 = cat(w1, w2) along the output dim) and ``config.json`` (the backbone's fields plus theirs,
    :data:`EXPORTED_FIELDS`). Returns ``{"config": written config, "not_carried": {field: value}}``: our fields
    their config cannot express (``grid``, ``group``, ``references``; bits 16 is written as 0, unquantised).

    Args:
        codec: a joint codec with a SwiGLU or linear encoder and a linear decoder.
        out_dir: created if needed; both files written atomically.
        model_config: the backbone (see :func:`model_config_dict`); its shape must match the codec's. Their loader
            builds llama / qwen2 / qwen3 models only.
        dtype: of the written tensors (default: the codec's).

    Raises:
        ValueError: ``joint=False``, a non-linear decoder, a stride whose inverse does not round-trip, or a
            model of another (n_layers, d_kv).
    """
    cfg = codec.config
    if not cfg.joint:
        raise ValueError("a joint=False codec has no DeltaKV equivalent (their split_kv differs: module doc)")
    if cfg.decoder != "linear":
        raise ValueError(f"the DeltaKV format holds a linear f_d here; this codec's decoder is {cfg.decoder!r}")
    base = model_config_dict(model_config)
    shape = config_kv_shape(base, "model_config")
    if shape != (cfg.n_layers, cfg.d_kv):
        raise ValueError(f"codec (n_layers, d_kv) = {(cfg.n_layers, cfg.d_kv)} does not fit model_config {shape}")
    ratio = 1.0 / cfg.stride
    if int(1.0 / ratio) != cfg.stride:
        raise ValueError(f"stride {cfg.stride}: 1/(1/stride) does not give it back in float; their int(1/ratio) "
                         f"would read another stride")
    swiglu = cfg.encoder == "swiglu"
    fields = {
        "kv_compressed_size": cfg.d_c, "compressor_down_type": "mlp_swiglu" if swiglu else "linear",
        "compressor_up_type": "linear", "use_nonlinear_compressor": swiglu, "compressor_intermediate_size": cfg.d_ff,
        "compressor_down_intermediate_size": cfg.d_ff if swiglu else -1, "compressor_up_intermediate_size": -1,
        "compressor_linear_bias": cfg.bias, "split_kv": False, "collect_kv_before_rope": True,
        "use_compression": True, "use_cluster": True, "cluster_metric": "l2", "cluster_on_kv": True,
        "deltakv_neighbor_count": cfg.k, "cluster_ratio": ratio, "stride_alpha": cfg.alpha,
        "num_sink_tokens": cfg.n_sink, "num_recent_tokens": cfg.window, "tail_token_size": cfg.window,
        "kv_quant_bits": cfg.bits if cfg.bits < 16 else 0,
    }
    config = {k: v for k, v in base.items() if k != "k_neighbors"}  # the legacy name would have to agree
    config.update(fields)
    state = codec.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for theirs, (key, _) in key_map(cfg).items():
        if "w1|w2" in key:
            t = torch.cat([state[key.replace("w1|w2", "w1")], state[key.replace("w1|w2", "w2")]], dim=0)
        else:
            t = state[key]
        tensors[theirs] = t.detach().to(dtype or t.dtype).contiguous().cpu()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / WEIGHTS_FILE) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})  # "pt": what transformers' loaders expect
    write_json(out / CONFIG_FILE, config)
    # their HF cache quantises each code as one group and schedules references per flushed block; ablating the
    # references is an environment variable there (REMOVE_REF), not a config field
    return {"config": config, "not_carried": {name: getattr(cfg, name) for name in ("grid", "group", "references")}}


def saved_dtype(codec_dir: str | os.PathLike) -> torch.dtype:
    """The dtype a codec directory's ``codec.safetensors`` stores (``ResidualCodec.load`` gives float32; an
    imported codec is saved in its source dtype, so exporting in this dtype gives the source bytes back).

    Raises:
        FileNotFoundError: no ``codec.safetensors``.
    """
    path = Path(codec_dir) / CODEC_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (a codec directory written by ResidualCodec.save)")
    with safe_open(str(path), "pt", "cpu") as f:
        return f.get_tensor(next(iter(f.keys()))).dtype
