"""The Snakemake side of Table 3: what the ``conduit_latency`` rule reads and which arguments it passes.

Kept in the package (not in the rule file) so the rule stays declarative and
the logic is testable without Snakemake.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from kvbench.bench.timing_model import TIMING_MODELS


@dataclass(frozen=True)
class LatencyJob:
    """``input``: the file the job depends on; ``args``: arguments of ``kvbench bench conduit-latency``."""

    input: str
    args: str


def latency_job(config: dict, model_dir: Callable[[str], str], tokenizer_dir: str) -> LatencyJob:
    """The timing job of a validated config.

    A timing model (random weights) depends on the zoo tokenizer; a ``models:``
    entry depends on its checkpoint's ``config.json``.

    Raises:
        ValueError: no ``conduit_latency`` section, or a model that is neither a timing
            model nor defined under ``models`` (the message names it).
    """
    if "conduit_latency" not in config:
        raise ValueError("this config has no `conduit_latency:` section, so it has no CONDUIT Table 3 target "
                         "(config/config.yaml shows one)")
    s = config["conduit_latency"]
    model = s["model"]
    if model in TIMING_MODELS:
        path, where = f"{tokenizer_dir}/tokenizer.json", f"--model {model} --tokenizer {tokenizer_dir}"
    elif model in config.get("models", {}):
        path, where = os.path.join(model_dir(model), "config.json"), f"--model {model_dir(model)}"
    else:
        raise ValueError(f"config conduit_latency.model: {model!r} is neither a timing model "
                         f"{sorted(TIMING_MODELS)} nor defined under `models`")
    args = (f"{where} --sizes {' '.join(map(str, s['sizes']))} --page-px {s['page_px']} --r {s['r']} "
            f"--methods {' '.join(s['methods'])} --repeats {s['repeats']} --warmup {s['warmup']} "
            f"--threads {s['threads']} --device {s['device']} --seed {config.get('seed', 0)}")
    return LatencyJob(input=path, args=args)
