"""Moving the bytes: broadcast rounds among node leaders, and the kernel copies of a one-node job."""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ...core import mpi
from ...observe.progress import Progress
from .destination import _JOURNAL_SECONDS, Destination
from .journal import JOURNAL
from .fileops import Copier, copy_file, fill_folder, new_folder, source_changed
from .listing import DEFAULT_CHUNK_BYTES, Entry, Piece, blocks, chunks, collector_paused, source_path, trailer_at

log = logging.getLogger("hpcsync.staging")

SPLIT_BYTES = 64 * 2**20  # on one node, a file this big is copied in one byte range per rank


def broadcast(leaders: Any, todo: List[Tuple[int, int]], chunk_bytes: int, reader: Optional["Reader"],
              node: "Destination", bar: Optional[Progress]) -> int:
    """The pipelined transfer among node leaders; returns the number of broadcast rounds.

    Nothing raised on a leader, here or in its threads, leaves another waiting in a broadcast: an
    error of a writer thread is its node's (:meth:`Destination.note`; the leader still takes part
    in every round), one of the root's reader thread or of its own loop ends the transfer for all
    (:meth:`Reader.stop`: one more round goes out, flagged as the last). Either reaches every rank
    as the stage's error."""
    MPI = mpi.MPI()
    plan = list(chunks(todo, chunk_bytes))
    if not plan:
        return 0
    pipe = _Pipeline(plan, reader, node)
    try:
        if not leaders.allreduce(pipe.allocate(), op=MPI.LAND):  # a leader without them: none starts
            return 0
        for k, pieces in enumerate(plan):
            buf, n = pipe.take(k), round_bytes(pieces)
            leaders.Bcast([buf, n, MPI.BYTE], root=0)
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
    finally:
        pipe.close()
    return len(plan)


def round_bytes(pieces: Sequence[Piece]) -> int:
    """The bytes of a broadcast round: the data, a CRC and a flag per piece, the round's flag (1:
    the root stopped, this round is the last and carries nothing)."""
    return trailer_at(pieces) + 16 * len(pieces) + 8


def _flag(buf: Any, n: int) -> Any:
    return np.frombuffer(buf, dtype=np.int64, count=1, offset=n - 8)


class _Pipeline:
    """A leader's three round buffers, its writer thread and, on the root, its reader thread.
    Nothing here raises: an error is the node's (the writer's) or stops the root's reader."""

    def __init__(self, plan: List[List[Piece]], reader: Optional["Reader"], node: "Destination") -> None:
        self.plan, self.reader, self.node = plan, reader, node
        self.cap = max(round_bytes(p) for p in plan)
        self.bufs: List[Any] = [None] * 3
        self.reads: Dict[int, Future] = {}
        self.writes: Dict[int, Future] = {}
        self.read_pool = None if reader is None else ThreadPoolExecutor(1, thread_name_prefix="hpcsync-stage-read")
        self.write_pool = ThreadPoolExecutor(1, thread_name_prefix="hpcsync-stage-write")

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
            self.writes.pop(k - 3).result()
        if self.bufs[k % 3] is None:
            self.bufs[k % 3] = np.empty(self.cap, dtype=np.uint8)  # no zero-fill: every byte sent is written first
        return self.bufs[k % 3]

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
                buf = self.reads.pop(k).result()
                if reader.stopped is None:
                    self._read(k + 1)
                    return buf
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
        """Wait for the reads and writes under way (none raises)."""
        for f in [*self.reads.values(), *self.writes.values()]:
            f.result()
        self.reads.clear()
        self.writes.clear()

    def stopped(self) -> None:
        """The root stopped the transfer (its error is the stage's): drop the files begun."""
        self.drain()
        self._drop_begun()

    def _drop_begun(self) -> None:
        for idx in list(self.node.fds):
            self.node.fail(idx, None)

    def close(self) -> None:
        self.drain()
        if self.reader is not None:
            self.reader.close()
        if self.read_pool is not None:
            self.read_pool.shutdown(wait=True)
        self.write_pool.shutdown(wait=True)


