#!/usr/bin/env bash
# ResidualKV Fig. 8 on a lent GPU (an H200): Llama-3.1-8B-shaped random-weight timing LM in bfloat16 at
# 32K-256K tokens, full attention (transformers DynamicCache + SDPA, and our cache) vs ResidualKV+OmniKV (INT4),
# tokens/s with 95% intervals and achieved bandwidth as a share of the measured and datasheet peak
# (src/kvbench/bench/gpu_fig8.py). Under 8 minutes: the sweep stops at 390 s of measuring (it skips a context
# that would overrun), the python step is cut at 450 s, and the CSV is rewritten after every context.
#
#   bash scripts/gpu_fig8.sh                # on the GPU machine, from any directory; CSV under $OUT
#   bash scripts/gpu_fig8.sh --device cpu   # dry run on tiny shapes (test timing LM, contexts 256/512)
#
# The machine is bare and reaches no registry: the repository is installed from pyproject.toml without its
# dependencies (the image's torch and transformers serve; its Python may be newer than the pin), after any
# wheels carried under wheels/ (e.g. transformers 5.24 when the image's is older). GPU_FIG8_INSTALL=0 skips
# installing and runs from src/ (a dry run in a checkout whose environment must not change).
# Writes $OUT/fig8_<cuda|cpu>.csv and $OUT/gpu_fig8.log (OUT defaults to results/gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-results/gpu}"
py="${PYTHON:-python3}"
mkdir -p "$out"
if [ "${GPU_FIG8_INSTALL:-1}" = 1 ]; then
    if compgen -G "wheels/*.whl" >/dev/null; then
        "$py" -m pip install --no-deps --no-index wheels/*.whl >"$out/pip.log" 2>&1
    fi
    "$py" -m pip install --no-deps --no-build-isolation --ignore-requires-python -e . >>"$out/pip.log" 2>&1 \
        || { echo "gpu_fig8: pip install -e . failed (tail of $out/pip.log below); running from src/"; tail -5 "$out/pip.log"
             export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"; }
else
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
"$py" -c 'import torch, transformers; print("gpu_fig8: torch", torch.__version__, "transformers", transformers.__version__,
"cuda", torch.cuda.is_available() and torch.cuda.get_device_name())' | tee "$out/gpu_fig8.log"
timeout 450 "$py" -m kvbench.bench.gpu_fig8 --out "$out" "$@" 2>&1 | tee -a "$out/gpu_fig8.log"
