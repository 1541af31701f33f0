"""Deadlines of operations that block inside MPI: one thread per process enforces them.

In the default mode (a timeout ends the job with a report and ``MPI_Abort``) an operation runs
as a plain blocking MPI call in the caller's thread: no polling, no thread hand-off. The caller
cannot notice its own deadline then, so this thread does, as torch's NCCL watchdog does: it
reads each group's current ``(record, deadline)`` every :data:`POLL_S` seconds and, once a
deadline has passed with the operation still open, has the group report the hang and abort.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from typing import Any, List, Optional, Tuple

import torch.distributed as dist

from ..core import mpi, jobend
from ..observe import watchdog

__all__ = ["POLL_S", "broken_groups", "watch", "stop", "Timeouts"]

log = logging.getLogger(__name__)

POLL_S = 0.05  # how late a deadline may be seen: a few µs of GIL 20 times a second

# (why, timeout, what to keep alive) of every broken group: the exit waits for them, then aborts
broken_groups: List[Tuple[str, float, Any]] = []

_groups: "weakref.WeakSet[Any]" = weakref.WeakSet()
_thread: Optional[threading.Thread] = None
_stop = threading.Event()
_lock = threading.Lock()


def watch(group: Any) -> None:
    """Watch ``group``'s ``_current`` and ``_current_worker`` (``(record, deadline, watched)`` or
    None) and its worker's future callbacks (``_settling``); start the thread once."""
    global _thread
    with _lock:
        _groups.add(group)
        if _thread is None or not _thread.is_alive():
            _stop.clear()
            _thread = threading.Thread(target=_loop, name="hpcsync-deadline", daemon=True)
            _thread.start()


def _loop() -> None:
    while not _stop.wait(POLL_S):
        now = time.monotonic()
        for group in list(_groups):
            settling = group._settling  # the worker's future callbacks: see Timeouts._callback_overran
            if settling is not None and now > settling and group._queue:
                try:
                    group._callback_overran()
                except BaseException as exc:  # noqa: BLE001  keep watching the other groups
                    sys.stderr.write(f"[hpcsync] failing the operations behind a stuck callback failed: {exc}\n")
            for slot in ("_current", "_current_worker"):  # the caller's operation, the worker's
                current = getattr(group, slot)  # one attribute: read whole, never half-updated
                if current is None or not current[2] or now <= current[1]:
                    continue
                rec = current[0]
                if rec.finished is None and rec.error is None and getattr(group, slot) is current:
                    try:
                        group._expired(rec)  # reports, then ends the job
                    except BaseException as exc:  # noqa: BLE001  keep watching the other groups
                        sys.stderr.write(f"[hpcsync] deadline handling failed ({type(exc).__name__}: {exc}); "
                                         "this process ends at the report's bound\n")


def stop() -> None:
    """Stop the thread (before MPI_Finalize: it may call MPI)."""
    _stop.set()
    t = _thread
    if t is not None and t is not threading.current_thread():
        t.join(timeout=2 * POLL_S + 1)


def _say_report_failed(rec: Any, exc: BaseException) -> None:
    """On stderr, not only in a log nobody configured: the job ends without the report it promised."""
    sys.stderr.write(f"[hpcsync] the hang report of {rec.describe()} failed ({type(exc).__name__}: {exc}); "
                     "the job ends all the same\n")
    sys.stderr.flush()


class Timeouts:
    """What happens past a deadline (mixed into :class:`~.engine.GroupEngine`): the group is
    broken for good, the hang reported, and in the watched mode the job ended."""

    def _mark_broken(self) -> None:
        """Remember a broken group for good. Its MPI operations are still in flight and may complete
        later (when a late rank arrives) by writing into their buffers: keep the group, the
        operation and the frames holding its staged tensors alive, so MPI never writes into freed
        memory."""
        frames, f = [], sys._getframe(1)
        while f is not None:
            frames.append(f)
            f = f.f_back
        broken_groups.append((self._broken or "broken", min(self._timeout_s, 3600), (self, self._rec, frames)))

    def _callback_overran(self) -> None:
        """On the deadline thread: a future callback has run on the worker past the timeout with
        operations queued behind it. It waits for one of them (torch's ``Future.wait()`` cannot be
        refused as :meth:`MPIWork.wait` is), which can never start. Break the group and fail the
        queued operations: the callback's wait raises instead of waiting forever."""
        msg = (f"hpcsync backend: a future callback on the worker of group {self._log.name!r} ran past the group's "
               f"timeout ({self._timeout_s:g}s) with operations queued behind it: it waits for one of them, "
               "which cannot start before the callback returns; the group is broken (issue the operation "
               "inside the callback instead)")
        with self._cv:
            if self._settling is None or not self._queue:
                return
            self._settling = None
            self._broken = self._broken or msg
            queued = list(self._queue)
            self._queue.clear()
            settle = [(work, work._complete(dist.DistBackendError(msg))) for _, _, work, _ in queued]
            self._pending -= len(queued)
            self._cv.notify_all()
        self._mark_broken()  # the other ranks may be inside those operations: the exit must abort
        sys.stderr.write(f"[hpcsync] rank {mpi.MPI().COMM_WORLD.Get_rank()}: {msg}\n")
        sys.stderr.flush()
        for work, future in settle:
            if future is not None:
                work._settle(future)

    def _expired(self, rec: Any) -> None:
        """On the deadline thread: the caller is blocked inside MPI past the deadline. Report the
        hang and end the job (the mode that lets an operation block promised it), all of it
        bounded: this process ends within the report's bound (:func:`hpcsync.observe.watchdog.report_bound`,
        30 s at least, growing with the job's nodes) + the abort grace whatever fails."""
        jobend.end_within(watchdog.report_bound() + jobend.grace_s())
        try:
            self._timed_out(rec)
        except dist.DistBackendError:  # another rank printed the report (or the policy changed)
            time.sleep(1.0)  # as the printer does: let the launcher forward the report first
        except BaseException as exc:  # noqa: BLE001  the report failed: end the job all the same
            _say_report_failed(rec, exc)
        jobend.abort(1)  # the group's mode promised it, whatever the policy is now

    def _timed_out(self, rec: Any) -> None:
        """Break the group, report the hang (and abort, unless turned off), raise DistBackendError.
        Once per operation: a worker's waiter and the deadline thread may both see its deadline."""
        timeout_s = rec.timeout_s or self._timeout_s
        msg = (f"hpcsync backend: {rec.describe()} in group {self._log.name!r} timed out after {timeout_s:g}s "
               f"(the group's timeout is {self._timeout_s:g}s)")  # torch's tests match " timeout "
        with self._timeout_once:
            first = rec.error != "timed out"
            rec.error = "timed out"
        if not first:
            raise dist.DistBackendError(msg)
        self._broken = (msg + "; the group is broken (MPI cannot cancel a collective): destroy it and end "
                        "the job")
        self._mark_broken()
        try:
            watchdog.report_timeout(self._log, rec, timeout_s)
        except Exception as exc:  # the report is best effort; the timeout error is not
            _say_report_failed(rec, exc)
        raise dist.DistBackendError(msg)

