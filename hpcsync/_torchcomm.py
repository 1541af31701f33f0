"""An mpi4py-like communicator over torch.distributed, for jobs without MPI (e.g. torchrun).

Only the object collectives that the comm helpers, file sync and the HDF5 fallback need; data
moves with torch's object collectives (pickled), so it is a correctness fallback, not a fast path.
:func:`world` is the one transport choice they all share.
"""
from __future__ import annotations

from typing import Any, List, Optional


class TorchComm:
    """``Get_rank``/``Get_size``/``allgather``/``gather``/``bcast``/``Barrier`` over a torch group
    (default: the world). ``root`` is a rank within the group, as in MPI."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group

    def Get_rank(self) -> int:
        return self._dist.get_rank(self.group)

    def Get_size(self) -> int:
        return self._dist.get_world_size(self.group)

    def _global(self, root: int) -> int:
        return root if self.group is None else self._dist.get_global_rank(self.group, root)

    def allgather(self, obj: Any) -> List[Any]:
        out: List[Any] = [None] * self.Get_size()
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: Any, root: int = 0) -> Optional[List[Any]]:
        out: Optional[List[Any]] = [None] * self.Get_size() if self.Get_rank() == root else None
        self._dist.gather_object(obj, out, dst=self._global(root), group=self.group)
        return out

    def bcast(self, obj: Any, root: int = 0) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=self._global(root), group=self.group)
        return box[0]

    def Barrier(self) -> None:
        self._dist.barrier(group=self.group)


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
