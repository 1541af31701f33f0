#!/usr/bin/env bash
# Workstation launcher: N local ranks with whatever mpirun/mpiexec matches your mpi4py.
#
# What to edit: nothing; pass NRANKS and train.py flags. MPIEXEC picks the launcher
# (default: the venv's MPICH mpiexec if present, else mpiexec on PATH).
#   bash jobs/mpirun_local.sh 4 --epochs 5
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-4}; shift || true
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
MPIEXEC=${MPIEXEC:-$( [ -x .venv/bin/mpiexec ] && echo .venv/bin/mpiexec || echo mpiexec )}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$MPIEXEC" -n "$n" "$PYTHON" examples/train.py "$@"
