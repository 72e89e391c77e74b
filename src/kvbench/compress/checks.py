"""The debug switch for checks that read device tensors back to the host.

A decode step of a compressed cache runs without host synchronisation: no ``.item()``, ``.any()``,
``.tolist()``, ``int(tensor)``, ``nonzero`` or finite checks on its per-step path (docs/decisions.md, "No host
synchronisation in a decode step"), since each one stalls a GPU until its queue drains. The checks that
did so (finite inputs, a token with no visible reference, indices in range, the selected positions a store
holds) run when ``KVBENCH_CHECKS=1`` is set in the environment, read once when this module is imported.
Public functions (``quant.quantize``, ``references.nearest_references``, ...) still check by default; the
caches pass ``check=ENABLED``.
"""
from __future__ import annotations

import os

#: True when ``KVBENCH_CHECKS=1``: the per-step paths check what they would otherwise trust.
ENABLED: bool = os.environ.get("KVBENCH_CHECKS", "") == "1"
