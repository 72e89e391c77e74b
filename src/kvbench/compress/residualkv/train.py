"""Training the ResidualKV codec on a frozen backbone (paper §IV-D; authors' ``train_compressor.py``).

Each step takes one packed window of real text and runs two passes of the frozen model:

1. teacher (no grad): forward hooks on every layer's codec key source (``keys.py``: ``self_attn.k_proj``,
   before Qwen3's ``k_norm`` and before RoPE) and ``v_proj`` record K and V; the target of layer l is
   ``kv = cat(k, v)``, ``[B, T, d_kv]``, the same tensor the cache codes at inference;
2. compressed: hooks on the same projections replace their outputs. Sinks and reference tokens keep
   their own kv; every other token gets ``kv_hat = restore(residual_code(kv, mean_ref), mean_ref)``
   with the mean of its k nearest *earlier* references (``references.py``), all on this pass's kv.
   The hooks sit before the key norm and RoPE, so the model normalises (Qwen3) and rotates ``kv_hat``
   at the token's own position, as the cache does after restore (and as the authors' training code).

No quantisation and no FP8 in training (as the authors' code). References are NOT detached: the
gradient of both losses also flows through ``mean_ref`` (it depends on earlier layers' codecs via the
hidden states), since the paper freezes the backbone without cutting its gradient (§IV-D).

Loss (``objective``): ``"joint"`` = next-token CE of the compressed pass + Σ_layers MSE(kv_hat, kv),
``"ntp"`` = CE only, ``"mse"`` = reconstruction only. The paper writes the reconstruction term as a
plain sum of squared errors over layers and tokens; here each layer's term is the *mean* over tokens
and dims (as the authors' code's MSE) and the layers are *summed*, so the two terms keep comparable
scales at any sequence length. Both terms are logged every step whatever the objective.

Placement (:class:`Placement`): the backbone may run on a GPU in bfloat16 under autocast while the codec keeps
float32 master weights (as the authors train: bf16 backbone, ``TrainingArguments(bf16=True)``); a step may
accumulate several sequences and, under ``torchrun``, spread them over the GPUs of a node
(:mod:`kvbench.train.dist`); the compressed pass may recompute each decoder layer in the backward pass
(transformers' activation checkpointing) to fit 8,192-token sequences of an 8B backbone in memory.
"""
from __future__ import annotations

import contextlib
import json
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F

from kvbench.compress.cache import decoder_layers
from kvbench.compress.residualkv.codec import CodecConfig, ResidualCodec, model_kv_shape
from kvbench.compress.residualkv.keys import codec_keys
from kvbench.compress.residualkv.vlm_data import VLMRecordStream
from kvbench.compress.residualkv.references import nearest_references, reference_mask
from kvbench.data import smoke
from kvbench.data.corpus import stdlib_files
from kvbench.data.local_text import local_documents
from kvbench.kernels.reference_mean import mean_reference
from kvbench.models.prompting import encode_record
from kvbench.train.dist import World
from kvbench.train.loop import Interrupted, StopOnSignal
from kvbench.train.recipes import lm_task_mixture
from kvbench.train.state import load_state, save_state
from kvbench.utils.io import atomic_path, write_json
from kvbench.utils.steps import SliceEnded, StepProgress

OBJECTIVES = ("joint", "ntp", "mse")
#: Share of steps spent warming the learning rate up (paper §V-A: 2%).
WARMUP_SHARE = 0.02
#: Held-out windows for the eval NTP / rec losses (from the corpus's 'test' split, fixed order).
N_VAL_WINDOWS = 4
#: Seed of the validation windows' document order: fixed, so every run evaluates the same text.
VAL_SEED = 0
#: Seconds between state saves (also saved at the end, when the slice ends and on SIGTERM/SIGINT).
SAVE_EVERY_S = 60.0


@contextlib.contextmanager
def record_kv(model: Any, store: list[dict]) -> Iterator[None]:
    """Hooks that record each layer's codec K (``keys.codec_keys``: the k_proj output) and v_proj output
    into ``store[l]['k'|'v']``, ``[B, T, d_kv/2]`` each."""
    handles = []
    try:
        for i, layer in enumerate(decoder_layers(model)):
            attn = layer.self_attn
            for name, mod in (("k", codec_keys(attn).source), ("v", attn.v_proj)):
                def hook(mod, inp, out, i=i, name=name):
                    store[i][name] = out.detach()
                handles.append(mod.register_forward_hook(hook))
        yield
    finally:
        for h in handles:
            h.remove()


