"""Refresh policies as evaluation methods: :class:`RefreshMethod` and the image caches it reads (CONDUIT §3-4).

A refresh run is named by a method spec (:mod:`kvbench.utils.spec`), e.g. ``conduit@0.1:lam=0.5``.
``full`` is the :class:`~kvbench.eval.methods.FullCache` reference (``model.generate``); every other
policy of :mod:`kvbench.reuse.policies` runs through :class:`RefreshMethod`: per-image caches built
under the record's ``generic_system`` (:func:`build_caches`, the ``conduit_cache`` rule), the request
assembled under its serving prefix, the policy's refresh, greedy decoding, and an audit record of the
executed plan (:mod:`kvbench.eval.audit`).
"""
from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from kvbench.beyond.compressed_store import CacheCodec, CompressedImageKVStore, summarize
from kvbench.bench.flops import DecoderShape
from kvbench.eval.audit import ReplayPolicy, plan_audit
from kvbench.eval.methods import EvalMethod, FatalRunError, eos_ids, until_eos
from kvbench.eval.runconfig import read_config
from kvbench.models.loader import load_model
from kvbench.reuse import (
    ImageKVStore,
    adapter_for,
    greedy_decode,
    prepare,
    refresh,
)
from kvbench.reuse.cache_store import template_hash
from kvbench.reuse.policies import REFRESH
from kvbench.utils.io import read_jsonl
from kvbench.utils.spec import parse

# --- the evaluation method -------------------------------------------------------------------

class MissingCacheEntry(FatalRunError, FileNotFoundError):
    """A read-only image cache lacks a valid entry: the run stops (scoring the sample 0 would change what is measured)."""


class ReadOnlyStore(ImageKVStore):
    """An :class:`ImageKVStore` that never writes: a missing (or corrupt) entry is an error.

    Evaluation jobs open the store the ``conduit_cache`` rule built, so a Snakemake-managed cache is
    never modified by its readers.

    Raises:
        MissingCacheEntry: the directory has no manifest (cache not built), or an entry is missing
            or failed its hash check; the whole run stops.
    """

    def __init__(self, root, adapter, generic_system):
        if not (Path(root) / "manifest.json").is_file():
            raise MissingCacheEntry(f"image cache {root} has not been built (no manifest.json); "
                                    "build it with `kvbench cache` (Snakemake rule conduit_cache)")
        super().__init__(root, adapter, generic_system)

    def _build(self, enc, key):
        raise MissingCacheEntry(f"image cache {self.root} has no valid entry {key[:12]} for an image of this "
                                "request (missing, or its hash check failed); rebuild it with `kvbench cache` "
                                "(Snakemake rule conduit_cache: rerun it with --forcerun conduit_cache)")


class ReadOnlyCompressedStore(CompressedImageKVStore):
    """A :class:`~kvbench.beyond.compressed_store.CompressedImageKVStore` that never writes (what pipeline runs read;
    rule ``conduit_rkv_cache`` builds it). Raises :class:`MissingCacheEntry` as :class:`ReadOnlyStore`."""

    def __init__(self, root, adapter, generic_system, spec):
        if not (Path(root) / "manifest.json").is_file():
            raise MissingCacheEntry(f"compressed image cache {root} has not been built (no manifest.json); build it "
                                    "with `kvbench cache --compressed` (Snakemake rule conduit_rkv_cache)")
        super().__init__(root, adapter, generic_system, spec)

    def missing(self, key):
        raise MissingCacheEntry(f"compressed image cache {self.root} has no valid entry {key[:12]} for an image of "
                                "this request (missing, or its hash check failed); rebuild it with `kvbench cache "
                                "--compressed` (Snakemake rule conduit_rkv_cache)")


def store_root(cache_dir: str | Path, adapter, generic_system: str) -> Path:
    """Store directory of one (model weights, cache-time template) under ``cache_dir``:
    ``<cache_dir>/<model fingerprint[:16]>/<template hash[:16]>`` (an ImageKVStore is pinned to both)."""
    tmpl = template_hash(adapter.processor, generic_system)
    return Path(cache_dir) / adapter.fingerprint()[:16] / tmpl[:16]


