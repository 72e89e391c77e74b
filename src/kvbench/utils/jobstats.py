"""One JSON line per ``kvbench`` invocation, for scripts that run the verbs as jobs (``scripts/gpu_paper.sh``).

When the environment variable :data:`ENV` names a file, :func:`kvbench.cli.main` appends to it at exit::

    {"verb": "eval", "rc": 0, "wall_s": 12.3, "cuda_max_allocated": 17179869184, "cuda_max_reserved": ...}

``rc`` is the exit status main returns (null when an unexpected exception escaped), ``wall_s`` seconds from the
parsed arguments to the exit (imports of the verb included; interpreter start not), ``cuda_max_allocated`` /
``cuda_max_reserved`` bytes: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` of the current device
when this process initialised CUDA, else null (a CPU run, or a verb that never touched CUDA). One short line
written with one ``write`` in append mode, so processes appending to one file (torchrun) do not interleave.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Iterator

#: The environment variable naming the JSON-lines file.
ENV = "KVBENCH_JOB_STATS"


def cuda_peaks() -> tuple[int | None, int | None]:
    """``(max allocated, max reserved)`` bytes on the current CUDA device, or ``(None, None)`` when CUDA was not
    initialised by this process (torch is not imported to ask: a verb that never imported it used no GPU)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None, None
    return int(torch.cuda.max_memory_allocated()), int(torch.cuda.max_memory_reserved())


def append_job_stats(path: str | os.PathLike, verb: str, rc: int | None, wall_s: float) -> dict:
    """Append this invocation's line (module doc) to ``path`` (created if missing); returns the record."""
    allocated, reserved = cuda_peaks()
    record = {"verb": verb, "rc": rc, "wall_s": round(float(wall_s), 3),
              "cuda_max_allocated": allocated, "cuda_max_reserved": reserved}
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return record


@contextlib.contextmanager
def recorded(verb: str) -> Iterator[dict]:
    """Time the ``with`` body and, when :data:`ENV` names a file, append its line (module doc) at exit, also when
    an exception escapes (``rc`` null then). The body sets ``job["rc"]`` on the dict it gets to its exit status."""
    job: dict = {"rc": None}
    t0 = time.perf_counter()
    try:
        yield job
    finally:
        if os.environ.get(ENV):
            append_job_stats(os.environ[ENV], verb, job["rc"], time.perf_counter() - t0)
