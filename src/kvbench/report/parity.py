"""``results/parity/kvpress.csv``: kvpress's and kvbench's kept sets and logits side by side.

Joins the plan and the two sides' JSON (:mod:`kvbench.bench.parity`, ``scripts/parity_kvpress.py``): one
row per (press, context, layer, KV head) with the Jaccard index of the two kept position sets, both kept
counts, and the largest absolute difference of the question's last-token logits (per press and context,
repeated on its rows). ``note`` says whether the sets are identical, nested (one side's budget is larger
over the same ranking) or cross, and names the known cause where there is one (docs/decisions/benchmarks.md,
"Parity with kvpress").
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from kvbench.utils.io import atomic_path

COLUMNS = ["press", "kvpress_params", "kvbench_spec", "context", "layer", "head", "jaccard", "n_kept_kvpress",
           "n_kept_kvbench", "max_logit_diff", "note"]

#: Known differences, by press name (the kept sets are not expected to match).
CAUSES = {
    "pyramidkv": "kvpress counts the observation window inside each layer's pyramid budget (top-k over window "
                 "and prefix together); kvbench, as KVCache-Factory, budgets the prefix and adds the window",
}


def jaccard(a: list[int] | set[int], b: list[int] | set[int]) -> float:
    """|a ∩ b| / |a ∪ b| of two position sets (1.0 when both are empty)."""
    a, b = set(a), set(b)
    return 1.0 if not (a or b) else len(a & b) / len(a | b)


def relation(kvpress: set[int], kvbench: set[int]) -> str:
    """``identical``, ``nested: kvpress ⊂ kvbench`` (or the reverse) or ``cross`` (neither contains the other)."""
    if kvpress == kvbench:
        return "identical"
    if kvpress < kvbench:
        return "nested: kvpress ⊂ kvbench"
    if kvbench < kvpress:
        return "nested: kvbench ⊂ kvpress"
    return "cross"


def parity_rows(plan: dict, kvbench: dict, kvpress: dict) -> list[dict]:
    """CSV rows (:data:`COLUMNS`) for every press and context of ``plan``.

    Raises:
        ValueError: a (press, context) missing on either side, or layer/head counts that differ.
    """
    sides = {}
    for side, data in (("kvbench", kvbench), ("kvpress", kvpress)):
        sides[side] = {(r["press"], r["context"]): r for r in data["runs"]}
    rows = []
    for entry in plan["presses"]:
        for ctx in plan["contexts"]:
            key = (entry["name"], ctx)
            missing = [s for s in sides if key not in sides[s]]
            if missing:
                raise ValueError(f"{entry['name']} on {ctx}: no run on the {' and '.join(missing)} side")
            kb, kp = sides["kvbench"][key], sides["kvpress"][key]
            if kp.get("match_distance", 0.0) != 0.0:
                raise ValueError(f"{entry['name']} on {ctx}: kvpress's kept keys match their originals only to "
                                 f"{kp['match_distance']:.3g}, so its kept positions are not certain")
            if [len(h) for h in kb["kept"]] != [len(h) for h in kp["kept"]]:
                raise ValueError(f"{entry['name']} on {ctx}: layer/head shapes differ between the sides")
            diff = max(abs(x - y) for x, y in zip(kb["logits"], kp["logits"], strict=True))
            params = json.dumps(entry["kvpress_params"][ctx], sort_keys=True)
            for layer, (heads_b, heads_p) in enumerate(zip(kb["kept"], kp["kept"])):
                for head, (b, p) in enumerate(zip(heads_b, heads_p)):
                    rel = relation(set(p), set(b))
                    note = rel if rel == "identical" or entry["name"] not in CAUSES else f"{rel}; {CAUSES[entry['name']]}"
                    rows.append({"press": entry["name"], "kvpress_params": params, "kvbench_spec": entry["kvbench_spec"],
                                     "context": ctx, "layer": layer, "head": head, "jaccard": jaccard(p, b),
                                     "n_kept_kvpress": len(p), "n_kept_kvbench": len(b), "max_logit_diff": diff, "note": note})
    return rows


def write_parity_csv(plan: str | Path, kvbench: str | Path, kvpress: str | Path, out: str | Path) -> pd.DataFrame:
    """Read the three JSON files, write :func:`parity_rows` to ``out`` atomically; returns the table."""
    def load(path):
        return json.loads(Path(path).read_text())

    table = pd.DataFrame(parity_rows(load(plan), load(kvbench), load(kvpress)), columns=COLUMNS)
    with atomic_path(out) as tmp:
        table.to_csv(tmp, index=False)
    return table


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per press: min and mean Jaccard, rows with identical sets, and the largest logit difference."""
    g = table.groupby("press", sort=False)
    return pd.DataFrame({"jaccard_min": g.jaccard.min(), "jaccard_mean": g.jaccard.mean(),
                         "identical": g.note.apply(lambda s: int((s == "identical").sum())), "rows": g.size(),
                         "max_logit_diff": g.max_logit_diff.max()})
