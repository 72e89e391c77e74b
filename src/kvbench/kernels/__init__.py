"""Triton kernels of the compressed caches, each with a pure-torch reference of the same signature.

Each kernel ships with its reference, and ``tests/test_kernel_*.py`` compare the two on the CPU under
Triton's interpreter (``TRITON_INTERPRET=1``; ``pytest tests/ -k kernel``). Modules:

- :mod:`.group_quant`: per-token group quantisation of ResidualKV's residual codes with packed 2/4/8-bit
  levels (``group_quant``, ``group_dequant``; ``pack_levels`` / ``unpack_levels`` for the CPU path);
- :mod:`.restore_attend`: a sparse layer's decode attention over raw tokens, references and coded tokens,
  restoring the coded ones in registers (ResidualKV §IV-B/C), optionally with V kept latent;
- :mod:`.kivi_attend`: decode attention over a KIVI-quantised layer (ResidualKV's 4-bit full layers);
- :mod:`.flash_decode`: the split online softmax and combine step the two attention kernels share.

Each also has a ``*_bytes`` helper: the bytes a call reads, for the benchmarks' bandwidth columns.

Nothing calls them yet: the caches still restore and attend in torch (the decode refactor wires them in).
"""
