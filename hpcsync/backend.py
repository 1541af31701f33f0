"""``hpcsync``: a socket-free torch.distributed backend that moves tensors with mpi4py.

Works with stock pip wheels of torch (which have no MPI backend) and opens no listening socket:
ranks come from MPI, rendezvous uses an in-process ``HashStore``, data goes through MPI.

    import hpcsync.backend                      # registers "hpcsync" (also done by hpcsync.init)
    dist.init_process_group("hpcsync", init_method="hpcsync://")

How it works. Each process group owns a private duplicate of its MPI communicator for
collectives and another for point-to-point, so torch's traffic never matches the program's own
MPI messages. Collectives run in issue order on one worker thread per group with blocking mpi4py
calls (the GIL is released inside MPI): ``async_op=True`` (and DDP's bucket all-reduces) return at
once and overlap with the caller's computation; a blocking call with nothing queued runs inline,
with no thread hand-off. Point-to-point uses ``Isend``/``Irecv`` started in the caller's thread,
so sends and receives never block each other.

Types: every torch dtype. MPI has no float16/bfloat16: reductions on them are computed in
float32 and rounded once (at least as accurate as reducing in 16 bits). CUDA tensors are staged
through host memory (a CUDA-aware MPI could take them directly; not detected yet).
Errors: an exception inside an operation fails its work (``wait()`` raises). Every operation is
bounded by the group's timeout: past it the waiting ranks raise ``DistBackendError``, the group is
broken for good (MPI cannot cancel a collective) and :mod:`hpcsync.watchdog` reports who is
stuck where. Mismatched collectives are detected (a fingerprint travels beside each one) and
raise on every rank instead of returning wrong data.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import sys
import threading
import time
import zlib
from array import array
from collections import deque
from datetime import timedelta
from typing import Any, Callable, Deque, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch.futures import Future

from . import _mpi, jobend, nodemap, settings, watchdog
from .errors import ranks_by_value

log = logging.getLogger(__name__)

BACKEND_NAME = "hpcsync"
INIT_METHOD = "hpcsync://"
_CHUNK_ELEMS = 1 << 30  # elements per MPI call: counts are C ints
_INLINE_BYTES = 64 << 10  # blocking calls up to this size run in the caller's thread

# Collectives whose non-blocking form is as fast as (or faster than) the blocking one at every
# size, per MPI library (measured, 2 and 4 ranks, 64 KiB-16 MiB; bench/bench_backend.py). Those
# run inline at any size (no thread hand-off) and non-blocking on the worker too. Open MPI 4.1's
# blocking Reduce_scatter_block is 3-4x slower than its Ireduce_scatter_block from 1 MiB on, its
# Iallreduce 1.7-2x slower than Allreduce; MPICH's Ireduce_scatter_block is 10x slower at 1 MiB.
_NONBLOCKING_FAST = {"Open MPI": {"Bcast", "Reduce_scatter_block"}, "MPICH": {"Bcast", "Allgather"}}
_NB_OPS = {"Bcast": "broadcast", "Reduce_scatter_block": "reduce_scatter", "Allgather": "all_gather"}


def _nonblocking_fast() -> Set[str]:
    version = _mpi.MPI().Get_library_version()
    for name, calls in _NONBLOCKING_FAST.items():
        if name in version:
            return set(calls)
    return set()

RedOp = dist.ReduceOp.RedOpType
_HALF = (torch.float16, torch.bfloat16)


_TYPES: dict = {}
_OPS: dict = {}
_BOOL_OPS: dict = {}


def _tables() -> None:
    """dtype -> MPI datatype and ReduceOp -> MPI.Op, built once (they sit on the hot path)."""
    MPI = _mpi.MPI()
    _TYPES.update({
        torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.int8: MPI.INT8_T, torch.uint8: MPI.UINT8_T,
        torch.int16: MPI.INT16_T, torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T, torch.bool: MPI.C_BOOL,
        torch.complex64: MPI.C_FLOAT_COMPLEX, torch.complex128: MPI.C_DOUBLE_COMPLEX,
        torch.uint16: MPI.UINT16_T, torch.uint32: MPI.UINT32_T, torch.uint64: MPI.UINT64_T,
        torch.float16: MPI.INT16_T, torch.bfloat16: MPI.INT16_T,  # moved as bits, reduced in float32
    })
    _BOOL_OPS.update({RedOp.SUM: MPI.LOR, RedOp.MAX: MPI.LOR, RedOp.BOR: MPI.LOR, RedOp.MIN: MPI.LAND,
                      RedOp.PRODUCT: MPI.LAND, RedOp.BAND: MPI.LAND, RedOp.BXOR: MPI.LXOR, RedOp.AVG: MPI.LOR})
    _OPS.update({RedOp.SUM: MPI.SUM, RedOp.AVG: MPI.SUM, RedOp.PREMUL_SUM: MPI.SUM, RedOp.PRODUCT: MPI.PROD,
                 RedOp.MIN: MPI.MIN, RedOp.MAX: MPI.MAX, RedOp.BAND: MPI.BAND, RedOp.BOR: MPI.BOR,
                 RedOp.BXOR: MPI.BXOR})


def _mpi_type(dtype: torch.dtype) -> Any:
    try:
        return _TYPES[dtype]
    except KeyError:
        if not _TYPES:
            _tables()
            return _mpi_type(dtype)
        raise TypeError(f"hpcsync backend: unsupported dtype {dtype}") from None


def _kind(op: Any) -> Any:
    return op.op if hasattr(op, "op") else op


def _mpi_op(op: Any, dtype: torch.dtype) -> Any:
    if not _OPS:
        _tables()
    table = _BOOL_OPS if dtype == torch.bool else _OPS
    try:
        return table[_kind(op)]
    except KeyError:
        raise ValueError(f"hpcsync backend: unsupported reduce op {_kind(op)} for {dtype}") from None


def _bytes(t: torch.Tensor, start: int = 0, nbytes: Optional[int] = None) -> Any:
    """A writable buffer over a contiguous CPU tensor's memory, from byte ``start`` (no copy).

    ``MPI.buffer.fromaddress`` costs ~0.3 µs where a numpy view costs ~3 µs: this is the hot path
    of every small message. The caller keeps the tensor alive for the duration of the MPI call.
    """
    if not t.is_contiguous():  # a reshaped copy would receive the data instead of the tensor
        raise AssertionError("hpcsync backend: internal error, buffer is not contiguous")
    total = t.numel() * t.element_size()
    size = total - start if nbytes is None else nbytes
    if size == 0:
        return bytearray(0)
    return _mpi.MPI().buffer.fromaddress(t.data_ptr() + start, size)


class _Staged:
    """A contiguous CPU (and, for 16-bit floats under reduction, float32) stand-in for a tensor."""

    def __init__(self, t: torch.Tensor, reduce: bool = False, read: bool = True) -> None:
        self.orig = t
        work = t.detach()
        if work.device.type != "cpu":
            work = work.cpu() if read else torch.empty(work.shape, dtype=work.dtype)
        if reduce and work.dtype in _HALF:
            work = work.to(torch.float32, memory_format=torch.contiguous_format)
        elif not work.is_contiguous():
            work = work.contiguous() if read else torch.empty(work.shape, dtype=work.dtype)
        self.t = work

    @property
    def copied(self) -> bool:
        return self.t.data_ptr() != self.orig.data_ptr() or self.t.dtype != self.orig.dtype

    def spec(self, start: int = 0, count: Optional[int] = None) -> List[Any]:
        """``[buffer, count, type]`` for a point-to-point / per-rank message."""
        n = self.t.numel() - start if count is None else count
        item = self.t.element_size()
        return [_bytes(self.t, start * item, n * item), n, _mpi_type(self.t.dtype)]

    def whole(self) -> List[Any]:
        """``[buffer, type]``: mpi4py splits it evenly among the ranks (Allgather, Gather, Scatter)."""
        return [_bytes(self.t), _mpi_type(self.t.dtype)]

    def finish(self) -> None:
        if self.copied:
            with torch.no_grad():
                self.orig.copy_(self.t)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share bytes (MPI forbids aliased send and receive buffers)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + a.numel() * a.element_size() if a.is_contiguous() else a.untyped_storage().nbytes() + a0
    b1 = b0 + b.numel() * b.element_size() if b.is_contiguous() else b.untyped_storage().nbytes() + b0
    return a0 < b1 and b0 < a1


def _chunks(n: int) -> Sequence[Tuple[int, int]]:
    return [(s, min(_CHUNK_ELEMS, n - s)) for s in range(0, n, _CHUNK_ELEMS)] or [(0, 0)]


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
        self._group: Optional["ProcessGroupHpcsync"] = None
        self._started: Optional[Tuple[Any, float]] = None  # (record, deadline) once running

    def _complete(self, exc: Optional[BaseException] = None) -> None:
        """Called with ``self._cv`` held."""
        self._exc = exc
        self._done = True
        if self._future is not None:
            self._settle(self._future)

    def _settle(self, fut: Future) -> None:
        if self._exc is None:
            fut.set_result(self._outputs)
        else:
            fut.set_exception(self._exc)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Wait for completion; past the group's timeout (from when the operation started) raise
        torch's ``DistBackendError`` ("timed out"), break the group and report the hang."""
        if not self._done:
            seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout or 0)
            mine = time.monotonic() + seconds if seconds > 0 else None
            with self._cv:
                while not self._done:
                    if self._group is not None and self._group._broken and self._started is None:
                        raise dist.DistBackendError(self._group._broken)  # queued behind a stuck operation
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
        if self._exc is not None:
            raise self._exc
        return True

    def get_future(self) -> Future:
        with self._cv:
            if self._future is None:
                self._future = Future()
                if self._done:
                    self._settle(self._future)
            return self._future

    def is_completed(self) -> bool:
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


