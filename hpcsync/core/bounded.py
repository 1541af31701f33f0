"""Collectives with a deadline, for hpcsync's own control messages outside the backend.

Checkpoints, the requeue decision and the bootstrap's address and interface proofs agree across
ranks with small object collectives. A plain MPI collective waits forever for a rank that raised
before reaching it (with ``HPCSYNC_ABORT_ON_EXCEPTION=0`` nothing ends the job) or that is stuck.
:func:`control` gives those paths a communicator whose every collective is the non-blocking MPI
form polled against a deadline: past it, :class:`CollectiveTimeout` on every rank that waited,
naming the operation and what the caller was doing.

MPI cannot cancel a collective. The abandoned operation stays inside MPI (its buffers are kept
alive here) on a private duplicate of the communicator, so it can never match the program's own
messages; later control operations on that rank fail at once, and the process ends with
``MPI_Abort`` at exit (MPI cannot finalize with a collective in flight), saying why.

Under torch.distributed without MPI the object collectives are torch's, bounded by the process
group's timeout; in one process there is nothing to wait for.
"""
from __future__ import annotations

import contextlib
import pickle
import sys
import time
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple, cast

import numpy as np

from . import bigmpi, mpi, jobend, serial, settings
from .errors import CollectiveTimeout

if TYPE_CHECKING:
    from mpi4py.MPI import Comm, Op, Request
    from mpi4py.typing import BufSpec, BufSpecB, BufSpecV, InPlace

    from .protocols import ObjectComm

__all__ = [
    "SPIN_S", "LARGE_BYTES", "wait", "BoundedComm", "own", "over", "owned", "default_timeout", "control", "helper",
    "abandon", "broken"
]

SPIN_S = 0.05  # test without sleeping this long first (a peer a few µs late costs no ms)
LARGE_BYTES = 64 << 10  # a transfer above this polls without sleeping (MPI progresses only inside calls)

_abandoned: List[Tuple[str, object, object]] = []  # (why, request, buffers): operations MPI may still complete, and write into


def wait(req: Request, timeout: float, large: bool = False, idle: bool = False) -> None:
    """Wait for the MPI request ``req`` at most ``timeout`` seconds, else raise
    :class:`CollectiveTimeout` (the request stays in flight: the caller keeps it and its buffers).
    Spins first, then sleeps a millisecond between tests, unless ``large`` (a transfer that MPI
    progresses only inside calls: it spins throughout) or ``idle`` (a rank with nothing to do
    while the others work: it sleeps from the start, 0.5 ms at most, leaving them the cores)."""
    serialized = serial.lock() is not None  # below THREAD_MULTIPLE: each test holds the process's MPI lock
    if serial.call(req.Test):
        return
    now = time.monotonic()
    deadline, spin_until = now + timeout, (now if idle else now + SPIN_S)
    pause = 0.0002
    while not serial.call(req.Test):
        now = time.monotonic()
        if now > deadline:
            raise CollectiveTimeout(f"an MPI request waited {timeout:g} s")
        if idle:
            time.sleep(pause)
            pause = min(pause * 2, 0.0005)
        elif not large and now > spin_until:
            time.sleep(0.001)
        elif serialized:
            time.sleep(0)  # a thread waiting for the lock gets it between two tests


class _Private:
    """A private duplicate of one communicator, shared by every :class:`BoundedComm` over it."""

    def __init__(self, base: Comm) -> None:
        self.base = base
        self.dup: Optional[Comm] = None
        self.broken: Optional[str] = None


_private: Dict[int, _Private] = {}
_helper_private: Dict[int, _Private] = {}  # the comm helpers': never shared with hpcsync's own exchanges


