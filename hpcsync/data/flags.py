"""The failure flags of a ``SyncedFile`` block, and the parts its ``open()`` gave.

A rank that leaves a block with an exception that ends the job posts its flag (one byte in an
``Iallreduce`` on a private communicator made when the block was entered) and does not wait:
where the program catches the exception, the other ranks find the flag at the block's end and
raise ``SyncError`` in seconds; a flag still in flight at exit is abandoned (the job then ends
with ``MPI_Abort``). The parts a block opened are flushed before this rank aborts, or when
another rank asks it to (:func:`hpcsync.core.jobend.before_abort`).
"""
from __future__ import annotations

import weakref
from typing import Any, List, Optional, Tuple

from ..core import bounded, jobend
from ..core.errors import CollectiveTimeout, SyncTimeout

__all__ = ["make", "vectors", "post_failed", "track", "flush_open"]

_open_parts: "weakref.WeakSet[Any]" = weakref.WeakSet()  # the parts SyncedFile.open() gave, while open
_posted: List[Tuple[Any, ...]] = []  # failure flags posted without waiting: (request, buffers, communicator)


def make(what: str, timeout: float) -> Optional[Any]:
    """Where an exception ends the job (hpcsync's hook, the policy on, several ranks under MPI):
    a private communicator, made now (collective, bounded by ``timeout``), on which a failing
    rank can post its flag at the block's end without waiting; None otherwise. Its cost per block:
    one Idup here and one Comm_free at the end (O(log N) rounds each) besides the flags'
    Allreduce of N bytes."""
    if not jobend.exception_ends_job(Exception):
        return None
    from ..core import mpi

    flags = bounded.own(mpi.MPI().COMM_WORLD, f"{what}: the ranks' failure flags", timeout)
    try:
        flags.raw()  # the duplicate, made by every rank together
    except CollectiveTimeout as exc:
        raise SyncTimeout(f"{what}: not every rank made it: {exc}") from None
    return flags


def vectors(flags: Any, failed: bool) -> Tuple[Any, Any]:
    """The MAX-reduced flags, one byte per rank (N bytes at N ranks: one Iallreduce, O(log N)
    rounds, the same on every rank): this rank's send buffer and the receive buffer, as mpi4py
    buffer specifications."""
    import numpy as np

    from ..core import mpi

    send = np.zeros(flags.Get_size(), dtype=np.int8)
    send[flags.Get_rank()] = int(failed)
    return [send, mpi.MPI().INT8_T], [np.zeros_like(send), mpi.MPI().INT8_T]


def post_failed(flags: Any) -> None:
    """This rank's flag, posted and left in flight: the others complete it at the block's end
    (every one raises SyncError in seconds if the program catches this rank's exception), or the
    job ends on the exception first. Still in flight at exit: abandoned (the job ends with MPI_Abort)."""
    from ..core import mpi

    raw = flags.raw()
    send, recv = vectors(flags, True)
    req = raw.Iallreduce(send, recv, op=mpi.MPI().MAX)
    if not _posted:
        jobend.at_exit("torch", _abandon_posted)
    _posted.append((req, send, recv, raw))


def _abandon_posted() -> None:
    for req, *keep in _posted:
        if not req.Test():
            bounded.abandon("SyncedFile: a failed rank's flag was never matched by the other ranks", req, keep)
    _posted.clear()


def track(f: Any) -> None:
    """A part's file object, flushed by :func:`flush_open` while it is open."""
    _open_parts.add(f)


def flush_open() -> None:
    """Before this rank aborts, or another rank asks it to, and when a block is left with an
    exception: what the program wrote to its parts."""
    for f in list(_open_parts):
        if not f.closed:
            try:
                f.flush()
            except (OSError, ValueError):  # (a full disk: the abort matters more)
                pass


jobend.before_abort(flush_open)
