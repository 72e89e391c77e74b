"""``kvbench conduit-diagnose``: CONDUIT's premise diagnostics captured over a split (App. D.2; Tables 11-13).

Each of the first ``n`` records is assembled from the read-only image cache the ``conduit_cache`` rule built
(as a refresh run reads it) and :func:`kvbench.reuse.diagnostics.capture` records, per layer and visual token,
the scoring pass's attention mass, the cached and fresh value norms, the cached key norm and the value drift.
The rows go to one CSV (atomic), which :mod:`kvbench.report.conduit.diagnostics` turns into the tables.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch

from kvbench.eval.refresh import RefreshMethod
from kvbench.models.loader import load_model
from kvbench.reuse import prepare
from kvbench.reuse.diagnostics import capture
from kvbench.utils.io import atomic_path, read_jsonl


def diagnose_split(model_spec: str | Path, split_path: str | Path, cache_dir: str | Path, out: str | Path, *,
                   model_name: str, dataset: str, n: int = 16, m: int = 5, seed: int = 0,
                   threads: int = 1, device: str | None = None) -> pd.DataFrame:
    """Capture the diagnostics of the first ``n`` records of a split into ``out`` (CSV).

    Args:
        model_spec: checkpoint directory or zoo name (a VLM).
        split_path: JSONL split of VLM records with ``generic_system``.
        cache_dir: the image-cache root of this model x dataset (built by ``kvbench cache``; read-only here).
        out: CSV path, written atomically: ``model``, ``dataset``, ``k`` (images), ``evidence_image`` (the image
            holding the answer, ``meta.page`` - 1 on docpages; 0 for one image; -1 unknown), then
            :data:`kvbench.reuse.diagnostics.COLUMNS` for every decoder layer.
        model_name, dataset: the config names written into each row.
        n: records (the paper: 16 prompts for Tables 11-13, 64 for the stability extension).
        m: Monte Carlo directions per token (§D.1: 5).
        seed: direction seed.

    Raises:
        ValueError: ``n`` < 1, an empty split, or a record that is not a VLM record with images and
            ``generic_system`` (all before the model is loaded).
        kvbench.eval.refresh.MissingCacheEntry: the cache lacks an image of a record.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n (records to capture) must be an integer >= 1, got {n!r}")
    records = read_jsonl(split_path)[:n]
    if not records:
        raise ValueError(f"split {str(split_path)!r} has no records: nothing to capture")
    torch.set_num_threads(int(threads))
    model, proc = load_model(model_spec, device=device or ("cuda" if torch.cuda.is_available() else "cpu"))
    method = RefreshMethod(spec="reuse", cache_dir=str(cache_dir), build_missing=False)
    method.check_records(records)
    adapter = method.get_adapter(model, proc)
    base = Path(split_path).parent
    rows = []
    with torch.inference_mode():
        for rec in records:
            req = prepare(adapter, method.get_store(adapter, rec["generic_system"]), rec, base)
            meta = rec.get("meta", {})
            k = int(req.n_images)
            evidence = int(meta["page"]) - 1 if "page" in meta else (0 if k == 1 else -1)
            for row in capture(adapter, req, str(rec["id"]), m=m, seed=seed):
                rows.append({"model": model_name, "dataset": dataset, "k": k, "evidence_image": evidence, **row})
    df = pd.DataFrame(rows)
    with atomic_path(out) as tmp:
        df.to_csv(tmp, index=False)
    return df
