"""Registry of compression presses: short name -> :class:`~kvbench.compress.cache.Press` subclass.

A new method is one file in :mod:`kvbench.compress.presses` plus one line here. ``fullkv`` is the exact
full cache read through the same machinery (the "Full cache" row of ResidualKV's tables).
"""
from __future__ import annotations

from kvbench.compress.cache import Press
from kvbench.compress.residualkv.cache import ResidualKVPress


class FullKV(Press):
    """The full, exact KV cache (every token of every layer, FP16): KR 100%, CR 100%."""

    name = "fullkv"


PRESSES: dict[str, type[Press]] = {
    "fullkv": FullKV,
    "residualkv": ResidualKVPress,
}