def open_store(cache_dir: str | Path, adapter, generic_system: str, build_missing: bool = True,
               compressed: CacheCodec | None = None, source_dir: str | Path | None = None) -> ImageKVStore:
    """The :class:`ImageKVStore` for ``generic_system`` under ``cache_dir`` (read-only unless ``build_missing``).

    With ``compressed``: the store in ResidualKV's form (:mod:`kvbench.beyond.compressed_store`); when it builds
    missing entries it codes them from the raw store under ``source_dir`` (read only).

    Raises:
        ValueError: ``compressed`` with ``build_missing`` but no ``source_dir``.
    """
    root = store_root(cache_dir, adapter, generic_system)
    if compressed is None:
        cls = ImageKVStore if build_missing else ReadOnlyStore
        return cls(root, adapter, generic_system)
    if not build_missing:
        return ReadOnlyCompressedStore(root, adapter, generic_system, compressed)
    if source_dir is None:
        raise ValueError("a compressed image cache codes its entries from a raw one: give source_dir (the raw "
                         "cache root, e.g. the conduit_cache rule's)")
    source = ReadOnlyStore(store_root(source_dir, adapter, generic_system), adapter, generic_system)
    return CompressedImageKVStore(root, adapter, generic_system, compressed, source)


@dataclass
class RefreshMethod(EvalMethod):
    """Serve a VLM record from per-image caches built under ``generic_system``, refreshing with a policy.

    Per record (CONDUIT §3.1, App. A.3): each image is looked up in (or added to) an
    :class:`ImageKVStore` built under the record's ``generic_system``; the request is assembled under
    its serving prefix ``system`` (:func:`kvbench.reuse.prepare`); the policy runs at budget ``r``
    (:func:`kvbench.reuse.refresh`: scoring pass, plan, Phase 2 executor); ``max_new_tokens`` tokens are
    greedy-decoded and cut after the first EOS, as :class:`~kvbench.eval.methods.FullCache` stops.
    The plan is kept for :meth:`audit` (:func:`kvbench.eval.audit.plan_audit`).

    Parameters:
        spec: method spec (module docstring), e.g. ``"conduit@0.1:lam=0.5"``.
        cache_dir: image-cache root (None: a temporary directory for this method's lifetime).
        build_missing: build missing entries (False: :class:`ReadOnlyStore`, what pipeline runs use).
        compressed: the image caches are stored in ResidualKV's form and restored when read: a
            :class:`~kvbench.beyond.compressed_store.CacheCodec` spec (``codec_dir``, ``full_layers``, ...); None: raw.
        source_dir: the raw cache root compressed entries are coded from (``compressed`` with ``build_missing``).

    Raises:
        ValueError: invalid spec (at construction), or a record without ``generic_system`` or images.
    """

    name: ClassVar[str] = "refresh"
    spec: str = "reuse"
    cache_dir: str | None = None
    build_missing: bool = True
    compressed: dict | None = None
    source_dir: str | None = None

    def __post_init__(self):
        if not isinstance(self.build_missing, bool):
            raise ValueError(f"build_missing must be true or false, got {self.build_missing!r}")
        self._codec = None if self.compressed is None else CacheCodec.from_spec(self.compressed)
        parsed = parse(self.spec, REFRESH)
        if parsed.policy == "full":
            raise ValueError("'full' is the FullCache method (model.generate); use method 'full', "
                             "or 'conduit@1.0' for a refresh of every visual token")
        self.spec = parsed.canonical
        self._parsed = parsed
        self._adapters: dict[int, Any] = {}
        self._stores: dict[str, ImageKVStore] = {}
        self._tmp = None
        self._audit: dict | None = None

    def config(self) -> dict:
        p = self._parsed
        return {"name": self.name, "spec": self.spec, "policy": p.policy, "r": p.effective_r,
                "policy_params": p.build().params(),
                "cache_dir": self.cache_dir, "build_missing": self.build_missing,
                **({} if self._codec is None else {"compressed": self._codec.to_spec(), "source_dir": self.source_dir})}

    def protocol(self) -> dict:
        # the image caches are not hashed into config.yaml: every entry is content-addressed and hash-checked
        # when read (ImageKVStore), so a changed cache stops the run instead of changing its predictions
        return {**super().protocol(),
                "prefill": "each image prefilled alone under the record's generic_system (the image cache, "
                           "cache_dir); the request assembled under its system prompt; the policy's scoring "
                           "pass and refresh at budget r; then greedy decoding from the refreshed cache"}

    def get_adapter(self, model: Any, proc: Any):
        """The reuse adapter of ``model`` (one per model object; a new model drops the open stores)."""
        key = id(model)
        if key not in self._adapters:
            self._adapters = {key: adapter_for(model, proc)}
            self._stores = {}
        return self._adapters[key]

    def get_store(self, adapter, generic_system: str) -> ImageKVStore:
        """The image store of ``generic_system`` under :attr:`cache_dir` (opened once)."""
        h = hashlib.sha256(generic_system.encode()).hexdigest()
        if h not in self._stores:
            root = self.cache_dir
            if root is None:
                self._tmp = self._tmp or tempfile.TemporaryDirectory(prefix="kvbench-imgcache-")
                root = self._tmp.name
            self._stores[h] = open_store(root, adapter, generic_system, self.build_missing, self._codec, self.source_dir)
        return self._stores[h]

    def check_records(self, records: list[dict]) -> None:
        """Refresh methods serve VLM records with a ``generic_system`` (the prefix their images are cached under)."""
        for r in records:
            self._check_record(r)

    def _check_record(self, r: dict) -> None:
        if r.get("kind") != "vlm" or "generic_system" not in r:
            raise ValueError(f"record {r.get('id')!r} (kind {r.get('kind')!r}) cannot be served by {self.spec!r}: "
                             "refresh methods need VLM records with 'generic_system' (the prefix their images are "
                             "cached under; e.g. docpages, digitgrid)")
        if not any(p.get("type") == "image" for p in r.get("content") or []):
            raise ValueError(f"record {r.get('id')!r} has no image part; {self.spec!r} refreshes cached images "
                             "and needs >= 1 image per record")

    def run(self, model: Any, proc: Any, record: dict, base_dir: str | Path | None):
        """Assemble and refresh ``record``; returns ``(adapter, request, RefreshResult)`` (no decoding)."""
        self._check_record(record)  # also on the lmms-eval path, which does not go through run_eval
        adapter = self.get_adapter(model, proc)
        req = prepare(adapter, self.get_store(adapter, record["generic_system"]), record, base_dir)
        p = self._parsed
        return adapter, req, refresh(adapter, req, p.build(), p.effective_r)

    @torch.inference_mode()
    def predict(self, model: Any, proc: Any, record: dict, base_dir: str | Path | None) -> str:
        self._audit = None
        adapter, req, result = self.run(model, proc, record, base_dir)
        tokens = until_eos(greedy_decode(adapter, result.output, int(record["max_new_tokens"])), eos_ids(model, proc))
        self._audit = plan_audit(req, result, self._parsed.params, tokens, DecoderShape.of(model))
        return self.decode(proc, record, torch.tensor(tokens))

    def audit(self) -> dict | None:
        return self._audit