class ProcessGroupHpcsync(dist.ProcessGroup):
    """A torch ProcessGroup over an mpi4py communicator."""

    def __init__(self, comm: Any, timeout: timedelta = timedelta(minutes=30), name: str = "0",
                 global_ranks: Optional[Sequence[int]] = None) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size())
        self._coll = comm.Dup()
        self._p2p_comm = comm.Dup()
        self._check = comm.Dup()  # fingerprints and desync agreement, never mixed with the data
        self._timeout = timeout
        self._timeout_s = timeout.total_seconds() if timeout.total_seconds() > 0 else float("inf")
        self._log = watchdog.group_log(id(self), name, list(global_ranks or range(comm.Get_size())))
        self._broken: Optional[str] = None
        self._debug = debug_mode()
        self._fingerprints = settings.flag("HPCSYNC_DESYNC_CHECK")
        self._worker_ident = -1
        self._deadline = float("inf")
        self._spin_s = 1.0
        self._rec: Any = None
        self._cv = threading.Condition()
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
        MPI = _mpi.MPI()
        self._int64 = MPI.INT64_T
        self._max = MPI.MAX
        self._threads_ok = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self._nb_calls = _nonblocking_fast()  # MPI calls made non-blocking everywhere
        self._nb_any_size = {_NB_OPS[c] for c in self._nb_calls}  # torch ops run inline at any size
        if not self._threads_ok:
            log.warning("hpcsync backend: MPI provides no THREAD_MULTIPLE; every operation runs synchronously")

    # -- identity ---------------------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    @property
    def comm(self) -> Any:
        return self._coll

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

    # -- execution --------------------------------------------------------------------------
    def _run(self, fn: Callable[[], None], outputs: List[torch.Tensor], opts: Any, what: Tuple[str, Any, int]
             ) -> MPIWork:
        async_op = getattr(opts, "asyncOp", True)
        cv = self._cv
        with cv:
            if self._closed:
                raise RuntimeError("hpcsync backend: process group was shut down")
            if self._broken:
                raise dist.DistBackendError(self._broken)
            # A blocking call with nothing queued runs here (no thread hand-off) as a non-blocking MPI
            # call polled against the deadline -- unless it is large and its non-blocking form is
            # slow in this MPI (_NONBLOCKING_FAST): those go to the worker (blocking MPI) and the
            # caller waits with the deadline.
            t = what[1]
            inline = not self._threads_ok or (not async_op and self._pending == 0 and (
                t is None or t.numel() * t.element_size() <= _INLINE_BYTES or what[0] in self._nb_any_size))
            self._pending += 1
            if not inline:
                work = MPIWork(outputs, cv)
                work._group = self
                self._queue.append((fn, what, work))
                if self._worker is None:
                    self._worker = threading.Thread(target=self._work_loop, name="hpcsync-pg", daemon=True)
                    self._worker.start()
                cv.notify_all()
                return work
        # blocking call with nothing queued: run here, no thread hand-off
        exc = None
        try:
            self._execute(fn, what, None)
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
                fn, what, work = self._queue.popleft()
            exc = None
            try:
                self._execute(fn, what, work)
            except BaseException as e:
                log.debug("hpcsync backend: operation failed: %s", e)
                exc = e
            with cv:
                work._complete(exc)
                self._pending -= 1
                cv.notify_all()

    # -- one operation: record, fingerprint, run, check ------------------------------------
    def _execute(self, fn: Callable[[], None], what: Tuple[str, Any, int], work: Optional[MPIWork]) -> None:
        """Run one collective with its flight record, deadline and desync check.

        Default mode: a 16-byte ``Iallreduce(MAX)`` of ``[fp, -fp]`` (fp = hash of sequence number,
        op, dtype, count, root) on a private communicator travels alongside the operation; if
        max != -min the ranks disagree, and every rank raises the same error instead of returning
        what MPI made of mismatched buffers. ``HPCSYNC_DEBUG=1`` / ``TORCH_DISTRIBUTED_DEBUG=DETAIL``:
        the full descriptions are all-gathered and compared *before* the operation starts.
        """
        if self._broken:
            raise dist.DistBackendError(self._broken)
        op, t, root = what
        rec = self._log.start(op, str(t.dtype).replace("torch.", "") if t is not None else "-",
                              tuple(t.shape) if t is not None else (), root)
        self._rec, self._deadline = rec, time.monotonic() + self._timeout_s
        # A large operation polled here spins all along: MPI progresses non-blocking collectives
        # only inside MPI calls, so sleeping between polls would stall a multi-second broadcast.
        self._spin_s = 1.0 if t is None or t.numel() * t.element_size() <= _INLINE_BYTES else float("inf")
        if work is not None:
            work._started = (rec, self._deadline)
        vec = _describe(rec, t)
        fp_req = None
        if self._debug:
            self._agree(rec, vec, in_flight=False)
        elif self._fingerprints:
            fp = hash(tuple(vec)) & 0x3FFFFFFFFFFFFFFF
            buf = self._fp
            buf[0], buf[1] = fp, -fp
            fp_req = self._check.Iallreduce(_mpi.MPI().IN_PLACE, [buf, self._int64], op=self._max)
        self._fp_req, self._vec = fp_req, vec
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
        rec.finished = time.time()

    @property
    def _fp_differs(self) -> bool:
        """After the fingerprint Iallreduce(MAX) of [fp, -fp]: max != min means the ranks disagree."""
        return self._fp[0] != -self._fp[1]

    def _agree(self, rec: Any, vec: List[int], from_exc: Optional[BaseException] = None,
               in_flight: bool = True) -> None:
        """All-gather every rank's description of this operation; raise the same error on all if they
        differ. ``in_flight``: the operation itself was started, so the group is broken afterwards."""
        self._fp_req = None
        size = self._check.Get_size()
        mine = array("q", vec)
        every = array("q", bytes(8 * len(vec) * size))
        self._wait(self._check.Iallgather([mine, self._int64], [every, self._int64]))
        rows = [tuple(every[r * len(vec):(r + 1) * len(vec)]) for r in range(size)]
        if len(set(rows)) == 1:
            return
        rec.error = "desync"
        if in_flight and not self._broken:
            self._broken = f"hpcsync backend: group {self._log.name!r} is broken after a collective mismatch (desync)"
            self._mark_broken()
        groups = ranks_by_value(rows, self._log.ranks)
        detail = "; ".join(f"rank(s) {nodemap.describe(rs)}: {_explain(row)}" for row, rs in groups.items())
        raise dist.DistBackendError(
            f"hpcsync backend: collective mismatch (desync) at operation #{rec.seq} of group "
            f"{self._log.name!r}: {detail}. Every rank must call the same collectives in the same order "
            "with matching dtype, size and root.") from from_exc

    def _mark_broken(self) -> None:
        """Remember a broken group for good. Its MPI operations are still in flight and may complete
        later (when a late rank arrives) by writing into their buffers: keep the group, the
        operation and the frames holding its staged tensors alive, so MPI never writes into freed
        memory."""
        frames, f = [], sys._getframe(1)
        while f is not None:
            frames.append(f)
            f = f.f_back
        _broken_groups.append((self._broken or "broken", min(self._timeout_s, 3600), (self, self._rec, frames)))

    def _c(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """One MPI collective: blocking on the worker thread (its waiter enforces the deadline),
        else non-blocking and polled against the deadline."""
        if threading.get_ident() == self._worker_ident and name not in self._nb_calls:
            return getattr(self._coll, name)(*args, **kwargs)
        self._wait(getattr(self._coll, "I" + name[0].lower() + name[1:])(*args, **kwargs))

    def _wait(self, req: Any) -> None:
        if threading.get_ident() == self._worker_ident:
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
            if now > spin_until:
                time.sleep(0.001)

    def _timed_out(self, rec: Any) -> None:
        """Break the group, report the hang (and abort, unless turned off), raise DistBackendError."""
        msg = (f"hpcsync backend: {rec.describe()} in group {self._log.name!r} timed out after {self._timeout_s:g}s "
               f"(the group's timeout is {self._timeout_s:g}s)")  # torch's tests match " timeout "
        self._broken = (msg + "; the group is broken (MPI cannot cancel a collective): destroy it and end "
                        "the job")
        self._mark_broken()
        rec.error = "timed out"
        try:
            watchdog.report_timeout(self._log, rec, self._timeout_s)
        except Exception as exc:  # the report is best effort; the timeout error is not
            log.warning("hpcsync: hang report failed: %s", exc)
        raise dist.DistBackendError(msg)

    # -- reductions -------------------------------------------------------------------------
    def _reduce_into(self, tensor: torch.Tensor, op: Any, root: Optional[int]) -> None:
        """All-reduce (root None) or reduce to ``root`` in place, for one tensor."""
        MPI = _mpi.MPI()
        kind = _kind(op)
        s = _Staged(tensor, reduce=True)
        if kind == RedOp.PREMUL_SUM:
            s.t.mul_(op.factor)
        mop = _mpi_op(op, s.t.dtype)
        for start, n in _chunks(s.t.numel()):
            if n == 0:
                continue
            buf = s.spec(start, n)
            if root is None:
                self._c("Allreduce", MPI.IN_PLACE, buf, op=mop)
            elif self._coll.Get_rank() == root:
                self._c("Reduce", MPI.IN_PLACE, buf, op=mop, root=root)
            else:
                self._c("Reduce", buf, None, op=mop, root=root)
        if kind == RedOp.AVG and (root is None or self._coll.Get_rank() == root):
            _divide(s.t, self._coll.Get_size())
        if root is None or self._coll.Get_rank() == root:
            s.finish()

    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> MPIWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if any(t.is_sparse for t in tensors):
            def sparse() -> None:
                for t in tensors:
                    self._allreduce_sparse(t, op)

            return self._run(sparse, tensors, opts, ("all_reduce", tensors[0], -1))
        if len(tensors) == 1:  # the common case, with as little Python as possible
            t = tensors[0]
            if (t.device.type == "cpu" and t.is_contiguous() and t.dtype not in _HALF
                    and 0 < t.numel() <= _CHUNK_ELEMS and _kind(op) not in (RedOp.AVG, RedOp.PREMUL_SUM)):
                buf = [_bytes(t), t.numel(), _mpi_type(t.dtype)]
                mop, in_place = _mpi_op(op, t.dtype), _mpi.MPI().IN_PLACE
                return self._run(lambda: self._c("Allreduce", in_place, buf, op=mop), tensors, opts,
                                 ("all_reduce", t, -1))

        def fn() -> None:
            for t in tensors:
                self._reduce_into(t, op, None)

        return self._run(fn, tensors, opts, ("all_reduce", tensors[0] if tensors else None, -1))

    def _allreduce_sparse(self, t: torch.Tensor, op: Any) -> None:
        """SUM of sparse COO tensors (what gloo supports): all-gather every rank's (index, value)
        rows with Allgatherv, add duplicates by coalescing, write the result into ``t``."""
        if _kind(op) != RedOp.SUM:
            raise ValueError("hpcsync backend: sparse all_reduce supports ReduceOp.SUM only (as gloo)")
        if not t.is_sparse or t.layout != torch.sparse_coo:
            raise ValueError("hpcsync backend: all_reduce of a mix of sparse and dense tensors")
        c = t.detach().coalesce().cpu()
        rows = c.indices().t().contiguous()  # (nnz, sparse_dim) int64: one row per entry
        vals = c.values().contiguous()  # (nnz, *dense dims)
        size, sd, per = self._coll.Get_size(), rows.shape[1], math.prod(vals.shape[1:])  # per: elements per row
        mine, counts = array("q", [rows.shape[0]]), array("q", bytes(8 * size))
        self._c("Allgather", [mine, self._int64], [counts, self._int64])
        total = sum(counts)
        all_rows = torch.empty((total, sd), dtype=torch.int64)
        all_vals = torch.empty((total, *vals.shape[1:]), dtype=vals.dtype)
        offsets = [sum(counts[:r]) for r in range(size)]
        vtype = _mpi_type(vals.dtype)
        self._c("Allgatherv", [_bytes(rows), rows.numel(), self._int64],
                [_bytes(all_rows), ([n * sd for n in counts], [o * sd for o in offsets]), self._int64])
        self._c("Allgatherv", [_bytes(vals), vals.numel(), vtype],
                [_bytes(all_vals), ([n * per for n in counts], [o * per for o in offsets]), vtype])
        summed = torch.sparse_coo_tensor(all_rows.t(), all_vals, t.shape).coalesce()
        with torch.no_grad():
            t.copy_(summed.to(t.device))

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> MPIWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        def fn() -> None:
            for _dtype, group in itertools.groupby(sorted(range(len(tensors)), key=lambda i: str(tensors[i].dtype)),
                                                  key=lambda i: str(tensors[i].dtype)):
                ts = [tensors[i] for i in group]
                flat = torch.cat([t.detach().reshape(-1).cpu() for t in ts])
                self._reduce_into(flat, op, None)
                pos = 0
                with torch.no_grad():
                    for t in ts:
                        t.copy_(flat[pos:pos + t.numel()].view_as(t))
                        pos += t.numel()

        return self._run(fn, tensors, opts, ("all_reduce_coalesced", tensors[0] if tensors else None, -1))

    def reduce(self, tensors: List[torch.Tensor], opts: Any) -> MPIWork:
        def fn() -> None:
            for t in tensors:
                self._reduce_into(t, opts.reduceOp, opts.rootRank)

        return self._run(fn, tensors, opts, ("reduce", tensors[0], opts.rootRank))

    # -- data movement ----------------------------------------------------------------------
    def broadcast(self, tensors: List[torch.Tensor], opts: Any) -> MPIWork:
        root = opts.rootRank

        def fn() -> None:
            me = self._coll.Get_rank()
            for t in tensors:
                s = _Staged(t, read=me == root)
                for start, n in _chunks(s.t.numel()):
                    if n:
                        self._c("Bcast", s.spec(start, n), root=root)
                if me != root:
                    s.finish()

        return self._run(fn, tensors, opts, ("broadcast", tensors[0], root))

    def _allgather_flat(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        size = self._coll.Get_size()
        if out.numel() != inp.numel() * size:
            raise ValueError(f"all_gather: output has {out.numel()} elements, expected {inp.numel()} x {size}")
        so, si = _Staged(out, read=False), _Staged(inp)
        n = si.t.numel()
        me = self._coll.Get_rank()
        if _overlap(so.t, si.t):  # in-place: the input is (part of) the output
            mine = so.t.reshape(-1)[me * n:(me + 1) * n]
            if mine.data_ptr() == si.t.data_ptr() and si.t.is_contiguous():
                si = None  # exactly this rank's slot: MPI_IN_PLACE
            else:
                si.t = si.t.clone()
        if n and n * size <= 2**31 - 1:
            self._c("Allgather", _mpi.MPI().IN_PLACE if si is None else si.spec(), so.whole())
        elif n:  # big counts: one broadcast per rank, in chunks
            for r in range(size):
                if r == me and si is not None:
                    so.t.reshape(-1)[r * n:(r + 1) * n].copy_(si.t.reshape(-1))
                for start, k in _chunks(n):
                    self._c("Bcast", so.spec(r * n + start, k), root=r)
        so.finish()

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> MPIWork:
        return self._run(lambda: self._allgather_flat(output, input), [output], opts, ("all_gather", input, -1))

    _allgather_base = all_gather_single

    def allgather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any = None) -> MPIWork:
        def fn() -> None:
            for outs, inp in zip(output_lists, inputs):
                flat = torch.empty((len(outs), *inp.shape), dtype=inp.dtype)
                self._allgather_flat(flat, inp)
                with torch.no_grad():
                    for o, src in zip(outs, flat):
                        o.copy_(src)

        return self._run(fn, [t for outs in output_lists for t in outs], opts, ("all_gather", inputs[0], -1))

    def allgather_coalesced(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor],
                            opts: Any = None) -> MPIWork:
        # torch: output_lists[r][i] is input i of rank r
        def fn() -> None:
            for i, inp in enumerate(inputs):
                flat = torch.empty((self._coll.Get_size(), *inp.shape), dtype=inp.dtype)
                self._allgather_flat(flat, inp)
                with torch.no_grad():
                    for r, outs in enumerate(output_lists):
                        outs[i].copy_(flat[r])

        return self._run(fn, [t for outs in output_lists for t in outs], opts,
                         ("all_gather_coalesced", inputs[0] if inputs else None, -1))

    def all_gather_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                    opts: Any = None) -> MPIWork:
        def fn() -> None:
            for o, i in zip(outputs, inputs):
                self._allgather_flat(o, i)

        return self._run(fn, outputs, opts, ("all_gather_coalesced", inputs[0] if inputs else None, -1))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any) -> MPIWork:
        root = opts.rootRank

        def fn() -> None:
            me, size = self._coll.Get_rank(), self._coll.Get_size()
            inp = _Staged(inputs[0])
            if me == root:
                flat = torch.empty((size, *inputs[0].shape), dtype=inputs[0].dtype)
                self._c("Gather", inp.spec(), _Staged(flat, read=False).whole(), root=root)
                with torch.no_grad():
                    for o, src in zip(output_lists[0], flat):
                        o.copy_(src)
            else:
                self._c("Gather", inp.spec(), None, root=root)

        return self._run(fn, [t for outs in output_lists for t in outs], opts, ("gather", inputs[0], root))

    def scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]], opts: Any) -> MPIWork:
        root = opts.rootRank

        def fn() -> None:
            out = _Staged(outputs[0], read=False)
            if self._coll.Get_rank() == root:
                flat = torch.stack([t.detach().cpu() for t in input_lists[0]]).contiguous()
                self._c("Scatter", _Staged(flat).whole(), out.spec(), root=root)
            else:
                self._c("Scatter", None, out.spec(), root=root)
            out.finish()

        return self._run(fn, outputs, opts, ("scatter", outputs[0], root))

    def _reduce_scatter_flat(self, out: torch.Tensor, inp: torch.Tensor, op: Any) -> None:
        size = self._coll.Get_size()
        if inp.numel() != out.numel() * size:
            raise ValueError(f"reduce_scatter: input has {inp.numel()} elements, expected {out.numel()} x {size}")
        kind = _kind(op)
        si = _Staged(inp, reduce=True)
        if not si.copied and (kind == RedOp.PREMUL_SUM or _overlap(si.t, out)):
            si.t = si.t.clone()  # never scale the caller's input, never alias send and receive
        if kind == RedOp.PREMUL_SUM:
            si.t.mul_(op.factor)
        so = _Staged(out, reduce=True, read=False)
        if so.t.dtype != si.t.dtype:
            so.t = torch.empty(out.shape, dtype=si.t.dtype)
        if out.numel():
            self._c("Reduce_scatter_block", si.whole(), so.spec(), op=_mpi_op(op, si.t.dtype))
        if kind == RedOp.AVG:
            _divide(so.t, size)
        so.finish()

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> MPIWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._run(lambda: self._reduce_scatter_flat(output, input, op), [output], opts,
                         ("reduce_scatter", input, -1))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]],
                       opts: Any = None) -> MPIWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        def fn() -> None:
            for out, ins in zip(outputs, input_lists):
                flat = torch.cat([t.detach().reshape(-1).cpu() for t in ins])
                self._reduce_scatter_flat(out, flat, op)

        return self._run(fn, outputs, opts, ("reduce_scatter", outputs[0], -1))

    def reduce_scatter_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                        opts: Any = None) -> MPIWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        def fn() -> None:
            for o, i in zip(outputs, inputs):
                self._reduce_scatter_flat(o, i, op)

        return self._run(fn, outputs, opts, ("reduce_scatter_coalesced", inputs[0] if inputs else None, -1))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _alltoallv(self, out: torch.Tensor, inp: torch.Tensor, send_counts: List[int], recv_counts: List[int]) -> None:
        so, si = _Staged(out, read=False), _Staged(inp)
        if _overlap(so.t, si.t):
            si.t = si.t.clone()
        if max(sum(send_counts), sum(recv_counts)) > 2**31 - 1:
            raise ValueError("all_to_all: more than 2**31-1 elements in one call is not supported")
        sd = [sum(send_counts[:r]) for r in range(len(send_counts))]
        rd = [sum(recv_counts[:r]) for r in range(len(recv_counts))]
        t = _mpi_type(si.t.dtype)
        self._c("Alltoallv", [_bytes(si.t), (send_counts, sd), t], [_bytes(so.t), (recv_counts, rd), t])
        so.finish()

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: List[int],
                          input_split_sizes: List[int], opts: Any = None) -> MPIWork:
        size = self._coll.Get_size()

        def counts(t: torch.Tensor, splits: List[int]) -> List[int]:
            row = t[0].numel() if t.dim() and t.shape[0] else (t.numel() // max(t.shape[0], 1) if t.dim() else 1)
            if not splits:
                if t.dim() == 0 or t.shape[0] % size:
                    raise ValueError(f"all_to_all_single: dim 0 ({t.shape[0] if t.dim() else 0}) "
                                     f"must divide by the group size {size}")
                return [t.numel() // size] * size
            return [s * row for s in splits]

        return self._run(lambda: self._alltoallv(output, input, counts(input, input_split_sizes),
                                                 counts(output, output_split_sizes)), [output], opts,
                         ("all_to_all", input, -1))

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: List[int],
                      input_split_sizes: List[int], opts: Any = None) -> MPIWork:
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any = None) -> MPIWork:
        def fn() -> None:
            dtype = inputs[0].dtype
            send = torch.cat([t.detach().reshape(-1).cpu() for t in inputs]) if inputs else torch.empty(0, dtype=dtype)
            recv = torch.empty(sum(t.numel() for t in outputs), dtype=dtype)
            self._alltoallv(recv, send, [t.numel() for t in inputs], [t.numel() for t in outputs])
            pos = 0
            with torch.no_grad():
                for o in outputs:
                    o.copy_(recv[pos:pos + o.numel()].view_as(o))
                    pos += o.numel()

        return self._run(fn, outputs, opts, ("all_to_all", inputs[0] if inputs else None, -1))

    def barrier(self, opts: Any = None) -> MPIWork:
        return self._run(lambda: self._c("Barrier"), [], opts, ("barrier", None, -1))

    # -- point to point ---------------------------------------------------------------------
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
                work._complete(exc)
                self._p2p_cv.notify_all()

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
        watchdog.drop_group_log(id(self))
        MPI = _mpi.MPI()
        if not MPI.Is_finalized() and not self._broken:  # a broken group may still be inside MPI
            for c in (self._coll, self._p2p_comm, self._check):
                if c != MPI.COMM_NULL:
                    c.Free()

    def abort(self) -> None:
        jobend.abort(1)


