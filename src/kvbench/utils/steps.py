"""Work counted in steps: the per-invocation wall-clock slice and console progress.

Training (zoo models, codecs) and evaluation are counted in optimiser steps or
records, never cut by wall-clock time, so the result of a run depends on its
seed and config alone, not on how busy the machine was. A wall-clock limit
exists only as a *slice*: when one invocation has run for ``slice_s`` seconds,
the loop saves its state and raises :class:`SliceEnded`; the CLI turns that
into a failing exit (:data:`SLICE_EXIT_CODE`) whose message says how many steps
are done and that rerunning resumes. No finished output is written before the
last step, so nothing downstream can ever read a partly trained model.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO

#: Exit status of a CLI verb whose slice ended before its work was done (rerun to resume).
SLICE_EXIT_CODE = 3


class SliceEnded(RuntimeError):
    """The invocation's wall-clock slice ended; state is saved and a rerun resumes.

    Attributes:
        done: steps (or records) finished so far, over all invocations.
        total: steps (or records) the work needs.
        state: where the resumable state lives (for the message).
    """

    def __init__(self, what: str, done: int, total: int, state: str, slice_s: float) -> None:
        self.done, self.total, self.state = done, total, state
        super().__init__(
            f"{what}: the {slice_s:g} s wall-clock slice ended after {done} of {total} steps; "
            f"state saved in {state}. Nothing final was written: rerun the same command "
            f"(or snakemake) to resume from step {done}.")


class StepProgress:
    """One console line each time ``every_pct`` percent more of the work is done.

    Long rules write their detailed logs to files; this keeps the console alive
    without tqdm's carriage returns filling those logs. Lines go to ``stream``
    (stderr by default) and are flushed at once, e.g.
    ``[train tiny-qwen2-lm] step 126/1260 (10%) phase copy loss 2.314 | 41 s``.

    Args:
        desc: label in brackets.
        total: steps of the whole job (> 0).
        done: steps already done (a resumed run starts here; no line for them).
        every_pct: percent between lines (1-100).
    """

    def __init__(self, desc: str, total: int, done: int = 0, every_pct: float = 5.0,
                 stream: TextIO | None = None) -> None:
        if total <= 0:
            raise ValueError(f"StepProgress: total must be > 0 steps, got {total}")
        if not 0 < every_pct <= 100:
            raise ValueError(f"StepProgress: every_pct must be in (0, 100], got {every_pct}")
        self.desc, self.total, self.every = desc, total, every_pct
        self.stream = stream
        self.t0 = time.monotonic()
        self._next = (int(100 * done / total / every_pct) + 1) * every_pct

    def update(self, step: int, **info: object) -> None:
        """Report ``step`` steps done (over all resumes); prints when a boundary was crossed."""
        pct = 100.0 * step / self.total
        if pct + 1e-9 < self._next and step != self.total:
            return
        while self._next <= pct + 1e-9:
            self._next += self.every
        extra = " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in info.items())
        line = f"[{self.desc}] step {step}/{self.total} ({pct:.0f}%) {extra} | {time.monotonic() - self.t0:.0f} s"
        stream = self.stream or sys.stderr
        print(line.replace("  ", " "), file=stream, flush=True)
