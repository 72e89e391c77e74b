"""Small shared helper for layer-wise policies."""
from __future__ import annotations

from kvbench.reuse.assemble import AssembledRequest


def n_layers_of(req: AssembledRequest) -> int:
    """Number of decoder layers (one stale K tensor per layer)."""
    return len(req.stale_k)