@collector_paused()
def copy_blocks(plan: List[Tuple[int, List[int]]], src: str, entries: List[Entry], node: "Destination",
                reader: "Reader", bar: Optional[Progress], claims: Optional[str] = None) -> List[int]:
    """Copy the :func:`~hpcsync.data.staging.listing.blocks` of ``plan`` in the kernel, as ``cp`` does:
    a folder whole, other files each under a temporary name renamed into place. With ``claims``
    (ranks sharing the plan), a block is copied by the rank that first makes its folder there.
    Returns the blocks this rank copied."""
    mine = []
    for k, (p, files) in enumerate(plan):
        if node.broken is not None:
            break
        if claims is not None:
            try:
                os.mkdir(f"{claims}/{k}")
            except FileExistsError:
                continue
            except OSError as exc:
                node.fail(files[0], f"claiming work in {claims}: {exc.strerror}")
                break
        mine.append(k)
        if p < 0:
            copy_local([(i, entries[i].size, source_path(src, entries, entries[i])) for i in files], node, reader, bar)
            continue
        if time.monotonic() - node.last_journal > _JOURNAL_SECONDS:
            node.checkpoint()
        _copy_folder(node, p, files, os.path.dirname(source_path(src, entries, entries[files[0]])), reader, bar)
    return mine


def copy_local(todo: List[Tuple[int, int, str]], node: "Destination", reader: "Reader", bar: Optional[Progress]) -> None:
    """Copy ``(index, size, source path)`` in the kernel, each file under a temporary name renamed
    into place; what is done is journaled at least once a second and before each large file."""
    entries, copier, umask = node.entries, node.copier, node.umask
    for idx, size, source in todo:
        if node.broken is not None:
            break
        if size > DEFAULT_CHUNK_BYTES or time.monotonic() - node.last_journal > _JOURNAL_SECONDS:
            node.checkpoint()
        final = node.path(idx)
        copied, done, error, source_side = copy_file(copier, umask, entries[idx], source, node.tmp_path(final), final)
        reader.read_bytes += copied
        if error is None:
            node.record(idx, done, None)  # type: ignore[arg-type]
        elif source_side:
            reader.fail(idx, error)
        else:
            node.fail(idx, error)
        if bar is not None:
            bar.update(size)


def _copy_folder(node: "Destination", p: int, files: List[int], source: str, reader: "Reader",
                 bar: Optional[Progress]) -> None:
    """Copy a folder's files into a hidden folder beside it, then rename that over the empty folder
    :meth:`Destination.prepare` made: readers see all of the folder's files or none (a folder
    whose fill failed is removed, not put in place). Its files are recorded once it is in place."""
    final = node.path(p)
    hidden = node.tmp_path(final)
    try:
        new_folder(hidden)
        done, read, failed = fill_folder(node.copier, node.umask, node.entries, files, source, hidden)
    except OSError as exc:
        node.fail(files[0], f"copying into {exc.filename or hidden}: {exc.strerror}")
        shutil.rmtree(hidden, ignore_errors=True)
        return
    reader.read_bytes += read
    for i, why, source_side in failed:
        if source_side:
            reader.fail(i, why)
        else:
            node.fail(i, why)
    if failed:  # the stage fails; the next call copies the whole folder again
        shutil.rmtree(hidden, ignore_errors=True)
        return
    try:
        try:
            os.rename(hidden, final)
        except OSError:  # the folder is no longer empty (written meanwhile): one file at a time
            done = [(i, *_move(f"{hidden}/{os.path.basename(node.path(i))}", node.path(i))) for i, *_ in done]
            os.rmdir(hidden)
    except OSError as exc:
        node.fail(files[0], f"moving {hidden} into place: {exc.strerror}")
        shutil.rmtree(hidden, ignore_errors=True)
        return
    node.record_all(done)
    if bar is not None:
        bar.update(sum(node.entries[i].size for i in files))


