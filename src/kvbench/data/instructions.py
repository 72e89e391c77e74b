"""Serving instructions that change how a page is read (the "shifted prefix").

CONDUIT (§3.1, §4.1) caches each image's KV under a generic prefix and serves
it behind a request-specific one. Measured on a tiny VLM in an earlier trial
(docs/log.md, "2026-11 Staleness trial"): the stale-cache gap appears only when the
instruction *precedes* the pages and *changes the answer*; "report the digit"
under the generic prefix was unaffected, "(digit + 1) mod 10" lost half its
accuracy. So every request's serving prefix (``system``) is a header sentence
plus one of the instructions below, and always differs from the generic prefix
(``generic_system``) its pages are cached under.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Instruction:
    """One reading instruction.

    Parameters
    ----------
    text : str — the sentence placed in the serving prefix.
    fn : Callable[[int], int] — maps the digit on the page (0..9) to the answer digit (0..9).
    """

    text: str
    fn: Callable[[int], int]


INSTRUCTIONS: dict[str, Instruction] = {
    "identity": Instruction("Report each digit as written.", lambda d: d),
    "plus_one": Instruction("Report each digit plus one, modulo ten.", lambda d: (d + 1) % 10),
    "plus_five": Instruction("Report each digit plus five, modulo ten.", lambda d: (d + 5) % 10),
    "nine_minus": Instruction("Report nine minus each digit.", lambda d: 9 - d),
}

#: Request headers (who is asking); one is drawn per request, in front of the instruction.
HEADERS: tuple[str, ...] = (
    "You read scanned forms for a records office.",
    "You check handwritten ledgers for an accounting team.",
    "You transcribe survey sheets for a census bureau.",
    "You assist a clerk who digitises archived invoices.",
    "You verify meter readings sent in by customers.",
    "You process order forms filled in by hand.",
    "You read exam answer sheets for a school.",
    "You index handwritten lab notebooks for a library.",
)

#: The fixed prefix every page is cached under later (CONDUIT's generic single-image template).
GENERIC_SYSTEM = "You read scanned pages. Report each digit as written."


def apply(name: str, digit: int) -> int:
    """Answer digit for ``digit`` under instruction ``name``.

    Raises:
        ValueError: unknown instruction name or a digit outside 0..9.
    """
    if name not in INSTRUCTIONS:
        raise ValueError(f"unknown instruction {name!r}; valid: {sorted(INSTRUCTIONS)}")
    if not 0 <= int(digit) <= 9:
        raise ValueError(f"digit must be in 0..9, got {digit!r}")
    return INSTRUCTIONS[name].fn(int(digit))


def sample_system(rng: random.Random, instruction: str | None = None) -> tuple[str, str]:
    """Draw a serving prefix: ``(instruction_name, header + " " + instruction_text)``.

    Args:
        rng: the request's random generator.
        instruction: fix the instruction by name; ``None`` draws one uniformly.

    Raises:
        ValueError: unknown instruction name.
    """
    if instruction is None:
        instruction = rng.choice(sorted(INSTRUCTIONS))
    elif instruction not in INSTRUCTIONS:
        raise ValueError(f"unknown instruction {instruction!r}; valid: {sorted(INSTRUCTIONS)}")
    header = rng.choice(HEADERS)
    return instruction, f"{header} {INSTRUCTIONS[instruction].text}"
