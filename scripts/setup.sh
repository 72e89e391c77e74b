#!/usr/bin/env bash
# One-time (idempotent) set-up: a Python 3.11 virtual environment in .venv with
# kvbench and every extra (eval = lmms-eval, slurm executor, dev = pytest).
# Pins and their reasons: docs/decisions/dependencies.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"kvbench needs Python 3.11, found {sys.version.split()[0]} at {sys.executable}; set PYTHON=/path/to/python3.11"'
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.kvbench-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet -e '.[dev,eval,slurm]'
  .venv/bin/python -c 'import kvbench, torch, transformers, snakemake, lmms_eval, rapidfuzz'
  touch "$stamp"
fi
