"""An mpi4py-like communicator over torch.distributed, for jobs without MPI (e.g. torchrun).

Only the object collectives hpcsync's file sync and HDF5 fallback need; data moves with
torch's object collectives (pickled), so it is a correctness fallback, not a fast path.
"""
from __future__ import annotations

from typing import Any, List, Optional


class TorchComm:
    """``Get_rank``/``Get_size``/``allgather``/``gather``/``bcast``/``Barrier`` over the default group."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist

    def Get_rank(self) -> int:
        return self._dist.get_rank()

    def Get_size(self) -> int:
        return self._dist.get_world_size()

    def allgather(self, obj: Any) -> List[Any]:
        out: List[Any] = [None] * self.Get_size()
        self._dist.all_gather_object(out, obj)
        return out

    def gather(self, obj: Any, root: int = 0) -> Optional[List[Any]]:
        out: Optional[List[Any]] = [None] * self.Get_size() if self.Get_rank() == root else None
        self._dist.gather_object(obj, out, dst=root)
        return out

    def bcast(self, obj: Any, root: int = 0) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=root)
        return box[0]

    def Barrier(self) -> None:
        self._dist.barrier()


def world() -> Any:
    """MPI's COMM_WORLD when MPI is in use, a TorchComm when only torch.distributed runs several
    processes, else None (one process)."""
    from . import _mpi

    if _mpi.use_mpi():
        from .topology import topology

        topology()  # silent-singleton check
        return _mpi.MPI().COMM_WORLD
    import sys

    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return TorchComm()
    from .errors import LaunchError
    from .topology import topology

    size = topology().world_size
    if size > 1:  # never degrade a multi-rank job to N independent single-rank ones
        raise LaunchError(f"the launcher started {size} ranks but neither MPI (mpi4py) nor torch.distributed "
                          f"is in use: install mpi4py, or call hpcsync.init() first")
    return None
