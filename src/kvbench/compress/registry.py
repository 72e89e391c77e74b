"""Registry of compression presses: short name -> :class:`~kvbench.compress.cache.Press` subclass.

A new method is one file in :mod:`kvbench.compress.presses` plus one line here. ``fullkv`` is the exact
full cache read through the same machinery (the "Full cache" row of ResidualKV's tables).
"""
from __future__ import annotations

from kvbench.compress.cache import Press
from kvbench.compress.presses.kivi import KIVIPress
from kvbench.compress.presses.kvzip import KVzipPress
from kvbench.compress.presses.omnikv import OmniKVPress
from kvbench.compress.presses.palu import PaluPress
from kvbench.compress.presses.pyramidkv import PyramidKVPress
from kvbench.compress.presses.quest import QuestPress
from kvbench.compress.presses.snapkv import SnapKVPress
from kvbench.compress.residualkv.cache import ResidualKVPress


class FullKV(Press):
    """The full, exact KV cache (every token of every layer, FP16): KR 100%, CR 100%."""

    name = "fullkv"


PRESSES: dict[str, type[Press]] = {cls.name: cls for cls in (
    FullKV, SnapKVPress, PyramidKVPress, KVzipPress, QuestPress, OmniKVPress, KIVIPress, PaluPress, ResidualKVPress)}
