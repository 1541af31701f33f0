"""Point-to-point: ``Isend``/``Irecv`` started in the caller's thread, completed by a thread of
their own, so sends and receives never block each other or the group's collectives."""
from __future__ import annotations

import threading
from typing import Any, Callable, List

import torch

from .. import _mpi
from .buffers import _Staged
from .work import MPIWork


class PointToPoint:
    """The point-to-point half of a group (mixed into :class:`~.engine.GroupEngine`, which owns
    ``_p2p_comm``, ``_p2p_cv``, ``_p2p_queue``, ``_p2p_thread`` and ``_closed``)."""

    def _track(self, request: Any, outputs: List[torch.Tensor], after: Callable[[Any], None]) -> MPIWork:
        work = MPIWork(outputs, self._p2p_cv)
        with self._p2p_cv:
            self._p2p_queue.append((request, work, after))
            if self._p2p_thread is None:
                self._p2p_thread = threading.Thread(target=self._p2p_loop, name="hpcsync-p2p", daemon=True)
                self._p2p_thread.start()
            self._p2p_cv.notify_all()
        return work

    def _p2p_loop(self) -> None:
        MPI = _mpi.MPI()
        while True:
            with self._p2p_cv:
                while not self._p2p_queue and not self._closed:
                    self._p2p_cv.wait()
                if not self._p2p_queue:
                    return
                request, work, after = self._p2p_queue.popleft()
            exc = None
            try:
                status = MPI.Status()
                request.Wait(status)
                after(status)
            except BaseException as e:
                exc = e
            with self._p2p_cv:
                future = work._complete(exc)
                self._p2p_cv.notify_all()
            if future is not None:  # its callbacks run outside the lock
                work._settle(future)

    def send(self, tensors: List[torch.Tensor], dst: int, tag: int = 0) -> MPIWork:
        s = _Staged(tensors[0])
        req = self._p2p_comm.Isend(s.spec(), dest=dst, tag=tag)
        return self._track(req, tensors, lambda status, keep=s: None)

    def _recv(self, tensors: List[torch.Tensor], src: int, tag: int) -> MPIWork:
        s = _Staged(tensors[0], read=False)
        req = self._p2p_comm.Irecv(s.spec(), source=src, tag=tag)
        holder: List[MPIWork] = []

        def after(status: Any) -> None:
            s.finish()
            holder[0]._source = status.Get_source()

        work = self._track(req, tensors, after)
        holder.append(work)
        return work

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int = 0) -> MPIWork:
        return self._recv(tensors, src, tag)

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int = 0) -> MPIWork:
        return self._recv(tensors, _mpi.MPI().ANY_SOURCE, tag)

