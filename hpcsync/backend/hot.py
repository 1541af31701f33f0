"""The hot path: one blocking collective on a dense contiguous CPU tensor, in the caller's thread.

What :meth:`~.engine.GroupEngine._execute` gives every operation in the watched mode -- flight
record, deadline (enforced by the deadline thread), the 16-byte fingerprint agreed *before* the
data call -- written out flat, because at 4 KiB every µs of Python shows. What does not change
from one call to the next on the same buffers is prepared once and kept (:class:`Prepared`): the
MPI call bound to its buffers, and the hash of the description minus its sequence number, so a
call costs a dictionary lookup where it cost a buffer wrapper, a type lookup and a tuple hash.
The fingerprint is :func:`~.desync.fingerprint` of the same row :func:`~.desync.describe` makes,
so ranks on the general path (a non-contiguous tensor, a queued operation) match ranks here.

Which MPI call a kind of operation makes does not depend on which path runs it (see
:meth:`~.engine.GroupEngine._bind`): a rank here and a rank on the general path make the same calls.
"""
from __future__ import annotations

import sys
import time
from datetime import timedelta
from functools import partial
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from .buffers import CHUNK_ELEMS, fast_types, mpi_type, spans_overlap
from ..observe.watchdog import OpRecord
from .desync import DTYPE_NAMES, FP_MASK, SEQ_MIX, hot_vector
from .work import WAITED, DoneWork

__all__ = ["NO_TIMEOUT", "Prepared", "HotPath"]

_monotonic, _now = time.monotonic, time.time
_refcount = sys.getrefcount
NO_TIMEOUT = timedelta(0)  # torch's unset per-call timeout is -1 ms: the hot path runs only then
_CACHE_MAX = 256  # prepared calls kept per group (buffers come and go: the oldest are dropped)


class Prepared(NamedTuple):
    """One operation on given buffers, ready to run: the bound MPI call, whether it returns a
    request, the hash of its description without the sequence number, that description, and the
    operation's name, dtype's name and root for the flight record."""

    call: Callable[[], Any]
    request: bool
    rest: int
    row: Tuple[int, ...]
    op: str
    dtype_name: str
    root: int