def _move(tmp: str, final: str) -> Tuple[int, int]:
    """Rename ``tmp`` to ``final``; the copy's inode and ctime after the rename."""
    os.replace(tmp, final)
    s = os.stat(final)
    return s.st_ino, s.st_ctime_ns


def idle_until_all_arrive(comm: Any) -> None:
    """Ranks with nothing to do wait here without spinning a core that the working ranks need (a
    blocking MPI collective busy-polls): called before a collective that follows uneven work."""
    if comm.Get_size() == 1:
        return
    req = comm.Ibarrier()
    pause = 0.0002
    while not req.Test():
        time.sleep(pause)
        pause = min(pause * 2, 0.0005)  # a wake-up every 0.5 ms costs little, and oversleeps by 0.5 ms at most


def identity(path: str) -> Optional[Tuple[int, int]]:
    """``(device, inode)`` of ``path``: whether two ranks see the very same file or directory."""
    try:
        s = os.stat(path)
    except OSError:
        return None
    return s.st_dev, s.st_ino


Range = Tuple[int, str, int, int]  # (entry index, temporary file, offset, bytes)


@collector_paused()
def copy_shared(ranks: Any, src: str, entries: List[Entry], todo: List[Tuple[int, int]], node: "Destination",
                 reader: "Reader", bar: Optional[Progress]) -> None:
    """One node, several ranks (each holding the listing): the node's ranks share the copying.
    Small files go in :func:`~hpcsync.data.staging.listing.blocks` that the ranks claim one at a time
    (a tree of them costs system calls, not bandwidth, and a rank slowed by other jobs takes
    fewer); a file over :data:`SPLIT_BYTES` is cut into one byte range per rank, copied into a
    temporary file the root created, and sealed by the root once every range is in. Each rank
    journals the whole files it finished; the root gathers the records and writes the manifest.
    A rank that does not see the very source claims nothing and leaves its ranges to the root
    (one that does not see the root's destination is a node of its own: see ``_split``). Whatever fails on the root, it still takes part in the scatter and the
    gather (the other ranks wait there): its error is the node's, and :meth:`Destination.finish`
    reports it."""
    idle_until_all_arrive(ranks)  # the others waited for the root's look at the destination
    size = ranks.Get_size()
    work = None
    if todo and node.broken is None:
        try:
            work = _share_out(size, entries, todo, node)
        except Exception as exc:
            node.note(unexpected(exc))
    if work is None or node.broken is not None:  # nothing to do, or the stage fails: the others stop
        if work is not None:
            shutil.rmtree(work[1], ignore_errors=True)
        ranks.scatter([None] * size, root=0)
        return
    plan, claims, ranges, sealing = work
    ids = (identity(src), identity(node.dst))
    ranks.scatter([(ids, plan, claims, r) for r in ranges], root=0)
    try:
        mine = copy_blocks(plan, src, entries, node, reader, bar, claims)
        if sealing:
            node.checkpoint()  # the root's whole files are recorded before the long ranges and the wait
        range_errors = _copy_ranges(src, entries, ranges[0])
        if node.broken is None and not reader.failed:  # the manifest's part of them, while the others make theirs
            node.encode_records([i for k in mine for i in plan[k][1]])
    except Exception as exc:
        range_errors = _all_failed(entries, ranges[0], node.note(unexpected(exc)))  # type: ignore[arg-type]
    idle_until_all_arrive(ranks)
    every = ranks.gather(None, root=0)
    try:
        _gathered(every, src, entries, ranges, range_errors, node, reader, bar)
        _seal(sealing, src, entries, range_errors, node, reader, bar)
    except Exception as exc:
        node.note(unexpected(exc))  # a split file not sealed is dropped by Destination.finish
    finally:
        shutil.rmtree(claims, ignore_errors=True)


