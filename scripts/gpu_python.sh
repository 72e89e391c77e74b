# Sourced by the GPU scripts (gpu_fig8.sh, gpu_table3.sh, gpu_paper.sh) after `name=<script name>`: sets repo, out and py, cds to
# the repository and makes kvbench importable.
# Python: $PYTHON if set, else the checkout's .venv (made by scripts/setup.sh; kvbench is installed there, so
# nothing is installed), else python3. On the bare GPU machine (no .venv, no registry) the repository is
# installed into python3 from pyproject.toml without its dependencies (the image's torch and transformers serve;
# its Python may be newer than the pin), after any wheels carried under wheels/ (e.g. transformers 5.24 when the
# image's is older). GPU_INSTALL=0/1 (or the older GPU_FIG8_INSTALL) forces skipping / installing (0 runs from
# src/). OUT (default results/gpu in the repository) is taken relative to the directory the script is called from.
for arg in "$@"; do
    case "$arg" in --out|--out=*) echo "$name: set OUT=DIR instead of --out (the log and pip.log go there too)" >&2
                                  exit 2;; esac
done
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$(realpath -m "${OUT:-$repo/results/gpu}")"
force="${GPU_INSTALL:-${GPU_FIG8_INSTALL:-}}"
if [ -n "${PYTHON:-}" ]; then
    py="$PYTHON"; install="${force:-1}"
elif [ -x "$repo/.venv/bin/python" ]; then
    py="$repo/.venv/bin/python"; install="${force:-0}"
else
    py=python3; install="${force:-1}"
fi
cd "$repo"
mkdir -p "$out"
if [ "$install" = 1 ]; then
    if compgen -G "wheels/*.whl" >/dev/null; then
        "$py" -m pip install --no-deps --no-index wheels/*.whl >"$out/pip.log" 2>&1
    fi
    "$py" -m pip install --no-deps --no-build-isolation --ignore-requires-python -e . >>"$out/pip.log" 2>&1 \
        || { echo "$name: pip install -e . failed (tail of $out/pip.log below); running from src/"; tail -5 "$out/pip.log"
             export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"; }
else
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
"$py" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__,
"cuda", torch.cuda.is_available() and torch.cuda.get_device_name())' | tee "$out/$name.log"
