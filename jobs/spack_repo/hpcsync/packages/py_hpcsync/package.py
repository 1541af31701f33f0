# Spack recipe for hpcsync. ../../../../../spack.yaml installs it from this checkout
# (`develop: py-hpcsync: path: .`); without `develop`, Spack clones `git` below, which is this
# same checkout, so `spack info` / `spack audit` / `spack install py-hpcsync@main` all work offline.
import os

from spack_repo.builtin.build_systems.python import PythonPackage

from spack.package import *

_CHECKOUT = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 5))


class PyHpcsync(PythonPackage):
    """MPI-first helpers for PyTorch training on clusters: socket-free bootstrap, a torch.distributed
    backend over mpi4py, file sync and collective HDF5, detectron2-style comm helpers."""

    homepage = "file://" + _CHECKOUT
    git = "file://" + _CHECKOUT

    license("BSD-3-Clause")

    version("main", branch="main")
    version("0.1.0", branch="main")

    # optional extras of pyproject.toml, as variants
    variant("torch", default=True, description="torch.distributed backend and DDP helpers")
    variant("h5", default=True, description="collective HDF5 writer (parallel h5py)")
    variant("lightning", default=False, description="Lightning Trainer/Fabric integration")
    variant("bench", default=False, description="plots for bench/")

    # pyproject.toml: requires-python >=3.11, setuptools>=77, numpy>=2.4, psutil>=7.1;
    # extras mpi4py>=4.1, torch>=2.12, h5py>=3.16, lightning>=2.2, pytest>=7, pyyaml>=6
    depends_on("python@3.11:", type=("build", "run"))
    depends_on("py-setuptools@77:", type="build")
    depends_on("py-numpy@2.4:", type=("build", "run"))
    depends_on("py-psutil@7.1:", type=("build", "run"))
    depends_on("py-mpi4py@4.1:", type=("build", "run"))
    depends_on("mpi", type=("build", "run"))
    depends_on("py-torch@2.12:", type=("build", "run"), when="+torch")
    depends_on("py-h5py@3.16:+mpi", type=("build", "run"), when="+h5")
    depends_on("hdf5+mpi", when="+h5")
    depends_on("py-lightning@2.2:", type=("build", "run"), when="+lightning")
    depends_on("py-matplotlib", type=("build", "run"), when="+bench")

    depends_on("py-pytest@7:", type="test")
    depends_on("py-pyyaml@6:", type="test")
