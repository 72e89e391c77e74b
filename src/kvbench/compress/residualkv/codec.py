"""The ResidualKV codec: a non-linear encoder f_c and a linear decoder f_d per decoder layer.

A non-reference token's pre-RoPE ``kv`` (K‖V of all KV heads, ``d_kv = 2 d_k``) is stored as the latent
residual ``z = f_c(kv) - f_c(mean_ref)`` (``d_c`` values) and restored as ``kv_hat = f_d(z) + mean_ref``,
where ``mean_ref`` is the mean of its k nearest earlier references in KV space
(ResidualKV, arXiv 2602.08005v2 §IV-A/B, Fig. 4). The encoder is a SwiGLU
``(silu(x W1) * (x W2)) W3``, the decoder one linear map, both without bias (paper; the authors'
``src/deltakv/modeling/compressor.py`` at b5169d6 defaults to bias on, kept here as an option).

Quantisation of ``z`` and the reference schedule live in other modules; this one only holds the
learned maps, their hyper-parameters (:class:`CodecConfig`) and their safetensors files.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from kvbench.compress.residualkv.references import GRIDS
from kvbench.utils.io import atomic_path, write_json

#: Bit widths of the latent quantiser (16 = no quantisation).
BITS = (2, 4, 8, 16)
#: Kinds of map an encoder or decoder may be.
KINDS = ("swiglu", "linear")
CODEC_FILE = "codec.safetensors"
CONFIG_FILE = "codec.json"


@dataclass
class CodecConfig:
    """Hyper-parameters of one model's ResidualKV codec (paper §IV-A, §V-A Table I).

    Parameters
    ----------
    n_layers : int — decoder layers of the backbone (one codec each).
    d_kv : int — ``2 d_k = 2 * n_kv_heads * head_dim``: K‖V of all KV heads, flattened.
    d_c : int — latent (residual code) width.
    d_ff : int — intermediate width of the SwiGLU map(s).
    k : int, 4 — references averaged per token.
    n_sink : int, 8 — attention-sink tokens kept raw.
    stride : int, 10 — reference stride ``s_0``.
    alpha : float, 0.0 — dynamic-stride growth (0 = fixed stride; §IV-A).
    grid : str, "paper" — reference grid of ``references.reference_mask`` ("paper" or "code"; the
        "code" grid restarts every ``window`` tokens, the authors' 128-token flush block).
    bits : int, 4 — latent quantisation bits (2, 4, 8, or 16 = off).
    group : int, 32 — latent values per quantisation group (within one token).
    window : int, 128 — recent tokens the cache keeps raw.
    bias : bool, False — linear layers with bias (paper: none; authors' config class default: on).
    joint : bool, True — one codec on K‖V; False: separate K and V codecs (Fig. 10), see
        :func:`separate_d_ff` for their sizing.
    encoder, decoder : str, "swiglu" / "linear" — kinds of f_c and f_d; ("linear", "swiglu") is
        the reversed codec of Fig. 6.
    references : bool, True — False: no reference tokens; every non-sink token is coded against a zero
        mean (z = f_c(kv) − f_c(0), kv̂ = f_d(z)): Table VIII's "without references" ablation.

    Raises:
        ValueError: non-positive sizes, ``k < 1``, ``n_sink``/``window`` negative, ``bits`` not in
            {2, 4, 8, 16}, ``d_c`` not a multiple of ``group`` (unless ``bits == 16``), ``d_c > d_kv``, odd ``d_kv``,
            odd ``d_c`` with ``joint=False``, unknown ``encoder``/``decoder``/``grid``, negative ``alpha``.
    """

    n_layers: int
    d_kv: int
    d_c: int
    d_ff: int
    k: int = 4
    n_sink: int = 8
    stride: int = 10
    alpha: float = 0.0
    grid: str = "paper"
    bits: int = 4
    group: int = 32
    window: int = 128
    bias: bool = False
    joint: bool = True
    encoder: str = "swiglu"
    decoder: str = "linear"
    references: bool = True

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_kv", "d_c", "d_ff", "stride", "group"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"CodecConfig.{name} must be a positive int, got {v!r}")
        for name in ("n_sink", "window"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"CodecConfig.{name} must be an int >= 0, got {v!r}")
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"CodecConfig.k (references per token) must be an int >= 1, got {self.k!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha >= 0):
            raise ValueError(f"CodecConfig.alpha must be a finite number >= 0, got {self.alpha!r}")
        if self.bits not in BITS:
            raise ValueError(f"CodecConfig.bits must be one of {BITS}, got {self.bits!r}")
        if self.bits != 16 and self.d_c % self.group:
            raise ValueError(f"CodecConfig.d_c={self.d_c} must be a multiple of group={self.group} "
                             f"(quantisation groups stay within one token), or set bits=16")
        if self.d_kv % 2:
            raise ValueError(f"CodecConfig.d_kv={self.d_kv} must be even (K and V halves)")
        if self.d_c > self.d_kv:
            raise ValueError(f"CodecConfig.d_c={self.d_c} is wider than d_kv={self.d_kv} (2 d_k): a residual "
                             f"code wider than the K‖V it codes compresses nothing")
        if not self.joint and self.d_c % 2:
            raise ValueError(f"CodecConfig.d_c={self.d_c} must be even with joint=False (K and V halves)")
        for name in ("encoder", "decoder"):
            if getattr(self, name) not in KINDS:
                raise ValueError(f"CodecConfig.{name} must be one of {KINDS}, got {getattr(self, name)!r}")
        if self.grid not in GRIDS:
            raise ValueError(f"CodecConfig.grid must be one of {GRIDS}, got {self.grid!r}")

    def to_json(self) -> str:
        """The config as a JSON object string (all fields)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | dict) -> CodecConfig:
        """Parse :meth:`to_json` output (a string or an already-decoded dict).

        Raises:
            ValueError: unknown or missing keys, or invalid values (see the class).
        """
        data = json.loads(text) if isinstance(text, str) else dict(text)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"CodecConfig JSON has unknown keys {unknown}; expected a subset of {sorted(names)}")
        try:
            return cls(**data)
        except TypeError as e:  # missing required keys
            raise ValueError(f"CodecConfig JSON incomplete: {e}") from e


