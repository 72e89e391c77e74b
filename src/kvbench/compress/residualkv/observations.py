"""ResidualKV's observations (arXiv 2602.08005v2 §III, Fig. 3): how redundant pre-RoPE K‖V is.

For every token of a context and every decoder layer, ``kv = k_proj(x) ‖ v_proj(x)`` ``[T, 2 d_k]`` (K and V of all
KV heads concatenated, before any key norm and before RoPE: the tensor the codec codes, :mod:`.keys`):

- (a) the maximum cosine similarity to any EARLIER token of the same context (the paper: mean 0.92 on
  Qwen2.5-7B-Instruct-1M), and (b) the distance in tokens to that best match (the paper: 59.7% beyond 16 tokens,
  so a local window would miss most matches) — :func:`max_cosine_to_earlier`;
- (c)-(f) the residual the codec codes, ``kv - mean of the k nearest earlier references`` (the reference schedule
  and retrieval of :mod:`.references`, with the main codec's ``k``, ``stride``, ``n_sink``, ``alpha``, ``grid``:
  the same residual :func:`kvbench.compress.residualkv.train.compress_kv` hands to the codec), against the raw kv of
  the same tokens — :func:`reference_residuals`: its spectrum (:func:`cumulative_explained_variance`), norms, values
  and per-token extremes.

:func:`observe` runs a model over a few contexts and gathers these per layer (:class:`LayerObservations`); tensors
stay bounded: ``max_tokens`` caps the tokens analysed and the cosine maximum runs over chunks of rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from kvbench.compress.cache import decoder_layers
from kvbench.compress.generate import split_prompt
from kvbench.compress.residualkv.references import check_schedule, nearest_references, reference_mask
from kvbench.compress.residualkv.train import record_kv
from kvbench.kernels.reference_mean import mean_reference
from kvbench.utils.io import read_jsonl

#: Entries of one chunk of the [rows, T] cosine matrix (float32: 16 MiB).
_CHUNK_ENTRIES = 1 << 22


def max_cosine_to_earlier(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's maximum cosine similarity to any earlier token of the same sequence, and its distance.

    Args:
        kv: float ``[T, D]``, one sequence's pre-RoPE K‖V of one layer (any float dtype; computed in float32).

    Returns:
        ``(cos, dist)``, float32 ``[T - 1]`` and int64 ``[T - 1]`` for tokens 1..T-1 (token 0 has no earlier
        token): ``cos[i-1] = max_{j<i} cos(kv_i, kv_j)`` and ``dist[i-1] = i - argmax_j`` (>= 1; a tie goes to the
        earliest j, the farthest match), clamped to [-1, 1]. A zero row has cosine 0 with everything. Memory: chunks of
        ``2^22 / T`` rows.

    Raises:
        ValueError: ``kv`` is not 2-D or not finite.
    """
    if kv.dim() != 2:
        raise ValueError(f"expected kv [T, D], got shape {tuple(kv.shape)}")
    x = kv.to(torch.float32)
    if not torch.isfinite(x).all():
        raise ValueError("kv must be finite (found NaN or inf)")
    n = x.shape[0]
    if n < 2:
        return torch.zeros(0), torch.zeros(0, dtype=torch.long)
    xn = x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)
    cos, dist = torch.empty(n - 1), torch.empty(n - 1, dtype=torch.long)
    chunk = max(1, _CHUNK_ENTRIES // n)
    for start in range(1, n, chunk):
        rows = torch.arange(start, min(n, start + chunk))
        sims = xn[rows] @ xn[: int(rows[-1])].T                      # [rows, rows[-1]]: only earlier columns
        earlier = torch.arange(sims.shape[1])[None, :] < rows[:, None]
        sims.masked_fill_(~earlier, float("-inf"))
        best, arg = sims.max(dim=1)                                  # first maximum: the earliest column
        cos[rows - 1], dist[rows - 1] = best, rows - arg
    # rounding puts a repeated direction at 1 + 1e-7, outside any histogram that ends at 1
    return cos.clamp_(-1.0, 1.0), dist


@dataclass(frozen=True)
class ReferenceSchedule:
    """The reference schedule and retrieval of the main codec (:class:`~.codec.CodecConfig` fields; ``block`` is the
    codec's ``window``, the ``"code"`` grid's restart block, as :func:`~.train.compress_kv` passes it).

    Raises:
        ValueError: ``k``, ``stride`` or ``block`` below 1, ``n_sink`` or ``alpha`` negative.
    """

    k: int = 4
    n_sink: int = 8
    stride: int = 10
    alpha: float = 0.0
    grid: str = "paper"
    block: int = 128

    def __post_init__(self):
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"reference schedule: k must be an integer >= 1, got {self.k!r}")
        check_schedule(self.n_sink, self.stride, self.alpha, self.grid, self.block)  # the retrieval's own check

    def describe(self) -> str:
        return (f"k = {self.k} nearest earlier references, n_sink = {self.n_sink}, stride = {self.stride}, "
                f"alpha = {self.alpha:g}, grid {self.grid}")