def _share_out(size: int, entries: List[Entry], todo: List[Tuple[int, int]], node: "Destination"
               ) -> Tuple[List[Tuple[int, List[int]]], str, List[List["Range"]], List[int]]:
    """The root's plan of a one-node copy: ``(blocks, claims folder, byte ranges per rank, split
    files to seal)``; it creates the split files' temporary files and the claims folder."""
    plan = blocks(entries, [i for i, n in todo if n <= SPLIT_BYTES], node.units)
    ranges: List[List[Range]] = [[] for _ in range(size)]
    sealing = []
    for i, n in todo:
        if n <= SPLIT_BYTES:
            continue
        fd = node.open(i, shared=True)  # created by the root, written by every rank, sealed by the root
        if fd is None:
            continue
        tmp = node.tmp_path(node.path(i))
        try:
            os.ftruncate(fd, n)
        except OSError as exc:
            node.fail(i, f"cannot extend {tmp} to {n} bytes: {exc.strerror}")
            continue
        sealing.append(i)
        cuts = [n * k // size for k in range(size + 1)]
        for r in range(size):
            ranges[r].append((i, tmp, cuts[r], cuts[r + 1] - cuts[r]))
    claims = node.claims_path()
    try:
        new_folder(claims)
    except OSError as exc:
        node.fail(todo[0][0], f"cannot create {claims}: {exc.strerror}")
        plan = []
    return plan, claims, ranges, sealing


def _gathered(every: List[Any], src: str, entries: List[Entry], ranges: List[List["Range"]],
              range_errors: Dict[str, str], node: "Destination", reader: "Reader", bar: Optional[Progress]) -> None:
    """Take in what each rank of a one-node copy reports (its records, errors and counts)."""
    for r, done in enumerate(every):
        if done is None:
            continue
        if done[0] == "unable":  # it does not see this source: the root does its ranges
            range_errors.update(_copy_ranges(src, entries, ranges[r]))
            continue
        copied, records, failed, unreadable, read_bytes, written, bad_ranges = done
        if node.records:  # (none left on a first stage: the root's own are encoded already)
            for i in copied:  # the helper's record replaces what an earlier stage recorded
                node.records.pop(entries[i].rel, None)
        node.add_records(records, len(copied))
        for k, why in enumerate(failed):  # named already (rank and node): see Destination.finish
            node.failed.setdefault(("rank", r, k), why)
        for k, why in enumerate(unreadable):
            reader.fail((r, k), why)
        reader.read_bytes += read_bytes
        node.bytes_written += written
        range_errors.update(bad_ranges)
        if bar is not None:
            bar.update(written)


def _seal(sealing: List[int], src: str, entries: List[Entry], range_errors: Dict[str, str], node: "Destination",
          reader: "Reader", bar: Optional[Progress]) -> None:
    """Every range of the split files is in (or one failed): seal each, or drop it."""
    for i in sealing:
        e = entries[i]
        if e.rel in range_errors:
            node.fail(i, range_errors[e.rel])
            continue
        why = _source_unchanged(source_path(src, entries, e), e)
        if why:
            reader.fail(i, why)
            node.fail(i, None)
            continue
        reader.read_bytes += e.size
        node.complete(i, None)
        if bar is not None:
            bar.update(e.size)


def _all_failed(entries: List[Entry], ranges: Sequence["Range"], why: str) -> Dict[str, str]:
    """Every file of ``ranges`` as failed: a range that may not be in must not be sealed."""
    return {entries[i].rel: why for i, *_ in ranges}


def unexpected(exc: Exception) -> str:
    """An error no part of the stage expected, as words for the StageError every rank raises
    (its traceback goes to the log of the rank where it happened)."""
    log.error("stage: unexpected error", exc_info=exc)
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return f"{type(exc).__name__}: {exc}"


def _copy_ranges(src: str, entries: List[Entry], ranges: Sequence[Range]) -> Dict[str, str]:
    """Copy byte ranges of split files in the kernel; returns ``{rel: error}`` for the ranges that
    failed (the root then drops those files)."""
    errors: Dict[str, str] = {}
    copier = Copier()
    for i, tmp, off, n in ranges:
        source = source_path(src, entries, entries[i])
        try:
            sfd = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC)
                try:
                    if copier.copy(sfd, fd, n, off) < n:
                        raise OSError(0, f"source file {source} shrank while being staged")
                finally:
                    os.close(fd)
            finally:
                os.close(sfd)
        except OSError as exc:
            errors[entries[i].rel] = exc.strerror if exc.errno == 0 else f"copying {source} to {tmp}: {exc.strerror}"
    return errors


