#!/usr/bin/env bash
# The main job on one machine: set up ./.venv (no root needed), then train the example with DDP
# on local MPI ranks.   bash jobs/quickstart.sh [NRANKS] [extra train.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-4}; shift || true
bash jobs/setup_env.sh
# MPICH's mpiexec from the venv (pip wheel): no --allow-run-as-root or --oversubscribe needed.
exec bash jobs/mpirun_local.sh "$n" --out runs/quickstart "$@"