class HotPath:
    """The hot path of a group (mixed into :class:`~.engine.GroupEngine`, which owns the
    communicators, the flight record, the fingerprint buffer and the wait mode)."""

    def _hot_setup(self) -> None:
        self._prepared: Dict[Tuple[Any, ...], Prepared] = {}
        self._done: Optional[DoneWork] = None
        self._fp_allreduce = self._check.Allreduce
        probe = DoneWork([])
        self._done_refs = _refcount(probe) + 1  # held by self._done and one local name: nobody else's

    def _prepare(self, key: Tuple[Any, ...], name: str, args: Tuple[Any, ...], op: str, dtype: torch.dtype,
                 count: int, root: int, redop: int) -> Prepared:
        """``args``: the MPI call's, positional (mpi4py parses those faster than keywords)."""
        fn, request = self._calls.get(name) or self._bind(name)
        row = hot_vector(0, op, dtype, count, root, redop)[1:]
        prepared = Prepared(partial(fn, *args), request, hash(row), row, op, DTYPE_NAMES[dtype], root)
        if len(self._prepared) >= _CACHE_MAX:
            self._prepared.clear()
        self._prepared[key] = prepared
        return prepared

    # -- the operations --------------------------------------------------------------------
    def _hot_allreduce(self, t: torch.Tensor, op: Any, tensors: List[torch.Tensor]) -> Optional[DoneWork]:
        """All-reduce of one dense contiguous CPU tensor whose dtype and op MPI reduces directly;
        None when it is not such a call (the general path then runs it)."""
        if not (t.is_cpu and t.is_contiguous()):  # sparse COO: not contiguous
            return None
        kind = hash(op)  # a ReduceOp's hash is its kind
        key = (0, t.data_ptr(), t.numel(), t.dtype, kind)
        p = self._prepared.get(key)
        if p is None:
            n, dtype = key[2], key[3]
            fast = fast_types(op, dtype)
            if fast is None or not 0 < n <= CHUNK_ELEMS:
                return None
            mtype, mop, item, kind = fast
            buf = [self._address(key[1], n * item), n, mtype]
            p = self._prepare(key, "Allreduce", (self._in_place, buf, mop), "all_reduce", dtype, n, -1, kind)
        return self._hot_run(p, t, tensors)

    def _hot_broadcast(self, t: torch.Tensor, root: int, tensors: List[torch.Tensor]) -> Optional[DoneWork]:
        if not (t.is_cpu and t.is_contiguous()):  # sparse COO: not contiguous
            return None
        key = (1, t.data_ptr(), t.numel(), t.dtype, root)
        p = self._prepared.get(key)
        if p is None:
            n, dtype = key[2], key[3]
            if not 0 < n <= CHUNK_ELEMS:
                return None
            try:
                mtype = mpi_type(dtype)
            except TypeError:
                return None  # the general path refuses it on every rank
            buf = [self._address(key[1], n * t.element_size()), n, mtype]
            p = self._prepare(key, "Bcast", (buf, root), "broadcast", dtype, n, root, -1)
        return self._hot_run(p, t, tensors)

    def _hot_allgather(self, output: torch.Tensor, input: torch.Tensor) -> Optional[DoneWork]:
        """``all_gather_single``: the input into this rank's slot of the output (in place when it
        is exactly that slot); None when the general path must run it (staging, aliasing)."""
        if not (input.is_cpu and output.is_cpu and input.is_contiguous() and output.is_contiguous()):
            return None
        key = (2, input.data_ptr(), input.numel(), input.dtype, output.data_ptr(), output.numel(), output.dtype)
        p = self._prepared.get(key)
        if p is None:
            i0, n, dtype, o0, total = key[1], key[2], key[3], key[4], key[5]
            if dtype != key[6] or total != n * self._size or not 0 < total <= CHUNK_ELEMS:
                return None
            try:
                mtype = mpi_type(dtype)
            except TypeError:
                return None
            item = input.element_size()
            out = [self._address(o0, total * item), mtype]
            if i0 == o0 + self._me * n * item:  # exactly this rank's slot: MPI_IN_PLACE
                send: Any = self._in_place
            elif not spans_overlap(i0, n * item, o0, total * item):
                send = [self._address(i0, n * item), n, mtype]
            else:
                return None
            p = self._prepare(key, "Allgather", (send, out), "all_gather", dtype, n, -1, -1)
        return self._hot_run(p, input, [output])

    def _hot_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Any) -> Optional[DoneWork]:
        if not (input.is_cpu and output.is_cpu and input.is_contiguous() and output.is_contiguous()):
            return None
        key = (3, input.data_ptr(), input.numel(), input.dtype, output.data_ptr(), output.numel(), output.dtype,
               hash(op))
        p = self._prepared.get(key)
        if p is None:
            i0, total, dtype, o0, n = key[1], key[2], key[3], key[4], key[5]
            fast = fast_types(op, dtype)
            if fast is None or dtype != key[6] or n * self._size != total or not 0 < total <= CHUNK_ELEMS:
                return None
            mtype, mop, item, kind = fast
            if spans_overlap(i0, total * item, o0, n * item):
                return None
            send = [self._address(i0, total * item), mtype]
            recv = [self._address(o0, n * item), n, mtype]
            p = self._prepare(key, "Reduce_scatter_block", (send, recv, mop), "reduce_scatter", dtype, n, -1, kind)
        return self._hot_run(p, input, [output])

    # -- one call --------------------------------------------------------------------------
    def _hot_run(self, p: Prepared, t: torch.Tensor, outputs: List[torch.Tensor]) -> DoneWork:
        """Flight record, deadline, fingerprint agreed before the data call, the call: what
        :meth:`~.engine.GroupEngine._execute` does in the watched mode, for a prepared call.
        :meth:`~hpcsync.observe.watchdog.GroupLog.start` and :func:`~.work.ran` are written out here: at
        4 KiB a function call costs as much as what these do."""
        if self._broken:
            raise dist.DistBackendError(self._broken)
        if self._closed:
            raise RuntimeError("hpcsync backend: process group was shut down")
        with self._issue:  # see GroupEngine.__init__
            log = self._log
            seq = log.seq = log.seq + 1
            rec = OpRecord(seq, p.op, p.dtype_name, t.shape, p.root, _now())
            log.ops.append(rec)
            self._rec = rec
            self._current = (rec, _monotonic() + self._timeout_s, True)
            try:
                if self._fingerprints:
                    fp = (p.rest + seq * SEQ_MIX) & FP_MASK
                    buf = self._fp
                    buf[0] = fp
                    buf[1] = -fp
                    self._fp_allreduce(self._in_place, self._fp_spec, self._max)
                    if buf[0] != -buf[1]:
                        self._agree(rec, [seq, *p.row], in_flight=False)
                if p.request:
                    p.call().Wait()
                else:
                    p.call()
            except BaseException as exc:  # surfaced by wait()
                if rec.error is None:
                    rec.error = f"{type(exc).__name__}: {exc}"
                return DoneWork(outputs, exc)
            now = _now()
            WAITED[0] += now - rec.started
            rec.finished = now
        # torch's blocking API waits on the Work and drops it, so the previous one is reused when
        # nobody else holds it (its reference count says so): a fresh torch Work costs more than
        # the rest of this path's Python
        w = self._done
        if w is not None and _refcount(w) == self._done_refs:
            w._outputs = outputs
            w._future = None
            return w
        w = self._done = DoneWork(outputs)
        return w
