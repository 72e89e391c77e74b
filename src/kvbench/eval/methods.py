"""Evaluation methods: how a model answers one record (the KV-cache policy under test).

An evaluation method is a small dataclass with one :meth:`EvalMethod.predict`. The shared machinery
(encoding through :func:`kvbench.models.prompting.model_inputs`, greedy ``generate`` settings, decoding
of the continuation, EOS handling) lives here; :mod:`kvbench.eval.registry` maps a method spec to one
of three evaluation methods:

- ``full``: :class:`FullCache`, greedy decoding with the full, exact KV cache (transformers'
  ``generate`` with its default ``DynamicCache``): the upper-bound baseline.
- a refresh policy spec (``conduit@0.1:lam=0.5``): :class:`~kvbench.eval.refresh.RefreshMethod`, a
  CONDUIT-side policy over cached per-image KV;
- a compression press spec (``snapkv:keep=0.3``): :class:`~kvbench.eval.compress.CompressMethod`.

A new refresh policy or press is one file in its family (:mod:`kvbench.reuse.policies`,
:mod:`kvbench.compress.presses`); nothing here changes.
"""
from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from kvbench.compress.generate import final_question_ids
from kvbench.data.scbench import TURNS
from kvbench.eval.metrics import METRICS
from kvbench.models.prompting import model_inputs

#: Decoding of every method (:meth:`EvalMethod.greedy_kwargs`), as ``config.yaml`` records it.
DECODING = "greedy (do_sample=False, num_beams=1, repetition_penalty=1.0), stop at EOS or max_new_tokens"


def _tokenizer(proc: Any) -> Any:
    return getattr(proc, "tokenizer", proc)


class FatalRunError(RuntimeError):
    """A failure of the run's inputs rather than of one sample (e.g. a missing or corrupt image cache):
    the runner stops and writes no result file, instead of scoring the sample 0 (rows already finished
    stay in the run's work files, so a rerun after the fix resumes)."""


@dataclass
class EvalMethod(abc.ABC):
    """Base class of evaluation methods (one record in, one prediction string out).

    Subclasses set ``name`` and implement :meth:`predict`; dataclass fields are
    the method's hyper-parameters and are recorded in the run's ``config.yaml``.
    """

    name: ClassVar[str] = ""
    #: The method answers multi-query records (``multi_turns``, :mod:`kvbench.eval.multiquery`): its
    #: :meth:`predict` then returns one string per query. Methods without it are refused such splits.
    multi_query: ClassVar[bool] = False

    @abc.abstractmethod
    def predict(self, model: Any, proc: Any, record: dict, base_dir: str | Path | None) -> str:
        """Answer ``record``; returns the decoded continuation (special tokens removed)."""

    def config(self) -> dict:
        """``{"name": ..., **hyper-parameters}`` (defaults filled in) for the run's ``config.yaml``."""
        return {"name": self.name, **dataclasses.asdict(self)}

    def protocol(self) -> dict:
        """How a record meets the model, for ``config.yaml`` (:mod:`kvbench.eval.runconfig`): ``decoding``
        (shared by every method) and ``prefill`` (how the prompt is prefilled; subclasses say theirs)."""
        return {"decoding": DECODING, "prefill": "the whole prompt in one forward (model.generate)"}

    def input_files(self) -> list[Path]:
        """Files named by the method's parameters whose bytes decide its predictions (e.g. a trained codec),
        recorded with their SHA-256 in ``config.yaml`` and checked by ``kvbench eval --from`` (default: none)."""
        return []

    def check_records(self, records: list[dict]) -> None:
        """Refuse a split this method cannot serve, before any model is loaded (default: accept all).

        Raises:
            ValueError: naming the first record that cannot be served and why.
        """

    def start(self, index: int) -> None:
        """Called by the runner before :meth:`predict` of the run's ``index``-th record (0-based).

        Whatever differs between records (e.g. "audit only the first N") must follow from ``index``,
        not from a count of calls: a resumed run skips the records already done, and its rows must
        equal an uninterrupted run's. Default: nothing.
        """

    def audit(self) -> dict | None:
        """Audit record of the last :meth:`predict` call, stored as ``plan`` in its predictions row
        (refresh methods: the refresh plan); None for methods without one."""
        return None

    # -- shared machinery ------------------------------------------------------
    @staticmethod
    def greedy_kwargs(model: Any, proc: Any, max_new_tokens: int) -> dict:
        """``generate`` kwargs for plain greedy decoding that stops at EOS.

        Sampling, beams and the repetition penalty a real checkpoint's
        ``generation_config.json`` may carry (Qwen2.5-VL-Instruct: 1.05) are
        overridden, so every method decodes the same way.
        """
        tok = _tokenizer(proc)
        eos = model.generation_config.eos_token_id
        if eos is None:
            eos = tok.eos_token_id
        pad = model.generation_config.pad_token_id
        if pad is None:
            pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
        return {"max_new_tokens": int(max_new_tokens), "do_sample": False, "num_beams": 1,
                "repetition_penalty": 1.0, "eos_token_id": eos, "pad_token_id": pad}

    @staticmethod
    def decode(proc: Any, record: dict, new_ids: torch.Tensor) -> str:
        """Decode generated ids ``[n_new]`` with special tokens skipped.

        Text records keep the raw continuation (metrics strip); VLM answers
        (an assistant turn) are stripped of surrounding whitespace.
        """
        text = _tokenizer(proc).decode(new_ids.tolist(), skip_special_tokens=True)
        return text.strip() if record.get("kind") == "vlm" else text


