"""Variable-length byte collectives that work past 2 GiB and keep memory bounded.

MPI counts and displacements are C ``int``: one call moves less than 2 GiB. These helpers move
any size in *rounds*: every rank knows every rank's size, so all of them compute the same
schedule (each round gives each rank with data left an equal share of ``round_bytes``), and each
round is one ``Gatherv`` / ``Allgatherv`` of variable-length byte buffers -- no padding to the
largest rank. The receiving side holds at most one round (plus whatever it keeps).
"""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .errors import ranks_by_value
from .worker import Stalled, Worker
from .worker import result as worker_result

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

    from .protocols import BufferComm

__all__ = [
    "INT_MAX", "DEFAULT_ROUND_BYTES", "Fill", "schedule", "allgather_sizes", "check_root", "agree_root", "iter_gatherv",
    "iter_gatherv_rounds", "gatherv_bytes", "allgatherv_bytes", "bcast_bytes"
]

INT_MAX = 2**31 - 1
DEFAULT_ROUND_BYTES = 256 * 2**20

# fill(view, offset): write len(view) bytes of this rank's data, starting at offset, into view.
Fill = Callable[[memoryview, int], None]


def schedule(sizes: Sequence[int], round_bytes: int = DEFAULT_ROUND_BYTES) -> Iterator[List[int]]:
    """Per-round counts: each round splits ``round_bytes`` among the ranks with data left."""
    budget = max(1, min(int(round_bytes), INT_MAX))
    left = [int(s) for s in sizes]
    while any(left):
        active = [i for i, n in enumerate(left) if n > 0]
        share = max(1, budget // len(active))
        counts = [min(n, share) for n in left]
        # Hand what a small rank left unused to the others, so few rounds are wasted.
        spare = budget - sum(counts)
        for i in active:
            if spare <= 0:
                break
            extra = min(left[i] - counts[i], spare)
            counts[i] += extra
            spare -= extra
        for i, c in enumerate(counts):
            left[i] -= c
        yield counts


def _displs(counts: Sequence[int]) -> List[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


NO_ROOT = -(2**62)  # what a header says for a collective without a root (any int a caller may give is checked)
NO_CALL = -1  # what a header says for an exchange that names no call


def allgather_sizes(comm: BufferComm, nbytes: int, root: Optional[int] = None,
                    call: Optional[enum.IntEnum] = None) -> List[int]:
    """Every rank's byte count, from one Allgather of a header ``[nbytes, root, call]`` per rank.

    With ``root``, also check that every rank names the same root (ranks that disagree would each
    think they are the root: silent wrong data) and that it is a rank of ``comm``. With ``call``
    (which of the caller's operations this rank is in: :class:`hpcsync.core.comm.Helper`), also
    check that every rank is in the same one: a caller whose every operation starts with this
    header finds ranks in different operations here, before anything pairs up wrongly. Each check
    is a ValueError on every rank (they all see every header), at no extra cost.

    Cost: one Allgather (O(log N) rounds); every rank receives 24 bytes per rank (24 KB at 1,000
    ranks). :func:`bcast_bytes` with a ``call`` pays that instead of a 16-byte Allreduce and an
    8-byte Bcast: the price of finding ranks in different calls at the first collective."""
    mine = [int(nbytes), NO_ROOT if root is None else int(root), NO_CALL if call is None else int(call)]
    size = comm.Get_size()
    if not hasattr(comm, "Allgather"):  # TorchComm: no buffer collectives
        heads = [tuple(int(x) for x in p) for p in comm.allgather(mine)]
    else:
        from mpi4py import MPI

        flat = np.zeros(3 * size, dtype=np.int64)
        comm.Allgather([np.array(mine, dtype=np.int64), MPI.INT64_T], [flat, MPI.INT64_T])
        heads = [(int(flat[3 * r]), int(flat[3 * r + 1]), int(flat[3 * r + 2])) for r in range(size)]
    _same_call([c for _, _, c in heads], call)
    where = f" in {call}" if call is not None else ""
    _same_root([r for _, r, _ in heads], where)
    if root is not None:
        check_root(root, size, where)
    return [n for n, _, _ in heads]


def check_root(root: int, size: int, where: str = "") -> None:
    """A ValueError unless ``root`` is a rank of a communicator of ``size`` ranks (``where``: the
    call, for the message). Every rank asks it of the same root (after :func:`allgather_sizes`'s
    check that they name one, or in one process)."""
    if not 0 <= root < size:
        ranks = "1 rank: 0" if size == 1 else f"{size} ranks: 0 to {size - 1}"
        raise ValueError(f"root {root} is not a rank of the communicator ({ranks}){where}: every rank named it")


def _call_name(call: Optional[enum.IntEnum], value: int) -> str:
    if value == NO_CALL:
        return "an exchange that names no call"
    try:
        return str(type(call)(value)) if call is not None else f"call {value}"
    except ValueError:
        return f"call {value}"


def _same_call(calls: Sequence[int], call: Optional[enum.IntEnum]) -> None:
    by = ranks_by_value(calls)
    if len(by) > 1:
        raise ValueError("ranks are in different calls (desync): "
                         + "; ".join(f"rank(s) {ranks} in {_call_name(call, c)}" for c, ranks in by.items()))


def _same_root(roots: Sequence[int], where: str = "") -> None:
    by = ranks_by_value(roots)
    if len(by) > 1:
        raise ValueError(f"ranks disagree on the root of a collective (desync){where}: "
                         + "; ".join(f"rank(s) {ranks} say " + ("no root" if r == NO_ROOT else f"root {r}")
                                     for r, ranks in by.items()))


def agree_root(comm: BufferComm, root: int) -> None:
    """Check (one 16-byte allreduce) that every rank names the same ``root``; ValueError on all if not."""
    from mpi4py import MPI

    mm = np.array([root, -root], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, [mm, MPI.INT64_T], op=MPI.MAX)
    if mm[0] != -mm[1]:
        _same_root(comm.allgather(root))


def _from_buffer(data: ReadableBuffer) -> Tuple[int, Fill]:
    mv = memoryview(data).cast("B")

    def fill(view: memoryview, offset: int) -> None:
        view[:] = mv[offset: offset + len(view)]

    return len(mv), fill


def iter_gatherv(
    comm: BufferComm,
    sizes: Sequence[int],
    fill: Fill,
    root: int = 0,
    round_bytes: int = DEFAULT_ROUND_BYTES,
    direct: Optional[memoryview] = None,
) -> Iterator[Tuple[int, int, memoryview]]:
    """Gather every rank's bytes to ``root`` in rounds.

    Yields ``(rank, offset, chunk)`` on the root, in rank order within each round (chunk is
    only valid until the next item); yields nothing elsewhere. ``direct`` is this rank's data
    as a buffer (sent without a copy); otherwise ``fill`` supplies it round by round.
    """
    for chunks in iter_gatherv_rounds(comm, sizes, fill, root, round_bytes, direct):
        yield from chunks


def iter_gatherv_rounds(
    comm: BufferComm,
    sizes: Sequence[int],
    fill: Fill,
    root: int = 0,
    round_bytes: int = DEFAULT_ROUND_BYTES,
    direct: Optional[memoryview] = None,
    pipeline: bool = False,
    read_timeout: Optional[float] = None,
    stalled: Optional[Callable[[float], None]] = None,
) -> Iterator[List[Tuple[int, int, memoryview]]]:
    """Like :func:`iter_gatherv`, one list of ``(rank, offset, chunk)`` per round (root only).

    ``pipeline=True`` overlaps the stages: senders fill round k+1 from a helper thread while
    round k is in flight, and the root receives into two alternating buffers of half the budget
    each (memory stays within ``round_bytes``). A round's chunks then stay valid until the
    generator is resumed *twice*, so the root can write round k while round k+1 arrives. A fill
    that takes longer than ``read_timeout`` seconds (a stuck disk) is left behind: ``stalled``
    is told, and this rank sends zeros in the rounds that remain (so no rank waits for it; the
    caller fails the merge).
    """
    me, is_root = comm.Get_rank(), comm.Get_rank() == root
    if not hasattr(comm, "Gatherv"):  # TorchComm: the same rounds, as pickled objects (always fresh)
        yield from _object_rounds(comm, sizes, fill, root, round_bytes, direct)
        return
    from mpi4py import MPI

    nbuf = 2 if pipeline else 1
    rounds = list(schedule(sizes, max(1, round_bytes // nbuf)))
    starts, sent = [], [0] * len(sizes)
    for counts in rounds:
        starts.append(list(sent))
        for r, c in enumerate(counts):
            sent[r] += c
    mine_max = max((c[me] for c in rounds), default=0)
    recv_max = max((sum(c) for c in rounds), default=0)
    # Allocated on first use: a one-round merge never touches the second buffer's pages.
    bounces: List[Optional[bytearray]] = [None] * nbuf
    recvs: List[Optional[bytearray]] = [None] * nbuf
    pool = None
    if pipeline and direct is None and mine_max:
        pool = Worker("hpcsync-read")

    def payload(k: int) -> memoryview:
        n, off = rounds[k][me], starts[k][me]
        if direct is not None:
            return direct[off: off + n]
        if bounces[k % nbuf] is None:
            bounces[k % nbuf] = bytearray(mine_max)
        view = memoryview(bounces[k % nbuf])[:n]  # type: ignore[arg-type]
        if n:
            fill(view, off)
        return view

    try:
        ahead = pool.submit(payload, 0) if pool is not None and rounds else None
        for k, counts in enumerate(rounds):
            if ahead is None:
                view = payload(k)
            else:
                try:
                    view = worker_result(ahead, read_timeout, lambda: "a read")
                except Stalled:
                    if stalled is not None:
                        stalled(read_timeout)  # type: ignore[arg-type]
                    pool.shutdown()  # type: ignore[union-attr]
                    pool, ahead, fill = None, None, _zeros
                    bounces = [None] * nbuf  # the stuck read may still write into the old ones
                    view = payload(k)
            if pool is not None and k + 1 < len(rounds):
                ahead = pool.submit(payload, k + 1)  # read the next round while this one travels
            sendbuf = [view, counts[me], MPI.BYTE]
            if is_root:
                displs = _displs(counts)
                recv = recvs[k % nbuf]
                if recv is None:
                    recv = recvs[k % nbuf] = bytearray(recv_max)
                comm.Gatherv(sendbuf, [recv, counts, displs, MPI.BYTE], root=root)
                rv = memoryview(recv)
                yield [(r, starts[k][r], rv[d: d + c]) for r, (c, d) in enumerate(zip(counts, displs)) if c]
            else:
                comm.Gatherv(sendbuf, None, root=root)
    finally:
        if pool is not None:
            pool.shutdown()


def _zeros(view: memoryview, offset: int) -> None:
    """What a rank whose reads stalled sends: zeros (its error fails the merge)."""
    view[:] = bytes(len(view))


def _object_rounds(comm: BufferComm, sizes: Sequence[int], fill: Fill, root: int, round_bytes: int,
                   direct: Optional[memoryview]) -> Iterator[List[Tuple[int, int, memoryview]]]:
    me, is_root = comm.Get_rank(), comm.Get_rank() == root
    sent = [0] * len(sizes)
    for counts in schedule(sizes, round_bytes):
        view = memoryview(bytearray(counts[me]))
        if counts[me] and direct is None:
            fill(view, sent[me])
        elif counts[me] and direct is not None:
            view[:] = direct[sent[me]:sent[me] + counts[me]]
        chunks = comm.gather(bytes(view), root=root)
        if is_root and chunks is not None:  # (the root's is a list)
            yield [(r, sent[r], memoryview(c)) for r, c in enumerate(chunks) if c]
        for r, c in enumerate(counts):
            sent[r] += c


def gatherv_bytes(comm: BufferComm, data: ReadableBuffer, root: int = 0, round_bytes: int = DEFAULT_ROUND_BYTES,
                  call: Optional[enum.IntEnum] = None) -> Optional[List[bytearray]]:
    """Gather one bytes-like object per rank to ``root``; returns the list there, None elsewhere.
    ``call``: as for :func:`allgather_sizes`, whose header is the first collective."""
    n, fill = _from_buffer(data)
    sizes = allgather_sizes(comm, n, root=root, call=call)
    out = [bytearray(s) for s in sizes] if comm.Get_rank() == root else None
    for r, off, chunk in iter_gatherv(comm, sizes, fill, root, round_bytes, direct=memoryview(data).cast("B")):
        out[r][off: off + len(chunk)] = chunk  # type: ignore[index]
    return out


def allgatherv_bytes(comm: BufferComm, data: ReadableBuffer, round_bytes: int = DEFAULT_ROUND_BYTES,
                     call: Optional[enum.IntEnum] = None) -> List[bytearray]:
    """Every rank gets every rank's bytes-like object, in rank order. ``call``: as for
    :func:`allgather_sizes`, whose header is the first collective."""
    from mpi4py import MPI

    mv = memoryview(data).cast("B")
    sizes = allgather_sizes(comm, len(mv), call=call)
    out = [bytearray(s) for s in sizes]
    me = comm.Get_rank()
    sent = [0] * len(sizes)
    recv = bytearray(0)
    for counts in schedule(sizes, round_bytes):
        total = sum(counts)
        if len(recv) < total:
            recv = bytearray(total)
        displs = _displs(counts)
        comm.Allgatherv([mv[sent[me]: sent[me] + counts[me]], counts[me], MPI.BYTE],
                        [recv, counts, displs, MPI.BYTE])
        for r, (c, d) in enumerate(zip(counts, displs)):
            if c:
                out[r][sent[r]: sent[r] + c] = recv[d: d + c]
            sent[r] += c
    return out


def bcast_bytes(comm: BufferComm, data: Any = None, root: int = 0, round_bytes: int = 1 << 30,
                call: Optional[enum.IntEnum] = None) -> memoryview:
    """Broadcast a bytes-like object of any size from ``root``.

    Without ``call``, the root is checked with :func:`agree_root` and its size broadcast. With
    it, the first collective is :func:`allgather_sizes`'s header instead (the same Allgather as
    every other call that names one, so ranks in different calls are found; the root's size
    travels in it)."""
    from mpi4py import MPI

    is_root = comm.Get_rank() == root
    if call is None:
        agree_root(comm, root)
        n = np.array([len(memoryview(data).cast("B")) if is_root else 0], dtype=np.int64)
        comm.Bcast([n, MPI.INT64_T], root=root)
        size = int(n[0])
    else:
        size = allgather_sizes(comm, len(memoryview(data).cast("B")) if is_root else 0, root=root, call=call)[root]
    mv = memoryview(data).cast("B") if is_root else memoryview(bytearray(size))
    step = max(1, min(round_bytes, INT_MAX))
    for off in range(0, size, step):
        c = min(step, size - off)
        comm.Bcast([mv[off: off + c], c, MPI.BYTE], root=root)
    return mv
