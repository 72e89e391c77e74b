"""The debug switch for checks that read device tensors back to the host.

A decode step of a compressed cache runs without host synchronisation: no ``.item()``, ``.any()``,
``.tolist()``, ``int(tensor)``, ``nonzero`` or finite checks on its per-step path (docs/decisions/residualkv.md, "No host
synchronisation in a decode step"), since each one stalls a GPU until its queue drains. The checks that
did so (finite inputs, a token with no visible reference, indices in range, the selected positions a store
holds) run when ``KVBENCH_CHECKS=1`` (or ``true``/``yes``/``on``) is set in the environment, read once when this module is imported.
Public functions (``quant.quantize``, ``references.nearest_references``, ...) still check by default; the
caches pass ``check=ENABLED``.
"""
from __future__ import annotations

import os

#: accepted values of ``KVBENCH_CHECKS`` (case-insensitive): on, off
_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _read(value: str) -> bool:
    """``KVBENCH_CHECKS`` as a bool. Raises ValueError for a value in neither :data:`_ON` nor :data:`_OFF` (a
    misspelt switch must not silently leave the checks off)."""
    v = value.strip().lower()
    if v not in _ON + _OFF:
        raise ValueError(f"KVBENCH_CHECKS must be one of {_ON} (on) or {_OFF[1:]} / unset (off), got {value!r}")
    return v in _ON


#: True when ``KVBENCH_CHECKS`` is on (``1``): the per-step paths check what they would otherwise trust.
ENABLED: bool = _read(os.environ.get("KVBENCH_CHECKS", ""))
