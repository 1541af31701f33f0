"""``MPIWork``: the torch ``Work`` of one operation, completed by a group's worker or an MPI request;
``DoneWork``: the one of an operation that ran to its end in the caller's thread."""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.futures import Future

__all__ = ["WAITED", "waited_s", "ran", "MPIWork", "DoneWork"]

# Seconds during which this process had an hpcsync operation in flight -- a collective from its
# start to its end, in the caller's thread or on the group's worker (DDP waits for its buckets
# through torch futures, out of Python's sight), a point-to-point Work.wait -- i.e. waiting for the
# other ranks and moving data. hpcsync.monitor takes it from a step's time: what is left is the
# rank's compute. One total for the process.
WAITED = [0.0]


def waited_s() -> float:
    """Seconds this process has had an hpcsync operation in flight, so far (see ``WAITED``)."""
    return WAITED[0]


def ran(rec: Any, now: float) -> float:
    """``now`` (``time.time()``), the end of the collective of flight record ``rec``, once its
    time is added to ``WAITED``."""
    WAITED[0] += now - rec.started
    return now


class MPIWork(dist.Work):
    """Work completed by the group's worker (collectives) or an MPI request (point-to-point).

    Completion is signalled on the owning group's condition variable: no lock or event per
    operation (small messages are dominated by such per-call costs).
    """

    def __init__(self, outputs: List[torch.Tensor], cv: threading.Condition, done: bool = False,
                 exc: Optional[BaseException] = None) -> None:
        super().__init__()
        self._cv = cv
        self._done = done
        self._exc = exc
        self._outputs = outputs
        self._future: Optional[Future] = None  # made on demand: most callers only wait()
        self._source = -1
        self._group: Any = None
        self._started: Optional[Tuple[Any, float]] = None  # (record, deadline) once running
        self._driver: Any = None  # below THREAD_MULTIPLE: the group whose p2p requests wait() completes

    def _complete(self, exc: Optional[BaseException] = None) -> Optional[Future]:
        """Called with ``self._cv`` held; returns the future the caller must settle once it has
        released the lock (a callback may issue operations that need it), or None."""
        self._exc = exc
        self._done = True
        return self._future

    def _settle(self, fut: Future) -> None:
        if self._exc is None:
            fut.set_result(self._outputs)
        else:
            fut.set_exception(self._exc)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Wait for completion; past the group's timeout (from when the operation started) raise
        torch's ``DistBackendError`` ("timed out"), break the group and report the hang."""
        if not self._done:
            t0 = time.monotonic()
            seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout or 0)
            mine = time.monotonic() + seconds if seconds > 0 else None
            if self._driver is not None:  # nobody else may call MPI: complete it here (bounded)
                self._driver._p2p_drive(self, mine)
            with self._cv:
                while not self._done:
                    if self._group is not None and self._group._broken and self._started is None:
                        raise dist.DistBackendError(self._group._broken)  # queued behind a stuck operation
                    if self._group is not None and threading.get_ident() == self._group._worker_ident:
                        raise RuntimeError("hpcsync backend: a future callback waits for an operation queued "
                                           "behind the one whose callback it is: it can never run; issue the "
                                           "operation inside the callback instead")
                    started = self._started  # set by the worker when it begins this operation
                    limit = min(x for x in (mine, started and started[1]) if x) if (mine or started) else None
                    now = time.monotonic()
                    if limit is not None and now >= limit:
                        break
                    self._cv.wait(min(1.0, limit - now) if limit is not None else 1.0)
            if not self._done:
                pg, rec = self._group, self._started and self._started[0]
                if pg is not None and rec is not None and (mine is None or mine >= self._started[1]):
                    pg._timed_out(rec)  # raises
                raise dist.DistBackendError(f"hpcsync backend: wait() timed out after {seconds}s")
            if self._group is None:  # point-to-point: a collective is counted where it runs
                WAITED[0] += time.monotonic() - t0
        if self._exc is not None:
            raise self._exc
        return True

    def get_future(self) -> Future:
        if self._driver is not None and not self._done:  # below THREAD_MULTIPLE only a waiter completes it
            self._driver._p2p_drive(self)
        with self._cv:
            fut = self._future
            if fut is None:
                fut = self._future = Future()
                settle = self._done  # else whoever completes the work settles it
            else:
                settle = False
        if settle:  # outside the lock: its callbacks may issue operations
            self._settle(fut)
        return fut

    def is_completed(self) -> bool:
        if self._driver is not None and not self._done:
            self._driver._p2p_drive(None)
        return self._done

    def is_success(self) -> bool:
        return self._done and self._exc is None

    def exception(self) -> Optional[BaseException]:
        return self._exc

    def result(self) -> List[torch.Tensor]:
        self.wait()
        return self._outputs

    def _source_rank(self) -> int:
        self.wait()
        return self._source

    def source_rank(self) -> int:
        return self._source_rank()


class DoneWork(MPIWork):
    """The Work of an operation that already ran in the caller's thread (the hot path: the least
    a torch ``Work`` can cost; its outputs and error as for :class:`MPIWork`)."""

    _done = True
    _cv = None
    _future = None
    _source = -1
    _group = None
    _started = None
    _driver = None

    def __init__(self, outputs: List[torch.Tensor], exc: Optional[BaseException] = None) -> None:
        dist.Work.__init__(self)
        self._outputs = outputs
        self._exc = exc

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if self._exc is not None:
            raise self._exc
        return True

    def get_future(self) -> Future:
        if self._future is None:
            self._future = Future()
            self._settle(self._future)
        return self._future
