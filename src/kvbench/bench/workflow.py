"""The Snakemake side of Table 3: what the ``conduit_latency`` rule reads and which arguments it passes.

Kept in the package (not in the rule file) so the rule stays declarative and
the logic is testable without Snakemake.
"""
from __future__ import annotations

import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass

from kvbench.bench import TABLE3_METHODS
from kvbench.bench.latency import LatencyConfig, table3_policy
from kvbench.bench.settings import DEVICE_PATTERN
from kvbench.bench.timing_model import TIMING_MODELS

#: ``conduit_latency.methods`` when the config leaves it out: every Table 3 method (``full``, the reference, is
#: always added by the bench). The one list is :data:`~kvbench.bench.TABLE3_METHODS`; neither the schema nor a
#: config repeats it.
TIMED_METHODS = [m for m in TABLE3_METHODS if m != "full"]


@dataclass(frozen=True)
class LatencyJob:
    """``input``: the file the job depends on; ``args``: arguments of ``kvbench bench conduit-latency``,
    shell-quoted (``shlex.join``), so the rule inserts them as they are."""

    input: str
    args: str


def latency_job(config: dict, model_dir: Callable[[str], str], tokenizer_dir: str) -> LatencyJob:
    """The timing job of a validated config.

    A timing model (random weights) depends on the zoo tokenizer; a ``models:``
    entry depends on its checkpoint's ``config.json``. Without ``methods`` the section times
    :data:`TIMED_METHODS`.

    Raises:
        ValueError: no ``conduit_latency`` section, a model that is neither a timing model nor
            defined under ``models`` (or is defined there but not as a vlm), or a value the bench would refuse (its counts and device, then
            the refresh policy registry); the message names the config key and value. Raised while
            the DAG is built, before Snakemake removes the previous CSV.
    """
    if "conduit_latency" not in config:
        raise ValueError("this config has no `conduit_latency:` section, so it has no CONDUIT Table 3 target "
                         "(config/config.yaml shows one)")
    s = {"methods": TIMED_METHODS, **config["conduit_latency"]}
    model = s["model"]
    if model in TIMING_MODELS:
        path, where = f"{tokenizer_dir}/tokenizer.json", ["--model", model, "--tokenizer", tokenizer_dir]
    elif model in config.get("models", {}):
        kind = config["models"][model].get("kind")
        if kind not in (None, "vlm"):
            raise ValueError(f"config conduit_latency.model: {model!r} is a {kind!r} model; Table 3 times image "
                             "reuse, so it needs a vlm (or a timing model)")
        path, where = os.path.join(model_dir(model), "config.json"), ["--model", model_dir(model)]
    else:
        raise ValueError(f"config conduit_latency.model: {model!r} is neither a timing model "
                         f"{sorted(TIMING_MODELS)} nor defined under `models`")
    argv = [*where, "--sizes", *map(str, s["sizes"]), "--page-px", str(s["page_px"]), "--r", str(s["r"]),
            "--methods", *map(str, s["methods"]), "--repeats", str(s["repeats"]), "--warmup", str(s["warmup"]),
            "--threads", str(s["threads"]), "--device", str(s["device"]), "--seed", str(config.get("seed", 0))]
    _check_section(s)
    return LatencyJob(input=path, args=shlex.join(argv))


def _is_int(v, lo: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _check_section(section: dict) -> None:
    """What ``kvbench bench conduit-latency`` would refuse only after Snakemake removed the old CSV: each value
    of the section (counts, device), then what :class:`~kvbench.bench.latency.LatencyConfig` checks (r, the
    methods as refresh policies).

    Raises:
        ValueError: naming the config key, its value and what was expected.
    """
    expected = {"sizes": ("page counts >= 1", lambda v: isinstance(v, list) and v and all(_is_int(x, 1) for x in v)),
                "page_px": ("an integer >= 1", lambda v: _is_int(v, 1)),
                "repeats": ("an integer >= 1", lambda v: _is_int(v, 1)),
                "warmup": ("an integer >= 0", lambda v: _is_int(v, 0)),
                "threads": ("a positive integer", lambda v: _is_int(v, 1)),
                "device": ("auto, cpu, cuda or cuda:<index>",
                           lambda v: isinstance(v, str) and re.fullmatch(DEVICE_PATTERN, v))}
    for key, (what, ok) in expected.items():
        if key in section and not ok(section[key]):
            raise ValueError(f"config conduit_latency.{key} = {section[key]!r}: expected {what}")
    for method in section["methods"]:
        try:
            table3_policy(method, section["r"])
        except ValueError as e:
            raise ValueError(f"config conduit_latency.methods: {method!r}: {e}") from None
    try:
        LatencyConfig(model=section["model"], tokenizer="-", sizes=section["sizes"], page_px=section["page_px"],
                      r=section["r"], methods=section["methods"], repeats=section["repeats"],
                      warmup=section["warmup"], device=section["device"]).validate()
    except (TypeError, ValueError) as e:
        raise ValueError(f"config conduit_latency: {e}") from None