def build_caches(model_spec: str | Path, split_path: str | Path, cache_dir: str | Path, limit: int | None = None,
                 device: str | None = None, threads: int = 1, compressed: dict | None = None,
                 source_dir: str | Path | None = None) -> dict:
    """Prefill every image of the first ``limit`` records of a split alone under its ``generic_system`` and
    store it under ``cache_dir`` (:func:`store_root` per generic prefix); existing valid entries are reused.

    This is what the ``conduit_cache`` rule runs before any refresh run reads the caches read-only. With
    ``compressed`` (a :class:`~kvbench.beyond.compressed_store.CacheCodec` spec) the entries are instead coded in
    ResidualKV's form from the raw caches under ``source_dir`` (read only; rule ``conduit_rkv_cache``).

    Returns:
        Index ``{"model", "model_fingerprint", "split", "n_records", "n_images", "stores": {generic prefix:
        store dir}, "built", "reused", "rebuilt_corrupt"}`` (counts of image entries); with ``compressed`` also
        ``compressed`` (the spec), ``codec_id`` and ``summary``: bytes per image raw vs compressed by part and the
        restore error, over the distinct images of the records
        (:func:`~kvbench.beyond.compressed_store.summarize`).

    Raises:
        ValueError: a record is not a VLM record with ``generic_system`` and at least one image.
    """
    split_path = Path(split_path)
    records = read_jsonl(split_path)[: None if limit is None else int(limit)]
    for r in records:
        if r.get("kind") != "vlm" or "generic_system" not in r:
            raise ValueError(f"{split_path}: record {r.get('id')!r} is not a VLM record with 'generic_system'")
    torch.set_num_threads(int(threads))
    model, proc = load_model(model_spec, device=device or ("cuda" if torch.cuda.is_available() else "cpu"))
    method = RefreshMethod(spec="reuse", cache_dir=str(cache_dir), build_missing=True, compressed=compressed,
                           source_dir=None if source_dir is None else str(source_dir))
    adapter = method.get_adapter(model, proc)
    n_images, seen = 0, {}
    with torch.inference_mode():
        for r in records:
            store = method.get_store(adapter, r["generic_system"])
            entries = store.entries(r, split_path.parent)
            n_images += len(entries)
            seen.update({(store.root, e.key): store for e in entries})
    stats = {k: sum(s.stats[k] for s in method._stores.values()) for k in ("built", "reused", "rebuilt_corrupt")}
    index = {"model": str(model_spec), "model_fingerprint": adapter.fingerprint(), "split": str(split_path),
             "n_records": len(records), "n_images": n_images,
             "stores": {s.generic_system: str(s.root) for s in method._stores.values()}, **stats}
    if method._codec is not None:
        index.update(compressed=method._codec.to_spec(), codec_id=method._codec.codec_id, source_dir=str(source_dir),
                     summary=summarize([store.sidecar(key) for (_, key), store in seen.items()]))
    return index


