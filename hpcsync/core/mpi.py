"""Lazy access to mpi4py: importing hpcsync never initialises MPI.

MPI is used when a launcher that speaks MPI started us (mpirun, mpiexec, srun with a PMI
plugin), when the program already initialised MPI itself, or when ``HPCSYNC_MPI=1``.
``HPCSYNC_MPI=0`` forces the environment-only path (e.g. torchrun on a machine with mpi4py).
"""
from __future__ import annotations

import os
import sys
import zlib
from typing import Any, Mapping, Optional, Sequence

from .errors import MissingDependencyError

__all__ = [
    "INSTALL_HINT", "mpi4py_importable", "launched_by_mpi", "already_initialized", "use_mpi", "MPI",
    "library_version", "sub_communicator", "library_name"
]

# Variables that only an MPI-capable launcher sets.
_MPI_LAUNCHER_VARS = (
    "OMPI_COMM_WORLD_SIZE",  # Open MPI mpirun
    "PMI_SIZE",  # MPICH Hydra, srun --mpi=pmi2
    "PMI_RANK",
    "PMIX_RANK",  # PMIx: Open MPI 5, srun --mpi=pmix
    "MPI_LOCALNRANKS",  # MPICH Hydra
    "MV2_COMM_WORLD_SIZE",  # MVAPICH
    "PALS_RANKID",  # HPE PALS / Cray
)

INSTALL_HINT = (
    "install mpi4py and an MPI: `pip install mpi4py mpich` (no root needed), or "
    "`pip install mpi4py` against your cluster's MPI (`module load openmpi`)"
)


def mpi4py_importable() -> bool:
    if "mpi4py" in sys.modules:
        return True
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


def launched_by_mpi(env: Optional[Mapping[str, str]] = None) -> bool:
    env = os.environ if env is None else env
    if any(v in env for v in _MPI_LAUNCHER_VARS):
        return True
    # An srun step with several tasks: the user wants MPI; a missing --mpi plugin is then
    # caught as "silent singletons" rather than silently running N separate jobs.
    return "SLURM_STEP_ID" in env and int(env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "1")) or 1) > 1


def already_initialized() -> bool:
    """True when the program (or a library) already initialised MPI through mpi4py."""
    mod = sys.modules.get("mpi4py.MPI")
    return bool(mod is not None and mod.Is_initialized() and not mod.Is_finalized())


def use_mpi(env: Optional[Mapping[str, str]] = None) -> bool:
    """Decide whether hpcsync talks MPI in this process."""
    env = os.environ if env is None else env
    choice = env.get("HPCSYNC_MPI", "auto").strip().lower()
    if choice in ("0", "no", "false", "off"):
        return False
    if choice in ("1", "yes", "true", "on"):
        MPI()  # raise the install hint now
        return True
    if already_initialized():
        return True
    return launched_by_mpi(env) and mpi4py_importable()


_MODULE: Any = None


def MPI() -> Any:
    """Return ``mpi4py.MPI`` (initialising MPI on first use) or raise with an install hint."""
    global _MODULE
    if _MODULE is None:
        try:
            from mpi4py import MPI as mod
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise MissingDependencyError(f"this feature needs MPI: {INSTALL_HINT} ({exc})") from exc
        _MODULE = mod
    return _MODULE


def library_version() -> str:
    """The first line of ``MPI_Get_library_version`` ("Open MPI v4.1.4, package: ...", "MPICH Version: 5.0.2")."""
    text = MPI().Get_library_version().strip("\x00 \n")
    return text.splitlines()[0] if text else ""


def sub_communicator(world: Any, ranks: Sequence[int], key: str) -> Any:
    """The communicator of ``ranks`` (world ranks, in that order), collective over them only
    (``MPI_Comm_create_group``); ``world`` itself when they are all of it. ``key`` names the
    group: its hash is the creation tag, so two groups made at once do not mix."""
    ranks = list(ranks)
    if ranks == list(range(world.Get_size())):
        return world
    group = world.Get_group().Incl(ranks)
    try:
        return world.Create_group(group, zlib.crc32(key.encode()) % 32768)
    finally:
        group.Free()


def library_name() -> Optional[str]:
    """Short MPI library name ('Open MPI 4.1.4', 'MPICH 5.0.2'), or None without MPI."""
    if not use_mpi():
        return None
    first = library_version()
    for prefix, name in (("Open MPI", "Open MPI"), ("MPICH Version:", "MPICH"), ("Intel", "Intel MPI"),
                         ("MVAPICH", "MVAPICH")):
        if first.startswith(prefix):
            version = first[len(prefix):].strip(" :v").split(",")[0].split()[0] if first[len(prefix):].strip() else ""
            return f"{name} {version}".strip()
    return first[:40]
