"""The Snakemake side of Table 3: what the ``conduit_latency`` rule reads and which arguments it passes.

Kept in the package (not in the rule file) so the rule stays declarative and
the logic is testable without Snakemake.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass

from kvbench.bench.timing_model import TIMING_MODELS


@dataclass(frozen=True)
class LatencyJob:
    """``input``: the file the job depends on; ``args``: arguments of ``kvbench bench conduit-latency``,
    shell-quoted (``shlex.join``), so the rule inserts them as they are."""

    input: str
    args: str


def latency_job(config: dict, model_dir: Callable[[str], str], tokenizer_dir: str) -> LatencyJob:
    """The timing job of a validated config.

    A timing model (random weights) depends on the zoo tokenizer; a ``models:``
    entry depends on its checkpoint's ``config.json``.

    Raises:
        ValueError: no ``conduit_latency`` section, a model that is neither a timing model nor
            defined under ``models``, or a value the bench would refuse (the CLI's own parser, then
            the refresh policy registry); the message names the config key and value. Raised while
            the DAG is built, before Snakemake removes the previous CSV.
    """
    if "conduit_latency" not in config:
        raise ValueError("this config has no `conduit_latency:` section, so it has no CONDUIT Table 3 target "
                         "(config/config.yaml shows one)")
    s = config["conduit_latency"]
    model = s["model"]
    if model in TIMING_MODELS:
        path, where = f"{tokenizer_dir}/tokenizer.json", ["--model", model, "--tokenizer", tokenizer_dir]
    elif model in config.get("models", {}):
        path, where = os.path.join(model_dir(model), "config.json"), ["--model", model_dir(model)]
    else:
        raise ValueError(f"config conduit_latency.model: {model!r} is neither a timing model "
                         f"{sorted(TIMING_MODELS)} nor defined under `models`")
    argv = [*where, "--sizes", *map(str, s["sizes"]), "--page-px", str(s["page_px"]), "--r", str(s["r"]),
            "--methods", *map(str, s["methods"]), "--repeats", str(s["repeats"]), "--warmup", str(s["warmup"]),
            "--threads", str(s["threads"]), "--device", str(s["device"]), "--seed", str(config.get("seed", 0))]
    _check_args(s, argv)
    return LatencyJob(input=path, args=shlex.join(argv))


def _check_args(section: dict, argv: list[str]) -> None:
    """What ``kvbench bench conduit-latency`` would refuse only after Snakemake removed the old CSV:
    a value its parser rejects (``--device``, counts), then a method that is no refresh policy."""
    from kvbench.cli import build_parser
    from kvbench.reuse import get_policy

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build_parser().parse_args(["bench", "conduit-latency", "--out", "x.csv", *argv])
    except SystemExit:
        msg = (err.getvalue().strip().splitlines() or ["invalid value"])[-1]
        flag = re.search(r"argument --([\w-]+)", msg)
        key = flag.group(1).replace("-", "_") if flag else None
        where = f"conduit_latency.{key} = {section[key]!r}" if key in section else "conduit_latency"
        raise ValueError(f"config {where}: {msg.removeprefix('kvbench bench: error: ')}") from None
    for method in section["methods"]:
        try:
            get_policy(method)
        except ValueError as e:
            raise ValueError(f"config conduit_latency.methods: {method!r}: {e}") from None
