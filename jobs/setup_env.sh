#!/usr/bin/env bash
# Create ./.venv with everything hpcsync needs, idempotently (a second run takes seconds).
#
#   bash jobs/setup_env.sh          quick path: no root, no compiler. mpi4py + the PyPI MPICH
#                                   wheel, torch 2.13.0 (CPU), serial h5py (the HDF5 writer then
#                                   uses its gather-to-root fallback).
#   bash jobs/setup_env.sh --full   the test stack (root, Debian 12): Debian Open MPI + PMIx,
#                                   parallel HDF5 and h5py built against it, Slurm + munge.
#
# On a cluster use the cluster's MPI instead: `module load openmpi`, then
#   MPICC=mpicc pip install --no-binary=mpi4py mpi4py && pip install -e .
# (or spack.yaml). Env: PYTHON (default python3), VENV (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
full=0
[ "${1:-}" = "--full" ] && full=1

log() { printf '[setup] %s\n' "$*" >&2; }

if [ "$full" = 1 ]; then
  pkgs="openmpi-bin libopenmpi-dev libpmix-dev libhdf5-openmpi-dev slurm-wlm munge"
  missing=$(for p in $pkgs; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || echo "$p"; done)
  if [ -n "$missing" ]; then
    [ "$(id -u)" = 0 ] || { log "need root to apt-get install: $missing"; exit 1; }
    log "apt-get install $missing"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
  fi
fi

[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
PY="$VENV/bin/python"
pip() { "$PY" -m pip --disable-pip-version-check -q "$@" 2>&1 | grep -v "^WARNING: Location" || true; }

# torch pinned: 2.13.0 is the CPU wheel on local disk; a looser spec pulls a multi-GB CUDA build.
if ! { "$PY" -c "import torch, mpi4py, numpy, psutil, pytest, yaml, h5py" 2>/dev/null && [ -x "$VENV/bin/mpiexec" ]; }; then
  log "pip install torch==2.13.0 mpi4py mpich numpy psutil h5py pytest pyyaml"
  pip install "torch==2.13.0" "mpi4py>=4.0" mpich numpy psutil h5py pytest pyyaml
fi
pip install --no-deps -e .

if [ "$full" = 1 ] && ! { "$PY" -c "import lightning, matplotlib, expecttest, sphinx, myst_parser" 2>/dev/null && [ -x "$VENV/bin/ruff" ] \
    && [ "$("$PY" -c 'import importlib.metadata as m; print(m.version("mypy"))' 2>/dev/null)" = 2.4.1 ]; }; then
  log "pip install lightning matplotlib expecttest ruff mypy + docs/requirements.txt (Lightning tests, plots, torch's suite, lint, types, docs)"
  # torch 2.13.0 already satisfies lightning: no CUDA download. ruff and mypy pinned: a new release
  # may add rules, and tests/mypy_baseline.json counts one release's errors.
  pip install lightning matplotlib expecttest "ruff==0.17.6" "mypy==2.4.1" -r docs/requirements.txt
fi
# Parallel h5py must be compiled with the headers of the MPI it links (Debian's Open MPI). The
# mpich wheel puts MPICH's mpi.h into $VENV/include, which setuptools adds to every compile of a
# venv: Open MPI's include dir goes first (CFLAGS precede it), else h5py passes 32-bit MPICH
# handles to Open MPI and segfaults in H5Pset_fapl_mpio. The check is a real mpio open
# (hpcsync.data.h5.mpi_abi_mismatch), not just h5py.get_config().mpi, so a broken build is rebuilt.
h5py_ok() {
  MPI4PY_MPIABI=openmpi "$PY" -c "import h5py, sys; from hpcsync.data.h5 import mpi_abi_mismatch as m
sys.exit(0 if h5py.get_config().mpi and not m() else 1)" 2>/dev/null
}
if [ "$full" = 1 ] && ! h5py_ok; then
  log "building h5py against Debian's parallel HDF5 + Open MPI (~2-3 min)"
  pip install "setuptools>=77" cython pkgconfig wheel
  CC=mpicc.openmpi HDF5_MPI=ON HDF5_DIR=/usr/lib/x86_64-linux-gnu/hdf5/openmpi \
    CFLAGS="$(mpicc.openmpi --showme:incdirs | sed 's/^/-I/; s/ / -I/g') ${CFLAGS:-}" \
    "$PY" -m pip --disable-pip-version-check -q install --no-cache-dir --force-reinstall --no-deps \
    --no-binary=h5py --no-build-isolation h5py
  h5py_ok || { log "h5py built, but an mpio open under Open MPI fails (MPI header/library mismatch)"; exit 1; }
fi
log "ready: $VENV ($("$PY" -c 'import torch, mpi4py, h5py; print("torch", torch.__version__, "mpi4py", mpi4py.__version__, "h5py", h5py.__version__, "parallel" if h5py.get_config().mpi else "serial")'))"
