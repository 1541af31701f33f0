"""Stage-in: copy a dataset that one rank can read to every node's local disk, reading it once.

The mirror of file sync. ``stage(src, dst)`` is collective: rank ``root`` (default 0) walks
``src`` (a file or a directory tree; only that rank needs to see it), every node's leader looks at
``dst`` (the same path on every node, a node-local directory) and says which files it lacks, and
the root reads each file that any node lacks exactly once. Its bytes travel to the node leaders
in a broadcast among them -- cost grows with log(nodes), not nodes -- and each leader writes them
once for its node. Small files are batched into one broadcast (up to ``chunk_bytes`` of data and
:data:`MAX_PIECES` files per broadcast), big files are cut into chunks and pipelined: the root
reads chunk k+1 while chunk k travels, a leader writes chunk k while k+1 arrives, three buffers of
``chunk_bytes`` each at most. On one node nothing needs to travel: the root copies in the kernel
(``copy_file_range``), like ``cp``.

Nothing half-done passes as done:

- every file is written to a hidden temporary name beside its final one (``.NAME.hpcsync-tmp``),
  checked -- its size, and for bytes that crossed MPI a CRC-32 against the root's, piece by piece --
  given its mode and mtime, then renamed into place;
- a manifest in ``dst`` (:data:`MANIFEST`, with a journal while a stage runs) records what was
  staged, with the source's size, mtime and mode and the copy's inode, size, mtime and ctime. A
  later call skips a file only when all of them still match, so a file changed at the source, or
  truncated, rewritten or deleted at a destination, is staged again, and a second call rewrites
  nothing;
- a stage killed half way leaves only temporary names (removed by the next call) and files that
  are complete; the journal, appended at least once a second and before each large file, lets the
  next call skip what was finished;
- any error -- a missing or unreadable source, a destination that is not writable or too small on
  one node, a file changing while it is read -- raises the same :class:`~hpcsync.errors.StageError`
  on every rank, naming the node and the path.

Directories get their mode and mtime once their files are in. Symbolic links are copied as links
(never followed, except a link given as ``src`` itself); sockets, FIFOs and devices are listed in
:attr:`StageResult.ignored`. Files in ``dst`` that the source lacks are left alone. With
``durable=True`` the node's filesystem is synced (``syncfs``) before the journal or manifest names a
file, so a power loss cannot leave a recorded file with lost data; the default is safe against
killed processes, which is what node-local scratch (``$SLURM_TMPDIR``) needs.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import pickle
import socket
import stat as st
import time
import uuid
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from . import _bigmpi, _mpi
from .errors import StageError, raise_if_any, ranks_by_value
from .progress import Progress

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]
MANIFEST = ".hpcsync-stage.json"
JOURNAL = ".hpcsync-stage.journal"
TMP_SUFFIX = ".hpcsync-tmp"
DEFAULT_CHUNK_BYTES = 16 * 2**20
MAX_PIECES = 4096  # files (or file pieces) per broadcast: bounds the trailer and the latency of one round
SPLIT_BYTES = 64 * 2**20  # on one node, a file this big is copied in one byte range per rank
_JOURNAL_SECONDS = 1.0
_FILE, _DIR, _LINK = "f", "d", "l"


class Entry(NamedTuple):
    """One item of the source listing (``rel`` is relative to ``dst``)."""

    rel: str
    kind: str
    mode: int
    atime_ns: int
    mtime_ns: int
    size: int
    target: str = ""  # symbolic links: what they point to


@dataclass(frozen=True)
class StageResult:
    """What a stage did (the same on every rank)."""

    source: str
    destination: str
    files: int  # regular files in the source
    bytes: int  # their bytes
    dirs: int
    symlinks: int
    copied: Tuple[str, ...]  # files some node lacked: read once, written where they were missing
    skipped: Tuple[str, ...]  # files already up to date on every node
    copied_bytes: int
    source_reads: int  # bytes read from the source (== copied_bytes: each byte once)
    broadcasts: int  # broadcast rounds among node leaders (0 on one node)
    nodes: int
    written: Tuple[Tuple[str, int, int], ...]  # per node: (hostname, files written, bytes written)
    ignored: Tuple[str, ...]  # sockets, FIFOs, devices: not staged
    seconds: float


class _Solo:
    """The communicator of a job of one process without MPI: every collective is the identity."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def allgather(self, obj: Any) -> List[Any]:
        return [obj]

    def gather(self, obj: Any, root: int = 0) -> List[Any]:
        return [obj]

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj

    def Free(self) -> None:
        pass


