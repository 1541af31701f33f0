"""What hpcsync asks of a communicator, for the type checker: mpi4py's, a
:class:`~hpcsync.core.bounded.BoundedComm`, :class:`~hpcsync.core.torchcomm.TorchComm` and
:data:`~hpcsync.core.torchcomm.SELF` all have the object collectives (:class:`ObjectComm`); MPI's
and the bounded one have the buffer forms :mod:`hpcsync.core.bigmpi` calls too
(:class:`BufferComm`). Code tells them apart at run time by ``hasattr``; nothing here runs."""
from __future__ import annotations

from typing import Any, List, Optional, Protocol

__all__ = ["ObjectComm", "BufferComm"]


class ObjectComm(Protocol):
    """Ranks, and collectives of picklable objects (``root`` a rank of the communicator)."""

    def Get_rank(self) -> int: ...

    def Get_size(self) -> int: ...

    def allgather(self, obj: Any, /) -> List[Any]: ...

    def gather(self, obj: Any, /, root: int = 0) -> Optional[List[Any]]: ...

    def bcast(self, obj: Any, /, root: int = 0) -> Any: ...

    def scatter(self, objs: Optional[List[Any]], /, root: int = 0) -> Any: ...

    def Barrier(self) -> None: ...


class BufferComm(ObjectComm, Protocol):
    """An :class:`ObjectComm` with the buffer collectives of mpi4py (buffer specifications as
    ``[buffer, count(s), displacements, datatype]``)."""

    def Allgather(self, sendbuf: Any, recvbuf: Any, /) -> None: ...

    def Allgatherv(self, sendbuf: Any, recvbuf: Any, /) -> None: ...

    def Gatherv(self, sendbuf: Any, recvbuf: Any, /, root: int = 0) -> None: ...

    def Bcast(self, buf: Any, /, root: int = 0) -> None: ...

    def Allreduce(self, sendbuf: Any, recvbuf: Any, /, op: Any = ...) -> None: ...