def reference_residuals(kv: torch.Tensor, schedule: ReferenceSchedule) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw kv and residual ``kv - mean of its k nearest earlier references`` of the tokens the codec codes.

    The tokens coded are those neither sinks (position < ``n_sink``) nor references (:func:`.reference_mask`);
    each one's references are the ``k`` nearest (squared L2) references at earlier positions
    (:func:`.nearest_references`, causal), averaged (:func:`~kvbench.kernels.reference_mean.mean_reference`): as
    :func:`kvbench.compress.residualkv.train.compress_kv` computes the codec's input.

    Args:
        kv: float ``[T, D]``, one sequence's pre-RoPE K‖V of one layer, positions 0..T-1.
        schedule: the main codec's reference settings.

    Returns:
        ``(raw, residual)``, float32 ``[N, D]`` each, N the coded tokens (0 when the sequence is all sinks and
        references).

    Raises:
        ValueError: ``kv`` not 2-D or not finite (from the retrieval).
    """
    if kv.dim() != 2:
        raise ValueError(f"expected kv [T, D], got shape {tuple(kv.shape)}")
    x = kv.to(torch.float32)
    pos = torch.arange(x.shape[0])
    ref = reference_mask(pos, n_sink=schedule.n_sink, stride=schedule.stride, alpha=schedule.alpha,
                         grid=schedule.grid, block=schedule.block)
    coded = ~(ref | (pos < schedule.n_sink))
    if not coded.any():
        return x[:0], x[:0]
    idx, valid = nearest_references(x[coded], pos[coded], x[ref], pos[ref], schedule.k)
    raw = x[coded]
    return raw, raw - mean_reference(x[ref], idx, valid)


def cumulative_explained_variance(x: torch.Tensor) -> torch.Tensor:
    """Cumulative share of the variance of the rows of ``x`` float ``[N, D]`` explained by the first 1..D principal
    components (eigenvalues of the covariance about the mean, float64), float64 ``[D]``, ending at 1.

    Raises:
        ValueError: fewer than 2 rows, or zero variance.
    """
    if x.dim() != 2 or x.shape[0] < 2:
        raise ValueError(f"need at least 2 rows [N, D] for a spectrum, got shape {tuple(x.shape)}")
    c = x.to(torch.float64)
    c = c - c.mean(0, keepdim=True)
    eig = torch.linalg.eigvalsh(c.T @ c / (c.shape[0] - 1)).flip(0).clamp_min(0.0)
    total = eig.sum()
    if not total > 0:
        raise ValueError("the rows have zero variance: no spectrum")
    return eig.cumsum(0) / total


@dataclass
class LayerObservations:
    """What :func:`observe` gathers for one decoder layer over every analysed context.

    Attributes:
        cos: float32 ``[M]``, each token's max cosine to an earlier token of its context (token 0 of each excluded).
        dist: int64 ``[M]``, the distance to that best match, in tokens.
        raw: float32 ``[N, D]``, the raw kv of the coded tokens (:func:`reference_residuals`).
        residual: float32 ``[N, D]``, their residuals against the reference mean.
    """

    cos: list = field(default_factory=list)
    dist: list = field(default_factory=list)
    raw: list = field(default_factory=list)
    residual: list = field(default_factory=list)

    def add(self, kv: torch.Tensor, schedule: ReferenceSchedule) -> None:
        """Add one context's kv ``[T, D]`` of this layer."""
        c, d = max_cosine_to_earlier(kv)
        r, e = reference_residuals(kv, schedule)
        self.cos.append(c), self.dist.append(d), self.raw.append(r), self.residual.append(e)

    def tensors(self) -> dict[str, torch.Tensor]:
        """``{cos, dist, raw, residual}`` concatenated over contexts."""
        return {k: torch.cat(getattr(self, k)) for k in ("cos", "dist", "raw", "residual")}