def stage(
    src: PathLike,
    dst: PathLike,
    *,
    root: int = 0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    durable: bool = False,
    progress: Optional[bool] = None,
    comm: Any = None,
) -> StageResult:
    """Copy ``src`` (a file or directory that rank ``root`` can read) into the directory ``dst`` on
    every node (collective).

    A directory's contents land in ``dst`` (as ``rsync -a src/ dst/``); a single file lands as
    ``dst/<name>``. Each source byte is read once, by ``root``; files already staged and unchanged
    are skipped. ``chunk_bytes`` bounds each of the three pipeline buffers; ``durable`` syncs the
    destination filesystem before recording files; ``progress`` shows a bar on the root (default:
    when stderr is a terminal). ``comm``: an mpi4py communicator (default: the world).
    Raises :class:`~hpcsync.errors.StageError` on every rank if anything fails.
    """
    t0 = time.perf_counter()
    comm = _transport(comm)
    me, size = comm.Get_rank(), comm.Get_size()
    if not 0 <= root < size:
        raise ValueError(f"root {root} outside the world of {size} rank(s)")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    chunk_bytes = min(int(chunk_bytes), _bigmpi.INT_MAX - 16 * MAX_PIECES - 8)
    src, dst = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
    _agree_settings(comm, {"src": src, "dst": dst, "root": root, "chunk_bytes": chunk_bytes, "durable": durable})
    what = f"stage of {src} to {dst} failed: "
    node, leaders = _split(comm, root)
    try:
        entries, ignored, err = _scan(src) if me == root else ([], [], None)
        raise_if_any(comm, err and f"node {socket.gethostname()}: {err}", StageError, what)
        result = None
        one_node = size > 1 and node.Get_size() == size  # its ranks share the copying
        if leaders is not None:
            result, err = _stage_on_leader(leaders, entries, ignored, src, dst, chunk_bytes, durable, progress,
                                           node if one_node else None)
        elif one_node:
            _help_on_one_node(node, src, dst, durable)
        _idle_until_all_arrive(comm)
        raise_if_any(comm, err, StageError, what)
        result = comm.bcast(result, root=root)
    finally:
        for c in (leaders, node):
            if c is not None and c is not comm:
                c.Free()
    return StageResult(**{**result, "seconds": time.perf_counter() - t0})


def _transport(comm: Any) -> Any:
    if comm is not None:
        return comm
    from ._torchcomm import world

    w = world()
    if w is None:
        return _Solo()
    if not hasattr(w, "Bcast"):
        raise StageError("stage needs MPI (mpi4py) in a multi-rank job; this one runs on torch.distributed "
                         "only: launch it with mpirun/mpiexec/srun --mpi and install mpi4py")
    return w


def _agree_settings(comm: Any, settings: Dict[str, Any]) -> None:
    """Every rank must mean the same stage: a rank that diverges is an error on all, not ignored."""
    if comm.Get_size() == 1:
        return
    every = comm.allgather(settings)
    differ = {k: by for k in settings if len(by := ranks_by_value([repr(s[k]) for s in every])) > 1}
    if differ:
        detail = "; ".join(f"{k}: " + ", ".join(f"rank(s) {ranks} {v}" for v, ranks in by.items())
                           for k, by in differ.items())
        raise StageError(f"stage: ranks called it with different arguments (desync), nothing staged: {detail}")


def _split(comm: Any, root: int) -> Tuple[Any, Any]:
    """(this node's communicator, the node leaders' communicator or None). ``root`` leads its node
    and is rank 0 among the leaders."""
    if comm.Get_size() == 1:
        return comm, comm
    MPI = _mpi.MPI()
    me = comm.Get_rank()
    key = 0 if me == root else me + 1
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=key)
    leaders = comm.Split(0 if node.Get_rank() == 0 else MPI.UNDEFINED, key=key)
    return node, (None if leaders == MPI.COMM_NULL else leaders)


def _idle_until_all_arrive(comm: Any) -> None:
    """Ranks with nothing to do wait here without spinning a core that the copying ranks need
    (a blocking MPI collective busy-polls)."""
    if comm.Get_size() == 1:
        return
    req = comm.Ibarrier()
    pause = 0.0002
    while not req.Test():
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


# -- the source ------------------------------------------------------------------------------------

def _scan(src: str) -> Tuple[List[Entry], List[str], Optional[str]]:
    """The root's listing of ``src``: directories before what they hold, names sorted."""
    try:
        top = os.stat(src)  # a link given as src is followed
    except FileNotFoundError:
        return [], [], f"source {src} does not exist"
    except OSError as exc:
        return [], [], f"cannot stat source {src}: {exc.strerror}"
    if st.S_ISREG(top.st_mode):
        if not os.access(src, os.R_OK):
            return [], [], f"source {src} is not readable"
        return [_entry(os.path.basename(src), top)], [], None
    if not st.S_ISDIR(top.st_mode):
        return [], [], f"source {src} is neither a file nor a directory"
    entries, ignored = [_entry("", top)], []
    todo = [""]
    while todo:
        rel = todo.pop()
        here = os.path.join(src, rel)
        try:
            with os.scandir(here) as it:
                items = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            return [], [], f"cannot read source directory {here}: {exc.strerror}"
        subdirs = []
        for item in items:
            r = os.path.join(rel, item.name)
            try:
                s = item.stat(follow_symlinks=False)
            except OSError as exc:
                return [], [], f"cannot stat {item.path}: {exc.strerror}"
            if st.S_ISDIR(s.st_mode):
                entries.append(_entry(r, s))
                subdirs.append(r)
            elif st.S_ISREG(s.st_mode):
                if not os.access(item.path, os.R_OK):
                    return [], [], f"source file {item.path} is not readable"
                entries.append(_entry(r, s))
            elif st.S_ISLNK(s.st_mode):
                entries.append(_entry(r, s, os.readlink(item.path)))
            else:
                ignored.append(r)
        todo.extend(reversed(subdirs))  # depth first, in name order
    return entries, ignored, None


def _entry(rel: str, s: os.stat_result, target: str = "") -> Entry:
    kind = _DIR if st.S_ISDIR(s.st_mode) else _LINK if st.S_ISLNK(s.st_mode) else _FILE
    return Entry(rel, kind, st.S_IMODE(s.st_mode), s.st_atime_ns, s.st_mtime_ns,
                 s.st_size if kind == _FILE else 0, target)


