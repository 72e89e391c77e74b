"""The lmms-eval model class: a kvbench VLM served through the reuse engine under one refresh policy.

Each ``generate_until`` request becomes a kvbench record (:func:`kvbench.lmms.records.to_record`),
its images are looked up in (or added to) the per-image KV caches under ``cache_dir``
(:class:`~kvbench.reuse.ImageKVStore`, one store per generic prefix), the request is
assembled and refreshed by the policy (:func:`~kvbench.reuse.run_record`) and decoded
greedily from the refreshed K/V (:func:`~kvbench.reuse.greedy_decode`). A ``loglikelihood``
request (multiple-choice tasks) scores its continuation over the same refreshed K/V
(:func:`~kvbench.reuse.continuation_logprob`). Multi-round requests run one reuse request per round
(:meth:`KVBenchReuse.generate_until_multi_round`). Batch size 1.
"""
from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path
from typing import Any

import torch
from lmms_eval.api.model import lmms

from kvbench.data.instructions import GENERIC_SYSTEM
from kvbench.lmms import class_name
from kvbench.lmms.records import (
    cut_at_stop,
    generate_until,
    generate_until_multi_round,
    loglikelihood,
)
from kvbench.models import load_model
from kvbench.reuse import (
    ImageKVStore,
    adapter_for,
    available_policies,
    continuation_logprob,
    greedy_decode,
    run_record,
)
from kvbench.reuse.policies.base import REFRESH
from kvbench.reuse.validate import check_ratio
from kvbench.utils.spec import MethodSpec, fmt, parse


def method_spec(policy: str, r: float, params: dict[str, Any], who: str = "kvbench") -> MethodSpec:
    """The refresh spec ``<policy>@<r>:key=value,...`` of lmms-eval model arguments, parsed by the one spec
    grammar (:mod:`kvbench.utils.spec`; ``r`` dropped for ``reuse``/``full``, whose budget is fixed).

    lmms-eval's ``--model_args`` is itself ``key=value,key=value``, so a whole spec with parameters cannot be
    one argument: the policy, ``r`` and each policy parameter are separate arguments, joined here. Values may
    arrive typed (lmms-eval converts numbers and booleans) or as text; both are written in the grammar's form
    and typed from the policy's fields.

    Raises:
        ValueError: unknown policy, or an argument that is not a parameter of the policy, naming ``who``.
    """
    bad = {k: v for k, v in params.items() if any(c in k + (v if isinstance(v, str) else "") for c in ",=:")}
    if bad:
        # lmms-eval splits model_args at commas; a value that still holds one would be read as more parameters
        raise ValueError(f"{who}: model argument(s) {bad} hold ',', '=' or ':'; give one value per argument "
                         "(a layer list as layers=2+3+4)")
    name = REFRESH.classes[policy].name if policy in REFRESH.classes else policy
    head = policy if name in REFRESH.fixed_r else f"{policy}@{r!r}"
    tail = ",".join(f"{k}={fmt(v)}" for k, v in params.items())
    try:
        return parse(head + (f":{tail}" if tail else ""), REFRESH)
    except ValueError as e:
        where = f"model arguments {sorted(params)} (neither the adapter's own nor the policy's): " if params else ""
        raise ValueError(f"{who}: {where}{e}") from None


