"""lmms-eval adapter: every kvbench refresh policy as an lmms-eval model (CONDUIT issue #3).

lmms-eval 0.7.3 resolves ``--model <name>`` through ``lmms_eval.models.MODEL_REGISTRY_V2``,
which loads :class:`~lmms_eval.models.registry_v2.ModelManifest` objects from the
entry-point group ``lmms_eval.models``. kvbench declares one entry point there
(``pyproject.toml``: ``kvbench = "kvbench.lmms:manifests"``), so after
``pip install -e .`` these names work in ``lmms-eval --model ...`` and
``simple_evaluate(model=...)``:

- ``kvbench``: any policy, chosen with ``policy=`` (default ``conduit``);
- ``kvbench_<policy>`` for every registered policy (``-`` becomes ``_``:
  ``kvbench_conduit``, ``kvbench_kvshare_conduit``, ``kvbench_full``, ...), with that policy preset;
- ``kvbench_press`` (``press=`` picks a compression press, its parameters as further arguments) and
  ``kvbench_press_<press>`` per registered press (``kvbench_press_snapkv``, ...): :mod:`kvbench.lmms.press`.

Model arguments: ``pretrained`` (checkpoint directory or zoo name), ``policy``,
``r``, ``lam`` (λ, policies that take it), ``cache_dir`` (per-image KV caches),
see :class:`kvbench.lmms.model.KVBenchReuse`. The task side (a local JSONL of
kvbench records as an offline lmms-eval task) is :mod:`kvbench.lmms.task`.
:func:`register` adds the manifests to a running lmms-eval without reinstalling.
"""
from __future__ import annotations

#: The generic model id; ``policy=`` picks the policy.
MODEL_ID = "kvbench"


def model_id(policy: str) -> str:
    """lmms-eval model id of a policy with that policy preset: ``kvbench_<policy>`` (``-`` → ``_``)."""
    return "kvbench_" + policy.replace("-", "_")


def class_name(policy: str) -> str:
    """Name of the preset subclass in :mod:`kvbench.lmms.model` (``KVBench_<policy>``)."""
    return "KVBench_" + policy.replace("-", "_")


def manifests() -> list:
    """lmms-eval manifests of every kvbench model id (the entry point's payload): one per registered policy
    (:func:`kvbench.reuse.available_policies`, read here so a new policy needs no line in this package)."""
    from lmms_eval.models.registry_v2 import ModelManifest

    from kvbench.reuse.policies import available_policies

    base = "kvbench.lmms.model."
    out = [ModelManifest(model_id=MODEL_ID, simple_class_path=base + "KVBenchReuse")]
    out += [ModelManifest(model_id=model_id(p), simple_class_path=base + class_name(p)) for p in available_policies()]
    return out + press_manifests()


def press_manifests() -> list:
    """lmms-eval manifests of the compression presses (:mod:`kvbench.lmms.press`): ``kvbench_press`` (``press=``
    picks one) and ``kvbench_press_<press>`` per registered press (ResidualKV Table II through lmms-eval)."""
    from lmms_eval.models.registry_v2 import ModelManifest

    from kvbench.compress.registry import PRESS
    from kvbench.lmms.press import PRESS_MODEL_ID, press_class_name, press_model_id

    base = "kvbench.lmms.press."
    out = [ModelManifest(model_id=PRESS_MODEL_ID, simple_class_path=base + "KVBenchPress")]
    return out + [ModelManifest(model_id=press_model_id(p), simple_class_path=base + press_class_name(p))
                  for p in PRESS.classes]


def register() -> None:
    """Add :func:`manifests` to the running lmms-eval registry (for an environment installed before the
    entry point existed; a normal install needs no call)."""
    from lmms_eval.models import MODEL_REGISTRY_V2

    for m in manifests():
        MODEL_REGISTRY_V2.register_manifest(m, overwrite=True)