def _source_path(src: str, entries: Sequence[Entry], e: Entry) -> str:
    single = len(entries) == 1 and entries[0].kind == _FILE
    return src if single else f"{src}/{e.rel}"


# -- the schedule ----------------------------------------------------------------------------------

Piece = Tuple[int, int, int]  # (file index, offset in the file, bytes)


def chunks(files: Sequence[Tuple[int, int]], chunk_bytes: int, max_pieces: int = MAX_PIECES) -> Iterator[List[Piece]]:
    """Cut the byte stream of ``files`` (``(index, size)``, in order) into broadcast rounds of at
    most ``chunk_bytes`` data and ``max_pieces`` pieces. Every leader computes the same rounds, so
    only data travels; an empty file is a piece of 0 bytes."""
    cur: List[Piece] = []
    used = 0
    for idx, size in files:
        off = 0
        while True:
            take = min(size - off, chunk_bytes - used)
            cur.append((idx, off, take))
            used += take
            off += take
            if used >= chunk_bytes or len(cur) >= max_pieces:
                yield cur
                cur, used = [], 0
            if off >= size:
                break
    if cur:
        yield cur


def _trailer_at(pieces: Sequence[Piece]) -> int:
    """Where the per-piece CRC trailer starts in a round's buffer (8-byte aligned after the data)."""
    n = sum(p[2] for p in pieces)
    return (n + 7) & ~7


# -- a node leader's work --------------------------------------------------------------------------

def _stage_on_leader(leaders: Any, entries: List[Entry], ignored: List[str], src: str, dst: str, chunk_bytes: int,
                     durable: bool, progress: Optional[bool], helpers: Any = None
                     ) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """Listing to every leader, what each node lacks, the transfer; the result on the root.
    ``helpers``: a one-node job's communicator, whose ranks share the copying."""
    is_root = leaders.Get_rank() == 0
    many = leaders.Get_size() > 1
    token = uuid.uuid4().hex[:12]
    if many:
        blob = _bigmpi.bcast_bytes(leaders, pickle.dumps((entries, ignored, token), protocol=5) if is_root else b"",
                                   root=0)
        entries, ignored, token = pickle.loads(blob)
    host = socket.gethostname()
    node = _Node(dst, src, entries, durable, host)
    err = node.open_destination(token, leaders.Get_rank())
    try:
        if many and not any(leaders.allgather(err)):
            node.writes = _writers(leaders.allgather(node.sees_probes(token, leaders.Get_rank())))[leaders.Get_rank()] \
                == leaders.Get_rank()
    finally:
        node.close_probe()
    if err is None and node.writes:
        err = node.prepare()
    if many and any(leaders.allgather(err)):
        return None, err  # no node moves anything when one cannot take it; every rank raises
    if err is not None:
        if helpers is not None:
            helpers.bcast(None, root=0)  # nothing for them to do
        return None, err
    union = node.need.copy()
    if many:
        leaders.Allreduce(node.need, union, op=_mpi.MPI().MAX)
    todo = [(i, entries[i].size) for i in np.flatnonzero(union).tolist()]
    total = sum(n for _, n in todo)
    bar = Progress(f"staging {os.path.basename(src) or src}", total, enabled=progress) if is_root else None
    rounds = 0
    reader = _Reader(src, entries) if is_root else None
    try:
        if many:
            rounds = _broadcast(leaders, todo, chunk_bytes, reader, node, bar)
        elif helpers is not None:
            _copy_shared(helpers, src, entries, todo, node, reader, bar)  # type: ignore[arg-type]
        elif todo:
            _copy_local([(i, n, _source_path(src, entries, entries[i])) for i, n in todo], node, reader,  # type: ignore[arg-type]
                        bar)
    finally:
        if bar is not None:
            bar.close()
    err = err or (reader.error if reader is not None else None) or node.finish()
    stats = (host, node.files_written, node.bytes_written)
    every = leaders.gather(stats, root=0) if many else [stats]
    if not is_root:
        return None, err
    files = [e for e in entries if e.kind == _FILE]
    copied = {entries[i].rel for i, _ in todo}
    result = dict(
        source=src, destination=dst, files=len(files), bytes=sum(e.size for e in files),
        dirs=sum(e.kind == _DIR for e in entries), symlinks=sum(e.kind == _LINK for e in entries),
        copied=tuple(entries[i].rel for i, _ in todo), skipped=tuple(e.rel for e in files if e.rel not in copied),
        copied_bytes=total, source_reads=reader.read_bytes, broadcasts=rounds,  # type: ignore[union-attr]
        nodes=leaders.Get_size(), written=tuple(tuple(s) for s in every), ignored=tuple(ignored))
    return result, err


def _writers(sees: Sequence[Tuple[bool, bool]]) -> List[int]:
    """Which leader writes for each node, from whether each sees the probe file of leader 0 and of
    the leader before it in ``dst``: nodes that share ``dst`` (a shared filesystem given as the
    destination) write it once. Sharing that is neither with leader 0 nor between neighbours goes
    undetected; it stays correct (per-node temporary names, atomic renames), only redundant."""
    writer: List[int] = []
    for i, (first, previous) in enumerate(sees):
        writer.append(0 if i and first else writer[i - 1] if i and previous else i)
    return writer


