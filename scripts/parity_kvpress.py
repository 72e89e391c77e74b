"""kvpress side of results/parity/kvpress.csv: run NVIDIA's kvpress presses on kvbench's parity plan.

Runs in the parity virtual environment (envs/kvpress-parity.txt, built by scripts/parity_env.sh), never
in kvbench's: kvpress 0.5.5 pins transformers < 5.3. Reads the plan that `kvbench parity prepare` wrote
(model directory, contexts, question, each press's kvpress class and parameters per context) and writes
the same JSON layout as kvbench's side: per (press, context) the kept context positions per layer and KV
head, and the question's last-token logits. Usage:

    envs/.parity-venv/bin/python scripts/parity_kvpress.py --plan PLAN.json --out KVPRESS.json

How the kept sets are read (kvpress keeps no positions):
- SnapKV, PyramidKV prune the cache in place, reordered by score. Each kept key vector is matched to the
  uncompressed keys of the same layer and head from a plain prefill of the same context (the press's
  hook does not change the forward, so kept keys equal their originals bit for bit; the largest match
  distance, max |Δ| over the head dimension, is recorded: 0 when every match is exact).
- KVzip masks instead of pruning: after its scoring pass each attention module holds
  ``masked_key_indices`` (batch, head, position) of the evicted pairs; kept = the rest.
The question then reads the compressed cache at positions after the context (``position_ids`` explicit,
as kvpress's pipeline), one token at a time, as kvpress's decoding loop: with SDPA, one forward over a
multi-token question fails after PyramidKV (the causal mask is sized from layer 0's cache, and PyramidKV's
layers hold different counts: transformers issue #35168). Causal attention makes the two equal.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def kept_by_matching(cache, reference) -> tuple[list, float]:
    """Kept positions per layer and head of a pruned cache, by exact match of key vectors to ``reference``."""
    kept, worst = [], 0.0
    for layer, ref in zip(cache.layers, reference):
        heads = []
        for h in range(layer.keys.shape[1]):
            dist = (layer.keys[0, h, :, None] - ref[0, h, None]).abs().amax(-1)    # [n_kept, T], exact
            best, idx = dist.min(-1)
            if len(set(idx.tolist())) != len(idx):
                raise RuntimeError("two kept keys matched one original key")
            worst = max(worst, float(best.max()) if best.numel() else 0.0)
            heads.append(sorted(idx.tolist()))
        kept.append(heads)
    return kept, worst


def kept_by_mask(model, n_ctx: int) -> list:
    """Kept positions per layer and head from KVzip's ``masked_key_indices`` (the evicted pairs)."""
    kept = []
    for layer in model.model.layers:
        n_heads = model.config.num_key_value_heads
        evicted = [set() for _ in range(n_heads)]
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        if masked is not None:
            for h, p in zip(masked[1].tolist(), masked[2].tolist()):
                evicted[h].add(p)
        kept.append([sorted(set(range(n_ctx)) - evicted[h]) for h in range(n_heads)])
    return kept


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    import kvpress
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    with open(a.plan) as f:
        plan = json.load(f)
    model_dir = os.path.join(os.path.dirname(os.path.abspath(a.plan)), plan["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    question = torch.tensor([plan["question"]])
    runs = []
    for name, ids in plan["contexts"].items():
        ctx = torch.tensor([ids])
        n = ctx.shape[1]
        ref = DynamicCache()
        model.model(input_ids=ctx, past_key_values=ref)
        reference = [layer.keys.clone() for layer in ref.layers]
        for entry in plan["presses"]:
            cls = entry["kvpress_class"]
            press = getattr(kvpress, cls)(**entry["kvpress_params"][name]) if cls else None
            cache = DynamicCache()
            if press is None:
                model.model(input_ids=ctx, past_key_values=cache)
            else:
                with press(model):
                    model.model(input_ids=ctx, past_key_values=cache)
            worst = 0.0
            if cls == "KVzipPress":
                kept = kept_by_mask(model, n)
            else:
                kept, worst = kept_by_matching(cache, reference)
            for i in range(question.shape[1]):         # one token at a time: see the module docstring
                pos = torch.tensor([[n + i]])
                logits = model(input_ids=question[:, i:i + 1], past_key_values=cache, position_ids=pos,
                               logits_to_keep=1).logits[0, -1]
            for layer in model.model.layers:            # no mask left for the next run
                layer.self_attn.masked_key_indices = None
            runs.append({"press": entry["name"], "context": name, "kept": kept, "logits": logits.float().tolist(),
                             "match_distance": worst})
    out = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                             "kvpress": getattr(kvpress, "__version__", None) or _dist_version("kvpress")},
               "runs": runs}
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    os.replace(tmp, a.out)
    return 0


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    sys.exit(main())
