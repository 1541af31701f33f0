"""mpi4py-like communicators for jobs without MPI: over torch.distributed (e.g. torchrun), and
the one-process communicator.

Only the object collectives that the comm helpers, file sync, stage-in and the HDF5 fallback
need. :class:`TorchComm` moves data with torch's object collectives (pickled), so it is a
correctness fallback, not a fast path; :class:`SelfComm` is the identity, so code written for N
ranks runs unchanged in one process. :func:`world` is the one transport choice they all share.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, List, Optional

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from .protocols import ObjectComm

__all__ = ["TorchComm", "SelfComm", "SELF", "world", "transport"]


class TorchComm:
    """``Get_rank``/``Get_size``/``allgather``/``gather``/``bcast``/``scatter``/``Barrier`` over a torch group
    (default: the world). ``root`` is a rank within the group, as in MPI."""

    def __init__(self, group: Optional[ProcessGroup] = None) -> None:
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

    def scatter(self, objs: Optional[List[Any]] = None, root: int = 0) -> Any:
        """Item ``r`` of ``objs`` (given on ``root``) to rank ``r``, and to it alone."""
        box: List[Any] = [None]
        self._dist.scatter_object_list(box, objs if self.Get_rank() == root else None, src=self._global(root),
                                       group=self.group)
        return box[0]

    def Barrier(self) -> None:
        self._dist.barrier(group=self.group)


class SelfComm:
    """The communicator of a job of one process without MPI: rank 0 of 1, every collective the
    identity (objects are not copied). Has no buffer methods (``Allgather``...), like TorchComm,
    so code that needs MPI's can tell it apart."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def allgather(self, obj: Any) -> List[Any]:
        return [obj]

    def gather(self, obj: Any, root: int = 0) -> Optional[List[Any]]:
        return [obj]

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj

    def scatter(self, objs: Optional[List[Any]] = None, root: int = 0) -> Any:
        return None if objs is None else objs[0]

    def Barrier(self) -> None:
        pass

    def Free(self) -> None:
        pass

    def __repr__(self) -> str:
        return "SelfComm()"


SELF = SelfComm()


def world() -> ObjectComm:
    """MPI's COMM_WORLD when MPI is in use, a TorchComm when only torch.distributed runs several
    processes, else :data:`SELF` (one process)."""
    from . import mpi

    if mpi.use_mpi():
        from .topology import topology

        topology()  # silent-singleton check
        comm: ObjectComm = mpi.MPI().COMM_WORLD
        return comm
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
    return SELF


_subcomms: "weakref.WeakKeyDictionary[ProcessGroup, Any]" = weakref.WeakKeyDictionary()  # -> mpi4py comm


def transport(group: Any = None) -> ObjectComm:
    """The transport for ``group``: an MPI communicator (the world's, an mpi4py one given, or the
    MPI communicator of a torch group's ranks), a TorchComm, or SELF (one process)."""
    if group is None:
        return world()
    if hasattr(group, "Get_rank"):  # an mpi4py communicator
        given: ObjectComm = group
        return given
    from . import mpi

    if mpi.use_mpi():
        sub: ObjectComm = _mpi_subcomm(group)
        return sub
    return TorchComm(group)


def _mpi_subcomm(group: ProcessGroup) -> Any:
    """The MPI communicator of a torch group's ranks (created once per group, by its members)."""
    import torch.distributed as dist

    from . import mpi

    sub = _subcomms.get(group)
    if sub is None:
        world_comm = mpi.MPI().COMM_WORLD
        ranks = dist.get_process_group_ranks(group)
        if world_comm.Get_rank() not in ranks:
            raise ValueError(f"this rank ({world_comm.Get_rank()}) is not a member of the group {ranks}")
        sub = _subcomms[group] = mpi.sub_communicator(world_comm, ranks, str(ranks))
    return sub