def _broadcast(leaders: Any, todo: List[Tuple[int, int]], chunk_bytes: int, reader: Optional["_Reader"],
               node: "_Node", bar: Optional[Progress]) -> int:
    """The pipelined transfer among node leaders; returns the number of broadcast rounds."""
    MPI = _mpi.MPI()
    plan = list(chunks(todo, chunk_bytes))
    if not plan:
        return 0
    cap = max(_trailer_at(p) + 16 * len(p) for p in plan)
    bufs: List[Any] = [None] * 3
    reads: Dict[int, Future] = {}
    writes: Dict[int, Future] = {}
    read_pool = ThreadPoolExecutor(1, thread_name_prefix="hpcsync-stage-read") if reader is not None else None
    write_pool = ThreadPoolExecutor(1, thread_name_prefix="hpcsync-stage-write")

    def buffer(k: int) -> Any:
        if k >= 3:
            writes[k - 3].result()  # the round that last used this buffer is written
        if bufs[k % 3] is None:
            bufs[k % 3] = np.empty(cap, dtype=np.uint8)  # no zero-fill: every byte sent is written first
        return bufs[k % 3]

    def start_read(k: int) -> None:
        if read_pool is not None and k < len(plan):
            buf = buffer(k)
            reads[k] = read_pool.submit(reader.fill, plan[k], buf)  # type: ignore[union-attr]

    try:
        start_read(0)
        for k, pieces in enumerate(plan):
            if read_pool is not None:
                buf = reads.pop(k).result()
                start_read(k + 1)  # read the next round while this one travels
            else:
                buf = buffer(k)
            n = _trailer_at(pieces) + 16 * len(pieces)
            leaders.Bcast([buf, n, MPI.BYTE], root=0)
            writes[k] = write_pool.submit(node.write_round, pieces, buf, reader is None)
            if bar is not None:
                bar.update(sum(p[2] for p in pieces))
        for f in writes.values():
            f.result()
    finally:
        if read_pool is not None:
            read_pool.shutdown(wait=True)
        write_pool.shutdown(wait=True)
    return len(plan)


def _copy_local(todo: List[Tuple[int, int, str]], node: "_Node", reader: "_Reader", bar: Optional[Progress]) -> None:
    """Copy ``(index, size, source path)`` in the kernel (``copy_file_range``), as ``cp`` does;
    what is done is journaled at least once a second and before each large file."""
    for idx, size, source in todo:
        if node.broken is not None:
            break
        if size > DEFAULT_CHUNK_BYTES or time.monotonic() - node.last_journal > _JOURNAL_SECONDS:
            node.checkpoint()
        copied, done, error, source_side = node.copy_in(idx, source)
        reader.read_bytes += copied
        if error is None:
            node.record(idx, done, None)  # type: ignore[arg-type]
        elif source_side:
            reader.fail(idx, error)
        else:
            node.fail(idx, error)
        if bar is not None:
            bar.update(size)


def split_work(sizes: Sequence[int], parts: int, per_file: int = 64 * 1024) -> List[Tuple[int, int]]:
    """Cut files (in order) into ``parts`` contiguous ranges ``[lo, hi)`` of about equal cost, a
    file costing its bytes plus ``per_file`` (what opening, creating and renaming one costs)."""
    cost = [s + per_file for s in sizes]
    total, bounds, acc, lo = sum(cost), [], 0, 0
    for k in range(parts):
        hi = lo
        while hi < len(cost) and (k == parts - 1 or acc + cost[hi] / 2 <= total * (k + 1) / parts):
            acc += cost[hi]
            hi += 1
        bounds.append((lo, hi))
        lo = hi
    return bounds


def _identity(path: str) -> Optional[Tuple[int, int]]:
    try:
        s = os.stat(path)
    except OSError:
        return None
    return s.st_dev, s.st_ino