@dataclass
class FullCache(EvalMethod):
    """Full KV cache, greedy decoding: ``model.generate`` with transformers' ``DynamicCache``.

    The prompt is prefilled once and every generated token attends to the exact
    KV of all previous tokens; no reuse, refresh or compression. Generation
    stops at EOS or after ``record["max_new_tokens"]`` tokens.
    """

    name: ClassVar[str] = "full"
    multi_query: ClassVar[bool] = True

    @torch.inference_mode()
    def predict(self, model: Any, proc: Any, record: dict, base_dir: str | Path | None) -> str | list[str]:
        if TURNS in record:
            # each query an independent request over context + query, prefilled in one pass (SCBench's SCDQ runs
            # of full attention under vLLM: generate(context ids + query ids) per query); the context is
            # recomputed per query: the full-cache reference, not a shared-context method
            return [self.predict(model, proc, one, base_dir) for one in single_queries(record)]
        inputs, prompt_len = model_inputs(model, proc, record, base_dir)
        out = model.generate(**inputs, **self.greedy_kwargs(model, proc, record["max_new_tokens"]))
        then = final_question_ids(_tokenizer(proc), record)
        if then is not None:   # the final question after the generated answer, then its answer (compress.generate)
            ids = torch.cat([out, torch.tensor([then[0]], dtype=out.dtype, device=out.device)], dim=1)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 **self.greedy_kwargs(model, proc, then[1]))
        return self.decode(proc, record, out[0, prompt_len:])


def full_cache_score(model: Any, proc: Any, record: dict) -> float:
    """Score in [0, 1] of :class:`FullCache`'s answer to ``record`` by the record's own metric (images resolved
    in memory): the zoo's skill floors score their validation slices with it (:mod:`kvbench.train.floors`)."""
    return float(METRICS[record["metric"]](FullCache().predict(model, proc, record, None), record["answer"]))


def single_queries(record: dict) -> list[dict]:
    """The queries of a multi-query record as single-query records on its context (each turn's ``input`` the
    ``question``, its ``answer``, metric and budget the record's fields)."""
    base = {k: v for k, v in record.items() if k != TURNS}
    return [{**base, "question": t["input"], "answer": t["answer"], "metric": t.get("metric", record["metric"]),
             "max_new_tokens": int(t.get("max_new_tokens", record["max_new_tokens"]))} for t in record[TURNS]]


def eos_ids(model: Any, proc: Any) -> set[int]:
    """Token ids that end an answer (the ones ``generate`` stops at in :class:`FullCache`)."""
    eos = EvalMethod.greedy_kwargs(model, proc, 1)["eos_token_id"]
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """``tokens`` up to and including the first EOS (what greedy ``generate`` would have produced)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens
