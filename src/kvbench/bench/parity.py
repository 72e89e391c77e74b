"""Parity with NVIDIA's kvpress: the kvbench side of ``results/parity/kvpress.csv``.

:func:`prepare` saves a tiny random float32 ``Qwen2ForCausalLM`` and a byte-level tokenizer without a chat
template (``save_pretrained``), seeded contexts and a question, and a plan that spells, per press and
context, kvbench's press spec and kvpress's parameters mapped to the same kept set
(:func:`kvpress_params`); then runs kvbench's presses and writes their kept sets and last-token logits.
``scripts/parity_kvpress.py`` runs kvpress 0.5.5 on the same plan in its own virtual environment (kvpress
pins transformers < 5.3); :mod:`kvbench.report.parity` joins the two (docs/decisions/benchmarks.md, "Parity with
kvpress").

Parameter mapping (kvpress 0.5.5 read in its ``presses/*.py`` and ``utils.py``):

- kvpress's ``compression_ratio`` is the share removed of the whole context, the observation window
  included; SnapKV keeps ``max(1, int(T · (1 − cr)))`` tokens, window inside (it scores the window
  max + 1). kvbench's ``keep`` is the share kept of the prefix (context minus window), the window added:
  ``round(keep · (T − w)) + w``. So ``cr = 1 − (round(keep · (T − w)) + w + ½) / T`` (the ½ survives the
  truncation). ``window_size = window``, ``kernel_size = kernel`` (kvpress pools with ``avg`` only).
- PyramidKV: kvpress's pyramid has mean ``T · (1 − cr)`` tokens per layer, window included, and each
  layer's count is a top-k over window and prefix together; kvbench's pyramid is over the prefix, mean
  ``keep · (T − w)``, the window added to every layer (as KVCache-Factory). ``cr = 1 − (keep · (T − w) + w)
  / T`` gives both the same mean kept tokens per layer; the per-layer counts still differ.
- KVzip: kvpress prunes ``int(cr · L · H_kv · T)`` pairs over all layers and heads (``layerwise=False``);
  kvbench's ``level="pair"`` keeps ``round(ratio · L · H_kv · T)``. So ``cr = (N − K + ½) / N``. kvpress
  always keeps ``n_sink`` first tokens (default 4); kvbench has no sinks, so ``n_sink = 0``.
  ``chunk_size`` is kvbench's (one chunk here); with no chat template both use the suffix ``"\\n"``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvbench.compress.cache import press_attention
from kvbench.compress.presses.eviction import PAD_POSITION, budget
from kvbench.compress.registry import PRESS
from kvbench.utils.io import write_json
from kvbench.utils.spec import parse

#: The tiny model: 4 layers, 4 query / 2 KV heads of 16 (GQA), byte vocabulary, float32.
MODEL = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 1024, "tie_word_embeddings": False}
#: Weight init std: the zoo's (:data:`kvbench.models.tiny.INIT_RANGE`), so attention is far from uniform
#: and scores do not tie.
INIT_RANGE = 0.08
CONTEXT_LENGTHS = (224, 301, 387)
QUESTION = "\nQuestion: which key opens the third door?\nAnswer:"
SEED = 0


@dataclass(frozen=True)
class ParityPress:
    """One compared method: ``name``, kvbench's press ``spec``, kvpress's class (None: no press)."""

    name: str
    spec: str
    kvpress_class: str | None


#: The compared presses. ``fullkv`` (no compression on either side) gives the logit difference's floor.
#: PyramidKV's beta 4 with window 16 keeps kvpress out of its SnapKV fallback (taken when the top layer's
#: window-inclusive count ``T · (1 − cr) / beta`` is below the window), so both run a pyramid.
PRESSES = (
    ParityPress("fullkv", "fullkv", None),
    ParityPress("snapkv", "snapkv:keep=0.3,window=16,kernel=5,pooling=avg", "SnapKVPress"),
    ParityPress("pyramidkv", "pyramidkv:keep=0.3,window=16,kernel=5,pooling=avg,beta=4", "PyramidKVPress"),
    ParityPress("kvzip", "kvzip:ratio=0.3,level=pair", "KVzipPress"),
)


def kvpress_params(press: Any, n_ctx: int, n_layers: int, n_kv_heads: int) -> dict:
    """kvpress constructor arguments that keep what kvbench's ``press`` keeps on a context of ``n_ctx`` tokens
    (module docstring); ``{}`` for the full cache.

    Raises:
        ValueError: a press kvpress has no counterpart for here, or a context within SnapKV's window.
    """
    name = type(press).name
    if name == "fullkv":
        return {}
    if name in ("snapkv", "pyramidkv"):
        if press.pooling != "avg":
            raise ValueError("kvpress's SnapKV pools with avg only")
        w = press.window
        if n_ctx <= w:
            raise ValueError(f"context of {n_ctx} tokens within the window {w}: kvpress refuses it")
        common = {"window_size": w, "kernel_size": press.kernel}
        if name == "snapkv":
            kept = budget(press.keep, n_ctx - w) + w
            return dict(compression_ratio=0.0 if kept >= n_ctx else 1 - (kept + 0.5) / n_ctx, **common)
        if press.beta != int(press.beta):
            raise ValueError(f"kvpress's PyramidKV takes an integer beta, got {press.beta}")
        mean = press.keep * (n_ctx - w) + w
        return dict(compression_ratio=max(0.0, 1 - mean / n_ctx), beta=int(press.beta), **common)
    if name == "kvzip":
        if press.level != "pair":
            raise ValueError("only KVzip's level='pair' has a kvpress counterpart (layerwise=False)")
        n = n_layers * n_kv_heads * n_ctx
        kept = budget(press.ratio, n)
        return {"compression_ratio": (n - kept + 0.5) / n, "layerwise": False, "n_sink": 0,
                    "chunk_size": press.chunk_size, "kvzip_plus_normalization": False}
    raise ValueError(f"no kvpress counterpart for {name!r}")


def byte_tokenizer() -> Any:
    """A byte-level ``PreTrainedTokenizerFast`` (256 ids, no merges, no special tokens, no chat template):
    both transformers versions encode KVzip's repeat prompt to the same ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: _byte_of(c)))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _byte_of(ch: str) -> int:
    """The byte GPT-2's byte-level alphabet maps to ``ch`` (printable bytes map to themselves)."""
    cp = ord(ch)
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if cp in printable:
        return cp
    others = [b for b in range(256) if b not in printable]
    return others[cp - 256]