def _copy_shared(ranks: Any, src: str, entries: List[Entry], todo: List[Tuple[int, int]], node: "_Node",
                 reader: "_Reader", bar: Optional[Progress]) -> None:
    """One node, several ranks: the node copies with every rank that sees the very source and
    destination. Small files are split among the ranks (a tree of them costs system calls, not
    bandwidth); a file over :data:`SPLIT_BYTES` is cut into one byte range per rank, copied into
    a temporary file the root created, and sealed by the root once every range is in. Each rank
    journals the whole files it finished; the root gathers the records and writes the manifest."""
    if not todo:
        ranks.bcast(None, root=0)
        return
    ranks.bcast((_identity(src), _identity(node.dst)), root=0)
    able = [r for r, ok in enumerate(ranks.gather(True, root=0)) if ok]
    whole = [(i, n) for i, n in todo if n <= SPLIT_BYTES or len(able) == 1]
    split = [(i, n) for i, n in todo if n > SPLIT_BYTES and len(able) > 1]
    jobs: List[List[Tuple[int, int]]] = [[] for _ in range(ranks.Get_size())]
    for r, (lo, hi) in zip(able, split_work([n for _, n in whole], len(able))):
        jobs[r] = whole[lo:hi]
    ranges: List[List[Tuple[Entry, str, str, int, int]]] = [[] for _ in range(ranks.Get_size())]
    sealing = []
    for i, n in split:
        final = node.path(i)
        fd = node.open(i)  # created by the root, written by every rank, sealed by the root
        if fd is None:
            continue
        os.ftruncate(fd, n)
        sealing.append(i)
        cuts = [n * k // len(able) for k in range(len(able) + 1)]
        for k, r in enumerate(able):
            ranges[r].append((entries[i], _source_path(src, entries, entries[i]), node.tmp_path(final), cuts[k],
                              cuts[k + 1] - cuts[k]))
    ranks.scatter([([(entries[i], _source_path(src, entries, entries[i])) for i, _ in job], ranges[r])
                   for r, job in enumerate(jobs)], root=0)
    _copy_local([(i, n, _source_path(src, entries, entries[i])) for i, n in jobs[0]], node, reader, bar)
    node.checkpoint()  # the root's whole files are recorded before the long ranges and the wait
    range_errors = _copy_ranges(ranges[0])
    for r, done in enumerate(ranks.gather(None, root=0)):
        if done is None:
            continue
        records, failed, unreadable, read_bytes, written, bad_ranges = done
        for rel, rec in records:
            node.records[rel] = rec
        for k, why in enumerate(failed):
            node.failed.setdefault((r, k), why)
        for k, why in enumerate(unreadable):
            reader.fail((r, k), why)
        reader.read_bytes += read_bytes
        node.files_written += len(records)
        node.bytes_written += written
        range_errors.update(bad_ranges)
        if bar is not None:
            bar.update(written)
    for i in sealing:  # every range is in (or one failed): seal, or drop
        e = entries[i]
        if e.rel in range_errors:
            node.fail(i, range_errors[e.rel])
            continue
        why = _source_unchanged(_source_path(src, entries, e), e)
        if why:
            reader.fail(i, why)
            node.fail(i, None)
            continue
        reader.read_bytes += e.size
        node.complete(i, None)
        if bar is not None:
            bar.update(e.size)


def _copy_ranges(ranges: Sequence[Tuple[Entry, str, str, int, int]]) -> Dict[str, str]:
    """Copy byte ranges ``(entry, source, temporary file, offset, bytes)`` in the kernel; returns
    ``{rel: error}`` for the ranges that failed (the root then drops those files)."""
    errors: Dict[str, str] = {}
    for e, source, tmp, off, n in ranges:
        try:
            sfd = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC)
                try:
                    done = 0
                    while done < n:
                        k = os.copy_file_range(sfd, fd, n - done, off + done, off + done)
                        if k == 0:
                            raise OSError(0, f"source file {source} shrank while being staged")
                        done += k
                finally:
                    os.close(fd)
            finally:
                os.close(sfd)
        except OSError as exc:
            errors[e.rel] = exc.strerror if exc.errno == 0 else f"copying {source} to {tmp}: {exc.strerror}"
    return errors


def _source_unchanged(source: str, e: Entry) -> Optional[str]:
    try:
        fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        return f"reading source {source}: {exc.strerror}"
    try:
        return _changed(fd, e)
    finally:
        os.close(fd)


def _help_on_one_node(ranks: Any, src: str, dst: str, durable: bool) -> None:
    """A non-root rank's part of :func:`_copy_shared` (its errors travel to the root)."""
    ids = ranks.bcast(None, root=0)
    if ids is None:
        return
    ranks.gather(ids == (_identity(src), _identity(dst)), root=0)
    jobs, ranges = ranks.scatter(None, root=0)
    node = _Node(dst, src, [e for e, _ in jobs], durable, socket.gethostname(), f"{JOURNAL}.{ranks.Get_rank()}")
    reader = _Reader(src, node.entries)
    try:
        _copy_local([(k, e.size, path) for k, (e, path) in enumerate(jobs)], node, reader, None)
        node.checkpoint()
    finally:
        if node.journal is not None:
            node.journal.close()
    bad_ranges = _copy_ranges(ranges)
    records = [(e.rel, node.records[e.rel]) for e in node.entries if e.rel in node.records]
    ranks.gather((records, list(node.failed.values()), list(reader.failed.values()), reader.read_bytes,
                  node.bytes_written, bad_ranges), root=0)


def _kernel_copy(sfd: int, dfd: int, size: int) -> int:
    done = 0
    try:
        while done < size:
            k = os.copy_file_range(sfd, dfd, size - done, done, done)
            if k == 0:
                return done
            done += k
    except OSError as exc:  # a filesystem without copy_file_range (or across devices on old kernels)
        if exc.errno not in (18, 22, 38, 95):  # EXDEV, EINVAL, ENOSYS, EOPNOTSUPP
            raise
        buf = bytearray(min(max(size - done, 1), 8 * 2**20))
        while done < size:
            view = memoryview(buf)[: min(len(buf), size - done)]
            got = os.preadv(sfd, [view], done)
            if got == 0:
                return done
            _pwrite_all(dfd, view[:got], done)
            done += got
    return done