class KVBenchReuse(lmms):
    """A kvbench VLM under a refresh policy, as an lmms-eval simple model.

    Parameters (lmms-eval ``model_args``):
        pretrained: str — HF checkpoint directory or zoo name (``kvbench.models.load_model``).
        policy: str, default ``conduit`` — a registered refresh policy (``kvbench.reuse.available_policies``).
        r: float in [0, 1], default 0.1 — refresh ratio of visual tokens (ignored by ``reuse``/``full``).
        any other argument: a parameter of the policy (e.g. ``lam=0.5`` for CONDUIT's image-coefficient
            strength λ), read through the spec grammar (:func:`method_spec`), so the adapter takes what
            ``kvbench eval --method <policy>@<r>:key=value`` takes.
        cache_dir: str or None — per-image KV cache root (default: a temporary directory for this object).
        device: str, default ``cpu``; dtype: ``auto`` (the checkpoint's) or a torch dtype name.
        threads: int or None — torch CPU threads.
        system_field, generic_field: document fields of the serving prefix and the cache-time prefix.
        system, generic_system: their values when the document lacks the field.
        max_new_tokens: int, default 16 — used when the task's generation kwargs give none.
        batch_size: must be 1.

    Raises:
        ValueError: bad ratio, unknown policy, a model argument that is neither the adapter's nor a
            parameter of the policy (listing the policy's), batch size other than 1, all before the model is
            loaded.
    """

    is_simple = True
    default_policy = "conduit"

    def __init__(self, pretrained: str, policy: str | None = None, r: float = 0.1, cache_dir: str | None = None,
                 device: str = "cpu", dtype: str = "auto", threads: int | None = None,
                 system_field: str = "system", generic_field: str = "generic_system", system: str = "",
                 generic_system: str = GENERIC_SYSTEM, max_new_tokens: int = 16, batch_size: int | str = 1,
                 max_batch_size: int | None = None, **policy_params: Any) -> None:
        super().__init__()
        if int(batch_size) != 1:
            raise ValueError(f"{type(self).__name__} serves one request at a time; batch_size must be 1, got {batch_size}")
        self.spec = method_spec(policy or self.default_policy, check_ratio(r), policy_params, type(self).__name__)
        self.policy, self.r, self.params = self.spec.name, self.spec.effective_r, self.spec.params
        self.opts = dict(system_field=system_field, generic_field=generic_field, system=system,
                         generic_system=generic_system)
        self.max_new_tokens = int(max_new_tokens)
        if threads:
            torch.set_num_threads(int(threads))

        model, proc = load_model(pretrained, device=device, dtype=dtype if dtype == "auto" else getattr(torch, dtype))
        self.adapter = adapter_for(model, proc)
        self._tmp = None if cache_dir else tempfile.TemporaryDirectory(prefix="kvbench-lmms-")
        self.cache_root = Path(cache_dir or self._tmp.name)
        self._stores: dict[str, ImageKVStore] = {}

    def store(self, generic_system: str) -> ImageKVStore:
        """The image-cache store of one generic prefix (a subdirectory per prefix: a store is pinned to one)."""
        if generic_system not in self._stores:
            sub = hashlib.sha256(generic_system.encode()).hexdigest()[:16]
            self._stores[generic_system] = ImageKVStore(self.cache_root / sub, self.adapter, generic_system)
        return self._stores[generic_system]

    def answer(self, record: dict, until: list[str]) -> str:
        """Greedy continuation of ``record`` under the policy, cut at EOS and at the first ``until`` string."""
        res = run_record(self.adapter, self.store(record["generic_system"]), record, self.policy, self.r,
                         **self.params)
        ids = greedy_decode(self.adapter, res.output, record["max_new_tokens"])
        tok = getattr(self.adapter.processor, "tokenizer", self.adapter.processor)
        if tok.eos_token_id in ids:
            ids = ids[:ids.index(tok.eos_token_id)]
        text = tok.decode(ids, skip_special_tokens=True)
        return cut_at_stop(text, until)

    def generate_until(self, requests) -> list[str]:
        return generate_until(self, requests)

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        """``(loss, is_greedy)`` per request (:func:`kvbench.lmms.records.loglikelihood`), the prompt refreshed by
        the policy.

        Raises:
            ValueError: an empty continuation.
        """
        return loglikelihood(self, requests, getattr(self.adapter.processor, "tokenizer", self.adapter.processor))

    def continuation_logprob(self, record: dict, ids: list[int]) -> tuple[float, bool]:
        """``(sum of log-probabilities in nats, is_greedy)`` of continuation ``ids`` after ``record``'s prompt, over
        the policy's refreshed K/V (:func:`kvbench.reuse.continuation_logprob`)."""
        res = run_record(self.adapter, self.store(record["generic_system"]), record, self.policy, self.r,
                         **self.params)
        return continuation_logprob(self.adapter, res.output, ids)

    def generate_until_multi_round(self, requests) -> list[tuple[str, ...]]:
        """lmms-eval's multi-round requests (:func:`kvbench.lmms.records.generate_until_multi_round`): every round is
        a new request to the reuse engine, so images that recur across rounds are read from their caches under the
        new prefix (CONDUIT's setting) and refreshed by the policy."""
        return generate_until_multi_round(self, requests)


def _preset(policy: str) -> type[KVBenchReuse]:
    return type(class_name(policy), (KVBenchReuse,), {
        "default_policy": policy, "__module__": __name__,
        "__doc__": f"``{policy}`` preset of :class:`KVBenchReuse` (lmms-eval model id ``kvbench_{policy.replace('-', '_')}``).",
    })


# One importable preset class per policy (the manifests' class paths point at these names).
for _p in available_policies():
    globals()[class_name(_p)] = _preset(_p)