@dataclass
class Observations:
    """:func:`observe`'s result: ``layers`` (one :class:`LayerObservations` each), the ``contexts`` analysed
    (``{task, id, tokens}``), the reference ``schedule``, and the model's name."""

    layers: list[LayerObservations]
    contexts: list[dict]
    schedule: ReferenceSchedule
    model: str

    @property
    def n_tokens(self) -> int:
        return sum(c["tokens"] for c in self.contexts)


def _tokenizer(proc: Any) -> Any:
    return getattr(proc, "tokenizer", proc)  # a VLM's processor holds its text tokenizer


@torch.inference_mode()
def layer_kv(model: Any, inputs: dict, layers: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Each decoder layer's pre-RoPE K‖V of one sequence: ``model(**inputs, use_cache=False)`` under forward hooks on
    the codec's key source and ``v_proj`` (:func:`kvbench.compress.residualkv.train.record_kv`, the tensors the codec
    trains on and the cache codes), K and V of all KV heads concatenated.

    Args:
        model: a HF causal LM or VLM in eval mode.
        inputs: the forward's keyword tensors, batch 1 (``input_ids`` ``[1, T]``; a VLM's ``pixel_values``,
            ``image_grid_thw``, ... as its processor gives them).
        layers: the layers kept (default all); the others are dropped as the forward returns.

    Returns:
        float32 CPU tensors ``[T, 2 d_k]``, one per layer (``layers`` order).

    Raises:
        ValueError: a batch other than 1, or a layer index outside the model.
    """
    n_layers = len(decoder_layers(model))
    keep = list(range(n_layers)) if layers is None else list(layers)
    bad = [i for i in keep if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"layer(s) {bad} outside the model's {n_layers} decoder layers (0..{n_layers - 1})")
    if inputs["input_ids"].shape[0] != 1:
        raise ValueError(f"one sequence expected, got a batch of {inputs['input_ids'].shape[0]}")
    store: list[dict] = [{} for _ in range(n_layers)]
    with record_kv(model, store):
        model(**inputs, use_cache=False)
    return [torch.cat([store[i]["k"], store[i]["v"]], dim=-1)[0].float().cpu() for i in keep]


@torch.inference_mode()
def observe(model: Any, proc: Any, splits: dict[str, str | Path], schedule: ReferenceSchedule, *,
            records_per_task: int = 2, max_tokens: int = 4096, context_tokens: int | None = None,
            model_name: str = "") -> Observations:
    """Run ``model`` over the contexts of the first ``records_per_task`` records of each split and gather every
    layer's :class:`LayerObservations`.

    A record's context is its ``context`` text tokenised as the compression runs tokenise it
    (:func:`kvbench.compress.generate.split_prompt`, the part before the question), truncated to
    ``context_tokens`` and to what is left of ``max_tokens``; splits are read in the order given and stop once
    ``max_tokens`` tokens are analysed. K and V come from :func:`layer_kv`, one context per forward, no cache.

    Args:
        model: a HF causal LM (or VLM, run on text only) in eval mode.
        proc: its tokenizer or processor.
        splits: ``{task name: JSONL split path}`` of text records with ``context`` and ``question``.
        schedule: the main codec's reference settings (:class:`ReferenceSchedule`).

    Raises:
        ValueError: no context of at least 2 tokens, a record without text fields, or bad limits.
    """
    if records_per_task < 1 or max_tokens < 2 or (context_tokens is not None and context_tokens < 2):
        raise ValueError(f"records_per_task >= 1, max_tokens >= 2 and context_tokens >= 2 expected, got "
                         f"{records_per_task}, {max_tokens}, {context_tokens}")
    tok = _tokenizer(proc)
    n_layers = len(decoder_layers(model))
    layers = [LayerObservations() for _ in range(n_layers)]
    contexts: list[dict] = []
    device = next(model.parameters()).device
    left = max_tokens
    for task, path in splits.items():
        for rec in read_jsonl(path)[:records_per_task]:
            if left < 2:
                break
            ids, split = split_prompt(tok, rec)
            ids = ids[0, :split][: min(left, context_tokens or left)]
            if ids.numel() < 2:
                continue
            for layer, kv in zip(layers, layer_kv(model, {"input_ids": ids[None].to(device)})):
                layer.add(kv, schedule)
            contexts.append({"task": task, "id": rec.get("id"), "tokens": int(ids.numel())})
            left -= int(ids.numel())
    if not contexts:
        raise ValueError(f"no context of at least 2 tokens in {sorted(splits)} (max_tokens {max_tokens})")
    return Observations(layers, contexts, schedule, model_name)
