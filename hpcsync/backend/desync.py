"""What every rank must agree on for each collective, as integers, and how to explain a mismatch.

An operation is described by a :class:`Call`; :func:`describe` turns it into one row of integers
(:data:`FIELDS`), the same on every rank exactly when the ranks' MPI calls match: the operation,
dtype, element count, root, reduce op, layout (dense or sparse), the number of tensors and a
checksum of every tensor's dtype and size (multi-tensor calls), and whether this rank's own
arguments are invalid (such a rank joins the agreement instead of raising alone, so every rank
fails at once).
"""
from __future__ import annotations

import os
import time
import zlib
from array import array
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..core import mpi, jobend, nodemap, settings
from ..core.errors import ranks_by_value
from ..core.serial import nap

__all__ = [
    "DTYPE_NAMES", "DTYPE_IDS", "OP_IDS", "FP_MASK", "SEQ_MIX", "FIELDS", "Call", "redop_id", "describe",
    "explain_row", "debug_mode", "fingerprint", "hot_vector", "Agreement"
]

_OP_IDS = {name: k for k, name in enumerate((
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_coalesced", "gather",
    "scatter", "reduce_scatter", "reduce_scatter_coalesced", "all_to_all", "barrier"))}
_OP_NAMES = {k: name for name, k in _OP_IDS.items()}
_DTYPE = type(torch.float32)  # torch.dtype; spelt so, it is a class where the docs' build mocks torch (docs/conf.py)
_DTYPE_IDS = {name: zlib.crc32(name.encode()) for name in sorted(
    {str(v).replace("torch.", "") for v in vars(torch).values() if isinstance(v, _DTYPE)})}
DTYPE_NAMES = {v: str(v).replace("torch.", "") for v in vars(torch).values() if isinstance(v, _DTYPE)}
DTYPE_IDS = {v: _DTYPE_IDS[name] for v, name in DTYPE_NAMES.items()}  # by torch dtype: the hot path
OP_IDS = _OP_IDS
_REDOP_NAMES = {int(v): name for name, v in dist.ReduceOp.RedOpType.__members__.items()}

FP_MASK = 0x3FFFFFFFFFFFFFFF  # a fingerprint and its negation both fit an int64
SEQ_MIX = 0x9E3779B97F4A7C15  # odd: two sequence numbers of one description never share a fingerprint

FIELDS = ("seq", "op", "dtype", "count", "root", "redop", "sparse", "tensors", "shapes", "invalid")


class Call(NamedTuple):
    """One operation as the engine runs it: ``t`` names the dtype and count (``count`` >= 0
    overrides its element count), ``redop`` the reduce op's kind (-1: none), ``tensors`` every
    tensor of a multi-tensor call, ``invalid`` this rank's own argument error."""

    op: str
    t: Optional[torch.Tensor]
    root: int = -1
    redop: int = -1
    count: int = -1
    tensors: Sequence[torch.Tensor] = ()
    invalid: Optional[BaseException] = None
    counts: Optional[Tuple[List[int], List[int]]] = None  # all-to-all: elements sent to / received from each rank


def redop_id(op: Any) -> int:
    """The reduce op's kind as an int (a ReduceOp's hash is its kind; PREMUL_SUM's too)."""
    return hash(op)


def describe(rec: Any, call: Call) -> List[int]:
    """What every rank must agree on, as the integers of :data:`FIELDS` (all-to-all: counts may differ)."""
    t, ts = call.t, call.tensors
    dtype = DTYPE_IDS.get(t.dtype, 0) if t is not None else -1
    a2a = call.op == "all_to_all"
    count = -1 if a2a or t is None else (call.count if call.count >= 0 else t.numel())
    sparse = int(t.is_sparse) if t is not None else 0
    n = len(ts) if ts else int(t is not None)
    shapes = 0
    if len(ts) > 1 and not a2a:
        shapes = zlib.crc32(";".join(f"{DTYPE_NAMES[x.dtype]}:{x.numel()}:{int(x.is_sparse)}" for x in ts).encode())
    return [rec.seq, _OP_IDS[call.op], dtype, count, call.root, call.redop, sparse, n, shapes,
            int(call.invalid is not None)]