class _SwiGLU(nn.Module):
    """``(silu(x W1) * (x W2)) W3``: [.., d_in] -> [.., d_out] (paper §IV-A, the encoder f_c)."""

    def __init__(self, d_in: int, d_ff: int, d_out: int, bias: bool) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_in, d_ff, bias=bias)
        self.w2 = nn.Linear(d_in, d_ff, bias=bias)
        self.w3 = nn.Linear(d_ff, d_out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


def _map(kind: str, d_in: int, d_ff: int, d_out: int, bias: bool) -> nn.Module:
    """An encoder/decoder map of ``kind`` ("swiglu" or "linear"; ``d_ff`` unused for linear)."""
    return _SwiGLU(d_in, d_ff, d_out, bias) if kind == "swiglu" else nn.Linear(d_in, d_out, bias=bias)


def _map_params(kind: str, d_in: int, d_ff: int, d_out: int, bias: bool) -> int:
    """Parameter count of :func:`_map` without building it."""
    if kind == "linear":
        return d_in * d_out + bias * d_out
    return 2 * (d_in * d_ff + bias * d_ff) + d_ff * d_out + bias * d_out


def _branch_params(cfg: CodecConfig, d_in: int, d_c: int, d_ff: int) -> int:
    """Parameters of one encoder + decoder pair on ``d_in`` values with latent ``d_c``."""
    return (_map_params(cfg.encoder, d_in, d_ff, d_c, cfg.bias)
            + _map_params(cfg.decoder, d_c, d_ff, d_in, cfg.bias))


def separate_d_ff(cfg: CodecConfig) -> int:
    """Intermediate width of each of the two K / V sub-codecs of a ``joint=False`` codec.

    Each sub-codec maps ``d_kv/2`` values to ``d_c/2``; halving every width would quarter the
    projection weights, so for Fig. 10's comparison at matched parameters the intermediate width is
    solved for (the count is linear in ``d_ff``) so that two sub-codecs hold as many parameters as
    one joint codec of ``cfg``'s sizes, rounded to the nearest integer (within 2% for any sizes a
    real model has; ``tests/test_rkv_codec.py`` checks it).
    """
    half_in, half_c = cfg.d_kv // 2, cfg.d_c // 2
    joint = _branch_params(cfg, cfg.d_kv, cfg.d_c, cfg.d_ff)
    c0 = 2 * _branch_params(cfg, half_in, half_c, 0)
    slope = 2 * _branch_params(cfg, half_in, half_c, 1) - c0
    if slope == 0:  # both maps linear: no free width
        return cfg.d_ff
    return max(1, round((joint - c0) / slope))


class _Branch(nn.Module):
    """One encoder f_c and decoder f_d on ``d_in`` values with a ``d_c`` latent."""

    def __init__(self, cfg: CodecConfig, d_in: int, d_c: int, d_ff: int) -> None:
        super().__init__()
        self.encoder = _map(cfg.encoder, d_in, d_ff, d_c, cfg.bias)
        self.decoder = _map(cfg.decoder, d_c, d_ff, d_in, cfg.bias)


class LayerCodec(nn.Module):
    """The codec of one decoder layer: f_c (encode) and f_d (decode) (paper §IV-A/B).

    With ``cfg.joint`` one branch codes the whole K‖V vector; otherwise branch 0 codes the K half
    (first ``d_kv/2`` values) into the first ``d_c/2`` latent values and branch 1 the V half into
    the rest (Fig. 10), each of width :func:`separate_d_ff`.
    """

    def __init__(self, cfg: CodecConfig) -> None:
        super().__init__()
        self.config = cfg
        if cfg.joint:
            self.branches = nn.ModuleList([_Branch(cfg, cfg.d_kv, cfg.d_c, cfg.d_ff)])
        else:
            d_ff = separate_d_ff(cfg)
            self.branches = nn.ModuleList([_Branch(cfg, cfg.d_kv // 2, cfg.d_c // 2, d_ff) for _ in range(2)])

    @property
    def dtype(self) -> torch.dtype:
        """Parameter dtype; inputs are cast to it (the backbone may run in another precision)."""
        return next(self.parameters()).dtype

    def _run(self, x: torch.Tensor, width: int, which: str) -> torch.Tensor:
        if x.shape[-1] != width:
            raise ValueError(f"LayerCodec.{which}: last dim must be {width}, got shape {tuple(x.shape)}")
        fn = "encoder" if which == "encode" else "decoder"
        x = x.to(self.dtype)
        parts = x.chunk(len(self.branches), dim=-1)
        return torch.cat([getattr(b, fn)(p) for b, p in zip(self.branches, parts)], dim=-1)

    def encode(self, kv: torch.Tensor) -> torch.Tensor:
        """f_c: float ``[..., d_kv]`` -> ``[..., d_c]`` in the codec's dtype.

        Raises:
            ValueError: last dim is not ``d_kv``.
        """
        return self._run(kv, self.config.d_kv, "encode")

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """f_d: float ``[..., d_c]`` -> ``[..., d_kv]`` in the codec's dtype (linear, no bias by default).

        Raises:
            ValueError: last dim is not ``d_c``.
        """
        return self._run(z, self.config.d_c, "decode")

    def residual_code(self, kv: torch.Tensor, mean_ref: torch.Tensor) -> torch.Tensor:
        """``z = f_c(kv) - f_c(mean_ref)``: ``[..., d_kv]`` x2 -> ``[..., d_c]`` (paper §IV-A, boxed).

        The references are averaged in KV space first and the mean is encoded (paper and authors'
        code), which differs from averaging encoded references since f_c is non-linear.
        """
        return self.encode(kv) - self.encode(mean_ref)

    def restore(self, z: torch.Tensor, mean_ref: torch.Tensor) -> torch.Tensor:
        """``kv_hat = f_d(z) + mean_ref``: ``[..., d_c]``, ``[..., d_kv]`` -> ``[..., d_kv]`` (paper §IV-B)."""
        return self.decode(z) + mean_ref.to(self.dtype)

    def linear_decoder(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """f_d as a matrix: ``(W_d [d_kv, d_c], b_d [d_kv] or None)`` in the codec's dtype, ``f_d(z) = z W_dᵀ +
        b_d`` (the paper's linear f_d): one branch's ``nn.Linear`` weight, or for a ``joint=False`` codec the
        block-diagonal matrix of its K and V branches (K codes the first d_c/2 latent values). Detached.

        Raises:
            ValueError: a branch's decoder is not an ``nn.Linear`` (the reversed codec of Fig. 6).
        """
        decoders = [b.decoder for b in self.branches]
        if not all(isinstance(d, nn.Linear) for d in decoders):
            raise ValueError(f"a linear decoder f_d (z W_d^T + b) is needed, got {[type(d).__name__ for d in decoders]}")
        w = torch.block_diag(*[d.weight.detach() for d in decoders])
        biases = [d.bias for d in decoders]
        return w, None if biases[0] is None else torch.cat([b.detach() for b in biases])


def _text_config(model_or_config: Any) -> Any:
    """The language-model config of a model or config (``text_config`` for VLMs)."""
    cfg = getattr(model_or_config, "config", model_or_config)
    return getattr(cfg, "text_config", None) or cfg


def model_kv_shape(model: Any) -> tuple[int, int]:
    """``(n_layers, d_kv)`` of a HF causal LM: ``d_kv = 2 * num_key_value_heads * head_dim``."""
    tc = _text_config(model)
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    n_kv = getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads
    return int(tc.num_hidden_layers), int(2 * n_kv * head_dim)


def config_kv_shape(cfg: dict, what: str = "model") -> tuple[int, int]:
    """``(n_layers, d_kv)`` of a ``config.json`` dict (``text_config`` for VLMs): :func:`model_kv_shape` for a
    config not loaded as a transformers object; ``d_kv = 2 * num_key_value_heads * head_dim`` (``head_dim`` else
    ``hidden_size // num_attention_heads``).

    Raises:
        ValueError: a field is missing, naming it and ``what``.
    """
    tc = cfg.get("text_config") or cfg
    try:
        n_heads = tc["num_attention_heads"]
        head_dim = tc.get("head_dim") or tc["hidden_size"] // n_heads
        n_kv = tc.get("num_key_value_heads") or n_heads
        return int(tc["num_hidden_layers"]), int(2 * n_kv * head_dim)
    except KeyError as e:
        raise ValueError(f"{what}: its config lacks {e.args[0]!r}, so its KV shape is unknown") from None


def codec_config_for_shape(n_layers: int, d_kv: int, **overrides: Any) -> CodecConfig:
    """The :class:`CodecConfig` of a backbone with ``n_layers`` layers and K‖V width ``d_kv``, with
    ``overrides`` applied over the defaults of :meth:`ResidualCodec.for_model` (which uses it). The
    workflow calls it while the DAG is built, so a bad codec setting fails before any training.

    Raises:
        ValueError: an override is not a :class:`CodecConfig` field, or the result is invalid.
    """
    fields = {f.name for f in dataclasses.fields(CodecConfig)} - {"n_layers", "d_kv"}
    bad = sorted(set(overrides) - fields)
    if bad:
        raise ValueError(f"unknown CodecConfig overrides {bad} (n_layers and d_kv come from the model); "
                         f"fields are {sorted(fields)}")
    kw = {"n_layers": n_layers, "d_kv": d_kv, "d_c": d_kv // 4, "d_ff": 3 * d_kv // 2, **overrides}
    if "group" not in overrides and isinstance(kw["d_c"], int) and not isinstance(kw["d_c"], bool) and 0 < kw["d_c"] < 32:
        # tiny models: d_c below 32 -> the largest group that divides it. A d_c >= 32 keeps the paper's 32,
        # so e.g. d_c = 48 is refused (naming d_c and group) instead of silently quantised in groups of 16.
        kw["group"] = math.gcd(kw["d_c"], 32)
    return CodecConfig(**kw)


class ResidualCodec(nn.Module):
    """One :class:`LayerCodec` per decoder layer (``layers``) and the shared :class:`CodecConfig` (``config``)."""

    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([LayerCodec(config) for _ in range(config.n_layers)])

    @classmethod
    def for_model(cls, model: Any, *, seed: int = 0, **overrides: Any) -> ResidualCodec:
        """A freshly initialised codec sized for ``model`` (a HF causal LM or VLM, or its config).

        Defaults: ``d_c = d_kv // 4`` and ``d_ff = 3 * d_kv // 2``, the ratios of Table I
        (Llama-3.1-8B: 2,048 -> 512, d_ff 3,072); ``group = 32`` (the paper's), or ``gcd(d_c, 32)`` when
        ``d_c < 32`` (tiny models; a ``d_c >= 32`` that 32 does not divide is an error, not a smaller group).
        Initialisation uses a private generator seeded with ``seed`` (the global torch RNG is left untouched),
        so equal seeds give equal weights.

        Raises:
            ValueError: an override is not a :class:`CodecConfig` field, or the result is invalid.
        """
        config = codec_config_for_shape(*model_kv_shape(model), **overrides)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return cls(config)

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``codec.safetensors`` (weights) and ``codec.json`` (config), each atomically."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        with atomic_path(directory / CODEC_FILE) as tmp:
            save_file(tensors, str(tmp))
        write_json(directory / CONFIG_FILE, dataclasses.asdict(self.config))

    @classmethod
    def load(cls, directory: str | os.PathLike, model: Any = None) -> ResidualCodec:
        """Read a codec written by :meth:`save` (safetensors only, nothing unpickled).

        Args:
            directory: holds ``codec.safetensors`` and ``codec.json``.
            model: optional backbone; its ``(n_layers, d_kv)`` must match the codec's.

        Raises:
            FileNotFoundError: a file is missing.
            ValueError: config invalid, weights do not match the config, or ``model`` has another
                ``d_kv`` / ``n_layers`` (message gives expected vs got).
        """
        directory = Path(directory)
        for name in (CODEC_FILE, CONFIG_FILE):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"{directory / name} not found (write it with ResidualCodec.save)")
        try:
            cfg = CodecConfig.from_json((directory / CONFIG_FILE).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{directory / CONFIG_FILE} is not valid JSON ({e.msg}, line {e.lineno})") from e
        except ValueError as e:
            raise ValueError(f"{directory / CONFIG_FILE}: {e}") from e
        if model is not None:
            n_layers, d_kv = model_kv_shape(model)
            if (n_layers, d_kv) != (cfg.n_layers, cfg.d_kv):
                raise ValueError(f"codec {directory} does not fit the model: model has n_layers={n_layers}, "
                                 f"d_kv={d_kv}; codec has n_layers={cfg.n_layers}, d_kv={cfg.d_kv}")
        codec = cls(cfg)
        try:
            state = load_file(str(directory / CODEC_FILE))
        except Exception as e:  # safetensors raises its own error type for a corrupt or truncated file
            raise ValueError(f"{directory / CODEC_FILE} is corrupt or truncated ({e})") from e
        try:
            codec.load_state_dict(state, strict=True)
        except RuntimeError as e:
            first = str(e).strip().splitlines()
            raise ValueError(f"{directory / CODEC_FILE} does not match {directory / CONFIG_FILE} "
                             f"({first[-1].strip() if first else e})") from e
        return codec

    def n_params(self) -> int:
        """Number of learned parameters over all layers."""
        return sum(p.numel() for p in self.parameters())
