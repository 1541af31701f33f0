"""Moving the bytes across nodes: pipelined broadcast rounds among node leaders, read once by the
root, each round's pieces checked (CRC-32) and written by every leader for its node."""
from __future__ import annotations

import logging
import os
import socket
import time
import zlib
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ...core import mpi
from ...core.worker import Stalled, Worker
from ...core.worker import result as worker_result
from ...observe.progress import Progress
from .destination import Destination
from .fileops import source_changed
from .listing import FILE, Entry, Piece, chunks, trailer_at

__all__ = ["broadcast", "round_bytes", "close_bar", "unexpected", "Reader"]

log = logging.getLogger(__name__)


def broadcast(leaders: Any, todo: List[Tuple[int, int]], chunk_bytes: int, reader: Optional["Reader"],
              node: "Destination", bar: Optional[Progress], local_s: Optional[float] = None,
              beat: Optional[Callable[[], None]] = None) -> int:
    """The pipelined transfer among node leaders; returns the number of broadcast rounds.

    Nothing raised on a leader, here or in its threads, leaves another waiting in a broadcast: an
    error of a writer thread is its node's (:meth:`Destination.note`; the leader still takes part
    in every round), one of the root's reader thread or of its own loop ends the transfer for all
    (:meth:`Reader.stop`: one more round goes out, flagged as the last). Either reaches every rank
    as the stage's error. A reader or writer thread that makes no progress for ``local_s``
    seconds (a stuck source or disk) is left behind the same way: its node's error, or the end
    of the transfer, naming the file (``local_s`` is a quarter of the rounds' timeout: the root
    may wait for a read, then a write, then the writes under way, and still post its round
    before the others' wait ends). ``leaders`` bounds each round by its own timeout (a
    :class:`~hpcsync.core.bounded.BoundedComm`); ``beat`` tells the node's other ranks of each
    round."""
    MPI = mpi.MPI()
    plan = list(chunks(todo, chunk_bytes))
    if not plan:
        return 0
    pipe = _Pipeline(plan, reader, node, local_s)
    phase = getattr(leaders, "what", "")
    try:
        ok = np.array([1 if pipe.allocate() else 0], dtype=np.int64)
        leaders.Allreduce(MPI.IN_PLACE, [ok, MPI.INT64_T], op=MPI.MIN)
        if not ok[0]:  # a leader without them: none starts
            return 0
        for k, pieces in enumerate(plan):
            buf, n = pipe.take(k), round_bytes(pieces)
            if hasattr(leaders, "what"):
                leaders.what = f"{phase}: broadcast round {k + 1} of {len(plan)} ({_files(node.entries, pieces)})"
            leaders.Bcast([buf, n, MPI.BYTE], root=0)
            if beat is not None:
                beat()
            if _flag(buf, n)[0]:  # the root stopped: nothing more comes
                pipe.stopped()
                return k + 1
            pipe.write(k, buf)
            if bar is not None:
                try:
                    bar.update(sum(p[2] for p in pieces))
                except Exception as exc:  # (stderr gone): an error like any other, the next round is the last
                    reader.stop(unexpected(exc))  # type: ignore[union-attr]
                    bar = None
    except BaseException:  # a round timed out (a leader stopped): the files begun here are dropped
        pipe.stopped()
        raise
    finally:
        pipe.close()
        if hasattr(leaders, "what"):
            leaders.what = phase
    return len(plan)


def _left(end: Optional[float]) -> Optional[float]:
    """Seconds left until ``end`` (None: no end), at least a millisecond."""
    return None if end is None else max(0.001, end - time.monotonic())


def _files(entries: List[Entry], pieces: Sequence[Piece]) -> str:
    """A round's files, for an error: the first and the last."""
    first, last = entries[pieces[0][0]].rel, entries[pieces[-1][0]].rel
    return first if first == last else f"{len(pieces)} pieces, {first} ... {last}"


def round_bytes(pieces: Sequence[Piece]) -> int:
    """The bytes of a broadcast round: the data, a CRC and a flag per piece, the round's flag (1:
    the root stopped, this round is the last and carries nothing)."""
    return trailer_at(pieces) + 16 * len(pieces) + 8


def _flag(buf: Any, n: int) -> Any:
    return np.frombuffer(buf, dtype=np.int64, count=1, offset=n - 8)