class BoundedComm:
    """The collectives hpcsync's control paths use, on a private duplicate of ``base``, each
    bounded by ``timeout`` seconds (from the call; rounds of a large transfer each get their own).

    Object forms (``allgather``, ``gather``, ``bcast``, ``Barrier``) and the buffer forms that
    :mod:`hpcsync.core.bigmpi` calls (``Allgather``, ``Allgatherv``, ``Gatherv``, ``Bcast``,
    ``Allreduce``), so :mod:`hpcsync.core.comm`'s helpers accept it as an MPI communicator.
    ``what`` says what the ranks were doing, for the error. One thread at a time.
    """

    def __init__(self, private: _Private, timeout: float, what: str) -> None:
        self._p = private
        self.timeout = float(timeout)
        self.what = what
        self._rank: int = private.base.Get_rank()
        self._size: int = private.base.Get_size()
        self.received = 0  # bytes that arrived in this rank's receive buffers

    def Get_rank(self) -> int:
        return self._rank

    def Get_size(self) -> int:
        return self._size

    @property
    def base(self) -> Comm:
        """The communicator this one bounds (for what has no non-blocking form: MPI-IO's open)."""
        return self._p.base

    # -- the deadline ---------------------------------------------------------------------------
    def _comm(self) -> Comm:
        p = self._p
        if p.broken:
            raise CollectiveTimeout(f"{self.what}: not attempted: {p.broken}")
        if p.dup is None:
            comm, req = serial.call(p.base.Idup)
            self._wait(req, "creating hpcsync's private communicator", (comm,), large=False)
            p.dup = comm
        return p.dup

    def _wait(self, req: Request, op: str, keep: object, large: bool, idle: bool = False) -> None:
        try:
            wait(req, self.timeout, large, idle)
        except CollectiveTimeout:
            self._p.broken = (f"{self.what}: {op} timed out after {self.timeout:g} s on rank {self._rank} "
                              f"(hpcsync's control communicator of {self._size} ranks is unusable from here)")
            abandon(self._p.broken, req, keep)
            raise CollectiveTimeout(f"{self.what}: the other ranks did not all arrive within {self.timeout:g} s "
                                    f"({op}, rank {self._rank} of {self._size}): a rank raised or is stuck "
                                    "before this point (its own error says which), or its node was lost") from None

    @staticmethod
    def _nbytes(spec: Any) -> int:  # a buffer specification, or any argument of a call
        buf = spec[0] if isinstance(spec, (list, tuple)) else spec
        try:
            return memoryview(buf).nbytes
        except TypeError:
            return 0

    def _run(self, op: str, name: str, args: Tuple[Any, ...], kwargs: Optional[Dict[str, Any]] = None,
             into: object = None) -> None:
        comm = self._comm()
        large = any(self._nbytes(a) > LARGE_BYTES for a in args if a is not None)
        self._wait(serial.call(getattr(comm, name), *args, **(kwargs or {})), op, args, large)
        if into is not None:
            self.received += self._nbytes(into) if not isinstance(into, int) else into

    def raw(self) -> Comm:
        """The private duplicate itself (made on first use), for point-to-point messages that
        must never match the program's own."""
        return self._comm()

    def give_up(self, op: str, reqs: object, keep: object) -> None:
        """Point-to-point requests on :meth:`raw` that waited past their deadline: kept for good
        with their buffers (MPI may still complete them), and this communicator unusable from here
        (as after a collective's timeout)."""
        self._p.broken = (f"{self.what}: {op} timed out after {self.timeout:g} s on rank {self._rank} "
                          f"(hpcsync's control communicator of {self._size} ranks is unusable from here)")
        abandon(self._p.broken, reqs, keep)

    def free(self) -> None:
        """Free the private duplicate of a communicator made by :func:`own` (not after a
        timeout: an abandoned operation is still in flight on it)."""
        p = self._p
        if p.dup is not None and not p.broken:
            serial.call(p.dup.Free)
        p.dup = None

    # -- buffer collectives (what bigmpi calls) ------------------------------------------------
    def Allgather(self, sendbuf: BufSpec | InPlace, recvbuf: BufSpecB) -> None:
        self._run("Allgather", "Iallgather", (sendbuf, recvbuf), into=recvbuf)

    def Allgatherv(self, sendbuf: BufSpec | InPlace, recvbuf: BufSpecV) -> None:
        self._run("Allgatherv", "Iallgatherv", (sendbuf, recvbuf), into=_counted(recvbuf))

    def Gatherv(self, sendbuf: BufSpec | InPlace, recvbuf: BufSpecV | None, root: int = 0) -> None:
        self._run("Gatherv", "Igatherv", (sendbuf, recvbuf), {"root": root},
                  into=_counted(recvbuf) if recvbuf is not None else None)

    def Bcast(self, buf: BufSpec, root: int = 0) -> None:
        self._run("Bcast", "Ibcast", (buf,), {"root": root}, into=_counted(buf) if self._rank != root else None)

    def Alltoall(self, sendbuf: BufSpecB | InPlace, recvbuf: BufSpecB) -> None:
        self._run("Alltoall", "Ialltoall", (sendbuf, recvbuf), into=recvbuf)

    def Allreduce(self, sendbuf: BufSpec | InPlace, recvbuf: BufSpec, op: Optional[Op] = None) -> None:
        self._run("Allreduce", "Iallreduce", (sendbuf, recvbuf), {"op": op if op is not None else mpi.MPI().SUM},
                  into=recvbuf)

    def Scatter(self, sendbuf: BufSpecB | None, recvbuf: BufSpec | InPlace, root: int = 0) -> None:
        self._run("Scatter", "Iscatter", (sendbuf, recvbuf), {"root": root}, into=recvbuf)

    def Scatterv(self, sendbuf: BufSpecV | None, recvbuf: BufSpec | InPlace, root: int = 0) -> None:
        self._run("Scatterv", "Iscatterv", (sendbuf, recvbuf), {"root": root}, into=_counted(recvbuf))

    def Barrier(self, idle: bool = False) -> None:
        """``idle``: this rank has nothing to do meanwhile (it sleeps while it waits)."""
        comm = self._comm()
        self._wait(serial.call(comm.Ibarrier), "Barrier", None, large=False, idle=idle)

    # -- object collectives (pickled; any size) -------------------------------------------------
    def allgather(self, obj: Any) -> List[Any]:
        parts = bigmpi.allgatherv_bytes(self, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        return [pickle.loads(p) for p in parts]

    def gather(self, obj: Any, root: int = 0) -> Optional[List[Any]]:
        parts = bigmpi.gatherv_bytes(self, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), root=root)
        return None if parts is None else [pickle.loads(p) for p in parts]

    def bcast(self, obj: Any = None, root: int = 0) -> Any:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self._rank == root else None
        return pickle.loads(bigmpi.bcast_bytes(self, data, root=root))

    def scatter(self, objs: Optional[Sequence[Any]] = None, root: int = 0, round_bytes: int = bigmpi.DEFAULT_ROUND_BYTES) -> Any:
        """Object ``i`` of the root's ``objs`` to rank ``i`` (each pickled): every rank learns every
        size, then the bytes go in rounds of at most ``round_bytes`` (MPI's counts and offsets are
        C ints: one call would overflow past 2 GiB in all), a rank's object across rounds if need
        be. Rounds: the total over ``round_bytes``, the same on every rank."""
        MPI = mpi.MPI()
        is_root = self._rank == root
        parts = [pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL) for o in cast("Sequence[Any]", objs)] if is_root else []
        sizes = np.array([len(p) for p in parts], dtype=np.int64) if is_root else np.zeros(self._size, np.int64)
        self.Bcast([sizes, MPI.INT64_T], root=root)
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        mine = bytearray(int(sizes[self._rank]))
        blob = memoryview(b"".join(parts)) if is_root else None
        for lo in range(0, int(starts[-1]), round_bytes):
            hi = min(lo + round_bytes, int(starts[-1]))
            first, last = np.maximum(starts[:-1], lo), np.minimum(starts[1:], hi)
            counts = np.maximum(last - first, 0).astype(np.int32)  # each rank's bytes in [lo, hi)
            displs = np.clip(first - lo, 0, hi - lo).astype(np.int32)
            at = int(first[self._rank] - starts[self._rank])  # where they go in this rank's object
            recv = [memoryview(mine)[at: at + int(counts[self._rank])], int(counts[self._rank]), MPI.BYTE]
            self.Scatterv([blob[lo:hi], counts, displs, MPI.BYTE] if blob is not None else None, recv, root=root)
        return pickle.loads(mine)

    def __repr__(self) -> str:
        return f"BoundedComm({self.what!r}, timeout={self.timeout:g}, rank {self._rank}/{self._size})"


