"""Compression methods as evaluation methods: one press spec per run (ResidualKV §V).

Spec grammar (:mod:`kvbench.utils.spec`, family :data:`kvbench.compress.registry.PRESS`)::

    spec := press [ "+" selector ] [ ":" key "=" value { "," key "=" value } ]

e.g. ``fullkv``, ``snapkv:keep=0.3``, ``kivi:bits=2``, ``residualkv+omnikv:full_layers=0+1,keep=0.2``.
``press`` names a class of :data:`kvbench.compress.registry.PRESSES`; keys are its dataclass fields.
A ResidualKV press needs ``codec_dir`` (a path, passed as a method parameter, not in the spec, so that run
names do not hold paths; the spec's ``codec`` field names the codec variant for the record).

Each answer is produced by :func:`kvbench.compress.generate.greedy_generate` (the prompt in one or two chunks
by the press's ``protocol``, then greedy decoding through the compressed cache). The audit row of every sample holds KR measured from the bytes
the cache holds, in two accountings never mixed (:mod:`kvbench.compress.accounting`): ``kr_packed`` (the paper's:
codes at their bit width, per part) and ``kr_resident`` (every tensor held, as held), with ``full_bytes`` (the
full FP16 cache, their denominator) and ``bytes`` (per layer: the packed parts and ``resident``); ``kept`` (share
of the tokens whose K/V the cache still holds, measured) beside ``kept_target`` (what the press's configured
budget keeps by construction, :meth:`~kvbench.compress.cache.Press.kept_target`); CR measured from the keys
attention could read; and, for the first ``audit_requests`` samples of a run, OmniKV's selected positions per step.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from kvbench.compress import accounting
from kvbench.compress.generate import GREEDY, Sampling, final_question_ids, greedy_generate, split_prompt
from kvbench.compress.generate_vlm import continuation_logprob_vlm, encode_vlm, greedy_generate_vlm, question_start
from kvbench.compress.multiquery import answer_queries
from kvbench.compress.registry import PRESS
from kvbench.compress.residualkv.codec import CODEC_FILE, CONFIG_FILE
from kvbench.data.scbench import TURNS
from kvbench.eval.methods import EvalMethod, FatalRunError, eos_ids
from kvbench.eval.multiquery import is_multi, turn_budgets
from kvbench.utils.spec import parse


@dataclass
class CompressMethod(EvalMethod):
    """A compression press run over text records and VLM records (images through
    :mod:`kvbench.compress.generate_vlm`, the full VLM eval's prompt; see the module docstring).

    Parameters:
        spec: press spec.
        codec_dir: trained codec directory, for presses that take one (ResidualKV).
        audit_requests: samples whose OmniKV selections are kept in the audit row (>= 0): the first
            records of the run by position (:meth:`start`), whether or not earlier ones failed.
        temperature, top_p, top_k: decoding (:class:`~kvbench.compress.generate.Sampling`; temperature 0, the
            default, is greedy). Table V's paper profile samples; each record draws from the generator the runner
            seeds per record (:func:`kvbench.eval.runner.record_seed`), so a resumed run draws the same tokens.

    Raises:
        ValueError: unknown press or parameter, ``codec_dir`` given to a press without a codec,
            ``audit_requests`` negative, bad sampling settings.
    """

    name: ClassVar[str] = "compress"
    multi_query: ClassVar[bool] = True
    spec: str = "full"
    codec_dir: str = ""
    audit_requests: int = 4
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        self._spec = parse(self.spec, PRESS)
        self._sampling = Sampling(self.temperature, self.top_p, self.top_k)
        if not isinstance(self.audit_requests, int) or isinstance(self.audit_requests, bool) or self.audit_requests < 0:
            raise ValueError(f"audit_requests must be an int >= 0, got {self.audit_requests!r}")
        self._takes_codec = "codec_dir" in {f.name for f in dataclasses.fields(self._spec.cls)}
        if self.codec_dir and not self._takes_codec:
            # a codec given to a press that never reads it would be recorded in run_info as if it mattered
            raise ValueError(f"method {self.spec!r} takes no codec, but codec_dir={self.codec_dir!r} was given")
        self._press = None
        self._audit: dict | None = None
        self._n = 0
        self._fits = False
        self._multi = False   # the split holds multi-query records (check_records)

    def press(self) -> Any:
        """The press instance (built once; a ResidualKV press loads and checks its codec here).

        Raises:
            ValueError: a press that takes a codec without ``codec_dir``, or one its codec does not fit.
        """
        if self._press is None:
            extra = {"codec_dir": self.codec_dir} if self._takes_codec else {}
            if extra and not self.codec_dir:
                raise ValueError(f"method {self.spec!r} needs codec_dir (a trained codec directory)")
            press = self._spec.build(**extra)
            press.load()
            self._press = press
        return self._press

    def config(self) -> dict:
        press = self.press()
        out = {"name": self.name, "spec": self._spec.canonical, "codec_dir": self.codec_dir,
               "press": {"class": type(press).__name__, **dataclasses.asdict(press)}}
        if self._sampling != GREEDY:   # greedy runs keep the config they always had (a repeat compares it)
            out["sampling"] = dataclasses.asdict(self._sampling)
        return out

    def protocol(self) -> dict:
        press = self.press()
        two = press.protocol == "shared_context" or press.context_pass
        prefill = ("two chunks: the context (then compressed), then the question reading the compressed cache"
                   if two else "one chunk: context + question (exact); decoding reads the compressed cache")
        if self._multi and not two:   # multi-query records are answered from the post-context cache (below)
            prefill = ("per multi-query record: the context as its own chunk (then compressed), each query reading "
                       "the compressed cache; the press's one_pass protocol does not apply to multi_turns records")
        if press.decode_tail:
            prefill += (f"; the question's last {press.decode_tail} token(s) (at most the whole question) are fed as "
                        "decode steps after the prefill")
        out = {**super().protocol(), "press_protocol": press.protocol, "prefill": prefill}
        if self._multi:  # only for such splits, so the recorded protocol of single-query runs is unchanged
            out["queries"] = ("multi-query records (multi_turns): the context prefilled once as its own chunk, then "
                              "each query from the post-context cache, restored per query (SCBench multi-request / "
                              "SCDQ mode, kvbench.compress.multiquery)")
        return out

    def input_files(self) -> list[Path]:
        """The trained codec's two files (``codec.json``, ``codec.safetensors``) when the press takes one."""
        if not (self._takes_codec and self.codec_dir):
            return []
        return [Path(self.codec_dir) / CONFIG_FILE, Path(self.codec_dir) / CODEC_FILE]

    def check_records(self, records: list[dict]) -> None:
        for r in records:
            if r.get("kind") == "vlm":
                continue  # images + text through kvbench.compress.generate_vlm
            if r.get("kind") != "text" or not isinstance(r.get("context"), str):
                raise ValueError(f"record {r.get('id')!r}: compression methods run on VLM records or on text records "
                                 f"with a 'context' field (kind {r.get('kind')!r})")
        self._multi = any(is_multi(r) for r in records)
        serves = type(self.press()).serves
        bad = next((r for r in records if r.get("kind") not in serves), None)
        if bad is not None:  # stop before the first sample, not with every sample failing
            raise ValueError(f"method {self.spec!r} answers {' and '.join(serves)} records only, but record "
                             f"{bad.get('id')!r} is {bad.get('kind')!r}")
        if self.press().decode_tail:
            bad = next((r for r in records if r.get("kind") == "vlm"), None)
            if bad is not None:
                raise ValueError(f"record {bad.get('id')!r}: decode_tail (question tokens fed as decode steps) is "
                                 "implemented for text records only; drop decode_tail for VLM tasks")
        bad = next((r for r in records if r.get("final") and (is_multi(r) or r.get("kind") == "vlm")), None)
        if bad is not None:  # only the single-query text path asks a record's final question after its answer
            raise ValueError(f"record {bad.get('id')!r}: a final question ('final') is implemented for single-query "
                             "text records only (kvbench.data.chain.sample_chain_pairs)")
        if self._sampling != GREEDY:
            # only the single-query text path samples; answering the others greedily would not be the configured run
            bad = next((r for r in records if is_multi(r) or r.get("kind") == "vlm"), None)
            if bad is not None:
                raise ValueError(f"record {bad.get('id')!r}: sampling ({self._sampling}) is implemented for single-query "
                                 "text records only (Table V); multi-query and VLM records are answered greedily")
        self.press()

    def start(self, index: int) -> None:
        # the run's record index, not a count of this process's calls: a resumed run audits the same records
        self._n = index

    def predict_checks(self, model: Any) -> None:
        """Once per run: a press that cannot serve this model (layers out of range, a codec of another shape) stops
        the run (:class:`FatalRunError`) instead of failing every record."""
        if not self._fits:
            try:
                self.press().new_cache(model)
            except ValueError as e:
                raise FatalRunError(f"method {self.spec!r} does not fit the model: {e}") from e
            self._fits = True

    def predict(self, model: Any, proc: Any, record: dict, base_dir: str | Path | None) -> str | list[str]:
        tok = getattr(proc, "tokenizer", proc)
        self.predict_checks(model)
        if is_multi(record):
            return self._predict_queries(model, proc, tok, record)
        if record.get("kind") == "vlm":
            inputs, split = self._vlm_prompt(model, proc, record, base_dir)
            ids = inputs["input_ids"]
            new, cache = greedy_generate_vlm(model, self.press(), inputs, split, int(record["max_new_tokens"]),
                                             eos_ids(model, proc))
            tail = 0
        else:
            ids, q_start = split_prompt(tok, record)
            tail = min(self.press().decode_tail, ids.shape[1] - q_start)   # the question's last tokens
            split = self.press().first_chunk(ids.shape[1], q_start)
            new, cache = greedy_generate(model, self.press(), ids, split, int(record["max_new_tokens"]),
                                         eos_ids(model, proc), self._sampling, then=final_question_ids(tok, record),
                                         tail=tail)
        self._audit = self._request_audit(model, cache, ids.shape[1], split, tail)
        self._audit["n_generated"] = len(new)   # Table V's mean generated tokens
        self._n += 1
        return self.decode(proc, record, torch.tensor(new))

    def continuation_logprob(self, model: Any, proc: Any, record: dict, base_dir: str | Path | None,
                             continuation: list[int]) -> tuple[float, bool]:
        """Log-likelihood of ``continuation`` (token ids) after a VLM record's prompt, read through the press's cache
        (prefilled as :meth:`predict` prefills it, the continuation teacher-forced one decode step per token:
        :func:`kvbench.compress.generate_vlm.continuation_logprob_vlm`); the audit row is that request's.

        Returns:
            ``(sum of log-probabilities in nats, whether every token is the greedy argmax)``.

        Raises:
            ValueError: a record that is not ``kind: "vlm"`` (lmms-eval's requests are), an empty continuation.
        """
        if record.get("kind") != "vlm" or is_multi(record):
            raise ValueError(f"{record.get('id')}: continuation scoring takes single-query VLM records (lmms-eval's "
                             f"requests), got kind {record.get('kind')!r}")
        self.predict_checks(model)
        inputs, split = self._vlm_prompt(model, proc, record, base_dir)
        total, greedy, cache = continuation_logprob_vlm(model, self.press(), inputs, split, continuation)
        self._audit = self._request_audit(model, cache, inputs["input_ids"].shape[1], split)
        self._n += 1
        return total, greedy

    def _vlm_prompt(self, model: Any, proc: Any, record: dict, base_dir: str | Path | None) -> tuple[dict, int]:
        """A VLM record's encoded prompt and its split into the press's chunks (:meth:`Press.first_chunk`)."""
        inputs = encode_vlm(model, proc, record, base_dir)
        ids = inputs["input_ids"]
        return inputs, self.press().first_chunk(ids.shape[1], question_start(proc, record, ids))

    def _request_audit(self, model: Any, cache: Any, n_prompt: int, split: int, tail: int = 0) -> dict:
        """The audit row of one single-query request whose prompt of ``n_prompt`` tokens was split at ``split``, its
        last ``tail`` tokens fed as decode steps (``decode_tail``: the ids they ran as, in the row)."""
        head = n_prompt - tail
        row = self._audit_row(model, cache, head, question_chunk=0 < split < head,
                              n_context=min(split, head) if 0 < split else head)
        return {**row, "decode_tail": tail}

    def _predict_queries(self, model: Any, proc: Any, tok: Any, record: dict) -> list[str]:
        """A multi-query record (:mod:`kvbench.eval.multiquery`): the context prefilled once as its own chunk
        (compressed by the press), then each query answered from the post-context cache (SCBench's multi-request
        mode: :func:`kvbench.compress.multiquery.answer_queries`), whatever the press's ``protocol`` (a one-pass
        prompt would recompute the context per query). Audit: the record's means over queries of KR, kept share,
        tokens and CR (each query's over its own chunk and decode steps), the last query's bytes by layer, and
        ``queries``: each query's own values."""
        context, queries = query_ids(tok, record)
        n_ctx = context.shape[1]
        per_query: list[dict] = []
        tail = self.press().decode_tail
        answers, _ = answer_queries(model, self.press(), context, queries, turn_budgets(record), eos_ids(model, proc),
                                    audit=lambda cache: self._audit_row(model, cache, n_ctx, n_context=n_ctx), tail=tail)
        for a in answers:
            head = a.n_query - min(tail, a.n_query)   # the query chunk's tokens; the rest ran as decode steps
            row = dict(a.audit, cr=_compute_ratio(a.attended, n_ctx + head if head else n_ctx + 1))
            per_query.append(row)
        keys = ("n_tokens", "kr_packed", "kr_resident", "kept", "cr")
        mean = {k: _mean_or_none([q[k] for q in per_query]) for k in keys}
        self._audit = {**per_query[-1], **mean, "n_context": n_ctx,
                       "queries": [{k: q[k] for k in (*keys, "kept_target")} for q in per_query]}
        self._n += 1
        return [self.decode(proc, record, torch.tensor(a.new_ids)) for a in answers]

    def _audit_row(self, model: Any, cache: Any, n_prompt: int, question_chunk: bool = True,
                   n_context: int | None = None) -> dict:
        cfg = model.config.get_text_config()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        parts = cache.stored_bytes()
        n_tokens = cache.get_seq_length()
        shape = {"n_tokens": n_tokens, "n_layers": cfg.num_hidden_layers, "n_kv_heads": cfg.num_key_value_heads,
                 "head_dim": head_dim}
        row = {
            "n_tokens": n_tokens,
            "kr_packed": accounting.keep_ratio_measured(parts, kind="packed", **shape),
            "kr_resident": accounting.keep_ratio_measured(parts, kind="resident", **shape),
            "full_bytes": accounting.full_cache_bytes(**shape),
            "kept": sum(layer.kept_share() for layer in cache.layers) / len(cache.layers),
            "kept_target": self.press().kept_target(n_prompt if n_context is None else n_context, n_tokens,
                                                    cfg.num_hidden_layers),
            # CR over the forwards after the first chunk (the question chunk, if any, and decode steps): what the
            # compressed cache served; the context chunk is exact by construction.
            "cr": _compute_ratio(cache.attended[1:], n_prompt if question_chunk else n_prompt + 1),
            "bytes": [dataclasses.asdict(p) for p in parts],
        }
        if self._n < self.audit_requests and cache.selections:
            row["selections"] = cache.selections
        return row

    def audit(self) -> dict | None:
        return self._audit


def query_ids(tok: Any, record: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Token ids of a multi-query record: the context ``[1, n_context]`` and each query ``[1, n_q]``.

    Each ``context + query`` is tokenised together and split where the query starts (:func:`split_prompt`: a
    token straddling the boundary belongs to the context), as a single-query record is, so every query meets the
    tokens the model was trained and evaluated on.

    Raises:
        ValueError: the split differs between queries (a query whose first characters merge with the context's
            last token otherwise than the others' do, so no one context chunk serves them all), or a query with
            no token of its own; naming the record and the query.
    """
    context, queries = None, []
    for i, turn in enumerate(record[TURNS]):
        ids, split = split_prompt(tok, {"id": record.get("id"), "context": record["context"], "question": turn["input"]})
        if context is None:
            context = ids[:, :split]
        elif not torch.equal(ids[:, :split], context):
            raise ValueError(f"record {record.get('id')!r}: query {i} changes the context's tokens at the boundary "
                             f"({ids.shape[1] - split} query tokens, context {split} vs {context.shape[1]} tokens); "
                             "the queries cannot share one context chunk (start every query with the same separator)")
        if split >= ids.shape[1]:
            raise ValueError(f"record {record.get('id')!r}: query {i} ({turn['input']!r}) has no token after the context")
        queries.append(ids[:, split:])
    if context.shape[1] == 0:
        raise ValueError(f"record {record.get('id')!r}: empty context (a multi-query record shares its context)")
    return context, queries


def _mean_or_none(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _compute_ratio(attended: list[list[int]], first_visible: int) -> float | None:
    """Mean over forwards and layers of attended keys / keys visible to the forward's last query row.

    ``attended``: per forward after the context chunk, per layer; ``first_visible``: keys visible to the first
    of them (the question chunk's last row sees the whole prompt; without a question chunk, the first decode
    step sees the prompt and itself); each later forward sees one key more.
    """
    if not attended:
        return None
    ratios = []
    for step, counts in enumerate(attended):
        visible = first_visible + step
        ratios += [c / visible for c in counts]
    return sum(ratios) / len(ratios)