# --- exact replay of a recorded plan (``kvbench replay``) ---------------------------------------

def _find_row(run_dir: Path, record_id: str) -> dict:
    row = next((r for r in read_jsonl(run_dir / "predictions.jsonl") if r.get("id") == record_id), None)
    if row is not None:
        return row
    raise KeyError(f"{run_dir}/predictions.jsonl has no row with id {record_id!r}")


def replay(run_dir: str | Path, record_id: str, *, cache_dir: str | None = None, device: str | None = None) -> dict:
    """Re-run the recorded plan of ``record_id`` in ``run_dir`` and decode again.

    The model, split, method, cache directory, thread count and device come from the run's ``config.yaml``
    (:mod:`kvbench.eval.runconfig`); the image caches are read from the run's cache directory when it still
    exists (else ``cache_dir``, else rebuilt in a temporary directory: entries are a deterministic function
    of model and image).

    Returns:
        ``{"id", "policy", "recorded", "replayed", "recorded_tokens", "replayed_tokens", "match"}``.

    Raises:
        FileNotFoundError: missing run files. KeyError: unknown id.
        ValueError: the row has no ``plan`` (not a refresh run, or the sample failed), the plan was recorded
            with the pre-fix CacheBlend check-layer blend (:class:`~kvbench.eval.audit.ReplayPolicy`), the
            record's request differs from the recorded one, or a bad ``config.yaml``.
    """
    run_dir = Path(run_dir)
    config = read_config(run_dir)
    info = config["method"]
    row = _find_row(run_dir, record_id)
    audit = row.get("plan")
    if audit and "policy" not in audit:
        raise ValueError(f"{run_dir}: method {info.get('spec', info.get('name'))!r} is not a refresh "
                         "policy; replay re-executes CONDUIT refresh plans only")
    if not audit:
        raise ValueError(f"{run_dir}: row {record_id!r} has no refresh plan (method {info.get('name')!r}, "
                         f"status {row.get('status')!r})")
    policy = ReplayPolicy(audit)  # a record it cannot replay fails here, before the model is loaded
    split = Path(config["split"]["path"])
    record = next((r for r in read_jsonl(split) if r["id"] == record_id), None)
    if record is None:
        raise KeyError(f"{split} has no record {record_id!r}")
    torch.set_num_threads(config["run"]["threads"])
    model, proc = load_model(config["model"]["checkpoint"], device=device or config["run"]["device"])
    recorded_cache, build = info.get("cache_dir"), True
    if cache_dir is None and recorded_cache and Path(recorded_cache).is_dir():
        cache_dir, build = recorded_cache, False  # never write into the run's (pipeline-managed) cache
    method = RefreshMethod(spec=info["spec"], cache_dir=cache_dir, build_missing=build)
    adapter = method.get_adapter(model, proc)
    with torch.inference_mode():
        req = prepare(adapter, method.get_store(adapter, record["generic_system"]), record, split.parent)
        result = refresh(adapter, req, policy, audit["r"])
        tokens = until_eos(greedy_decode(adapter, result.output, int(record["max_new_tokens"])), eos_ids(model, proc))
    pred = method.decode(proc, record, torch.tensor(tokens))
    return {"id": record_id, "policy": audit["policy"], "recorded": row["prediction"], "replayed": pred,
            "recorded_tokens": audit["tokens"], "replayed_tokens": tokens,
            "match": pred == row["prediction"] and tokens == audit["tokens"]}
