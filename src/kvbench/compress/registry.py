"""Registry of compression presses: short name -> :class:`~kvbench.compress.cache.Press` subclass.

A new method is one file in :mod:`kvbench.compress.presses` plus one line here. ``fullkv`` is the exact
full cache read through the same machinery (the "Full cache" row of ResidualKV's tables). :data:`PRESS`
is the family of press specs (``<press>[+<selector>][:key=value,...]``, :mod:`kvbench.utils.spec`).
"""
from __future__ import annotations

from kvbench.compress.cache import Press
from kvbench.compress.presses.divprune import DivPrunePress
from kvbench.compress.presses.fastv import FastVPress
from kvbench.compress.presses.kivi import KIVIPress
from kvbench.compress.presses.kvzip import KVzipPress
from kvbench.compress.presses.omnikv import OmniKVPress
from kvbench.compress.presses.pact import PACTPress
from kvbench.compress.presses.palu import PaluPress
from kvbench.compress.presses.pyramidkv import PyramidKVPress
from kvbench.compress.presses.quest import QuestPress
from kvbench.compress.presses.snapkv import SnapKVPress
from kvbench.compress.presses.snapkv_decoding import SnapKVDecodingPress
from kvbench.compress.residualkv.cache import ResidualKVPress
from kvbench.utils.spec import Family


class FullKV(Press):
    """The full, exact KV cache (every token of every layer, FP16): KR 100%, CR 100%.

    Every token's K/V is stored and read at every step through the same press machinery as the methods
    (:class:`~kvbench.compress.cache.Press`'s base layer), so it is the reference row of the compression
    tables.

    Source: the full-cache reference of ResidualKV ("ResidualKV: Residual-Based KV Cache Compression for
    Efficient Long-Context Inference", arXiv 2602.08005v2, §V-B; e.g. Table V's "Full cache" column).

    Parameters
    ----------
    protocol : str, default "shared_context" — how a record's prompt meets the cache (every press has it;
        :class:`~kvbench.compress.cache.Press`).
    decode_tail : int, default 0 — the question's last tokens fed as decode steps (every press has it).
    """

    name = "fullkv"


PRESSES: dict[str, type[Press]] = {cls.name: cls for cls in (
    FullKV, SnapKVPress, PyramidKVPress, KVzipPress, QuestPress, OmniKVPress, KIVIPress, PaluPress, ResidualKVPress,
    FastVPress, PACTPress, DivPrunePress, SnapKVDecodingPress)}

#: Press specs: no budget ``@r``; the canonical form keeps every parameter the spec spelled; a trained
#: codec (``codec_dir``), KVzip's and Palu's tokenizer and Palu's calibration windows (``calib_ids``) are
#: resources, given when the press is built, never in a spec.
PRESS = Family("press", PRESSES, resources=("codec_dir", "tokenizer", "calib_ids"))
