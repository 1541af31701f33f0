"""Moving the bytes on one node: the kernel copies of a one-node job, shared by its ranks."""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...observe.progress import Progress
from .broadcast import Reader, unexpected
from .destination import JOURNAL_SECONDS, Destination, claims_path
from .manifest import encode_records
from .journal import JOURNAL
from .fileops import Copier, copy_file, fill_folder, new_folder, source_changed
from .listing import DEFAULT_CHUNK_BYTES, Entry, blocks, source_path

__all__ = [
    "SPLIT_BYTES", "copy_blocks", "copy_local", "idle_until_all_arrive", "identity", "Range", "copy_shared",
    "help_on_one_node"
]

log = logging.getLogger(__name__)

SPLIT_BYTES = 64 * 2**20  # on one node, a file this big is copied in one byte range per rank


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
        if time.monotonic() - node.last_journal > JOURNAL_SECONDS:
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
        if size > DEFAULT_CHUNK_BYTES or time.monotonic() - node.last_journal > JOURNAL_SECONDS:
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
    blocking MPI collective busy-polls), within the timeout of ``comm`` (a stage's
    :class:`~hpcsync.core.bounded.BoundedComm`): called before a collective that follows uneven work."""
    if comm.Get_size() > 1:
        comm.Barrier(idle=True)


def identity(path: str) -> Optional[Tuple[int, int]]:
    """``(device, inode)`` of ``path``: whether two ranks see the very same file or directory."""
    try:
        s = os.stat(path)
    except OSError:
        return None
    return s.st_dev, s.st_ino


Range = Tuple[int, str, int, int]  # (entry index, temporary file, offset, bytes)


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
            encode_records(node, [i for k in mine for i in plan[k][1]])
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
    claims = claims_path(node.dst, node.tag)
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
    node = Destination(dst, src, entries, durable, socket.gethostname(), f"{JOURNAL}.{rank}", call=uuid.uuid4().hex)
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
