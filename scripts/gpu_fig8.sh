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
# Python: $PYTHON if set, else the checkout's .venv (made by scripts/setup.sh; kvbench is installed there, so
# nothing is installed), else python3. On the bare GPU machine (no .venv, no registry) the repository is
# installed into python3 from pyproject.toml without its dependencies (the image's torch and transformers serve;
# its Python may be newer than the pin), after any wheels carried under wheels/ (e.g. transformers 5.24 when the
# image's is older). GPU_FIG8_INSTALL=0/1 forces skipping / installing (0 runs from src/).
# Writes $OUT/fig8_<cuda|cpu>.csv, $OUT/gpu_fig8.log and $OUT/pip.log; OUT (default results/gpu in the
# repository) is taken relative to the directory the script is called from. Set OUT, not --out.
set -euo pipefail
for arg in "$@"; do
    case "$arg" in --out|--out=*) echo "gpu_fig8: set OUT=DIR instead of --out (the log and pip.log go there too)" >&2
                                  exit 2;; esac
done
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="$(realpath -m "${OUT:-$repo/results/gpu}")"
if [ -n "${PYTHON:-}" ]; then
    py="$PYTHON"; install="${GPU_FIG8_INSTALL:-1}"
elif [ -x "$repo/.venv/bin/python" ]; then
    py="$repo/.venv/bin/python"; install="${GPU_FIG8_INSTALL:-0}"
else
    py=python3; install="${GPU_FIG8_INSTALL:-1}"
fi
cd "$repo"
mkdir -p "$out"
if [ "$install" = 1 ]; then
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