def compress_kv(codec_layer: Any, kv: torch.Tensor, positions: torch.Tensor, cfg: CodecConfig,
                detach_refs: bool = False) -> torch.Tensor:
    """Replace non-sink, non-reference tokens' kv by their codec reconstruction (no quantisation).

    Args:
        codec_layer: the :class:`~kvbench.compress.residualkv.codec.LayerCodec` of this layer.
        kv: float ``[B, T, d_kv]`` pre-RoPE K‖V.
        positions: int64 ``[T]`` token positions (0-based).
        cfg: supplies ``n_sink``, ``stride``, ``alpha``, ``grid``, ``k``.
        detach_refs: stop the gradient through ``mean_ref`` (off by default, see module doc).

    Returns:
        float ``[B, T, d_kv]`` in ``kv``'s dtype: raw kv at sinks and references, ``kv_hat`` elsewhere.
    """
    ref = reference_mask(positions, n_sink=cfg.n_sink, stride=cfg.stride, alpha=cfg.alpha, grid=cfg.grid,
                         block=max(1, cfg.window))
    if not cfg.references:  # Table VIII "without references": code every token against a zero mean
        ref = torch.zeros_like(ref)
    coded = ~(ref | (positions < cfg.n_sink))
    if not coded.any():  # e.g. stride 1: every token is kept raw
        return kv
    out = []
    for row in kv:  # batch rows are independent sequences
        ref_kv = row[ref].detach() if detach_refs else row[ref]
        x = row[coded]
        if cfg.references:
            # Only the ranking is taken from here (indices carry no gradient).
            idx, valid = nearest_references(x.detach(), positions[coded], ref_kv.detach(), positions[ref], cfg.k)
            mean = mean_reference(ref_kv, idx, valid)
        else:
            mean = torch.zeros_like(x)
        new = row.clone()
        new[coded] = codec_layer.restore(codec_layer.residual_code(x, mean), mean).to(row.dtype)
        out.append(new)
    return torch.stack(out)


@contextlib.contextmanager
def _compress_hooks(model: Any, codec: ResidualCodec, kv_hat_store: list, detach_refs: bool) -> Iterator[None]:
    """Hooks that make every layer attend to codec-reconstructed kv (see module doc, pass 2).

    The hook on the codec's key source (``keys.codec_keys``: k_proj) computes v itself through the sibling
    ``v_proj`` (K and V are coded jointly), replaces k and stashes ``v_hat``; the v_proj hook then returns
    the stash. The nested v_proj call made from inside the k_proj hook is let through unchanged. A key
    norm (Qwen3's ``k_norm``) then acts on the replaced k, as after restore at inference.
    """
    cfg = codec.config
    handles = []
    try:
        for i, layer in enumerate(decoder_layers(model)):
            attn = layer.self_attn
            state: dict = {"inner": False, "v_hat": None}

            def k_hook(mod, inp, out, i=i, attn=attn, state=state):
                state["inner"] = True
                try:
                    v = attn.v_proj(inp[0])
                finally:
                    state["inner"] = False
                d_k = out.shape[-1]
                positions = torch.arange(out.shape[1], device=out.device)
                kv_hat = compress_kv(codec.layers[i], torch.cat([out, v], -1), positions, cfg, detach_refs)
                kv_hat_store[i] = kv_hat
                state["v_hat"] = kv_hat[..., d_k:]
                return kv_hat[..., :d_k]

            def v_hook(mod, inp, out, state=state):
                if state["inner"]:
                    return None
                v_hat, state["v_hat"] = state["v_hat"], None
                if v_hat is None:
                    raise RuntimeError("v_proj ran without a preceding k_proj in the compressed pass")
                return v_hat

            handles.append(codec_keys(attn).source.register_forward_hook(k_hook))
            handles.append(attn.v_proj.register_forward_hook(v_hook))
        yield
    finally:
        for h in handles:
            h.remove()


