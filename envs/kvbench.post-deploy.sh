#!/usr/bin/env bash
# Runs once inside the freshly created conda env (Snakemake post-deploy hook).
# Installs kvbench itself, editable and without dependencies (kvbench.yaml
# carries them), from the repository. Snakemake runs this script from the
# run's working directory; set KVBENCH_REPO when that is not the repository root.
set -euo pipefail
repo="${KVBENCH_REPO:-$PWD}"
if [ ! -f "$repo/pyproject.toml" ]; then
    echo "kvbench post-deploy: no pyproject.toml in $repo; set KVBENCH_REPO to the repository root" >&2
    exit 1
fi
python -m pip install --no-deps -e "$repo"