def explain_row(row: Tuple[int, ...]) -> str:
    seq, op, dtype, count, root, redop, sparse, n, shapes, invalid = row
    names = {v: k for k, v in _DTYPE_IDS.items()}
    return "".join((
        f"#{seq} {_OP_NAMES.get(op, op)} dtype={names.get(dtype, '-')} count={count if count >= 0 else '-'}",
        f" op={_REDOP_NAMES.get(redop, redop)}" if redop >= 0 else "",
        f" root={root}" if root >= 0 else "",
        " sparse" if sparse else "",
        f" tensors={n}" if n > 1 else "",
        f" sizes={shapes:08x}" if shapes else "",
        " invalid arguments (its own error says why)" if invalid else ""))


def debug_mode() -> bool:
    """Full pre-agreement of every collective: ``HPCSYNC_DEBUG=1`` or torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``."""
    return (settings.flag("HPCSYNC_DEBUG")
            or os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL")


def fingerprint(vec: Sequence[int]) -> int:
    """The 62-bit fingerprint of a description: the hash of its fields after the sequence number,
    mixed with that number (the hot path keeps the first part per buffer and adds the second)."""
    return (hash(tuple(vec[1:])) + vec[0] * SEQ_MIX) & FP_MASK


def hot_vector(seq: int, op: str, dtype: torch.dtype, count: int, root: int, redop: int) -> Tuple[int, ...]:
    """:func:`describe`'s row for one dense tensor (the hot path builds the same tuple inline)."""
    return (seq, OP_IDS[op], DTYPE_IDS[dtype], count, root, redop, 0, 1, 0, 0)


class Agreement:
    """The agreement half of a group (mixed into :class:`~.engine.GroupEngine`, which owns the
    ``_check`` communicator, ``_fp`` and the flight record): what the ranks agree on when the
    group is created and before each collective, and the same error on every rank when they do not."""

    def _agree_mode(self) -> bool:
        """Agree at creation on what decides which MPI calls each rank makes: the wait mode (the
        MIN over the ranks of "a timeout ends the job") and, exactly, the desync check and the
        debug mode (ranks that differ would make different MPI calls and hang). A rank that
        differs gets the same ``ValueError`` as every other, naming the ranks."""
        mine = array("q", [int(self._threads_ok and jobend.abort_on_error()), int(self._fingerprints),
                           int(self._debug)])
        size = self._check.Get_size()
        every = array("q", bytes(8 * len(mine) * size))
        self._bounded(self._check.Iallgather([mine, self._int64], [every, self._int64]), "creating the group")
        rows = [tuple(every[r * len(mine):(r + 1) * len(mine)]) for r in range(size)]
        for col, name in ((1, "HPCSYNC_DESYNC_CHECK"), (2, "HPCSYNC_DEBUG (or TORCH_DISTRIBUTED_DEBUG=DETAIL)")):
            values = ranks_by_value([row[col] for row in rows], self._log.ranks)
            if len(values) > 1:
                said = "; ".join(f"rank(s) {nodemap.describe(rs)}: {'on' if v else 'off'}" for v, rs in values.items())
                raise ValueError(f"hpcsync backend: {name} differs between the ranks of group {self._log.name!r} "
                                 f"({said}); it decides which MPI calls a rank makes: set it the same on every rank")
        return bool(min(row[0] for row in rows))

    def _dup(self, comm: Any) -> Any:
        """``comm.Idup()``, waited for at most the group's timeout."""
        dup, req = comm.Idup()
        self._bounded(req, "creating the group")
        return dup

    def _bounded(self, req: Any, what: str) -> None:
        """Wait for a request of the group's own set-up, at most the group's timeout."""
        until = time.monotonic() + self._timeout_s
        while not req.Test():
            if time.monotonic() > until:
                raise dist.DistBackendError(f"hpcsync backend: {what} {self._log.name!r} timed out after "
                                            f"{self._timeout_s:g}s: not every rank of the group joined")
            nap(self._serial, 0.001)

    def _fingerprint(self, vec: List[int], beside: bool) -> Any:
        """``Allreduce(MAX)`` of ``[fp, -fp]`` (fp: the hash of ``vec``) on the group's check
        communicator: blocking, or (``beside``) started and its request returned. Afterwards
        :attr:`_fp_differs` says whether the ranks disagree (max != -min)."""
        fp = fingerprint(vec)
        buf = self._fp
        buf[0], buf[1] = fp, -fp
        if beside:
            return self._check.Iallreduce(self._in_place, [buf, self._int64], op=self._max)
        self._check.Allreduce(self._in_place, [buf, self._int64], op=self._max)
        return None

    def _check_counts(self, rec: Any, send: List[int], recv: List[int]) -> None:
        """All-to-all: what each rank sends to another must be what that one expects from it. One
        ``Allreduce(SUM)``: each rank adds a 32-bit hash of (itself, peer, count) for each send
        and subtracts one of (peer, itself, count) for each receive; the total is 0 exactly when
        the two sides agree (but for a 2**-32 chance). If not, every rank raises the same error,
        naming the pairs, before MPI sees the buffers."""
        me = self._check.Get_rank()
        bal = array("q", [sum(hash((me, b, c)) & 0xFFFFFFFF for b, c in enumerate(send))
                          - sum(hash((b, me, c)) & 0xFFFFFFFF for b, c in enumerate(recv))])
        self._wait(self._check.Iallreduce(self._in_place, [bal, self._int64], op=mpi.MPI().SUM))
        if bal[0] == 0:
            return
        size = len(send)
        mine = array("q", list(send) + list(recv))
        every = array("q", bytes(8 * 2 * size * size))
        self._wait(self._check.Iallgather([mine, self._int64], [every, self._int64]))
        sends = [every[a * 2 * size:a * 2 * size + size] for a in range(size)]
        recvs = [every[a * 2 * size + size:(a + 1) * 2 * size] for a in range(size)]
        ranks = self._log.ranks
        bad = [f"rank {ranks[a]} sends {sends[a][b]} to rank {ranks[b]}, which expects {recvs[b][a]}"
               for a in range(size) for b in range(size) if sends[a][b] != recvs[b][a]]
        rec.error = "desync"
        raise dist.DistBackendError(
            f"hpcsync backend: all_to_all #{rec.seq} of group {self._log.name!r}: split sizes do not match "
            f"between ranks ({'; '.join(bad[:4])}{f'; and {len(bad) - 4} more' if len(bad) > 4 else ''}). "
            "What a rank sends to another must be what that one expects from it.")

    def _refuse(self, rec: Any, vec: List[int], invalid: BaseException) -> None:
        """This rank's arguments are invalid: make the same agreement the other ranks make (so
        they raise at once, naming this rank), then raise this rank's own error. In the polled
        mode the others' operation is already in flight: the group is broken on every rank."""
        rec.error = f"invalid arguments: {invalid}"
        try:
            if self._debug:
                self._agree(rec, vec, in_flight=not self._watched)
            elif self._fingerprints:
                req = self._fingerprint(vec, beside=not self._watched)
                if req is not None:  # the polled mode's call, waited for here: nothing travels beside it
                    self._fp_req = None
                    self._wait(req)
                if self._fp_differs:
                    self._agree(rec, vec, in_flight=not self._watched)
        except dist.DistBackendError as mismatch:
            raise invalid from mismatch
        raise invalid

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
        detail = "; ".join(f"rank(s) {nodemap.describe(rs)}: {explain_row(row)}" for row, rs in groups.items())
        raise dist.DistBackendError(
            f"hpcsync backend: collective mismatch (desync) at operation #{rec.seq} of group "
            f"{self._log.name!r}: {detail}. Every rank must call the same collectives in the same order "
            "with matching dtype, size and root.") from from_exc