def _changed(fd: int, e: Entry) -> Optional[str]:
    """Why a source file read to its end no longer matches the listing (torn copy), or None."""
    s = os.fstat(fd)
    if s.st_size != e.size or s.st_mtime_ns != e.mtime_ns:
        return f"source file {e.rel or '.'} changed while being staged"
    return None


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class _Reader:
    """The root's side of the transfer: fills each round's buffer from the source files."""

    def __init__(self, src: str, entries: List[Entry]) -> None:
        self.src, self.entries = src, entries
        self.fd, self.crc = -1, 0
        self.read_bytes = 0
        self.failed: Dict[Any, str] = {}

    @property
    def error(self) -> Optional[str]:
        if not self.failed:
            return None
        first = next(iter(self.failed.values()))
        more = f" (and {len(self.failed) - 1} more file(s))" if len(self.failed) > 1 else ""
        return f"node {socket.gethostname()}: {first}{more}"

    def fail(self, idx: Any, why: str) -> None:
        self.failed.setdefault(idx, why)

    def fill(self, pieces: Sequence[Piece], buf: Any) -> Any:
        trailer = np.frombuffer(buf, dtype=np.int64, count=2 * len(pieces), offset=_trailer_at(pieces))
        mv, pos = memoryview(buf), 0
        for j, (idx, off, n) in enumerate(pieces):
            e = self.entries[idx]
            view = mv[pos: pos + n]
            ok = idx not in self.failed
            if ok:
                path = _source_path(self.src, self.entries, e)
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
                        why = _changed(self.fd, e)
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