_OP_IDS = {name: k for k, name in enumerate((
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_coalesced", "gather",
    "scatter", "reduce_scatter", "reduce_scatter_coalesced", "all_to_all", "barrier"))}
_OP_NAMES = {k: name for name, k in _OP_IDS.items()}
_DTYPE_IDS = {name: zlib.crc32(name.encode()) for name in sorted(
    {str(v).replace("torch.", "") for v in vars(torch).values() if isinstance(v, torch.dtype)})}


def _describe(rec: Any, t: Optional[torch.Tensor]) -> List[int]:
    """What every rank must agree on, as integers: seq, op, dtype, count, root (all-to-all: counts may differ)."""
    dtype = _DTYPE_IDS.get(rec.dtype, 0) if t is not None else -1
    count = t.numel() if t is not None and rec.op != "all_to_all" else -1
    return [rec.seq, _OP_IDS[rec.op], dtype, count, rec.root]


def _explain(row: Tuple[int, ...]) -> str:
    seq, op, dtype, count, root = row
    names = {v: k for k, v in _DTYPE_IDS.items()}
    return (f"#{seq} {_OP_NAMES.get(op, op)} dtype={names.get(dtype, '-')} count={count if count >= 0 else '-'}"
            + (f" root={root}" if root >= 0 else ""))


