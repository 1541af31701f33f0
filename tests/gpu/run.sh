#!/usr/bin/env bash
# GPU checks for a machine with CUDA (not run in CI; see README "GPU"). Needs a python with torch
# (CUDA build), mpi4py, h5py and this checkout importable, and an mpirun:
#   PYTHON=.venv/bin/python bash tests/gpu/run.sh
# 1) auto -> nccl, one rank per GPU (NCCL forbids two ranks on one GPU), TCP store and MPI store;
# 2) the hpcsync backend with CUDA tensors, 2 ranks (they may share one GPU).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HPCSYNC_GPU_OUT=${HPCSYNC_GPU_OUT:-$(mktemp -d)}
ngpu=$($PY -c 'import torch; print(torch.cuda.device_count())')
[ "$ngpu" -ge 1 ] || { echo "no CUDA device visible to torch" >&2; exit 1; }
MPIRUN=${MPIRUN:-mpirun}
extra=()
"$MPIRUN" --version 2>/dev/null | grep -q "Open MPI" && extra=(--allow-run-as-root --oversubscribe --bind-to none)
run() { echo "== $*"; timeout 300 "$MPIRUN" "${extra[@]}" "$@"; }
run -n "$ngpu" "$PY" tests/gpu/gpu_check.py auto tcp
run -n "$ngpu" "$PY" tests/gpu/gpu_check.py auto mpi
run -n 2 "$PY" tests/gpu/gpu_check.py hpcsync
echo "GPU checks passed ($ngpu GPU(s))"