def prepare(workdir: str | Path, threads: int = 1) -> dict:
    """Write ``model/``, ``plan.json`` and ``kvbench.json`` under ``workdir``; returns the plan.

    ``plan.json``: ``model_dir`` (relative to ``workdir``), ``question`` ids, ``contexts`` {name: ids},
    ``presses`` [{name, kvbench_spec, kvpress_class, kvpress_params {context: kwargs}}].
    ``kvbench.json``: :func:`run_kvbench`'s result.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.set_num_threads(threads)
    workdir = Path(workdir)
    model_dir = workdir / "model"
    torch.manual_seed(SEED)
    cfg = Qwen2Config(**MODEL, initializer_range=INIT_RANGE, attn_implementation="sdpa")
    Qwen2ForCausalLM(cfg).float().eval().save_pretrained(model_dir)
    tok = byte_tokenizer()
    tok.save_pretrained(model_dir)
    gen = torch.Generator().manual_seed(SEED)
    contexts = {f"c{i}_{n}": torch.randint(0, MODEL["vocab_size"], (n,), generator=gen).tolist()
                for i, n in enumerate(CONTEXT_LENGTHS)}
    presses = []
    for p in PRESSES:
        press = parse(p.spec, PRESS).build()
        params = {c: kvpress_params(press, len(ids), MODEL["num_hidden_layers"], MODEL["num_key_value_heads"])
                  for c, ids in contexts.items()}
        presses.append({"name": p.name, "kvbench_spec": parse(p.spec, PRESS).canonical,
                            "kvpress_class": p.kvpress_class, "kvpress_params": params})
    plan = {"model_dir": "model", "question": tok.encode(QUESTION, add_special_tokens=False), "contexts": contexts,
                "presses": presses}
    write_json(workdir / "plan.json", plan)
    write_json(workdir / "kvbench.json", run_kvbench(plan, model_dir))
    return plan


@torch.inference_mode()
def run_kvbench(plan: dict, model_dir: str | Path) -> dict:
    """kvbench's kept sets and logits for every (press, context) of ``plan``, as the kvpress script writes
    them: ``{"versions": {...}, "runs": [{press, context, kept, logits}]}`` where ``kept[layer][head]`` is
    the sorted context positions kept after the context prefill (and KVzip's scoring pass), and ``logits``
    the float32 last-token logits of the question read through the compressed cache."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    question = torch.tensor([plan["question"]])
    runs = []
    for entry in plan["presses"]:
        spec = parse(entry["kvbench_spec"], PRESS)
        press = spec.build(tokenizer=tok) if "tokenizer" in _fields(spec.cls) else spec.build()
        for name, ids in plan["contexts"].items():
            ctx = torch.tensor([ids])
            n = ctx.shape[1]
            cache = press.new_cache(model)
            with press_attention(model, cache):
                model(input_ids=ctx, position_ids=torch.arange(n).view(1, -1), cache=cache, use_cache=True)
                press.after_context(model, cache, ctx)
                kept = [_kept_positions(layer, n) for layer in cache.layers]
                pos = torch.arange(n, n + question.shape[1]).view(1, -1)
                logits = model(input_ids=question, position_ids=pos, cache=cache, use_cache=True).logits[0, -1]
            runs.append({"press": entry["name"], "context": name, "kept": kept, "logits": logits.float().tolist()})
    return {"versions": {"torch": torch.__version__, "transformers": transformers.__version__}, "runs": runs}


def _fields(cls: type) -> set[str]:
    import dataclasses

    return {f.name for f in dataclasses.fields(cls)}


def _kept_positions(layer: Any, n_ctx: int) -> list[list[int]]:
    """Sorted context positions (< ``n_ctx``) each KV head of ``layer`` holds, padding excluded."""
    view = layer.history()
    if view is None:
        return []
    pos = view.positions[0]
    return [sorted(int(p) for p in row if p != PAD_POSITION and p < n_ctx) for row in pos]