def _source_unchanged(source: str, e: Entry) -> Optional[str]:
    try:
        fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        return f"reading source {source}: {exc.strerror}"
    try:
        return source_changed(fd, e)
    finally:
        os.close(fd)


@collector_paused()
def help_on_one_node(ranks: Any, src: str, dst: str, durable: bool, entries: List[Entry], rank: int) -> None:
    """A non-root rank's part of :func:`copy_shared` (``rank``: its rank in the stage's group).
    Its errors travel to the root in the gather, which it reaches whatever fails here (the root
    waits there), each naming this rank and node."""
    idle_until_all_arrive(ranks)
    share = ranks.scatter(None, root=0)
    if share is None:
        return
    ids, plan, claims, ranges = share
    me = ranks.Get_rank()
    if ids[1] != identity(dst):  # the ranks were grouped by what they see at dst: it changed since
        why = f"no longer sees the directory {dst} that rank 0 of the node writes"
        done: Tuple[Any, ...] = ([], "{}", [why], [], 0, 0, _all_failed(entries, ranges, why))
    elif ids[0] != identity(src):  # another source: its share goes to the root
        done = ("unable",)
    else:
        try:
            done = _help(me, src, dst, durable, entries, plan, claims, ranges)
        except Exception as exc:
            why = unexpected(exc)
            done = ([], "{}", [why], [], 0, 0, _all_failed(entries, ranges, why))
    if done[0] != "unable":
        done = (*done[:2], [f"rank {rank}: node {socket.gethostname()}: {why}" for why in done[2]], *done[3:])
    idle_until_all_arrive(ranks)
    ranks.gather(done, root=0)


def _help(rank: int, src: str, dst: str, durable: bool, entries: List[Entry], plan: List[Tuple[int, List[int]]],
          claims: str, ranges: List["Range"]) -> Tuple[Any, ...]:
    """Copy the blocks this rank claims and its byte ranges; returns its report for the root."""
    node = Destination(dst, src, entries, durable, socket.gethostname(), f"{JOURNAL}.{rank}")
    reader = Reader(src, entries)
    try:
        mine = copy_blocks(plan, src, entries, node, reader, None, claims)
        if ranges:
            node.checkpoint()  # the whole files are recorded before the long ranges
    finally:
        node.journal.close()
    bad_ranges = _copy_ranges(src, entries, ranges)
    copied = [i for k in mine for i in plan[k][1] if entries[i].rel in node.records]
    records = json.dumps(node.records, separators=(",", ":"))  # JSON for the manifest, made here in parallel
    return (copied, records, list(node.failed.values()), list(reader.failed.values()), reader.read_bytes,
            node.bytes_written, bad_ranges)


class Reader:
    """The root's side of the transfer: fills each round's buffer from the source files."""

    def __init__(self, src: str, entries: List[Entry]) -> None:
        self.src, self.entries = src, entries
        self.fd, self.crc = -1, 0
        self.read_bytes = 0
        self.failed: Dict[Any, str] = {}
        self.stopped: Optional[str] = None

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
                path = source_path(self.src, self.entries, e)
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