class _Pipeline:
    """A leader's three round buffers, its writer thread and, on the root, its reader thread.
    Nothing here raises: an error is the node's (the writer's) or stops the root's reader. A
    thread stuck for ``local_s`` seconds is left behind with the buffers it may still touch:
    the rounds that remain use fresh ones (two, for the root's read-ahead) and write nothing."""

    def __init__(self, plan: List[List[Piece]], reader: Optional["Reader"], node: "Destination",
                 local_s: Optional[float] = None) -> None:
        self.plan, self.reader, self.node, self.local_s = plan, reader, node, local_s
        self.cap = max(round_bytes(p) for p in plan)
        self.bufs: List[Any] = [None] * 3
        self.reads: Dict[int, Future] = {}
        self.writes: Dict[int, Future] = {}
        self.read_stuck = self.write_stuck = False
        self.read_pool = None if reader is None else Worker("hpcsync-stage-read")
        self.write_pool = Worker("hpcsync-stage-write")

    def allocate(self) -> bool:
        """The round buffers, made before the first round (False: this node's error, noted)."""
        try:
            for k in range(min(3, len(self.plan))):
                self.buffer(k)
            return True
        except Exception as exc:  # MemoryError: up to three times chunk_bytes
            self.node.note(f"cannot allocate the broadcast's buffers ({min(3, len(self.plan))} x {self.cap} bytes): "
                           f"{unexpected(exc)}")
            return False

    def buffer(self, k: int) -> Any:
        """Round ``k``'s buffer, once the round that last used it is written."""
        if k - 3 in self.writes:
            self._wait_write(k - 3)
        bufs = self.bufs
        if bufs[k % len(bufs)] is None:
            bufs[k % len(bufs)] = np.empty(self.cap, dtype=np.uint8)  # no zero-fill: every byte sent is written first
        return bufs[k % len(bufs)]

    def _wait_write(self, k: int, limit: Optional[float] = None) -> None:
        fut = self.writes.pop(k)
        try:
            worker_result(fut, self.local_s if limit is None else limit,
                          lambda: f"writing {self.node.writing_what()} (round {k + 1})")
        except Stalled as exc:
            self.write_stuck = True
            self.node.stall(str(exc))
            self.writes.clear()  # queued behind the stuck one: they find the node stalled and write nothing
            self.bufs = [None, None]  # the old ones may still be read by the stuck thread

    def take(self, k: int) -> Any:
        """Round ``k`` to broadcast: on the root, read from the source (the next round is read while
        this one travels), or flagged as the last once the reader stopped."""
        reader = self.reader
        if reader is None:
            return self.buffer(k)
        try:
            if reader.stopped is None:
                if k == 0:
                    self._read(0)
                buf = worker_result(self.reads.pop(k), self.local_s,
                                    lambda: f"reading {reader.reading} from the source")
                if reader.stopped is None:
                    self._read(k + 1)
                    return buf
        except Stalled as exc:
            self.read_stuck = True
            self.reads.clear()
            self.bufs = [None, None]  # the stuck reader may still write into the old ones
            reader.stop(str(exc))
        except Exception as exc:
            reader.stop(unexpected(exc))
        self.drain()
        buf = self.buffer(k)
        _flag(buf, round_bytes(self.plan[k]))[0] = 1
        return buf

    def _read(self, k: int) -> None:
        if k < len(self.plan):
            self.reads[k] = self.read_pool.submit(self._fill, self.plan[k], self.buffer(k))  # type: ignore[union-attr]

    def _fill(self, pieces: List[Piece], buf: Any) -> Any:
        try:
            self.reader.fill(pieces, buf)  # type: ignore[union-attr]
        except Exception as exc:
            self.reader.stop(unexpected(exc))  # type: ignore[union-attr]
        _flag(buf, round_bytes(pieces))[0] = 0
        return buf

    def write(self, k: int, buf: Any) -> None:
        if self.write_stuck:
            return  # the node's error is noted; the rounds still go by, unwritten
        try:
            self.writes[k] = self.write_pool.submit(self._write, self.plan[k], buf)
        except Exception as exc:
            self.drain()
            self._broken(exc)

    def _write(self, pieces: List[Piece], buf: Any) -> None:
        try:
            self.node.write_round(pieces, buf, self.reader is None)
        except Exception as exc:
            self._broken(exc)

    def _broken(self, exc: Exception) -> None:
        """A round not written whole: the node's error, and every file begun is dropped -- its
        later pieces would complete it around a hole (the root, which takes each checksum from
        the round, would not see it)."""
        self.node.note(unexpected(exc))
        self._drop_begun()

    def drain(self) -> None:
        """Wait for the reads and writes under way, ``local_s`` for all of them together (none
        raises; a stuck one is left behind with the buffers it may still touch)."""
        end = None if self.local_s is None else time.monotonic() + self.local_s
        for k in sorted(self.reads):
            try:
                worker_result(self.reads[k], _left(end),
                              lambda: f"reading {self.reader.reading} from the source")  # type: ignore[union-attr]
            except Stalled as exc:
                self.read_stuck = True
                self.bufs = [None, None]  # the stuck reader may still write into the old ones
                self.reader.stop(str(exc))  # type: ignore[union-attr]
                break
        for k in sorted(self.writes):
            if k in self.writes:
                self._wait_write(k, _left(end))
        self.reads.clear()
        self.writes.clear()

    def stopped(self) -> None:
        """The root stopped the transfer (its error is the stage's): drop the files begun."""
        self.drain()
        self._drop_begun()

    def _drop_begun(self) -> None:
        if self.node.stalled is None:  # (a stalled node's files stay as they are: no more I/O there)
            for idx in list(self.node.fds):
                self.node.fail(idx, None)

    def close(self) -> None:
        self.drain()
        if self.reader is not None and not self.read_stuck:
            self.reader.close()
        if self.read_pool is not None:
            self.read_pool.shutdown()
        self.write_pool.shutdown()