def _counted(spec: object) -> object:
    """The bytes a buffer specification ``[buf, counts, displs, type]`` or ``[buf, count, type]``
    receives (its counts, not its capacity)."""
    if isinstance(spec, (list, tuple)) and len(spec) >= 3:
        counts = spec[1]
        return int(sum(counts)) if isinstance(counts, (list, tuple)) else int(counts)
    return spec


def own(base: Comm, what: str, timeout: float) -> BoundedComm:
    """A :class:`BoundedComm` over an mpi4py communicator ``base`` with a private duplicate of its
    own (for one call's communicators, split and freed by that call: :meth:`BoundedComm.free`)."""
    return BoundedComm(_Private(base), timeout, what)


def over(c: ObjectComm, what: str, timeout: float) -> Any:  # Any: the callers reach past ObjectComm
    """``c`` with every collective bounded by ``timeout`` seconds on a private duplicate of its own
    (:func:`own`) when it is an mpi4py communicator; a torch-backed or already bounded one as it
    is (bounded by its process group's timeout, or already)."""
    return own(cast("Comm", c), what, timeout) if hasattr(c, "Idup") else c


@contextlib.contextmanager
def owned(c: Any, what: str, timeout: float) -> Iterator[Any]:
    """:func:`over` for the length of a ``with`` block: the private duplicate it made is freed when
    the block ends, however it ends (:meth:`BoundedComm.free`: kept after a timeout, whose
    operation is still in flight on it). ``c`` itself when :func:`over` gave it back as it is."""
    comm = over(c, what, timeout)
    try:
        yield comm
    finally:
        if comm is not c:
            comm.free()


