"""The engine every hpcsync process group runs on: issue-order execution on one worker thread,
inline blocking calls, deadlines, desync checks, point-to-point completion and shutdown.

A blocking operation with nothing queued runs in the caller's thread, the others on the
group's worker thread, in issue order. Which MPI call an operation makes never depends on that
(or on anything else local: MPI does not match a blocking collective with a non-blocking one),
only on the group's wait mode, fixed and agreed when the group is created:

- *watched* (the default: a timeout ends the job, report then ``MPI_Abort``): blocking MPI calls
  (the non-blocking form followed by ``Wait`` where this MPI does it faster), each preceded by a
  16-byte fingerprint ``Allreduce``; :mod:`.deadline`'s thread enforces the deadline.
- *polled* (``abort_on_exception=False``, or no THREAD_MULTIPLE): non-blocking calls, the
  fingerprint ``Iallreduce`` beside each; the caller polls against the deadline, so a timeout
  raises in the caller.
"""
from __future__ import annotations

import logging
import threading
import time
from array import array
from collections import deque
from datetime import timedelta
from typing import Any, Callable, Deque, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from ..core import mpi, jobend, settings
from ..observe import watchdog
from . import deadline
from .desync import DTYPE_NAMES, Agreement, Call, describe, debug_mode
from .hot import HotPath
from .p2p import PointToPoint
from ..core.serial import SERIAL, check_thread, nap
from .work import DoneWork, MPIWork, ran

__all__ = ["BACKEND_NAME", "GroupIdentity", "GroupEngine"]

log = logging.getLogger(__name__)

BACKEND_NAME = "hpcsync"
_INLINE_BYTES = 64 << 10  # a polled wait on more bytes than this spins throughout (see _execute)

# Collectives whose non-blocking form (then ``Wait``) is as fast as or faster than the blocking
# one at every size, per MPI library (bench/bench_backend.py; the figures are in
# docs/performance.md): a watched group calls them that way, in any thread.
_NONBLOCKING_FAST = {"Open MPI": {"Bcast", "Reduce_scatter_block"}, "MPICH": {"Bcast", "Allgather"}}


def _nonblocking_fast() -> Set[str]:
    version = mpi.library_version()
    for name, calls in _NONBLOCKING_FAST.items():
        if name in version:
            return set(calls)
    return set()



class GroupIdentity(dist.ProcessGroup):
    """What torch asks a backend about itself: its name, the group's name and description."""

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    @property
    def comm(self) -> Any:
        return self._coll

    @property
    def _device_types(self) -> List[torch.device]:
        """The devices this group serves. torch reads it (``dcp.async_save`` wants a CPU backend,
        object collectives pick their device); the C++ side of a Python group has no backends
        registered, so it would say none."""
        return [torch.device("cpu"), torch.device("cuda")]

    # torch keeps a group's name in its C++ backends; this group is its own backend, so keep it here
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupName(self) -> str:
        return getattr(self, "_group_name", "")

    def getGroupDesc(self) -> str:
        return getattr(self, "_group_desc", "")

    @property
    def group_name(self) -> str:
        return self.getGroupName()

    @property
    def group_desc(self) -> str:
        return self.getGroupDesc()


