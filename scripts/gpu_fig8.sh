#!/usr/bin/env bash
# ResidualKV Fig. 8 on a lent GPU (an H200): Llama-3.1-8B-shaped random-weight timing LM in bfloat16 at
# 32K-256K tokens, full attention (transformers DynamicCache + SDPA, and our cache) vs ResidualKV+OmniKV (INT4, and
# with latent V),
# tokens/s with 95% intervals and achieved bandwidth as a share of the measured and datasheet peak
# (src/kvbench/bench/gpu_fig8.py). Under 8 minutes: the sweep stops at 390 s of measuring (it skips a context
# that would overrun), the python step is cut at 450 s, and the CSV is rewritten after every context.
#
#   bash scripts/gpu_fig8.sh                # on the GPU machine, from any directory; CSV under $OUT
#   bash scripts/gpu_fig8.sh --device cpu   # dry run on tiny shapes (test timing LM, contexts 256/512)
#
# Python and install: scripts/gpu_python.sh (the checkout's .venv, else the bare machine's python3 with the
# repository installed without dependencies).
# Writes $OUT/fig8_<cuda|cpu>.csv, $OUT/gpu_fig8.log and $OUT/pip.log; OUT (default results/gpu in the
# repository) is taken relative to the directory the script is called from. Set OUT, not --out.
set -euo pipefail
name=gpu_fig8
source "$(dirname "$0")/gpu_python.sh"
timeout 450 "$py" -m kvbench.bench.gpu_fig8 --out "$out" "$@" 2>&1 | tee -a "$out/gpu_fig8.log"