class _Node:
    """A node leader's copy: what it lacks, temporary files, checks, renames, manifest and journal."""

    def __init__(self, dst: str, src: str, entries: List[Entry], durable: bool, host: str,
                 journal: str = JOURNAL) -> None:
        self.dst, self.src, self.entries, self.durable, self.host = dst, src, entries, durable, host
        self.journal_name = journal
        self.need = np.zeros(len(entries), dtype=np.uint8)
        self.records: Dict[str, list] = {}
        self.fds: Dict[int, int] = {}
        self.crcs: Dict[int, int] = {}
        self.failed: Dict[Any, str] = {}
        self.unjournaled: List[Tuple[str, list]] = []
        self.journal: Optional[Any] = None
        self.last_journal = time.monotonic()
        self.files_written = self.bytes_written = 0
        self.broken: Optional[str] = None  # first write error: later files are not even tried
        self.tag = hashlib.sha1(host.encode()).hexdigest()[:8]  # temporary names never collide between nodes
        self.writes = True  # False: another node's leader writes this very directory (shared dst)
        self.probe: Optional[str] = None
        self.interrupted = False  # journals of a killed stage were found

    def path(self, idx: int) -> str:
        rel = self.entries[idx].rel
        return f"{self.dst}/{rel}" if rel else self.dst

    def tmp_path(self, final: str) -> str:
        folder, _, name = final.rpartition("/")
        if len(name) > 200:  # keep the temporary name within NAME_MAX
            name = hashlib.sha1(name.encode()).hexdigest()
        return f"{folder}/.{name}.{self.tag}{TMP_SUFFIX}"

    def _where(self, msg: str) -> str:
        return f"node {self.host}: {msg}"

    # - before the transfer

    def _probe_path(self, token: str, index: int) -> str:
        return os.path.join(self.dst, f".probe-{token}-{index}{TMP_SUFFIX}")

    def open_destination(self, token: str, index: int) -> Optional[str]:
        """Create ``dst`` and prove it writable with a probe file, left in place until
        :meth:`close_probe` so that leaders sharing the directory can see each other's."""
        dst = self.dst
        try:
            os.makedirs(dst, exist_ok=True)
        except OSError as exc:
            return self._where(f"cannot create destination {dst}: {exc.strerror}")
        if not os.path.isdir(dst):
            return self._where(f"destination {dst} is not a directory")
        probe = self._probe_path(token, index)
        try:
            _make_writable(dst)
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            self.probe = probe
        except OSError as exc:
            return self._where(f"destination {dst} is not writable: {exc.strerror}")
        return None

    def sees_probes(self, token: str, index: int) -> Tuple[bool, bool]:
        """Whether leader 0's and the previous leader's probe files are visible in our ``dst``."""
        if index == 0:
            return False, False
        return (os.path.exists(self._probe_path(token, 0)),
                index > 1 and os.path.exists(self._probe_path(token, index - 1)))

    def close_probe(self) -> None:
        if self.probe is not None:
            try:
                os.unlink(self.probe)
            except OSError:
                pass
            self.probe = None

    def prepare(self) -> Optional[str]:
        """Create the directories and links, check there is room, and mark the files this node
        lacks. Returns an error naming node and path, or None."""
        dst = self.dst
        self.records, self.interrupted = self._load_manifest()
        if self.interrupted:
            _remove_temporaries(dst, f".{self.tag}{TMP_SUFFIX}")
        need_bytes = replaced = largest = 0
        try:
            for i, e in enumerate(self.entries):
                path = self.path(i)
                if e.kind == _DIR:
                    _ensure_dir(path)
                elif e.kind == _LINK:
                    _ensure_link(path, e, self.tmp_path(path))
                elif e.rel not in self.records:  # never staged here: needed, whatever lies there now
                    self.need[i] = 1
                    need_bytes += e.size
                else:
                    try:
                        have: Optional[os.stat_result] = os.lstat(path)
                    except FileNotFoundError:
                        have = None
                    if have is not None and st.S_ISDIR(have.st_mode):
                        return self._where(f"{path} is a directory, the source has a file there")
                    if not _up_to_date(e, self.records.get(e.rel), have):
                        self.need[i] = 1
                        need_bytes += e.size
                        if have is not None:
                            replaced += have.st_size
                            largest = max(largest, have.st_size)
            vfs = os.statvfs(dst)
        except OSError as exc:
            return self._where(f"preparing {exc.filename or dst}: {exc.strerror}")
        free = vfs.f_bavail * vfs.f_frsize
        want = need_bytes - replaced + largest  # a replaced file is freed only after its copy is in
        if want > free:
            return self._where(f"not enough space in {dst}: need {want} bytes, {free} free (disk full)")
        return None

    def _load_manifest(self) -> Tuple[Dict[str, list], bool]:
        records: Dict[str, list] = {}
        try:
            with open(os.path.join(self.dst, MANIFEST)) as f:
                doc = json.load(f)
            if doc.get("version") == 1 and doc.get("source") == self.src:
                records = doc["files"]
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            log.warning("%s: ignoring unreadable stage manifest in %s: %s", self.host, self.dst, exc)
        journals = _journals(self.dst)
        for name in journals:
            try:
                with open(os.path.join(self.dst, name)) as f:
                    head = f.readline()
                    if not head.endswith("\n") or json.loads(head).get("source") != self.src:
                        continue
                    for line in f:
                        if not line.endswith("\n"):
                            break  # torn last line of a killed stage
                        rel, rec = json.loads(line)
                        records[rel] = rec
            except (OSError, ValueError) as exc:
                log.warning("%s: ignoring the rest of stage journal %s in %s: %s", self.host, name, self.dst, exc)
        interrupted = bool(journals)
        return records, interrupted

    # - the transfer

    def open(self, idx: int) -> Optional[int]:
        """A fresh temporary file for entry ``idx`` (None when this node skips it)."""
        if self.broken is not None or idx in self.failed:
            return None
        e = self.entries[idx]
        if e.size > DEFAULT_CHUNK_BYTES or time.monotonic() - self.last_journal > _JOURNAL_SECONDS:
            self.checkpoint()  # record what is done before a long file, so a kill loses little
        tmp = self.tmp_path(self.path(idx))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            self.fail(idx, f"cannot create {tmp}: {exc.strerror}")
            return None
        self.fds[idx], self.crcs[idx] = fd, 0
        return fd

    def write_round(self, pieces: Sequence[Piece], buf: Any, verify: bool) -> None:
        """Write this node's pieces of one broadcast round (on the writer thread)."""
        trailer = np.frombuffer(buf, dtype=np.int64, count=2 * len(pieces), offset=_trailer_at(pieces))
        mv, pos = memoryview(buf), 0
        for j, (idx, off, n) in enumerate(pieces):
            view = mv[pos: pos + n]
            pos += n
            if not self.need[idx]:
                continue
            if trailer[2 * j + 1]:  # the root could not read it: its error fails the stage
                self.fail(idx, None)
                continue
            fd = self.open(idx) if off == 0 else self.fds.get(idx)
            if fd is None:
                continue
            try:
                _pwrite_all(fd, view, off)
            except OSError as exc:
                self.fail(idx, f"writing {self.path(idx)}: {exc.strerror}")
                continue
            crc = zlib.crc32(view, self.crcs[idx]) if verify else int(trailer[2 * j])
            self.crcs[idx] = crc
            if crc != int(trailer[2 * j]):
                self.fail(idx, f"{self.path(idx)}: checksum mismatch at byte {off + n} (corrupted in transfer)")
            elif off + n == self.entries[idx].size:
                self.complete(idx, crc)

    def complete(self, idx: int, crc: Optional[int]) -> None:
        """Check size, set mode and times, rename into place, record."""
        final = self.path(idx)
        try:
            done = _seal(self.fds.pop(idx), self.entries[idx], self.tmp_path(final), final)
        except OSError as exc:
            self.fds[idx] = -1  # closed; fail() removes the temporary file
            self.fail(idx, exc.strerror if exc.errno == 0 else f"finishing {final}: {exc.strerror}")
            return
        self.record(idx, done, crc)

    def copy_in(self, idx: int, source: str) -> Tuple[int, Optional[os.stat_result], Optional[str], bool]:
        """Copy one file from ``source`` in the kernel, check and seal it. Returns (bytes read, the
        copy's stat, error, whether the source is to blame)."""
        e = self.entries[idx]
        final = self.path(idx)
        tmp = self.tmp_path(final)
        try:
            sfd = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            return 0, None, f"reading {source}: {exc.strerror}", True
        fd, copied = -1, 0
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            copied = _kernel_copy(sfd, fd, e.size)
            why = _changed(sfd, e) if copied == e.size else f"source file {source} shrank while being staged"
            if why:
                os.close(fd)
                os.unlink(tmp)
                return copied, None, why, True
            fd, sealed = -1, fd
            return copied, _seal(sealed, e, tmp, final), None, False
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return copied, None, exc.strerror if exc.errno == 0 else f"writing {final}: {exc.strerror}", False
        finally:
            os.close(sfd)

    def record(self, idx: int, done: os.stat_result, crc: Optional[int]) -> None:
        """Entry ``idx`` is in place as ``done``: remember it for the journal and the manifest."""
        e, s = self.entries[idx], done
        rec = [e.size, e.mtime_ns, e.mode, crc, s.st_ino, s.st_ctime_ns]
        self.records[e.rel] = rec
        self.unjournaled.append((e.rel, rec))
        self.files_written += 1
        self.bytes_written += e.size

    def fail(self, idx: int, why: Optional[str]) -> None:
        """Drop entry ``idx``'s temporary file; ``why`` (None: the root's error says it) fails the stage."""
        fd = self.fds.pop(idx, None)
        if fd is not None:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(self.tmp_path(self.path(idx)))
            except OSError:
                pass
        if why is not None:
            self.failed.setdefault(idx, why)
            self.broken = self.broken or why

    def checkpoint(self) -> None:
        """Append the files finished since the last checkpoint to the journal."""
        self.last_journal = time.monotonic()
        if not self.unjournaled:
            return
        if self.durable:
            _syncfs(self.dst)
        if self.journal is None:
            self.journal = open(os.path.join(self.dst, self.journal_name), "w")
            self.journal.write(json.dumps({"source": self.src}) + "\n")
        self.journal.write("".join(json.dumps(item) + "\n" for item in self.unjournaled))
        self.journal.flush()
        if self.durable:
            os.fsync(self.journal.fileno())
        self.unjournaled.clear()

    # - after the transfer

    def finish(self) -> Optional[str]:
        """Write the manifest (or keep the journal after an error), then directories' modes and
        mtimes. Returns this node's first error, named."""
        if not self.writes:
            return None
        for idx in list(self.fds):
            self.fail(idx, f"{self.path(idx)}: incomplete")
        try:
            if self.failed:
                self.checkpoint()  # what did finish is kept for the next call
                return self._where(next(iter(self.failed.values())))
            if self.files_written or self.journal is not None or self.interrupted or self._stale_records():
                self._write_manifest()
            self._set_dir_attributes()
        except OSError as exc:
            return self._where(f"finishing {exc.filename or self.dst}: {exc.strerror}")
        finally:
            if self.journal is not None:
                self.journal.close()
        return None

    def _stale_records(self) -> bool:
        return len(self.records) != sum(e.kind == _FILE for e in self.entries)

    def _write_manifest(self) -> None:
        current = {e.rel for e in self.entries if e.kind == _FILE}
        doc = {"version": 1, "source": self.src,
               "files": {rel: rec for rel, rec in self.records.items() if rel in current}}
        if self.durable:
            _syncfs(self.dst)
        tmp = self.tmp_path(os.path.join(self.dst, MANIFEST))
        with open(tmp, "w") as f:
            f.write(json.dumps(doc, separators=(",", ":")))  # the C encoder; json.dump is pure Python
            if self.durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.dst, MANIFEST))
        for name in _journals(self.dst):
            try:
                os.unlink(os.path.join(self.dst, name))
            except FileNotFoundError:
                pass

    def _set_dir_attributes(self) -> None:
        for i in range(len(self.entries) - 1, -1, -1):  # children before their parents
            e = self.entries[i]
            if e.kind == _DIR:
                path = self.path(i)
                os.chmod(path, e.mode)
                os.utime(path, ns=(e.atime_ns, e.mtime_ns))