def compressed_forward(model: Any, codec: ResidualCodec, input_ids: torch.Tensor, *, detach_refs: bool = False,
                       hooks: contextlib.ExitStack | None = None
                       ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Teacher pass, then the compressed pass of ``model`` on ``input_ids`` (paper §IV-D).

    Args:
        model: HF causal LM (Qwen2/Qwen3/Llama layout, or a VLM's text model); not modified.
        codec: one layer codec per decoder layer; its config gives sinks, stride and k.
        input_ids: int64 ``[B, T]``, no padding, positions 0..T-1; or a VLM's input tensors (a dict with
            ``input_ids`` and its ``pixel_values``, ... : :class:`~kvbench.compress.residualkv.vlm_data.VLMRecordStream`),
            the model placing its own (M-RoPE) positions.
        detach_refs: see :func:`compress_kv`.
        hooks: keep the compressed pass's hooks on ``model`` until this stack closes (default: removed on
            return). Activation checkpointing re-runs each layer in the backward pass, which must code its kv
            again, so the backward has to run before the stack closes.

    Returns:
        ``(logits, kv_hat, kv_teacher)``: float ``[B, T, V]`` logits of the compressed pass (with a
        graph to the codec when grad is enabled), and per layer float ``[B, T, d_kv]`` the kv the
        compressed pass attended to and the teacher's kv (no grad), both the codec's quantity
        (``keys.py``: pre-RoPE, and before the key norm of a model that has one).

    Raises:
        ValueError: the codec does not fit the model (n_layers / d_kv).
    """
    n_layers, d_kv = model_kv_shape(model)
    if (n_layers, d_kv) != (codec.config.n_layers, codec.config.d_kv):
        raise ValueError(f"codec (n_layers={codec.config.n_layers}, d_kv={codec.config.d_kv}) does not fit the "
                         f"model (n_layers={n_layers}, d_kv={d_kv})")
    rec: list[dict] = [{} for _ in range(n_layers)]
    with torch.no_grad(), record_kv(model, rec):
        model(**_inputs(input_ids), use_cache=False)
    teacher = [torch.cat([r["k"], r["v"]], -1) for r in rec]
    kv_hat: list = [None] * n_layers
    with contextlib.ExitStack() as own:
        (hooks or own).enter_context(_compress_hooks(model, codec, kv_hat, detach_refs))
        logits = model(**_inputs(input_ids), use_cache=False).logits
    # the first pass's kv_hat: a recompute in the backward pass writes the list again (same values)
    return logits, list(kv_hat), teacher


def ntp_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats/token) over the predicted tokens of ``labels`` ``[B, T]``
    (the input ids for plain text; -100 marks positions without a target, e.g. task prompts)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)


def rec_loss(kv_hat: list[torch.Tensor], teacher: list[torch.Tensor]) -> torch.Tensor:
    """Σ_layers mean over tokens and dims of ``(kv_hat - kv)²`` (see module doc on the normalisation)."""
    return sum(F.mse_loss(h.float(), t.float()) for h, t in zip(kv_hat, teacher))


def lr_at(step: int, steps: int, lr: float) -> float:
    """Learning rate at 0-based ``step`` of ``steps``: 2% linear warm-up, then linear decay to 0 (§V-A)."""
    warmup = max(1, round(WARMUP_SHARE * steps))
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * max(0.0, (steps - step) / max(1, steps - warmup))


class TokenStream:
    """Packed windows of a corpus split: documents in a seeded order, EOS between them, cut into windows.

    Documents are, by default, the stdlib source files of the split (:func:`kvbench.data.corpus.stdlib_files`;
    code with its comments and docstrings, whose prose lines are ``prose_lines``), or with ``files`` the
    documents of a local corpus (JSONL / JSON / parquet / txt read with ``datasets``,
    :func:`kvbench.data.local_text.local_documents`: the paper's FineWeb-Edu in that layout). They are
    tokenised lazily in order, so window ``i`` is the same whatever number of windows is asked for; when the
    split is exhausted, the next epoch reshuffles with ``(seed, epoch)``.
    """

    def __init__(self, tokenizer: Any, split: str, seq_len: int, seed: int,
                 files: Sequence[str] | None = None, text_field: str = "text") -> None:
        if files:
            self.docs: Sequence[str] = local_documents(files, split, text_field)
        else:
            self.docs = [text for _, text in stdlib_files(split)]
        if not self.docs:
            raise ValueError(f"corpus split {split!r} has no documents")
        self.tok, self.seq_len, self.seed = tokenizer, seq_len, seed
        self.eos = tokenizer.eos_token_id
        if self.eos is None:
            raise ValueError("the tokenizer has no eos_token_id to separate packed documents")
        self.ids: list[int] = []
        self._order: list[int] = []
        self._epoch, self._next, self._epoch_text = -1, 0, 0

    def _more(self) -> None:
        if self._next >= len(self._order):
            if self._epoch >= 0 and self._epoch_text == 0:
                raise ValueError(f"the corpus holds no text: a whole pass over its {len(self.docs)} documents "
                                 "gave no token (empty strings?)")
            self._epoch_text = 0
            self._epoch += 1
            self._order = list(range(len(self.docs)))
            random.Random(f"{self.seed}:{self._epoch}").shuffle(self._order)
            self._next = 0
        i = self._order[self._next]
        text = self.docs[i]
        self._next += 1
        if not isinstance(text, str):
            raise ValueError(f"corpus document {i} is a {type(text).__name__}, not text: {str(text)[:60]!r}")
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        self._epoch_text += len(ids)
        self.ids.extend(ids + [self.eos])

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, labels)`` of window ``i``: every token is a next-token target."""
        ids = self.window(i)
        return ids, ids

    def window(self, i: int) -> torch.Tensor:
        """int64 ``[1, seq_len]``: the ``i``-th window (0-based)."""
        end = (i + 1) * self.seq_len
        while len(self.ids) < end:
            self._more()
        return torch.tensor([self.ids[end - self.seq_len:end]], dtype=torch.long)


class TaskStream:
    """Sequences of the zoo LM's own task mixture (``kvbench.train.recipes``: needle, key-value and
    variable-tracking retrieval over real prose, code completion), one record per step, labels on the
    answers (code: every token), from the smoke generators' ``split`` pools in a seeded order.

    Why: the zoo LM was trained on these tasks, not on plain text (its NTP loss on stdlib text is ~7.9
    nats, near uniform), so plain text gives the codec's NTP term no signal; the paper trains on the kind
    of text its backbones model (FineWeb-Edu). ``docs/decisions/residualkv.md``, "Codec training".
    """

    def __init__(self, tokenizer: Any, split: str, seq_len: int, seed: int) -> None:
        self.tok, self.split, self.seq_len, self.seed = tokenizer, split, seq_len, seed
        self.mixture = lm_task_mixture(seq_len)

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, labels)`` int64 ``[1, T]`` of record ``i`` (T ≈ ``seq_len`` plus its answers)."""
        rng = random.Random(f"{self.seed}:{self.split}:{i}")
        fam, _, params = rng.choices(self.mixture, [m[1] for m in self.mixture])[0]
        params = dict(params)
        full_loss = params.pop("full_loss", False)
        enc = encode_record(smoke.sample(fam, rng, self.split, tokenizer=self.tok, **params), self.tok, with_answer=True)
        return enc["input_ids"], enc["input_ids"].clone() if full_loss else enc["labels"]


class ChainStream(TaskStream):
    """:class:`TaskStream` over the chain tasks (:mod:`kvbench.data.chain`) that ResidualKV Table V's zoo backbone
    (``tiny-qwen2-lm-chain``) was trained on, half each: plain chains of ``seq_len // 12 .. seq_len // 6`` hops, one
    distractor chain, every chain asked, and chain pairs of ``seq_len // 16 .. seq_len // 8`` hops with their trace
    and asks (records of about ``seq_len`` prompt tokens plus their answers)."""

    def __init__(self, tokenizer: Any, split: str, seq_len: int, seed: int) -> None:
        super().__init__(tokenizer, split, seq_len, seed)
        hops, pairs = max(2, seq_len // 6), max(2, seq_len // 8)
        self.mixture = (("chain", 1.0, {"hops": hops, "min_hops": hops // 2, "n_distractors": 1}),
                        ("chain_pairs", 1.0, {"hops": pairs, "min_hops": pairs // 2, "n_asks": min(4, pairs // 2)}))


#: Training data of the codec: plain text (the paper's kind), the zoo LM's task mixture, a VLM's image records
#: (:class:`~kvbench.compress.residualkv.vlm_data.VLMRecordStream`: ``data_files`` name them), or the chain task of
#: Table V's zoo backbone.
DATA = {"text": TokenStream, "tasks": TaskStream, "vlm": VLMRecordStream, "chain": ChainStream}
#: Data kinds read from ``data_files``.
FILE_DATA = ("text", "vlm")


#: Dtypes the backbone may run in (``Placement.dtype``).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Placement:
    """Where and how one codec-training process runs (none of it changes what a step computes, except the
    precision of the backbone's and codec's matmuls under ``dtype``).

    Parameters
    ----------
    device : str, "cpu" — torch device of the backbone and the codec ("cuda", "cuda:1", "cpu").
    dtype : str, "float32" — the backbone's dtype; "bfloat16"/"float16" also run the compressed and teacher
        passes under ``torch.autocast`` of that dtype while the codec keeps float32 master weights and AdamW
        state (the authors' bf16 training). The caller loads the backbone in this dtype.
    grad_accum : int, 1 — sequences each process accumulates per optimiser step.
    checkpointing : bool, False — recompute each decoder layer in the backward pass (transformers' activation
        checkpointing, non-reentrant) instead of keeping its activations.
    world : World — this process among the data-parallel processes (:func:`kvbench.train.dist.init_world`).

    The global batch is ``grad_accum * world.size`` sequences: optimiser step ``s`` reads windows
    ``s * batch .. s * batch + batch - 1``, process ``rank`` those with ``j % world.size == rank``, so one process
    with ``grad_accum = 2`` and two with ``grad_accum = 1`` train on the same data and reach the same weights.

    Raises:
        ValueError: unknown ``dtype``, ``grad_accum < 1``, or a half dtype on the CPU other than bfloat16.
    """

    device: str = "cpu"
    dtype: str = "float32"
    grad_accum: int = 1
    checkpointing: bool = False
    world: World = field(default_factory=World)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"Placement.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            raise ValueError(f"Placement.grad_accum must be an int >= 1, got {self.grad_accum!r}")
        if self.dtype == "float16" and not self.device.startswith("cuda"):
            raise ValueError("Placement.dtype='float16' needs a CUDA device (CPU autocast supports bfloat16)")

    @property
    def batch(self) -> int:
        """Sequences per optimiser step over all processes."""
        return self.grad_accum * self.world.size

    def autocast(self) -> contextlib.AbstractContextManager:
        """``torch.autocast`` of ``dtype`` on ``device`` (a no-op context for float32)."""
        if self.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(torch.device(self.device).type, dtype=DTYPES[self.dtype])

    def windows(self, step: int) -> list[int]:
        """The window indices this process trains on at 0-based optimiser ``step``, in accumulation order."""
        return [step * self.batch + self.world.rank + self.world.size * a for a in range(self.grad_accum)]


def _to(batch: tuple, device: str) -> tuple:
    """``(ids or model inputs, labels)`` on ``device`` (a VLM stream gives a dict of input tensors)."""
    x, labels = batch
    x = {k: v.to(device) for k, v in x.items()} if isinstance(x, dict) else x.to(device)
    return x, labels.to(device)


def _inputs(x: torch.Tensor | dict) -> dict:
    """Model keyword arguments of a batch's ids ``[B, T]`` or of a VLM's input tensors."""
    return dict(x) if isinstance(x, dict) else {"input_ids": x}


@torch.no_grad()
def evaluate(model: Any, codec: ResidualCodec, windows: list[torch.Tensor], place: Placement | None = None) -> dict:
    """Mean compressed-pass NTP loss and rec loss over ``windows`` (``(ids, labels)``, int64 ``[1, T]`` each),
    on ``place``'s device under its autocast."""
    place = place or Placement()
    ntp = rec = 0.0
    for batch in windows:
        ids, labels = _to(batch, place.device)
        with place.autocast():
            logits, hat, teacher = compressed_forward(model, codec, ids)
        ntp += ntp_loss(logits, labels).item()
        rec += rec_loss(hat, teacher).item()
    return {"eval_ntp": ntp / len(windows), "eval_rec": rec / len(windows)}


@torch.no_grad()
def baseline_ntp(model: Any, windows: list[torch.Tensor], place: Placement | None = None) -> float:
    """Mean NTP loss of the uncompressed model over ``windows``."""
    place = place or Placement()
    total = 0.0
    for batch in windows:
        ids, labels = _to(batch, place.device)
        with place.autocast():
            logits = model(**_inputs(ids), use_cache=False).logits
        total += ntp_loss(logits, labels).item()
    return total / len(windows)


@contextlib.contextmanager
def _checkpointed(model: Any, on: bool) -> Iterator[None]:
    """Activation checkpointing of every decoder layer for the block (transformers' non-reentrant form).

    transformers checkpoints a layer only in training mode, so the decoder layers are put in training mode while
    every other module (attention and its dropout included) stays in eval mode: no dropout is ever active.
    """
    if not on:
        yield
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support activation checkpointing")
    layers = decoder_layers(model)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    try:
        for layer in layers:
            layer.training = True  # the flag alone: children (attention, MLP, dropout) stay in eval mode
        yield
    finally:
        for layer in layers:
            layer.training = False
        model.activation_checkpointing_disable()


def _model_signature(model: Any) -> dict:
    n_layers, d_kv = model_kv_shape(model)
    return {"n_layers": n_layers, "d_kv": d_kv, "name_or_path": str(getattr(model.config, "_name_or_path", ""))}


def train_codec(model: Any, tokenizer: Any, codec: ResidualCodec, *, out_dir: str | Path, objective: str = "joint",
                steps: int, seq_len: int = 512, slice_s: float | None = None, seed: int = 0, lr: float = 2e-4,
                log_every: int = 10, eval_every: int = 50, progress: bool = True, data: str = "text",
                data_files: Sequence[str] | None = None, text_field: str = "text",
                place: Placement | None = None) -> dict:
    """Train ``codec`` on the frozen ``model`` for ``steps`` steps (paper §IV-D, §V-A), resuming from ``out_dir/state``.

    AdamW (lr ``lr``, 2% warm-up then linear decay), gradient clipping at 1.0, ``place.batch`` sequences per
    step (1 by default, the paper's batch; each sequence's loss scaled by 1 / batch): step ``s`` reads windows
    ``s * batch ..`` of the 'train' split (:class:`TokenStream` / :class:`TaskStream`, order from ``seed``), so
    the data does not depend on where a run was interrupted or on how the batch is split over processes. The
    backbone's parameters are frozen for the call (flags restored after) and never updated; hooks are removed on
    exit even after an exception. The weights depend on the seed and the arguments alone (not on ``slice_s`` or on resumes):
    the state saves codec, AdamW and torch RNG, and the curves rows, so a resumed run continues bit-exactly.

    Writes under ``out_dir``: ``state/`` (codec + AdamW tensors in safetensors; step, RNG, curve rows in
    ``meta.json``; nothing pickled) whenever it stops, and only once all ``steps`` are done: ``codec/``
    (:meth:`ResidualCodec.save`), ``curves.csv`` (step, loss, ntp, rec, lr every ``log_every`` steps, plus
    eval_ntp / eval_rec every ``eval_every`` steps on :data:`N_VAL_WINDOWS` fixed windows of the 'test'
    split), ``summary.json`` (written last) and the wall-clock beside them, ``curves.timing.csv`` (step,
    elapsed_s) and ``summary.timing.json`` (wall_s, steps_per_s), kept out of the files results are built
    from so that two runs give byte-identical results.

    Args:
        slice_s: wall-clock seconds this call may train (checked after each step, so at least one step
            runs); when they are up before ``steps``, the state is saved and :class:`SliceEnded` raised,
            and a rerun resumes. ``None``: train to the end.
        data: ``"text"`` (packed corpus windows, :class:`TokenStream`), ``"tasks"`` (:class:`TaskStream`) or
            ``"vlm"`` (a VLM's image records from ``data_files``, ``tokenizer`` its processor:
            :class:`~kvbench.compress.residualkv.vlm_data.VLMRecordStream`).
        data_files, text_field: with ``data="text"``, a local corpus instead of the bundled one
            (:func:`kvbench.data.local_text.local_documents`; validation windows from its held-out documents).
        place: device, dtype, accumulation, checkpointing and data-parallel world (:class:`Placement`; default:
            one CPU process in float32). Only ``place.world``'s main process evaluates and writes files; the
            state records the global batch and dtype, so a resume with another split of the same global batch
            (e.g. 1 GPU x 2 accumulated vs 2 GPUs x 1) continues the same run.

    Returns:
        the summary dict: steps, objective, data, final_loss/ntp/rec (of the last step), baseline_ntp
        (uncompressed model, validation windows), eval_before (fresh codec), eval_final, n_val_windows,
        codec_params.

    Raises:
        ValueError: unknown ``objective`` or ``data``, ``data_files`` with ``data="tasks"`` (or none with ``"vlm"``),
            non-positive ``steps``/``seq_len``/``slice_s``,
            ``seq_len`` above the model's ``max_position_embeddings``, ``out_dir`` an existing file, codec not
            fitting the model, or ``out_dir/state`` written with another configuration.
        SliceEnded: ``slice_s`` ran out before ``steps`` (state saved; rerun to resume).
        Interrupted: SIGTERM/SIGINT arrived (state saved first; rerun to resume).
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if data not in DATA:
        raise ValueError(f"data must be one of {sorted(DATA)}, got {data!r}")
    if data_files and data not in FILE_DATA:
        raise ValueError(f"data_files are a text corpus or VLM records: they need data in {FILE_DATA}, got data={data!r}")
    place = place or Placement()
    if steps <= 0 or seq_len <= 1:
        raise ValueError(f"steps must be > 0 and seq_len > 1, got steps={steps}, seq_len={seq_len}")
    if slice_s is not None and not slice_s > 0:
        raise ValueError(f"slice_s must be a positive number of seconds (or None: no slice), got {slice_s}")
    max_pos = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if max_pos is not None and seq_len > max_pos:
        raise ValueError(f"seq_len={seq_len} exceeds the model's max_position_embeddings={max_pos}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"out_dir {str(out_dir)!r} exists and is not a directory")
    run_cfg = {"codec": json.loads(codec.config.to_json()), "objective": objective, "steps": steps, "data": data,
               "seq_len": seq_len, "seed": seed, "lr": lr, "model": _model_signature(model)}
    # Only what changes the weights enters the run's identity (not the device, nor how the batch is split).
    if place.batch != 1:
        run_cfg["batch"] = place.batch
    if place.dtype != "float32":
        run_cfg["dtype"] = place.dtype
    if data_files:
        # paths and byte sizes: a corpus replaced between two slices of one run is refused on resume (a hash of a
        # FineWeb-size corpus would cost minutes per invocation; a same-size edit goes unseen)
        files = sorted({str(Path(f).resolve()) for f in data_files})
        run_cfg.update(data_files=files, data_bytes=[Path(f).stat().st_size for f in files], text_field=text_field)
    codec.to(place.device)
    opt = torch.optim.AdamW(codec.parameters(), lr=lr)
    modules = {"codec": codec}
    saved = out_dir / "state" / "meta.json"
    if saved.is_file():  # refuse another configuration before loading tensors of other shapes
        _check_same_run(json.loads(saved.read_text()), run_cfg, out_dir)
    meta = load_state(out_dir / "state", modules, opt)
    if meta is not None:
        _check_same_run(meta, run_cfg, out_dir)
    corpus = {"files": data_files, "text_field": text_field} if data_files else {}
    stream = DATA[data](tokenizer, "train", seq_len, seed, **corpus)
    val_stream = DATA[data](tokenizer, "test", seq_len, VAL_SEED, **corpus)
    val = [val_stream.batch(i) for i in range(N_VAL_WINDOWS)]

    frozen = {n: p.requires_grad for n, p in model.named_parameters()}
    was_training = model.training
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()  # no dropout: the teacher and compressed passes must see the same backbone
    try:
        if meta is None:
            main = place.world.main  # only the process that writes evaluates
            meta = {"run": run_cfg, "step": 0, "elapsed_s": 0.0,
                    "baseline_ntp": baseline_ntp(model, val, place) if main else None,
                    "eval_before": evaluate(model, codec, val, place) if main else None,
                    "last": {}, "curves": [], "timing": [],
                    "rng": torch.Generator().manual_seed(seed).get_state().tolist()}
        # The training's CPU RNG stream starts from ``seed`` and continues from the state on a resume; the
        # caller's global RNG is left as it was.
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(torch.tensor(meta["rng"], dtype=torch.uint8))
            with _checkpointed(model, place.checkpointing):
                summary = _loop(model, codec, opt, stream, val, meta, out_dir, objective, steps, lr, slice_s,
                                log_every, eval_every, progress, place)
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(frozen[n])
        model.train(was_training)
    return summary


def _check_same_run(meta: dict, run_cfg: dict, out_dir: Path) -> None:
    """Refuse a state written by another configuration (or by a kvbench without curve rows in its state)."""
    old = meta.get("run", {})
    if old != run_cfg:
        # both sides' keys: batch/dtype/data_files are absent at their defaults, on either side
        diff = sorted(k for k in set(run_cfg) | set(old) if old.get(k) != run_cfg.get(k))
        new_c, old_c = run_cfg["codec"], old.get("codec", {})
        diff += sorted(f"codec.{k}" for k in set(new_c) | set(old_c) if old_c.get(k) != new_c.get(k))
        raise ValueError(f"{out_dir / 'state'} was written by another configuration (differs in {diff}); "
                         "use a new out_dir or delete it to start over")
    if "curves" not in meta:
        raise ValueError(f"{out_dir / 'state'} was written by an older kvbench (no curve rows in its meta.json); "
                         "delete it to start over")


def _step(model, codec, opt, stream, step, objective, place) -> dict:
    """One optimiser step's forward/backward passes over this process's windows (:meth:`Placement.windows`),
    gradients summed over the processes. Returns the global batch's mean ``loss``, ``ntp``, ``rec``."""
    opt.zero_grad(set_to_none=True)
    sums = torch.zeros(3, dtype=torch.float64)
    for j in place.windows(step):
        ids, labels = _to(stream.batch(j), place.device)
        with contextlib.ExitStack() as hooks:  # open through the backward pass (checkpointed layers re-run)
            with place.autocast():
                logits, hat, teacher = compressed_forward(model, codec, ids, hooks=hooks)
            ntp, rec = ntp_loss(logits, labels), rec_loss(hat, teacher)
            loss = {"joint": ntp + rec, "ntp": ntp, "mse": rec}[objective]
            (loss / place.batch).backward()
        sums += torch.tensor([loss.item(), ntp.item(), rec.item()], dtype=torch.float64)
    if place.world.size > 1:
        for p in codec.parameters():  # every process must all-reduce the same tensors
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        place.world.sum_([p.grad for p in codec.parameters()])
        sums = sums.to(place.device)
        place.world.sum_([sums])
    loss, ntp, rec = (sums.cpu() / place.batch).tolist()
    return {"loss": loss, "ntp": ntp, "rec": rec}


def _loop(model, codec, opt, stream, val, meta, out_dir, objective, steps, lr, slice_s,
          log_every, eval_every, progress, place) -> dict:
    """The step loop of :func:`train_codec` (state in ``meta``); writes the final files once ``steps`` are done.
    Decisions to stop (signal, slice) are taken by all processes together, so none waits alone."""
    done = meta["step"]
    rows, timing = meta["curves"], meta["timing"]
    t0, elapsed0 = time.monotonic(), meta["elapsed_s"]
    last_save = t0
    step, last = done, meta["last"]
    evals: dict[int, dict] = {}  # step -> eval result, so the final eval is not run twice
    main = place.world.main
    bar = StepProgress(f"codec {out_dir.name}", steps, done) if progress and main else None

    def save() -> None:
        if not main:
            return
        meta.update(step=step, last=last, elapsed_s=elapsed0 + time.monotonic() - t0,
                    rng=torch.get_rng_state().tolist())
        save_state(out_dir / "state", {"codec": codec}, opt, meta)

    codec.train()
    with StopOnSignal() as stop:
        while step < steps:
            for group in opt.param_groups:
                group["lr"] = lr_at(step, steps, lr)
            last = _step(model, codec, opt, stream, step, objective, place)
            torch.nn.utils.clip_grad_norm_(codec.parameters(), 1.0)
            opt.step()
            step += 1
            if bar is not None:
                bar.update(step, ntp=last["ntp"], rec=last["rec"])
            is_eval = eval_every > 0 and (step % eval_every == 0 or step == steps)
            if step % log_every == 0 or step == steps or is_eval or step == 1:
                row = {"step": step, **last, "lr": opt.param_groups[0]["lr"], "eval_ntp": None, "eval_rec": None}
                if is_eval and main:
                    codec.eval()
                    evals[step] = evaluate(model, codec, val, place)
                    row.update(evals[step])
                    codec.train()
                rows.append(row)
                timing.append({"step": step, "elapsed_s": round(elapsed0 + time.monotonic() - t0, 3)})
            if place.world.any(stop.requested):
                save()
                place.world.barrier()  # no process leaves before rank 0 has saved (torchrun stops the others)
                raise Interrupted(f"codec training interrupted at step {step}; state saved in {out_dir / 'state'}")
            if slice_s is not None and step < steps and place.world.any(time.monotonic() - t0 >= slice_s):
                save()
                # under torchrun the launcher's own exit status (1) replaces the processes' 3; the state is saved
                place.world.barrier()
                raise SliceEnded(f"training codec {out_dir}", step, steps, str(out_dir / "state"), slice_s)
            if time.monotonic() - last_save >= SAVE_EVERY_S:
                save()
                last_save = time.monotonic()
    if step > done:
        save()
    codec.eval()
    if not main:  # the main process evaluates and writes; the others only trained
        place.world.barrier()
        return {"steps": steps, "objective": objective, "rank": place.world.rank}
    summary = {"steps": steps, "objective": objective, "data": meta["run"]["data"],
               "final_loss": last["loss"], "final_ntp": last["ntp"], "final_rec": last["rec"],
               "baseline_ntp": meta["baseline_ntp"], "eval_before": meta["eval_before"],
               "eval_final": evals.get(step) or evaluate(model, codec, val, place),
               "n_val_windows": len(val), "codec_params": codec.n_params()}
    wall = meta["elapsed_s"]
    codec.save(out_dir / "codec")
    for name, table in (("curves.csv", rows), ("curves.timing.csv", timing)):
        with atomic_path(out_dir / name) as tmp:
            pd.DataFrame(table).to_csv(tmp, index=False)
    write_json(out_dir / "summary.timing.json",
               {"wall_s": round(wall, 2), "steps_per_s": round(steps / wall, 3) if wall > 0 else None})
    write_json(out_dir / "summary.json", summary)  # last: the rule's output says everything is there
    place.world.barrier()
    return summary
