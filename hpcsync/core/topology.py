"""Who is who in the job: world / local / node ranks, from MPI when it is in use.

Local ranks come from ``Split_type(COMM_TYPE_SHARED)`` (processes that share memory, i.e. a
node), node ranks from the order of each node's lowest world rank. Both are right for block and
round-robin placement, unlike arithmetic on ``rank // ranks_per_node``.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import asdict, dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

from . import mpi, nodemap
from .environments import LauncherEnvironment, detect_environment
from .errors import LaunchError

__all__ = ["Topology", "topology", "local_comm", "node_layout", "check_not_singleton", "from_environment"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_size: int
    node_rank: int
    num_nodes: int
    hostname: str
    launcher: str
    mpi_library: Optional[str]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def uses_mpi(self) -> bool:
        return self.mpi_library is not None

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


_lock = threading.Lock()
_cached: Optional[Topology] = None
_local_comm: Any = None


def topology(refresh: bool = False) -> Topology:
    """Return this process's :class:`Topology` (computed once, collectively under MPI)."""
    global _cached
    with _lock:
        if _cached is None or refresh:
            _cached = _from_mpi() if mpi.use_mpi() else from_environment(os.environ)
        return _cached


def local_comm() -> Any:
    """The node-local MPI communicator (``COMM_TYPE_SHARED``); None without MPI."""
    topology()
    return _local_comm


def _from_mpi() -> Topology:
    global _local_comm
    MPI = mpi.MPI()
    world = MPI.COMM_WORLD
    env = detect_environment(os.environ)
    check_not_singleton(world.Get_size(), env)
    if _local_comm is None:
        _local_comm = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    node_rank, num_nodes = node_layout(world, _local_comm)
    # every rank knows every rank's node while all are healthy: reports about lost ranks name it
    nodemap.set_current(nodemap.build(world, _local_comm, node_rank, socket.gethostname()))
    return Topology(
        rank=world.Get_rank(),
        world_size=world.Get_size(),
        local_rank=_local_comm.Get_rank(),
        local_size=_local_comm.Get_size(),
        node_rank=node_rank,
        num_nodes=num_nodes,
        hostname=socket.gethostname(),
        launcher=env.name if env.name != "single" else "mpi",
        mpi_library=mpi.library_name(),
    )


def node_layout(world: Any, local: Any) -> Tuple[int, int]:
    """(node rank, number of nodes) given the world and this rank's node communicator.

    Nodes are numbered by their lowest world rank, so the answer does not depend on how ranks
    were placed (block, round-robin, or arbitrary). Collective over ``world``.
    """
    from mpi4py import MPI

    leader = 1 if local.Get_rank() == 0 else 0
    # A node's index = how many node leaders have a lower world rank than its own leader.
    before = world.exscan(leader, op=MPI.SUM) if world.Get_size() > 1 else 0
    node_rank = local.bcast(before if leader else None, root=0) or 0
    return node_rank, world.allreduce(leader, op=MPI.SUM)


def check_not_singleton(mpi_size: int, env: LauncherEnvironment) -> None:
    """Raise when MPI sees a 1-rank world but the launcher started several tasks.

    This is ``srun`` with a missing or wrong ``--mpi`` plugin (or an MPI that cannot talk to
    the launcher): N independent copies that all believe they are rank 0 and overwrite each
    other's output.
    """
    expected = env.world_size()
    if mpi_size != 1 or expected is None or expected <= 1:
        return
    lib = ""
    try:
        lib = " ".join(mpi.library_version().split(",")[0].split())
    except Exception:  # pragma: no cover
        pass
    if env.name == "slurm":
        plugin = "pmix" if "Open MPI" in lib else "pmi2"
        fix = (f"launch with `srun --mpi={plugin}` (see `srun --mpi=list`; Open MPI wants pmix, "
               f"MPICH wants pmi2), or set MpiDefault in slurm.conf")
    else:
        fix = ("launch with the mpirun/mpiexec that belongs to the MPI library mpi4py loaded, or "
               "make mpi4py load the launcher's MPI (MPI4PY_MPIABI=openmpi|mpich, MPI4PY_LIBMPI=path)")
    raise LaunchError(
        f"silent singletons: launcher {env.name!r} started {expected} tasks but MPI "
        f"({lib or 'unknown library'}) sees a world of size 1 in each, so every task would "
        f"act as rank 0. Fix: {fix}. Set HPCSYNC_MPI=0 to run without MPI on purpose."
    )


def from_environment(env: Mapping[str, str]) -> Topology:
    """Topology from launcher variables alone (no MPI): torchrun, Slurm, Open MPI, PMI, single."""
    launcher = detect_environment(env)
    rank = launcher.world_rank()
    size = launcher.world_size()
    if rank is None or size is None:
        raise LaunchError(
            f"launcher {launcher.name!r} does not export the world rank and size; "
            f"install mpi4py so hpcsync can ask MPI (or set RANK/WORLD_SIZE/LOCAL_RANK)"
        )
    if not 0 <= rank < size:
        raise LaunchError(f"launcher {launcher.name!r} exported rank {rank} outside world size {size}")
    local_rank = launcher.local_rank()
    local_size = launcher.local_size()
    if local_rank is None or local_size is None:
        if size == 1:
            local_rank, local_size = 0, 1
        else:
            raise LaunchError(
                f"launcher {launcher.name!r} does not export the local rank and size; "
                f"hpcsync does not guess them: run under MPI (install mpi4py) or export "
                f"LOCAL_RANK/LOCAL_WORLD_SIZE"
            )
    node_rank = launcher.node_rank()
    num_nodes = launcher.num_nodes()
    if local_size == size:  # everyone is on this node
        node_rank, num_nodes = 0, 1
    if node_rank is None or num_nodes is None:
        raise LaunchError(
            f"launcher {launcher.name!r} does not export the node rank and node count; "
            f"hpcsync does not guess them from rank arithmetic: run under MPI (install mpi4py)"
        )
    return Topology(
        rank=rank,
        world_size=size,
        local_rank=local_rank,
        local_size=local_size,
        node_rank=node_rank,
        num_nodes=num_nodes,
        hostname=socket.gethostname(),
        launcher=launcher.name,
        mpi_library=None,
    )
