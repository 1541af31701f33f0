#!/usr/bin/env bash
# Concretize spack.yaml with a real Spack (needs a Spack >= 1.0 checkout and the spack-packages
# builtin repo; CI machines cannot clone them, so this runs by hand and the README quotes it):
#   bash tests/spack_concretize.sh /path/to/spack /path/to/spack-packages [openmpi-version]
# Passes when: one Open MPI of the asked version, built for Slurm, that keeps mpirun/mpiexec;
# Slurm external (not built); py-hpcsync from this checkout; `spack audit` clean for the recipe.
set -euo pipefail
spack_root=$1 packages=$2 ompi=${3:-}
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export SPACK_USER_CONFIG_PATH=$work/user SPACK_USER_CACHE_PATH=$work/cache
mkdir -p "$SPACK_USER_CONFIG_PATH" "$work/env"
printf 'repos:\n  builtin: %s/repos/spack_repo/builtin\n' "$packages" > "$SPACK_USER_CONFIG_PATH/repos.yaml"
"$spack_root/bin/spack" compiler find >/dev/null
sed -e "s#path: \.#path: $here#" -e "s#: jobs/spack_repo/#: $here/jobs/spack_repo/#" \
    ${ompi:+-e "s#require: \[openmpi\]#require: [openmpi@$ompi]#"} "$here/spack.yaml" > "$work/env/spack.yaml"
"$spack_root/bin/spack" -e "$work/env" concretize -f > "$work/concretize.log"
cat > "$work/check.py" <<'PY'
import spack.environment as ev
specs = {s.name: s for s in ev.active_environment().all_specs()}
mpi = specs["openmpi"]
print(f"openmpi@{mpi.version} schedulers=slurm:{mpi.satisfies('schedulers=slurm')}",
      f"mpirun-stub:{mpi.satisfies('~legacylaunchers schedulers=slurm')}",
      f"slurm-external:{specs['slurm'].external}",
      f"py-torch@{specs['py-torch'].version} py-mpi4py@{specs['py-mpi4py'].version}",
      f"py-h5py@{specs['py-h5py'].version} hdf5@{specs['hdf5'].version} pmix@{specs['pmix'].version}")
assert mpi.satisfies("schedulers=slurm") and not mpi.satisfies("~legacylaunchers schedulers=slurm")
assert specs["slurm"].external and "mpich" not in specs
assert all(s["mpi"].name == "openmpi" for s in specs.values() if "mpi" in s)
PY
"$spack_root/bin/spack" -e "$work/env" python "$work/check.py"
"$spack_root/bin/spack" -e "$work/env" audit packages py-hpcsync | grep -v ': passed' || true
echo "spack.yaml concretizes: OK"
