#!/usr/bin/env bash
# Idempotent: the kvpress parity virtual environment at $1 (default envs/.parity-venv) from the pinned
# requirements $2 (default envs/kvpress-parity.txt); writes `pip freeze` to $1/freeze.txt once the
# imports work. Re-running with an unchanged requirements file installs nothing.
# Used by workflow/rules/parity.smk (docs/decisions/benchmarks.md, "Parity with kvpress").
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-envs/.parity-venv}
reqs=${2:-envs/kvpress-parity.txt}
PY=${PARITY_PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
stamp="$venv/freeze.txt"
if [ ! -f "$stamp" ] || [ "$reqs" -nt "$stamp" ]; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$reqs"
  "$venv/bin/python" -c 'import kvpress, torch, transformers; print("kvpress parity env:", torch.__version__, transformers.__version__)'
  "$venv/bin/python" -m pip freeze --disable-pip-version-check > "$stamp.tmp"
  mv "$stamp.tmp" "$stamp"
fi
