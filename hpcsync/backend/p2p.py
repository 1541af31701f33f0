"""Point-to-point: ``Isend``/``Irecv`` posted in the caller's thread when they are issued, and
completed by whoever can call MPI: under ``THREAD_MULTIPLE`` a thread of their own that tests
every outstanding request at once (one unmatched receive never holds up the completion of later
sends); below it (``SERIALIZED``, ``FUNNELED``: no thread may call MPI beside the caller) the
caller, in ``wait()`` / ``is_completed()``, testing every outstanding request of the group under
the group's issue lock. Either way ``irecv(left); isend(right)`` on every rank completes: nothing
blocks at issue. Each request is bounded by the group's timeout and recorded in the group's
flight recorder (numbered apart from the collectives). Past its deadline a request breaks the
group: in the default mode the rank reports the send or receive, with what its peer is doing,
and ends the job; in the polled mode its work raises ``DistBackendError``."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from ..core import mpi, jobend
from ..observe import watchdog
from .buffers import Staged
from .desync import DTYPE_NAMES
from ..core.serial import nap
from .work import MPIWork

__all__ = ["IDLE_S", "PointToPoint"]

IDLE_S = 0.0002  # between two tests of the outstanding requests when none completed


class _Pending:
    __slots__ = ("request", "work", "after", "rec", "deadline")

    def __init__(self, request: Any, work: MPIWork, after: Callable[[Any, MPIWork], None], rec: Any,
                 deadline: float):
        self.request, self.work, self.after, self.rec, self.deadline = request, work, after, rec, deadline


class PointToPoint:
    """The point-to-point half of a group (mixed into :class:`~.engine.GroupEngine`, which owns
    ``_p2p_comm``, ``_p2p_cv``, ``_p2p_queue``, ``_p2p_thread``, the timeout, the flight record and
    the broken and closed states)."""

    def _start_p2p(self, op: str, t: torch.Tensor, peer: int) -> Any:
        self._check_thread()
        if self._closed:
            raise RuntimeError("hpcsync backend: process group was shut down")
        if self._broken:
            raise dist.DistBackendError(self._broken)
        return self._log.start_p2p(op, DTYPE_NAMES[t.dtype], tuple(t.shape), peer)

    def _track(self, request: Any, outputs: List[torch.Tensor], after: Callable[[Any, MPIWork], None],
               rec: Any) -> MPIWork:
        work = MPIWork(outputs, self._p2p_cv)
        item = _Pending(request, work, after, rec, time.monotonic() + self._timeout_s)
        if not self._threads_ok:  # no thread may call MPI beside the caller: completed in its wait()
            work._driver = self
            with self._p2p_cv:
                self._p2p_queue.append(item)
            return work
        with self._p2p_cv:
            self._p2p_queue.append(item)
            if self._p2p_thread is None:
                self._p2p_thread = threading.Thread(target=self._p2p_loop, name="hpcsync-p2p", daemon=True)
                self._p2p_thread.start()
            self._p2p_cv.notify_all()
        return work

    def _p2p_loop(self) -> None:
        active: List[_Pending] = []
        while True:
            with self._p2p_cv:
                while not active and not self._p2p_queue and not self._closed:
                    self._p2p_cv.wait()
                active.extend(self._p2p_queue)
                self._p2p_queue.clear()
                if not active:
                    return
            active = self._p2p_complete(active)

    def _p2p_drive(self, work: Optional[MPIWork], until: Optional[float] = None) -> None:
        """Below THREAD_MULTIPLE: test every outstanding request of the group (under the process's
        MPI lock, given up between tests) until ``work`` is done (each request ends at its
        own deadline) or ``until``; once when ``work`` is None."""
        self._check_thread()
        while True:
            with self._serial:  # type: ignore[union-attr]  (below THREAD_MULTIPLE it is the process's MPI lock)
                with self._p2p_cv:
                    active = list(self._p2p_queue)
                    self._p2p_queue.clear()
                left = self._p2p_complete(active) if active else []
                with self._p2p_cv:
                    self._p2p_queue.extendleft(reversed(left))
                if work is None or work._done or (until is not None and time.monotonic() >= until):
                    return
                nap(self._serial, IDLE_S)

    def _p2p_complete(self, active: List[_Pending], until_done: bool = False) -> List[_Pending]:
        """Test every request in ``active`` once (``until_done``: until all are done), complete
        the finished and the expired ones; return the others."""
        MPI = mpi.MPI()
        while active:
            statuses = [MPI.Status() for _ in active]
            done = set(MPI.Request.Testsome([a.request for a in active], statuses) or ())
            now = time.monotonic()
            left = []
            for i, item in enumerate(active):
                if i in done:
                    exc: Optional[BaseException] = None
                    try:
                        item.after(statuses[i], item.work)
                        item.rec.finished = time.time()
                    except BaseException as e:  # noqa: BLE001  surfaced by wait()
                        exc = e
                    self._p2p_settle(item, exc)
                elif now > item.deadline:
                    self._p2p_settle(item, self._p2p_expired(item))
                else:
                    left.append(item)
            active = left
            if not done and active:
                time.sleep(IDLE_S)
            if not until_done:
                return active
        return active

    def _p2p_settle(self, item: _Pending, exc: Optional[BaseException]) -> None:
        with self._p2p_cv:
            future = item.work._complete(exc)
            self._p2p_cv.notify_all()
        if future is not None:  # its callbacks run outside the lock
            item.work._settle(future)

    def _p2p_expired(self, item: _Pending) -> BaseException:
        """The request outlived its deadline: MPI cannot cancel a send, so the group is broken
        (the request and its buffer are kept alive); report and end the job in the default mode."""
        rec = item.rec
        rec.error = "timed out"
        msg = (f"hpcsync backend: {rec.op} #{rec.seq} (peer {rec.root}) in group {self._log.name!r} timed out after "
               f"{self._timeout_s:g}s (the group's timeout is {self._timeout_s:g}s)")
        if not self._broken:
            self._broken = msg + "; the group is broken (MPI cannot cancel a send): destroy it and end the job"
            self._mark_broken()
        self._keep.append(item)  # MPI may still write into its buffer: kept with the broken group
        if self._watched:
            jobend.end_within(watchdog.report_bound() + jobend.grace_s())
            try:
                watchdog.report_p2p_timeout(self._log, rec, self._timeout_s)
            finally:
                jobend.abort(1)
        return dist.DistBackendError(msg)

    def _post(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``Isend``/``Irecv`` now; below THREAD_MULTIPLE under the process's MPI lock (one call at
        a time), under it beside the other threads' calls (MPI allows it; a lock would make a
        send wait for a collective that may itself wait for that send's peer)."""
        if self._serial is None:
            return call(*args, **kwargs)
        with self._serial:
            return call(*args, **kwargs)

    def send(self, tensors: List[torch.Tensor], dst: int, tag: int = 0) -> MPIWork:
        rec = self._start_p2p("send", tensors[0], dst)
        s = Staged(tensors[0])
        req = self._post(self._p2p_comm.Isend, s.spec(), dest=dst, tag=tag)
        return self._track(req, tensors, lambda status, work, keep=s: None, rec)

    def _recv(self, tensors: List[torch.Tensor], src: int, tag: int) -> MPIWork:
        rec = self._start_p2p("recv", tensors[0], src)
        s = Staged(tensors[0], read=False)
        req = self._post(self._p2p_comm.Irecv, s.spec(), source=src, tag=tag)

        def after(status: Any, work: MPIWork) -> None:
            s.finish()
            work._source = status.Get_source()

        return self._track(req, tensors, after, rec)

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int = 0) -> MPIWork:
        return self._recv(tensors, src, tag)

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int = 0) -> MPIWork:
        return self._recv(tensors, mpi.MPI().ANY_SOURCE, tag)