def _journals(dst: str) -> List[str]:
    """The journals in ``dst``: the root's, and one per rank that helped on a one-node job."""
    try:
        return sorted(n for n in os.listdir(dst) if n == JOURNAL or n.startswith(JOURNAL + "."))
    except OSError:
        return []


def _seal(fd: int, e: Entry, tmp: str, final: str) -> os.stat_result:
    """Check the size of the written temporary file, give it the source's mode and times, close
    it and rename it into place; returns the copy's stat. ``fd`` is closed whatever happens."""
    try:
        size = os.fstat(fd).st_size
        if size != e.size:
            raise OSError(0, f"{final}: wrote {size} bytes, the source has {e.size}")
        os.fchmod(fd, e.mode)
        os.utime(fd, ns=(e.atime_ns, e.mtime_ns))
    finally:
        os.close(fd)
    os.replace(tmp, final)
    return os.stat(final)


def _up_to_date(e: Entry, rec: Optional[list], have: Optional[os.stat_result]) -> bool:
    """The copy is the one this stage recorded and the source is unchanged since."""
    if rec is None or have is None or not st.S_ISREG(have.st_mode):
        return False
    size, mtime, mode, _crc, ino, ctime = rec
    return ((size, mtime, mode) == (e.size, e.mtime_ns, e.mode)
            and (have.st_ino, have.st_size, have.st_mtime_ns, have.st_ctime_ns) == (ino, size, mtime, ctime))


def _make_writable(path: str) -> None:
    mode = st.S_IMODE(os.stat(path).st_mode)
    if mode & 0o700 != 0o700:  # a read-only source directory, staged before: writable until the end
        os.chmod(path, mode | 0o700)


def _ensure_dir(path: str) -> None:
    try:
        s = os.lstat(path)
    except FileNotFoundError:
        os.mkdir(path, 0o700)
        return
    if not st.S_ISDIR(s.st_mode):  # the source has a directory where the copy has something else
        os.unlink(path)
        os.mkdir(path, 0o700)
        return
    _make_writable(path)


def _ensure_link(path: str, e: Entry, tmp: str) -> None:
    try:
        if os.readlink(path) == e.target:
            return
    except FileNotFoundError:
        pass
    except OSError:  # not a link
        if os.path.isdir(path) and not os.path.islink(path):
            raise OSError(21, "the source has a symbolic link here, the copy a directory", path) from None
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    os.symlink(e.target, tmp)
    os.utime(tmp, ns=(e.atime_ns, e.mtime_ns), follow_symlinks=False)
    os.replace(tmp, path)


def _remove_temporaries(dst: str, suffix: str) -> None:
    """A stage was killed here: this node's temporary files (``suffix``) are not data, remove them."""
    for folder, _dirs, files in os.walk(dst):
        for name in files:
            if name.endswith(suffix):
                try:
                    os.unlink(os.path.join(folder, name))
                except OSError:
                    pass


def _syncfs(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)
