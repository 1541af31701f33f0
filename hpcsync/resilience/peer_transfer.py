"""Files and byte ranges between ranks over MPI, every exchange bounded by its progress.

Node-local checkpoints use it twice: on save a rank's files go to a peer on another node
(:func:`send_files`), and on load each rank fetches the byte ranges it reads from a rank whose
node holds them (:func:`fetch`). The messages are point-to-point on hpcsync's private control
communicator (they never match the program's own), in chunks of at most :data:`CHUNK` bytes (MPI's
counts are C ints), and every stream of a rank progresses at once, so a ring of ranks that each
send and receive cannot deadlock.

**Bounded.** An exchange ends with :class:`~hpcsync.core.errors.CollectiveTimeout` when none of
its messages completed for ``timeout`` seconds plus a chunk's time at
``HPCSYNC_CHECKPOINT_MBPS``, naming the ranks and nodes it still waited for: a deadline per chunk,
not per job, so a large copy is never a false timeout. A rank's own file I/O (open, read, write,
flush, close) runs on a worker thread of its own (:class:`Disk`), each call waited for at most a
quarter of the timeout plus a chunk's time: a node-local disk that stops answering is that
rank's error, naming the rank, its node, the file and the phase (save or load), raised before
its peers' deadline; the thread is left to its stuck call and the rank does no more I/O in that
exchange. **Never silently wrong:** a local error (a file that cannot be read or written, a
stuck disk) does not break the exchange: the rank goes on sending zeros or dropping what it
receives, and returns its error, for the ranks to agree on before anything they moved is used.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Dict, Generator, List, Optional, Sequence, Tuple

import numpy as np

from ..core import bounded, mpi, serial, settings
from ..core.errors import CollectiveTimeout
from ..core.worker import Stalled, Worker, result
from . import checksums

__all__ = ["CHUNK", "TAG_HEAD", "TAG_DATA", "TAG_ASK", "TAG_RANGE", "SPIN_S", "STUCK", "Step", "Range", "StuckDisk", "Disk",
           "open_file", "read_into", "write_all", "sync_close", "close_file", "file_size", "read_range",
           "send_files", "fetch"]

CHUNK = 64 << 20  #: the most bytes one message carries
TAG_HEAD, TAG_DATA, TAG_ASK, TAG_RANGE = (settings.TAG_COPY_HEAD, settings.TAG_COPY_DATA, settings.TAG_COPY_ASK,
                                         settings.TAG_COPY_RANGE)
SPIN_S = 0.05  # test without sleeping this long after the last progress
STUCK = "its node-local disk stopped answering"  #: how a stuck disk's error begins (:class:`StuckDisk`)

Step = Tuple[Any, int, Any]  # (an MPI request, the peer rank, the buffers it uses)
Range = Tuple[str, int, int]  # (a file's name, offset, length)


class StuckDisk(OSError):
    """This rank's disk did not answer a call within its deadline (or an earlier one did not)."""


# What runs on the worker thread (module functions: a test program may make one hang).
def open_file(path: str, mode: str) -> Any:
    return open(path, mode)


def read_into(f: Any, view: Any) -> int:
    return f.readinto(view)


def write_all(f: Any, data: Any) -> None:
    f.write(data)


def sync_close(f: Any) -> None:
    try:
        f.flush()
        os.fsync(f.fileno())
    finally:
        f.close()


def close_file(f: Any) -> None:
    f.close()


def file_size(path: str) -> int:
    return os.path.getsize(path)


