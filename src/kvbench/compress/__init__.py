"""ResidualKV side: compressed KV caches, the ResidualKV codec and the compression baselines.

- :mod:`kvbench.compress.residualkv`: the reference + residual-code representation
  (ResidualKV, arXiv 2602.08005v2 §IV): stride schedules and reference retrieval,
  the codec, its training and the cache (the per-token group quantiser is
  :mod:`kvbench.kernels.quant`, shared with KIVI and the kernels).
- :mod:`kvbench.compress.presses`: one file per baseline (SnapKV, PyramidKV, KVzip,
  Quest, OmniKV, KIVI, Palu).
- :mod:`kvbench.compress.accounting`: KR / CR from the bytes a cache really holds and
  from the paper's formula (§V-A).
"""
