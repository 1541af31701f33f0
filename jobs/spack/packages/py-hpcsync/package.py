# Spack recipe for hpcsync, used by ../../../spack.yaml to install the project from the checkout
# (`develop: py-hpcsync: path: .`).
from spack.package import *


class PyHpcsync(PythonPackage):
    """MPI-first helpers for PyTorch training on clusters."""

    homepage = "https://example.invalid/hpcsync"
    git = "https://example.invalid/hpcsync.git"

    version("0.1.0")

    depends_on("python@3.9:", type=("build", "run"))
    depends_on("py-setuptools@68:", type="build")
    depends_on("py-numpy", type=("build", "run"))
    depends_on("py-psutil", type=("build", "run"))
    depends_on("py-mpi4py", type=("build", "run"))
    depends_on("py-h5py+mpi", type=("build", "run"))
    depends_on("py-torch", type=("build", "run"))
