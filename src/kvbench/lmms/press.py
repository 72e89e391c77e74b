"""The lmms-eval model class of the compression presses: a kvbench VLM whose KV cache is a press's (ResidualKV
Table II through lmms-eval's own tasks).

Each ``generate_until`` request becomes a kvbench record (:func:`kvbench.lmms.records.to_record`) answered by
:class:`kvbench.eval.compress.CompressMethod` (the full VLM eval's prompt, the context chunk with every image
compressed, then the question and greedy decoding through the compressed cache: :mod:`kvbench.compress.generate_vlm`).
So ``--model kvbench_press_fullkv`` answers as ``kvbench eval --method fullkv`` and as ``--model kvbench_full``.
``loglikelihood`` requests (multiple-choice tasks) teacher-force the continuation through the same compressed cache.
Batch size 1.
"""
from __future__ import annotations

from typing import Any

import torch
from lmms_eval.api.model import lmms

from kvbench.compress.registry import PRESS
from kvbench.data.instructions import GENERIC_SYSTEM
from kvbench.eval.compress import CompressMethod
from kvbench.lmms.records import (
    cut_at_stop,
    generate_until,
    generate_until_multi_round,
    loglikelihood,
)
from kvbench.models import load_model
from kvbench.utils.spec import MethodSpec, fmt, parse

#: lmms-eval model id of the generic press model (``press=`` picks the press).
PRESS_MODEL_ID = "kvbench_press"


def press_model_id(press: str) -> str:
    """``kvbench_press_<press>``: the lmms-eval model id with that press preset."""
    return f"{PRESS_MODEL_ID}_{press.replace('-', '_')}"


def press_class_name(press: str) -> str:
    return "KVBenchPress_" + press.replace("-", "_")


def press_spec(press: str, params: dict[str, Any], who: str = "kvbench_press") -> MethodSpec:
    """The press spec ``<press>:key=value,...`` of lmms-eval model arguments (each press parameter one argument, as
    lmms-eval splits ``--model_args`` at commas), parsed by the one spec grammar.

    Raises:
        ValueError: unknown press, a parameter the press does not have, or a value holding ``,``, ``=`` or ``:``.
    """
    bad = {k: v for k, v in params.items() if any(c in k + (v if isinstance(v, str) else "") for c in ",=:")}
    if bad:
        raise ValueError(f"{who}: model argument(s) {bad} hold ',', '=' or ':'; give one value per argument "
                         "(a layer list as full_layers=0+1)")
    tail = ",".join(f"{k}={fmt(v)}" for k, v in params.items())
    try:
        return parse(press + (f":{tail}" if tail else ""), PRESS)
    except ValueError as e:
        raise ValueError(f"{who}: {e}") from None


class KVBenchPress(lmms):
    """A kvbench VLM under a compression press, as an lmms-eval simple model.

    Parameters (lmms-eval ``model_args``):
        pretrained: str: checkpoint directory or zoo name (:func:`kvbench.models.load_model`).
        press: str, default ``fullkv``: a registered press (:data:`kvbench.compress.registry.PRESSES`).
        any other argument: a parameter of the press (``keep=0.1``, ``protocol=one_pass``), read through the spec
            grammar, so the adapter takes what ``kvbench eval --method <press>:key=value`` takes.
        codec_dir: trained codec directory of presses that take one.
        device, dtype, threads, system_field, generic_field, system, generic_system, max_new_tokens, batch_size:
            as :class:`kvbench.lmms.model.KVBenchReuse`.

    Raises:
        ValueError: unknown press or parameter, batch size other than 1, all before the model is loaded; a checkpoint
            without a vision tower (a text LM), once loaded.
    """

    is_simple = True
    default_press = "fullkv"

    def __init__(self, pretrained: str, press: str | None = None, codec_dir: str = "", device: str = "cpu",
                 dtype: str = "auto", threads: int | None = None, system_field: str = "system",
                 generic_field: str = "generic_system", system: str = "", generic_system: str = GENERIC_SYSTEM,
                 max_new_tokens: int = 16, batch_size: int | str = 1, max_batch_size: int | None = None,
                 **press_params: Any) -> None:
        super().__init__()
        if int(batch_size) != 1:
            raise ValueError(f"{type(self).__name__} serves one request at a time; batch_size must be 1, got {batch_size}")
        self.spec = press_spec(press or self.default_press, press_params, type(self).__name__)
        self.method = CompressMethod(spec=self.spec.canonical, codec_dir=codec_dir)
        self.method.press()  # a codec that does not fit fails here, before the model is loaded
        self.opts = dict(system_field=system_field, generic_field=generic_field, system=system,
                         generic_system=generic_system)
        self.max_new_tokens = int(max_new_tokens)
        if threads:
            torch.set_num_threads(int(threads))

        self.model, self.processor = load_model(pretrained, device=device,
                                                dtype=dtype if dtype == "auto" else getattr(torch, dtype))
        if getattr(self.model.config, "vision_config", None) is None:
            # a text LM would read the image placeholders as text and answer without the images
            raise ValueError(f"{type(self).__name__}: pretrained={pretrained!r} is a {type(self.model).__name__} with no "
                             "vision tower; lmms-eval's requests carry images, so this model needs a VLM checkpoint")
        self._n = 0

    def answer(self, record: dict, until: list[str]) -> str:
        """Greedy continuation of ``record`` through the press's cache, cut at the first ``until`` string."""
        self.method.start(self._n)
        self._n += 1
        text = self.method.predict(self.model, self.processor, record, None)
        return cut_at_stop(text, until)

    def generate_until(self, requests) -> list[str]:
        return generate_until(self, requests)

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        """``(loss, is_greedy)`` per request (:func:`kvbench.lmms.records.loglikelihood`), the prompt's cache
        compressed by the press: the continuation is teacher-forced after the generation prompt, one decode step per
        token through the compressed cache (:meth:`kvbench.eval.compress.CompressMethod.continuation_logprob`).

        Raises:
            ValueError: an empty continuation.
        """
        return loglikelihood(self, requests, getattr(self.processor, "tokenizer", self.processor))

    def continuation_logprob(self, record: dict, ids: list[int]) -> tuple[float, bool]:
        """``(sum of log-probabilities in nats, is_greedy)`` of continuation ``ids`` after ``record``'s prompt."""
        self.method.start(self._n)
        self._n += 1
        return self.method.continuation_logprob(self.model, self.processor, record, None, ids)

    def generate_until_multi_round(self, requests) -> list[tuple[str, ...]]:
        """lmms-eval's multi-round requests (:func:`kvbench.lmms.records.generate_until_multi_round`): every round is
        a new request whose whole prompt goes through the press (no cache is carried between rounds)."""
        return generate_until_multi_round(self, requests)


def _preset(press: str) -> type[KVBenchPress]:
    return type(press_class_name(press), (KVBenchPress,), {
        "default_press": press, "__module__": __name__,
        "__doc__": f"``{press}`` preset of :class:`KVBenchPress` (lmms-eval model id ``{press_model_id(press)}``).",
    })


for _p in PRESS.classes:
    globals()[press_class_name(_p)] = _preset(_p)