def debug_mode() -> bool:
    """Full pre-agreement of every collective: ``HPCSYNC_DEBUG=1`` or torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``."""
    return (settings.flag("HPCSYNC_DEBUG")
            or os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL")


def _divide(t: torch.Tensor, n: int) -> None:
    if t.is_floating_point() or t.is_complex():
        t.div_(n)
    elif t.dtype != torch.bool:
        t.copy_(torch.div(t, n, rounding_mode="trunc"))


def _group_comm(world: Any, ranks: Sequence[int], group_id: str) -> Any:
    """An MPI communicator of ``ranks`` (world ranks, in that order); collective over them only."""
    if list(ranks) == list(range(world.Get_size())):
        return world
    group = world.Get_group().Incl(list(ranks))
    try:
        tag = zlib.crc32(group_id.encode()) % 32768
        return world.Create_group(group, tag)
    finally:
        group.Free()


def _create(opts: Any, _backend_options: Any = None) -> ProcessGroupHpcsync:
    from .topology import topology

    topology()  # silent-singleton check, MPI initialised
    world = _mpi.MPI().COMM_WORLD
    ranks = list(opts.global_ranks_in_group) or list(range(world.Get_size()))
    comm = _group_comm(world, ranks, str(opts.group_id))
    if comm.Get_rank() != opts.group_rank or comm.Get_size() != opts.group_size:
        raise RuntimeError(f"hpcsync backend: torch expects rank {opts.group_rank}/{opts.group_size} in group "
                           f"{opts.group_id}, MPI gives {comm.Get_rank()}/{comm.Get_size()}")
    if comm is world and _mpi.MPI().Query_thread() == _mpi.MPI().THREAD_MULTIPLE:
        watchdog.start()  # collective over the world: the default group is created by every rank
    pg = ProcessGroupHpcsync(comm, opts.timeout, str(opts.group_id), ranks)
    if comm is not world:
        comm.Free()  # the group keeps its own duplicates
    return pg


def _rendezvous(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs: Any):
    """``hpcsync://``: rank and size from MPI, an in-process store: no TCP listener at all."""
    from .topology import topology

    topo = topology()
    yield dist.HashStore(), topo.rank, topo.world_size


_broken_groups: List[Tuple[str, float, Any]] = []


def _at_exit() -> None:
    """Stop the watchdog before MPI_Finalize; end the job if a group is broken.

    A group that timed out or desynchronised still has MPI operations in flight, and MPI_Finalize
    would hang or crash on them. Every rank first meets the others in a bounded exit barrier (its
    watchdog still answering): a broken rank waits up to that group's timeout + 20 s, so every
    rank can finish handling its own error and report, then ends the job with MPI_Abort, saying
    why; a healthy rank waits up to 30 s (MPI_Finalize would wait for the others anyway).
    """
    MPI = _mpi.MPI()
    if MPI.Is_finalized():
        return
    resp = watchdog.responder()
    if resp is not None:
        req = resp.comm.Ibarrier()
        deadline = time.monotonic() + (max(t for _, t, _ in _broken_groups) + 20 if _broken_groups else 30)
        while not req.Test() and time.monotonic() < deadline:
            time.sleep(0.01)
    if resp is not None:
        resp.stop()
    if _broken_groups:
        sys.stdout.flush()
        sys.stderr.write(f"[hpcsync] rank {MPI.COMM_WORLD.Get_rank()}: exiting with a broken process group "
                         f"({_broken_groups[0][0]}); MPI cannot finalize with collectives in flight: MPI_Abort\n")
        sys.stderr.flush()
        jobend.abort(1)


def register() -> None:
    """Register the backend and the ``hpcsync://`` rendezvous with torch (idempotent)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    from torch.distributed.rendezvous import register_rendezvous_handler

    try:
        register_rendezvous_handler("hpcsync", _rendezvous)
    except ValueError:
        pass  # already registered


register()
__import__("atexit").register(_at_exit)