def close_bar(bar: Optional[Progress], node: "Destination") -> None:
    """Close the progress bar; its error (stderr gone) is the node's: every rank still reaches
    what follows."""
    if bar is not None:
        try:
            bar.close()
        except Exception as exc:
            node.note(unexpected(exc))


def unexpected(exc: Exception) -> str:
    """An error no part of the stage expected, as words for the StageError every rank raises
    (its traceback goes to the log of the rank where it happened)."""
    log.error("stage: unexpected error", exc_info=exc)
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return f"{type(exc).__name__}: {exc}"


class Reader:
    """The root's side of the transfer: fills each round's buffer from the source files."""

    def __init__(self, src: str, entries: List[Entry], single: Optional[bool] = None) -> None:
        self.src, self.entries = src, entries
        self.single = (len(entries) == 1 and entries[0].kind == FILE) if single is None else single
        self.fd, self.crc = -1, 0
        self.read_bytes = 0
        self.failed: Dict[Any, str] = {}
        self.stopped: Optional[str] = None
        self.reading = src  # the file being read (for a stall's error)

    @property
    def error(self) -> Optional[str]:
        if not self.failed:
            return None
        first = next(iter(self.failed.values()))
        more = f" (and {len(self.failed) - 1} more file(s))" if len(self.failed) > 1 else ""
        return f"node {socket.gethostname()}: {first}{more}"

    def fail(self, idx: Any, why: str) -> None:
        self.failed.setdefault(idx, why)

    def stop(self, why: str) -> None:
        """An error that no file explains: nothing more is read, the transfer ends (see broadcast)."""
        self.stopped = self.stopped or why
        self.fail(("stop",), why)

    def next_round(self, entries: List[Entry]) -> None:
        """A stage across nodes: the next round of the listing (its file indexes start at 0)."""
        self.entries = entries
        self.failed = {("before", i): why for i, why in enumerate(self.failed.values())}

    def close(self) -> None:
        """Close the file that a stop left open (no read is under way)."""
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1

    def fill(self, pieces: Sequence[Piece], buf: Any) -> Any:
        trailer = np.frombuffer(buf, dtype=np.int64, count=2 * len(pieces), offset=trailer_at(pieces))
        mv, pos = memoryview(buf), 0
        for j, (idx, off, n) in enumerate(pieces):
            e = self.entries[idx]
            view = mv[pos: pos + n]
            ok = idx not in self.failed
            if ok:
                path = self.src if self.single else f"{self.src}/{e.rel}"
                self.reading = path
                try:
                    if off == 0:
                        self.fd, self.crc = os.open(path, os.O_RDONLY | os.O_CLOEXEC), 0
                    got = 0
                    while got < n:
                        k = os.preadv(self.fd, [view[got:]], off + got)
                        if k == 0:
                            raise OSError(0, f"{path} shrank while being staged")
                        got += k
                    self.read_bytes += n
                    self.crc = zlib.crc32(view, self.crc)
                    if off + n == e.size:
                        why = source_changed(self.fd, e)
                        if why:
                            raise OSError(0, why)
                except OSError as exc:
                    self.fail(idx, exc.strerror if exc.errno == 0 else f"reading {path}: {exc.strerror}")
                    ok = False
            if not ok:
                np.frombuffer(view, dtype=np.uint8)[:] = 0
            if self.fd >= 0 and (off + n == e.size or not ok):
                os.close(self.fd)
                self.fd = -1
            trailer[2 * j], trailer[2 * j + 1] = (self.crc, 0) if ok else (0, 1)
            pos += n
        return buf