class GroupEngine(HotPath, Agreement, PointToPoint, deadline.Timeouts, GroupIdentity):
    """A group's communicators, identity and engine: the queue and worker thread, one operation's
    flight record, deadline and fingerprint, waits bounded by the timeout, the broken state, and
    point-to-point requests. :class:`ProcessGroupHpcsync` adds the operations."""

    def __init__(self, comm: Any, timeout: timedelta = timedelta(minutes=30), name: str = "0",
                 global_ranks: Optional[Sequence[int]] = None) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size())
        if timeout.total_seconds() <= 0:
            raise ValueError(f"hpcsync backend: the group timeout must be positive, got {timeout}")
        self._timeout = timeout
        self._timeout_s = timeout.total_seconds()
        self._log = watchdog.group_log(id(self), name, list(global_ranks or range(comm.Get_size())))
        MPI = mpi.MPI()
        level = MPI.Query_thread()
        self._threads_ok = level == MPI.THREAD_MULTIPLE
        self._serial: Optional[threading.Condition] = None if self._threads_ok else SERIAL
        self._main_only = level < MPI.THREAD_SERIALIZED  # FUNNELED: MPI from the main thread alone
        # private duplicates, each bounded by the timeout: a rank that never joins is an error here
        self._coll, self._p2p_comm, self._check = (self._dup(comm) for _ in range(3))  # _check: fingerprints
        self._broken: Optional[str] = None
        self._debug = debug_mode()
        self._fingerprints = settings.flag("HPCSYNC_DESYNC_CHECK")
        self._worker_ident = -1
        self._deadline = float("inf")
        self._spin_s = 1.0
        self._rec: Any = None
        # (record, deadline, enforced by the deadline thread) of the caller's and the worker's operation
        self._current: Optional[Tuple[Any, float, bool]] = None
        self._current_worker: Optional[Tuple[Any, float, bool]] = None
        # the deadline of the future callbacks the worker is running, if any: see _callback_overran
        self._settling: Optional[float] = None
        self._timeout_once = threading.Lock()
        self._keep: List[Any] = []  # what MPI may still write into after a timeout (p2p requests, buffers)
        self._calls: dict = {}  # MPI call name -> (bound call, returns a request): see _bind
        self._cv = threading.Condition()
        # Held around every operation's MPI calls, from whichever thread: two threads never call
        # MPI on the group's communicators at once, and each operation keeps its own deadline.
        self._issue = threading.RLock()
        self._queue: Deque[Tuple[Callable[[], None], MPIWork]] = deque()
        self._pending = 0
        self._worker: Optional[threading.Thread] = None
        self._closed = False
        self._p2p_cv = threading.Condition()
        self._p2p_queue: Deque[Tuple[Any, MPIWork, Callable[[Any], None]]] = deque()
        self._p2p_thread: Optional[threading.Thread] = None
        self._fp = array("q", [0, 0])
        self._fp_req: Any = None
        self._vec: List[int] = []
        self._int64 = MPI.INT64_T
        self._max = MPI.MAX
        self._nb_calls = _nonblocking_fast()  # MPI calls made non-blocking everywhere
        self._in_place = MPI.IN_PLACE
        self._address = MPI.buffer.fromaddress  # (pointer, bytes) -> buffer: the cheapest wrapper
        self._me, self._size = comm.Get_rank(), comm.Get_size()
        self._fp_spec = [self._fp, self._int64]
        # The wait mode, fixed for the group's life and agreed by its ranks (a blocking collective
        # never matches a non-blocking one): blocking MPI calls watched by the deadline thread when
        # a timeout ends the job anyway; polled calls when the caller wants the exception.
        self._watched = self._agree_mode()
        self._hot = self._watched and not self._debug  # blocking requests may take the hot path (.hot)
        self._hot_setup()
        if not self._threads_ok:
            log.warning("hpcsync backend: MPI provides no THREAD_MULTIPLE; every operation runs synchronously, "
                        "one MPI call at a time in the process")
        if self._watched or self._threads_ok:  # polled groups: the worker's callbacks only
            deadline.watch(self)

    # -- execution --------------------------------------------------------------------------
    def _run(self, fn: Callable[[], None], outputs: List[torch.Tensor], opts: Any, call: Call) -> MPIWork:
        async_op = getattr(opts, "asyncOp", True)
        timeout = getattr(opts, "timeout", None)
        timeout_s = timeout.total_seconds() if timeout is not None else -1.0
        timeout_s = timeout_s if timeout_s > 0 else self._timeout_s  # torch's unset per-call timeout is -1 ms
        # An operation issued from the worker thread itself (a future's callback: torch's PowerSGD
        # hook issues and waits on collectives there) runs at once, where it was issued: queued, it
        # would wait for the worker it blocks.
        on_worker = threading.get_ident() == self._worker_ident
        if (not async_op or on_worker) and self._pending == 0 and self._watched:
            # blocking MPI in this thread, no thread hand-off; the deadline thread enforces the timeout
            if self._closed:
                raise RuntimeError("hpcsync backend: process group was shut down")
            if self._broken:
                raise dist.DistBackendError(self._broken)
            try:
                self._execute(fn, call, None, timeout_s)
            except BaseException as e:  # surfaced by wait()
                return DoneWork(outputs, e)
            return DoneWork(outputs)
        cv = self._cv
        with cv:
            if self._closed:
                raise RuntimeError("hpcsync backend: process group was shut down")
            if self._broken:
                raise dist.DistBackendError(self._broken)
            # A blocking call with nothing queued runs here (no thread hand-off); the others queue
            # behind the operations in flight, on the worker.
            inline = not self._threads_ok or on_worker or (not async_op and self._pending == 0)
            self._pending += 1
            if not inline:
                work = MPIWork(outputs, cv)
                work._group = self
                self._queue.append((fn, call, work, timeout_s))
                if self._worker is None:
                    self._worker = threading.Thread(target=self._work_loop, name="hpcsync-pg", daemon=True)
                    self._worker.start()
                cv.notify_all()
                return work
        # blocking call with nothing queued: run here, no thread hand-off
        exc = None
        try:
            self._execute(fn, call, None, timeout_s)
        except BaseException as e:  # surfaced by wait()
            exc = e
        with cv:
            self._pending -= 1
            if self._queue:
                cv.notify_all()
        return MPIWork(outputs, cv, done=True, exc=exc)

    def _work_loop(self) -> None:
        self._worker_ident = threading.get_ident()
        cv = self._cv
        while True:
            with cv:
                while not self._queue and not self._closed:
                    cv.wait()
                if not self._queue:
                    return
                fn, call, work, timeout_s = self._queue.popleft()
            exc = None
            try:
                self._execute(fn, call, work, timeout_s)
            except BaseException as e:
                log.debug("hpcsync backend: operation failed: %s", e)
                exc = e
            with cv:
                future = work._complete(exc)
                cv.notify_all()
            # The future's callbacks run here, outside the lock (they may issue and wait on further
            # operations: those run at once on this thread, see _run), and before the operation
            # counts as done: the caller's next blocking call queues behind them, so every rank
            # issues the callbacks' operations at the same point.
            if future is not None:
                self._settling = time.monotonic() + timeout_s
                try:
                    work._settle(future)
                finally:
                    self._settling = None
            with cv:
                self._pending -= 1
                cv.notify_all()

    # -- one operation: record, fingerprint, run, check ------------------------------------
    def _execute(self, fn: Callable[[], None], call: Call, work: Optional[MPIWork], timeout_s: float) -> None:
        """Run one collective with its flight record, deadline and desync check.

        Default mode: a 16-byte ``Allreduce(MAX)`` of ``[fp, -fp]`` (fp = hash of
        :func:`~.desync.describe`'s row) on a private communicator is agreed before the
        operation starts; if max != -min the ranks disagree, and every rank raises the same error
        instead of returning what MPI made of mismatched buffers. Polled mode: the fingerprint
        travels beside the operation. ``HPCSYNC_DEBUG=1`` / ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: the
        full descriptions are all-gathered and compared *before* the operation starts. A rank
        whose own arguments are invalid (``call.invalid``) joins the agreement and raises its error
        there, so the other ranks fail at once instead of at the timeout.
        """
        self._check_thread()
        with self._issue:
            if self._serial is None:
                self._execute_locked(fn, call, work, timeout_s)
            else:
                with self._serial:
                    self._execute_locked(fn, call, work, timeout_s)

    def _check_thread(self) -> None:
        check_thread(self._main_only, self._log.name)

    def _execute_locked(self, fn: Callable[[], None], call: Call, work: Optional[MPIWork], timeout_s: float) -> None:
        if self._broken:
            raise dist.DistBackendError(self._broken)
        t = call.t
        rec = self._log.start(call.op, DTYPE_NAMES[t.dtype] if t is not None else "-",
                              tuple(t.shape) if t is not None else (), call.root)
        watched = self._watched
        self._rec, self._deadline = rec, time.monotonic() + timeout_s
        if timeout_s != self._timeout_s:
            rec.timeout_s = timeout_s
        if watched:  # what the deadline thread reads
            if threading.get_ident() == self._worker_ident:
                self._current_worker = (rec, self._deadline, True)
            else:
                self._current = (rec, self._deadline, True)
        else:
            # A large operation polled here spins all along: MPI progresses non-blocking collectives
            # only inside MPI calls, so sleeping between polls would stall a multi-second broadcast.
            self._spin_s = 1.0 if t is None or t.numel() * t.element_size() <= _INLINE_BYTES else float("inf")
        if work is not None:
            work._started = (rec, self._deadline)
        vec = describe(rec, call)
        if call.invalid is not None:
            self._refuse(rec, vec, call.invalid)
        fp_req = None
        if self._debug:
            self._agree(rec, vec, in_flight=False)
        elif self._fingerprints:
            # watched: agreed before the operation starts, so a mismatch never reaches MPI; polled:
            # travels alongside the operation, a mismatch is caught while it is in flight
            fp_req = self._fingerprint(vec, beside=not watched)
            if fp_req is None and self._fp_differs:
                self._agree(rec, vec, in_flight=False)
        self._fp_req, self._vec = fp_req, vec
        if fp_req is not None:
            # Polled: the fingerprint is agreed before the data moves, like the watched mode's. A
            # mismatch beside the data call reaches MPI, and Open MPI's non-blocking collectives
            # answer a truncation (MPI_ERR_TRUNCATE) with a corrupted heap ("double free"), seen
            # with mismatched counts under HPCSYNC_ABORT_ON_EXCEPTION=0.
            self._fp_req = None
            self._wait(fp_req)
            fp_req = None
            if self._fp_differs:
                self._agree(rec, vec, in_flight=False)
        if call.counts is not None and (self._fingerprints or self._debug):
            self._check_counts(rec, *call.counts)
        try:
            fn()
        except BaseException as exc:
            if fp_req is not None and not isinstance(exc, dist.DistBackendError):
                self._wait(fp_req)
                if self._fp_differs:
                    self._agree(rec, vec, from_exc=exc)
            rec.error = f"{type(exc).__name__}: {exc}"
            raise
        if fp_req is not None:
            self._wait(fp_req)
            if self._fp_differs:
                self._agree(rec, vec)
        rec.finished = ran(rec, time.time())

    def _bind(self, name: str) -> Tuple[Callable[..., Any], bool]:
        """``(call, returns a request)`` for MPI collective ``name`` in this group's wait mode: in a
        watched group the blocking call, or the non-blocking one where this MPI does it faster
        (``_NONBLOCKING_FAST``); in a polled group always the non-blocking one. The same on every
        rank and thread, whichever runs the operation."""
        request = not self._watched or name in self._nb_calls
        bound = self._calls[name] = (getattr(self._coll, ("I" + name[0].lower() + name[1:]) if request else name),
                                     request)
        return bound

    def _c(self, name: str, *args: Any, **kwargs: Any) -> None:
        """One MPI collective (see :meth:`_bind`), waited for: blocking in a watched group and on
        the worker, polled against the deadline by a caller in a polled group."""
        fn, request = self._calls.get(name) or self._bind(name)
        if request:
            self._wait(fn(*args, **kwargs))
        else:
            fn(*args, **kwargs)

    def _wait(self, req: Any) -> None:
        """Wait for ``req``: blocking in a watched group (the deadline thread enforces the
        deadline); polled against the deadline in a polled group, on the worker too, so an
        operation there, its future and the work queued behind it end at the timeout."""
        if self._watched:
            req.Wait()
            return
        if req.Test():
            return
        # Spin first (as a blocking MPI call would), then poll each millisecond: a long wait on a
        # small message is a stuck rank and should not burn a core for minutes. Large messages
        # spin throughout (see _execute), as a blocking MPI call would.
        spin_until = time.monotonic() + self._spin_s
        fp_req = self._fp_req if req is not self._fp_req else None
        while not req.Test():
            now = time.monotonic()
            if fp_req is not None and fp_req.Test():
                fp_req = self._fp_req = None
                if self._fp_differs:  # mismatched operations may never complete: say so now
                    self._agree(self._rec, self._vec)
            if now > self._deadline:
                self._timed_out(self._rec)
            if self._serial is not None:  # every test: another thread may need the process's MPI lock
                nap(self._serial, 0.001 if now > spin_until else 0.00005)
            elif now > spin_until:
                time.sleep(0.001)

    # -- lifecycle --------------------------------------------------------------------------
    def shutdown(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        with self._p2p_cv:
            self._p2p_cv.notify_all()
        for t in (self._worker, self._p2p_thread):
            if t is not None:
                t.join(timeout=0.1 if self._broken else min(self._timeout_s, 3600))
        if not self._threads_ok and self._p2p_queue and not self._broken:
            self._p2p_drive(None)  # below THREAD_MULTIPLE nobody else completes what MPI finished
        if not self._broken and (self._p2p_queue or any(t is not None and t.is_alive()
                                                        for t in (self._worker, self._p2p_thread))):
            # still inside MPI: its communicators must not be freed, and MPI cannot finalize
            # with it in flight, so the exit ends the job (bounded) instead of hanging
            self._broken = f"hpcsync backend: group {self._log.name!r} was shut down with an operation in flight"
            self._mark_broken()
        watchdog.drop_group_log(id(self))
        MPI = mpi.MPI()
        if not MPI.Is_finalized() and not self._broken:  # a broken group may still be inside MPI
            for c in (self._coll, self._p2p_comm, self._check):
                if c != MPI.COMM_NULL:
                    c.Free()

    def abort(self) -> None:
        jobend.abort(1)