def read_range(path: str, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


class Disk:
    """One exchange's file I/O on this rank, each call run on a daemon worker thread and waited
    for at most ``limit`` seconds. Past it, :class:`StuckDisk` naming ``who`` (rank and node),
    what the call did (the file) and ``phase``; every later call then raises at once (the thread
    is still in the stuck one: nothing more is handed to it)."""

    def __init__(self, ctl: Any, where: Callable[[int], str], phase: str) -> None:
        timeout = getattr(ctl, "timeout", None) or bounded.default_timeout()  # (one process: no control comm)
        self.limit = timeout / 4 + CHUNK / (settings.number("HPCSYNC_CHECKPOINT_MBPS") * 1e6)
        self.who, self.phase = where(ctl.Get_rank()), phase
        self.stuck: Optional[str] = None
        self._worker: Optional[Worker] = None

    def call(self, doing: str, fn: Callable[..., Any], *args: Any) -> Any:
        if self.stuck is not None:
            raise StuckDisk(self.stuck)
        if self._worker is None:
            self._worker = Worker("hpcsync-copy-io")
        try:
            return result(self._worker.submit(fn, *args), self.limit, lambda: f"{self.who}: {doing} ({self.phase})")
        except Stalled as exc:
            self.stuck = f"{STUCK}: {exc}"
            raise StuckDisk(self.stuck) from None

    def close(self, f: Any) -> None:
        """Close ``f`` (not on a stuck disk: the file stays open, as the thread is in it); never raises."""
        if f is not None and self.stuck is None:
            try:
                self.call(f"closing {f.name}", close_file, f)
            except OSError:
                pass

    def done(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()


def _plain_name(name: str) -> bool:
    """A file name a peer may give: relative, inside the folder (``sharded/__3_0.distcp``)."""
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def _drive(ctl: Any, streams: Sequence[Generator[Step, None, None]], where: Callable[[int], str], doing: str) -> None:
    """Run ``streams`` (each yields its next request once the previous one completed) until all
    end; :class:`CollectiveTimeout` when none progressed for the deadline (see the module)."""
    limit = ctl.timeout + CHUNK / (settings.number("HPCSYNC_CHECKPOINT_MBPS") * 1e6)
    pending: List[List[Any]] = []

    def advance(stream: Generator[Step, None, None]) -> None:
        step = next(stream, None)
        if step is not None:
            pending.append([stream, *step])

    for stream in streams:
        advance(stream)
    last = time.monotonic()
    while pending:
        moved = False
        for item in list(pending):
            if serial.call(item[1].Test):
                pending.remove(item)
                advance(item[0])
                moved = True
        now = time.monotonic()
        if moved:
            last = now
        elif now - last > limit:
            peers = sorted({item[2] for item in pending})
            ctl.give_up(doing, [item[1] for item in pending], [item[3] for item in pending])
            raise CollectiveTimeout(
                f"{ctl.what}: {doing}: nothing moved for {limit:g} s between rank {ctl.Get_rank()} and "
                + ", ".join(where(p) for p in peers[:8]) + (f" and {len(peers) - 8} more" if len(peers) > 8 else "")
                + ": a peer raised or is stuck before this point (its own error says which), or its node was lost")
        elif now - last > SPIN_S:
            time.sleep(0.0002)


def _sized(comm: Any, peer: int, blob: bytes, tag: int) -> Generator[Step, None, None]:
    """Send ``blob`` to ``peer``: its length, then itself."""
    MPI = mpi.MPI()
    n = np.array([len(blob)], np.int64)
    yield serial.call(comm.Isend, [n, MPI.INT64_T], peer, tag), peer, n
    if blob:
        yield serial.call(comm.Isend, [blob, MPI.BYTE], peer, tag), peer, blob


def _receive_sized(comm: Any, peer: int, tag: int, into: List[bytes]) -> Generator[Step, None, None]:
    MPI = mpi.MPI()
    n = np.zeros(1, np.int64)
    yield serial.call(comm.Irecv, [n, MPI.INT64_T], peer, tag), peer, n
    blob = bytearray(int(n[0]))
    if blob:
        yield serial.call(comm.Irecv, [blob, MPI.BYTE], peer, tag), peer, blob
    into.append(bytes(blob))


def _send_chunks(comm: Any, peer: int, pieces: Sequence[Tuple[str, int, int, Optional[str]]], errors: List[str],
                 disk: Disk) -> Generator[Step, None, None]:
    """Send the bytes of ``pieces`` ((path, 0, length, checksum as written or None), in order) to
    ``peer`` in chunks, summed as read: a file whose bytes differ from its checksum is this rank's
    error (its disk changed it since it was written); what cannot be read goes as zeros (the error
    kept in ``errors``)."""
    MPI = mpi.MPI()
    for path, _, length, want in pieces:
        f, crc = None, 0
        try:
            f = disk.call(f"opening {path}", open_file, path, "rb")
        except OSError as exc:
            errors.append(f"cannot read {path}: {exc}")
        try:
            for at in range(0, length, CHUNK):
                buf = bytearray(min(CHUNK, length - at))
                try:
                    if f is not None and disk.call(f"reading {path}", read_into, f, buf) != len(buf):
                        raise OSError(f"{path} is shorter than {length} bytes")
                except OSError as exc:
                    errors.append(f"cannot read {path}: {exc}")
                    disk.close(f)
                    f = None
                crc = checksums.digest(buf, crc)
                yield serial.call(comm.Isend, [buf, MPI.BYTE], peer, TAG_DATA), peer, buf
            if f is not None and want is not None and checksums.hex_sum(crc) != want:
                errors.append(f"{path} changed on its node-local disk since it was written "
                              f"({checksums.DIGEST} {checksums.hex_sum(crc)}, written as {want})")
        finally:
            disk.close(f)


def send_files(ctl: Any, out: Dict[int, List[Tuple[str, str]]], incoming: Sequence[int], folder: str,
               where: Callable[[int], str], sums: Optional[Dict[str, str]] = None
               ) -> Tuple[Dict[str, Tuple[int, Optional[str]]], List[str]]:
    """Collective over the ranks that send or receive: to each rank in ``out``, the files listed
    there ((name, path): the name it is written under, in its ``folder``); from each rank in
    ``incoming``, theirs, written into ``folder`` (each flushed to disk). ``sums``: the checksums
    of this rank's files as they were written (``{name: hex}``), sent with them; each file is
    summed as it is read (sent) and as it is received (written), and a file whose bytes differ
    from its sum on either side is an error. Returns the ``(size, checksum)`` of the files
    received and this rank's errors (empty when all went well)."""
    errors: List[str] = []
    got: Dict[str, Tuple[int, Optional[str]]] = {}
    sums = sums or {}
    if not out and not incoming:
        return got, errors
    comm, disk = ctl.raw(), Disk(ctl, where, "save")

    def sender(peer: int, files: List[Tuple[str, str]]) -> Generator[Step, None, None]:
        listing = []
        for name, path in files:
            try:
                listing.append((name, disk.call(f"reading the size of {path}", file_size, path)))
            except OSError as exc:
                errors.append(f"cannot read {path}: {exc}")
                listing.append((name, 0))
        head = [(name, n, sums.get(name)) for name, n in listing]
        yield from _sized(comm, peer, json.dumps(head).encode(), TAG_HEAD)
        yield from _send_chunks(comm, peer, [(p, 0, n, sums.get(name)) for (name, p), (_, n) in zip(files, listing)],
                                errors, disk)

    def receiver(peer: int) -> Generator[Step, None, None]:
        MPI = mpi.MPI()
        head: List[bytes] = []
        yield from _receive_sized(comm, peer, TAG_HEAD, head)
        for name, size, want in json.loads(head[0]):
            f, path, crc = None, os.path.join(folder, name), 0
            if _plain_name(name):
                try:
                    f = disk.call(f"creating {path}", open_file, path, "xb")
                except OSError as exc:
                    errors.append(f"cannot write the copy of rank {peer}'s {name}: {exc}")
            else:
                errors.append(f"rank {peer} sent a file named {name!r}, outside the checkpoint's folder")
            for at in range(0, size, CHUNK):
                buf = bytearray(min(CHUNK, size - at))
                yield serial.call(comm.Irecv, [buf, MPI.BYTE], peer, TAG_DATA), peer, buf
                crc = checksums.digest(buf, crc)  # (summed as received, as written)
                try:
                    if f is not None:
                        disk.call(f"writing {path}", write_all, f, buf)
                except OSError as exc:
                    errors.append(f"cannot write the copy of rank {peer}'s {name}: {exc}")
                    disk.close(f)
                    f = None
            if want is not None and checksums.hex_sum(crc) != want:
                errors.append(f"the copy of rank {peer}'s {name} arrived damaged ({checksums.DIGEST} "
                              f"{checksums.hex_sum(crc)}, sent as {want})")
            if f is not None:
                try:
                    disk.call(f"flushing {path} to disk", sync_close, f)
                    got[name] = (size, checksums.hex_sum(crc))
                except OSError as exc:
                    errors.append(f"cannot write the copy of rank {peer}'s {name}: {exc}")

    streams = [sender(p, files) for p, files in out.items()] + [receiver(p) for p in incoming]
    try:
        _drive(ctl, streams, where, "copying checkpoint files to peers")
    finally:
        disk.done()
    return got, errors


def fetch(ctl: Any, wants: Dict[int, List[Range]], path_of: Callable[[str], Optional[str]],
          where: Callable[[int], str]) -> Tuple[Dict[Range, memoryview], List[str]]:
    """Collective over ``ctl``: from each rank in ``wants``, the byte ranges listed there, read by
    that rank from ``path_of(name)`` (its own node's copy); this rank serves what the others ask of
    it. Returns each range's bytes and this rank's errors (its own reads' and those it served).

    One ``Alltoall`` of N integers says who asks whom (8 bytes a rank pair); then only the ranks
    that ask and serve exchange messages: a rank receives just the bytes it asked for."""
    me, size = ctl.Get_rank(), ctl.Get_size()
    asks = {peer: json.dumps(items).encode() for peer, items in wants.items() if items and peer != me}
    counts = np.zeros(size, np.int64)
    for peer, blob in asks.items():
        counts[peer] = len(blob)
    theirs = np.zeros(size, np.int64)
    if size > 1:  # (one process: nothing to exchange, and perhaps no MPI at all)
        MPI = mpi.MPI()
        ctl.Alltoall([counts, MPI.INT64_T], [theirs, MPI.INT64_T])
    errors: List[str] = []
    got: Dict[Range, memoryview] = {}
    comm = ctl.raw() if asks or theirs.any() else None
    disk = Disk(ctl, where, "load")

    def asker(peer: int, blob: bytes) -> Generator[Step, None, None]:
        MPI = mpi.MPI()
        yield serial.call(comm.Isend, [blob, MPI.BYTE], peer, TAG_ASK), peer, blob
        items = wants[peer]
        data = bytearray(sum(n for _, _, n in items))
        view = memoryview(data)
        for at in range(0, len(data), CHUNK):
            piece = view[at: at + CHUNK]
            yield serial.call(comm.Irecv, [piece, MPI.BYTE], peer, TAG_RANGE), peer, data
        at = 0
        for item in items:
            got[tuple(item)] = view[at: at + item[2]]  # type: ignore[index]
            at += item[2]

    def server(peer: int, n: int) -> Generator[Step, None, None]:
        blob = bytearray(n)
        yield serial.call(comm.Irecv, [blob, MPI.BYTE], peer, TAG_ASK), peer, blob
        pieces, total = [], 0
        for name, offset, length in json.loads(blob):
            path = path_of(name) if _plain_name(name) else None
            if path is None:
                errors.append(f"rank {peer} asked for {name}, which this node does not hold")
            pieces.append((path, int(offset), int(length)))
            total += int(length)
        # one stream of chunks, cut where the asker cuts its buffer: the pieces' bytes back to back
        yield from _send_chunks_cut(comm, peer, pieces, total, errors, disk)

    streams = [asker(p, b) for p, b in asks.items()] + [server(p, int(n)) for p, n in enumerate(theirs) if n]
    try:
        if streams:
            _drive(ctl, streams, where, "fetching checkpoint bytes from peers")
        for name, offset, length in wants.get(me, []):
            path = path_of(name)
            try:
                if path is None:
                    raise OSError(f"this node holds no copy of {name}")
                data = disk.call(f"reading {path}", read_range, path, offset, length)
                if len(data) != length:
                    raise OSError(f"{path} is shorter than {offset + length} bytes")
                got[(name, offset, length)] = memoryview(data)
            except StuckDisk as exc:
                errors.append(f"cannot read {path}: {exc}")
            except OSError as exc:
                errors.append(str(exc))
    finally:
        disk.done()
    return got, errors


def _send_chunks_cut(comm: Any, peer: int, pieces: Sequence[Tuple[Optional[str], int, int]], total: int,
                     errors: List[str], disk: Disk) -> Generator[Step, None, None]:
    """The bytes of ``pieces`` back to back, sent as messages of exactly :data:`CHUNK` bytes (the
    last shorter), as :func:`fetch`'s asker receives them whatever the pieces' own sizes; a piece
    without a path (its error already kept) or that cannot be read goes as zeros."""
    MPI = mpi.MPI()
    buf, fill = bytearray(min(CHUNK, total)), 0
    for path, offset, length in pieces:
        done, f = 0, None
        try:
            f = disk.call(f"opening {path}", open_file, path, "rb") if path is not None else None
            if f is not None:
                f.seek(offset)  # (no I/O: the next read's)
        except OSError as exc:
            errors.append(f"cannot read {path}: {exc}")
            disk.close(f)
            f = None
        try:
            while done < length:
                n = min(length - done, len(buf) - fill)
                view = memoryview(buf)[fill: fill + n]
                try:
                    if f is not None and disk.call(f"reading {path}", read_into, f, view) != n:
                        raise OSError(f"{path} is shorter than {offset + length} bytes")
                except OSError as exc:
                    errors.append(f"cannot read {path}: {exc}")
                    disk.close(f)
                    f = None
                if f is None:
                    view[:] = bytes(n)
                fill, done = fill + n, done + n
                if fill == len(buf):
                    yield serial.call(comm.Isend, [buf, MPI.BYTE], peer, TAG_RANGE), peer, buf
                    total -= fill
                    buf, fill = bytearray(min(CHUNK, total)), 0
        finally:
            disk.close(f)