def default_timeout() -> float:
    """``HPCSYNC_TIMEOUT``: how long a control collective waits for the other ranks."""
    return settings.number("HPCSYNC_TIMEOUT")


def control(what: str, group: Any = None, timeout: Optional[float] = None) -> Any:  # as over()
    """The communicator for a control exchange among ``group``'s ranks (default: the world; a
    torch process group or an mpi4py communicator, as for :mod:`hpcsync.core.comm`): a
    :class:`BoundedComm` under MPI (``timeout`` default :func:`default_timeout`), else the
    torch-backed or one-process communicator :func:`hpcsync.core.torchcomm.transport` gives."""
    from .torchcomm import transport

    base = transport(group)
    if isinstance(base, BoundedComm):
        return base
    if not hasattr(base, "Iallgatherv") or base.Get_size() == 1:
        return base
    return BoundedComm(_cached(_private, cast("Comm", base)), default_timeout() if timeout is None else timeout, what)


def helper(what: str, base: ObjectComm) -> Any:  # as over()
    """The communicator one of :mod:`hpcsync.core.comm`'s helpers uses over ``base`` (the world,
    or this node's): a :class:`BoundedComm` on a private duplicate of its own -- not the one
    hpcsync's control exchanges use, so a program's helper call in one thread and a checkpoint's
    exchange in another never share a communicator -- bounded by :func:`default_timeout`. A
    torch-backed or one-process communicator as it is."""
    if not hasattr(base, "Iallgatherv") or base.Get_size() == 1:
        return base
    return BoundedComm(_cached(_helper_private, cast("Comm", base)), default_timeout(), what)


def _cached(cache: Dict[int, _Private], base: Comm) -> _Private:
    """``base``'s private duplicate in ``cache``, made once (the exit hook that frees them set up
    with the first of all)."""
    private = cache.get(id(base))
    if private is None or private.base is not base:
        if not _private and not _abandoned and not _helper_private:
            jobend.at_exit("backend", _at_exit)
        private = cache[id(base)] = _Private(base)
    return private


def abandon(why: str, req: object, keep: object = None) -> None:
    """Keep a timed-out request and its buffers for good (MPI may still complete it and write into
    them); the process then ends with ``MPI_Abort`` at exit, saying ``why``."""
    if not _abandoned and not _private and not _helper_private:
        jobend.at_exit("backend", _at_exit)
    _abandoned.append((why, req, keep))


def broken() -> Optional[str]:
    """Why this process has an MPI operation abandoned in flight (a control collective or the
    preemption guard's flags timed out), or None."""
    return _abandoned[0][0] if _abandoned else None


def _at_exit() -> None:
    """Free the private duplicates; with an operation abandoned inside MPI, end the job instead
    (MPI_Finalize would wait for it forever)."""
    MPI = mpi.MPI()
    if MPI.Is_finalized():
        return
    why = broken()
    if why is not None:
        sys.stdout.flush()
        sys.stderr.write(f"[hpcsync] rank {MPI.COMM_WORLD.Get_rank()}: exiting after {why}; MPI cannot finalize "
                         "with a collective in flight: MPI_Abort\n")
        sys.stderr.flush()
        jobend.abort(1)
    for p in [*_private.values(), *_helper_private.values()]:
        if p.dup is not None:
            p.dup.Free()
            p.dup = None
    _private.clear()
    _helper_private.clear()
