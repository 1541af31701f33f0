"""Stage-in: copy a dataset that one rank can read to every node's local disk, reading it once.

The mirror of file sync. ``stage(src, dst)`` is collective: rank ``root`` (default 0) walks
``src`` (a file or a directory tree; only that rank needs to see it), every node's leader looks at
``dst`` (the same path on every node, a node-local directory) and says which files it lacks, and
the root reads each file that any node lacks exactly once. Its bytes travel to the node leaders
in a broadcast among them -- cost grows with log(nodes), not nodes -- and each leader writes them
once for its node. Small files are batched into one broadcast (up to ``chunk_bytes`` of data and
:data:`MAX_PIECES` files per broadcast), big files are cut into chunks and pipelined: the root
reads chunk k+1 while chunk k travels, a leader writes chunk k while k+1 arrives, three buffers of
``chunk_bytes`` each at most. The ranks on the root's node share the listing (the root walks the
names, each rank stats a share); the node leaders take it in rounds (:mod:`.rounds`: a leader
holds one round of it, not the dataset's). On one node nothing needs to travel: the node's ranks claim
blocks of files one at a time and copy them in the kernel (``copy_file_range``), like ``cp``; a
file over :data:`SPLIT_BYTES` is cut in one byte range per rank.

Nothing half-done passes as done:

- every file is written to a hidden temporary name beside its final one (``.NAME.hpcsync-tmp``),
  checked -- its size, and for bytes that crossed MPI a CRC-32 against the root's, piece by piece --
  given its mode and mtime, then renamed into place; on one node a new folder of small files is
  filled under a hidden name instead and renamed into place whole (one rename, not one per file:
  readers see all of its files or none; a folder whose copy failed is removed, not put in place,
  and a folder that something else wrote into meanwhile gets its files one rename each);
- a manifest in ``dst`` (:data:`MANIFEST`, with a journal while a stage runs) records what was
  staged, with the source's size, mtime and mode and the copy's inode, size, mtime and ctime. A
  later call skips a file only when all of them still match, so a file changed at the source, or
  truncated, rewritten or deleted at a destination, is staged again, and a second call rewrites
  nothing;
- a stage killed half way leaves only temporary names and folders (removed by the next call) and
  files that are complete; the journal, appended at least once a second and before each large file, lets the
  next call skip what was finished (a resumed stage rewrites it under a temporary name first, so
  a kill amid that rewrite loses nothing);
- any error -- a missing or unreadable source, a destination that overlaps the source
  (:mod:`.overlap`), a destination that is not writable or too small on one node, a file
  changing while it is read, a journal that cannot be written, on one node an error of any kind
  on any rank, across nodes one of any kind while the source is listed or on a node leader
  while the bytes move (in its reader or writer thread too) -- raises the same
  :class:`~hpcsync.core.errors.StageError` on every rank, naming the rank, its node and the path; no
  rank is left waiting for another. A source that cannot be listed leaves nothing behind, not
  even ``dst``.

Directories get their mode and mtime once their files are in. Symbolic links are copied as links
(never followed, except a link given as ``src`` itself); sockets, FIFOs and devices are listed in
:attr:`StageResult.ignored`. Files in ``dst`` that the source lacks are left alone. With
``durable=True`` the node's filesystem is synced (``syncfs``) before the journal or manifest names a
file, so a power loss cannot leave a recorded file with lost data; the default is safe against
killed processes, which is what node-local scratch (``$SLURM_TMPDIR``) needs.

At N ranks on M nodes, each exchange is bounded by the timeout (per round, not per stage).
Per stage: three private duplicates (the group, the node, the leaders: ``Idup``, O(log N)
rounds each); the agreement on the arguments and on errors are all-gathers of a few hundred
bytes per rank (what every rank receives grows with N: about 2 MB at 8,192 ranks); the bytes
go down the leaders' broadcast (O(log M) or a pipelined chain, :mod:`.broadcast`); a node's
other ranks receive a heartbeat from their leader at most every ``timeout / 4`` seconds and
the result, a summary of a few hundred bytes (no names unless asked).
"""
from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from ...core import bigmpi, bounded, mpi
from ...core.errors import CollectiveTimeout, StageError, StageTimeout, raise_if_any, raise_if_settings_differ
from ...observe.progress import Progress
from .destination import Destination
from .options import StageOptions
from .listing import (DEFAULT_CHUNK_BYTES, DIR, FILE, LINK, MAX_PIECES, Entry, assemble, blocks,
                      collector_paused, scan, stat_names, walk_names)
from .broadcast import Reader, close_bar, unexpected
from .heartbeat import Heartbeat
from .overlap import overlap
from .rounds import stage_across_nodes
from .transfer import copy_blocks, copy_shared, help_on_one_node, identity, idle_until_all_arrive

__all__ = ["stage", "StageResult"]

PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class StageResult:
    """What a stage did (the same on every rank, but ``received_bytes``)."""

    source: str
    destination: str
    files: int  # regular files in the source
    bytes: int  # their bytes
    dirs: int
    symlinks: int
    copied_files: int  # files some node lacked: read once, written where they were missing
    skipped_files: int  # files already up to date on every node
    copied: Optional[Tuple[str, ...]]  # their names, with ``names=True`` (else None)
    skipped: Optional[Tuple[str, ...]]
    copied_bytes: int
    source_reads: int  # bytes read from the source (== copied_bytes: each byte once)
    broadcasts: int  # broadcast rounds among node leaders (0 on one node)
    nodes: int  # (ranks of a host that see different directories at dst count as that many nodes)
    written: Tuple[Tuple[str, int, int], ...]  # per node: (hostname, files written, bytes written)
    ignored: Tuple[str, ...]  # sockets, FIFOs, devices: not staged
    seconds: float
    received_bytes: int = 0  # what this rank received from the others (MPI payloads): differs by rank


@collector_paused()  # its objects live to its end and form no cycles: no collection walks them all
def stage(
    src: PathLike,
    dst: PathLike,
    *,
    root: int = 0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    durable: bool = False,
    progress: Optional[bool] = None,
    timeout: Optional[float] = None,
    names: bool = False,
    group: Any = None,
) -> StageResult:
    """Copy ``src`` (a file or directory that rank ``root`` can read) into the directory ``dst`` on
    every node (collective).

    A directory's contents land in ``dst`` (as ``rsync -a src/ dst/``); a single file lands as
    ``dst/<name>``. Each source byte is read once, by ``root``; files already staged and unchanged
    are skipped. ``chunk_bytes`` bounds each of the three pipeline buffers; ``durable`` syncs the
    destination filesystem before recording files; ``progress`` shows a bar on the root (default:
    when stderr is a terminal). ``timeout`` (default ``HPCSYNC_TIMEOUT``) bounds each exchange
    among the ranks, not the whole stage: a broadcast round, the listing, the result; a node's
    own disk or the source gets a quarter of it to make progress on a file, so its error (the
    node, the file, reading or writing) comes before the others' rounds time out. ``names``: the
    result lists every file copied and skipped (by default it counts them: the names of a
    million files on every rank cost memory). ``group``: the ranks taking part, a torch process
    group (under MPI) or an mpi4py communicator (default: the world). ``dst`` may not be
    ``src``, lie inside it or hold it (links and ``..`` resolved, a missing ``dst`` through its
    nearest existing folder): refused before anything is made.
    Raises :class:`~hpcsync.core.errors.StageError` on every rank if anything fails, and
    :class:`~hpcsync.core.errors.StageTimeout` (a StageError and a CollectiveTimeout) on the
    ranks that waited past the timeout for a rank that stopped.
    """
    t0 = time.perf_counter()
    from ...core.comm import group_comm

    base = _transport(group_comm(group))
    me, size = base.Get_rank(), base.Get_size()
    if not 0 <= root < size:
        raise ValueError(f"root {root} outside the world of {size} rank(s)")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    limit = bounded.default_timeout() if timeout is None else float(timeout)
    if not limit > 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    chunk_bytes = min(int(chunk_bytes), bigmpi.INT_MAX - 16 * MAX_PIECES - 16)  # a round's count fits an int
    src, dst = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
    opts = StageOptions(src, dst, root, chunk_bytes, durable, progress, limit, names)
    what = f"stage of {src} to {dst} failed: "
    host = socket.gethostname()
    comm = bounded.over(base, f"agreeing on the arguments on rank {me} ({host})", limit)
    made: List[Any] = [comm]
    try:
        raise_if_settings_differ(comm, opts.agreed(), StageError,
                                 "stage: ranks called it with different arguments (desync), nothing staged: ")
        result = _stage(comm, base, made, opts, what, host)
    except CollectiveTimeout as exc:
        if isinstance(exc, StageError):
            raise
        raise StageTimeout(f"{what}{exc}") from None
    finally:
        for c in made:
            if hasattr(c, "free"):
                c.free()
    received = sum(getattr(c, "received", 0) for c in made)
    return StageResult(**{**result, "seconds": time.perf_counter() - t0, "received_bytes": received})


def _stage(comm: Any, base: Any, made: List[Any], opts: StageOptions, what: str, host: str) -> Dict[str, Any]:
    """The stage once the ranks agree on what it is: the result (a dict) on every rank. Each
    communicator it makes goes into ``made`` (bounded; freed by the caller)."""
    src, dst, root, limit = opts.src, opts.dst, opts.root, opts.limit
    me, size = comm.Get_rank(), comm.Get_size()
    phase = f"%s on rank {me} ({host})"
    node_raw, leaders_raw = _split(base, root, dst)
    node = bounded.over(node_raw, phase % "listing the source", limit)
    leaders = None if leaders_raw is None else \
        bounded.over(leaders_raw, phase % "sending the listing to the node leaders", limit)
    made += [c for c in (node, leaders) if c is not None]
    made += [c for c in (node_raw, leaders_raw) if c is not None and c is not base and c != mpi.MPI().COMM_SELF]
    one_node = size > 1 and node.Get_size() == size  # its ranks share the listing and the copying
    # each node's writer (its leader; on one node the root) refuses a destination that overlaps the
    # source in its own view, before the source is walked or anything made: a listing error
    try:
        refused = overlap(src, dst) if leaders is not None else None
    except Exception as exc:  # (a NUL in a path) every rank must still reach the agreement below
        refused = unexpected(exc)
    entries, ignored, err = _list_source(node, me == root, src, one_node, me, refused)
    err = err or refused
    _say(comm, phase % "agreeing on the listing")
    if one_node:  # every rank has the listing's error already
        if err:
            raise StageError(f"{what}rank {root}: node {host}: {err}")
    else:
        raise_if_any(comm, err and f"node {host}: {err}", StageError, what)
    beat = Heartbeat(node, limit, f"{_leader_of(node, me)} ({host})") if size > 1 and not one_node else None
    result = None
    if leaders is not None:
        try:
            result, err = _stage_on_leader(leaders, entries, ignored, opts, node if one_node else None, beat, phase)
        except CollectiveTimeout as exc:
            if beat is not None:
                beat.done(f"rank {me}: node {host}: {exc}", timed_out=True)
            raise
        except Exception as exc:
            if not one_node:
                if beat is not None:
                    beat.done(f"rank {me}: node {host}: {unexpected(exc)}")
                raise
            # the other ranks are past their last exchange with this one (copy_shared sees to
            # it): they learn this error from the broadcast below
            result, err = None, f"node {host}: {unexpected(exc)}"
        if beat is not None:
            beat.done(None)  # this node's own error reaches every rank below, named once
    elif one_node:
        help_on_one_node(node, src, dst, opts.durable, entries, me)
    elif beat is not None:
        beat.follow(what)
    _say(comm, phase % "agreeing on the outcome")
    idle_until_all_arrive(comm)
    if one_node:  # the root has every rank's error (the others send theirs to it)
        result, err = comm.bcast((result, err), root=root)
        if err:  # (an error another rank of the node reported names that rank already)
            raise StageError(what + (err if err.startswith("rank ") else f"rank {root}: {err}"))
    else:
        raise_if_any(comm, err, StageError, what)
        result = comm.bcast(result, root=root)
    return result


def _say(comm: Any, doing: str) -> None:
    """What the ranks are doing, for a bounded communicator's timeout error."""
    if hasattr(comm, "what"):
        comm.what = doing


def _leader_of(node: Any, me: int) -> str:
    """The node leader's rank in the stage's group, as a non-leader names it."""
    return str(node.bcast(me, root=0))


def _transport(comm: Any) -> Any:
    from ...core.torchcomm import world

    w = comm if comm is not None else world()
    if not hasattr(w, "Bcast") and w.Get_size() > 1:
        raise StageError("stage needs MPI (mpi4py) in a multi-rank job; this one runs on torch.distributed "
                         "only: launch it with mpirun/mpiexec/srun --mpi and install mpi4py")
    return w


def _split(comm: Any, root: int, dst: str) -> Tuple[Any, Any]:
    """(this node's communicator, the node leaders' communicator or None). ``root`` leads its node
    and is rank 0 among the leaders. A "node" is the ranks of one host that see the same ``dst``:
    a rank that sees another directory there (a private ``/tmp`` in a container) is a node of its
    own, which gets its own copy."""
    if comm.Get_size() == 1:
        return comm, comm
    MPI = mpi.MPI()
    me = comm.Get_rank()
    key = 0 if me == root else me + 1
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=key)
    if node.Get_size() > 1:
        seen = node.allgather(_destination(dst))
        if len(set(seen)) > 1:
            mine = node.Split(seen.index(seen[node.Get_rank()]), key=key)
            node.Free()
            node = mine
    if node.Get_size() == comm.Get_size():  # one node: the root leads alone
        return node, (MPI.COMM_SELF if me == root else None)
    leaders = comm.Split(0 if node.Get_rank() == 0 else MPI.UNDEFINED, key=key)
    return node, (None if leaders == MPI.COMM_NULL else leaders)


def _destination(dst: str) -> Tuple[Optional[Tuple[int, int]], str]:
    """What ``dst`` is as this rank sees it, made or changed by nothing (a source that cannot be
    listed leaves no destination behind): its identity, or while it is missing, the identity of
    its nearest existing ancestor and the path from there (ranks with a ``/tmp`` of their own see
    different ancestors)."""
    path, rest = dst, ""
    while True:
        ident = identity(path)
        parent, name = os.path.split(path)
        if ident is not None or parent == path:
            return ident, rest
        path, rest = parent, f"{name}/{rest}" if rest else name


def _list_source(node: Any, is_root: bool, src: str, one_node: bool, me: int, refused: Optional[str] = None
                 ) -> Tuple[List[Entry], List[str], Optional[str]]:
    """The source's listing, made on the root's node: the root walks the names, every rank there
    takes a share of the ``stat`` calls (a tree of small files costs system calls; a rank that
    does not see the very source leaves its share to the root). Returns ``(entries, ignored,
    error)`` on the root, and on every rank of a one-node job (which all copy), where the error
    too is every rank's. An error no check expects becomes the listing's error: every rank still
    reaches each exchange (``me``, this rank in the stage's group, names where it happened).
    ``refused``: the root's refusal of the arguments, its error instead of a walk."""
    if node.Get_size() == 1 or (not one_node and node.bcast(is_root, root=0) is not True):  # not the root's node
        if not is_root:
            return [], [], None
        return ([], [], refused) if refused else _guarded(scan, src, ([], []))
    names, dirs, err = (([], bytearray(), refused) if refused else _guarded(walk_names, src, ([], bytearray()))) \
        if is_root else ([], bytearray(), None)
    idle_until_all_arrive(node)  # the others wait for the walk without spinning a core
    n = node.Get_size()
    cut = [len(names) * r // n for r in range(n + 1)]
    single = len(names) == 1 and not dirs[0]
    if one_node:  # every rank copies: every rank gets the whole listing
        plan = node.bcast((names, dirs, identity(src), single) if is_root and err is None else err, root=0)
    else:  # the others only stat: each gets the names of its share, and keeps none of them
        plan = node.scatter(None if not is_root else [err] * n if err is not None else
                            [(names[cut[r]:cut[r + 1]], dirs[cut[r]:cut[r + 1]], identity(src), single)
                             for r in range(n)], root=0)
    if not isinstance(plan, tuple):  # the walk failed
        return [], [], plan if one_node or is_root else None
    if one_node or not is_root:
        names, dirs, ident, single = plan
    else:
        ident = plan[2]
    whole = one_node or is_root  # holds every name (a share's names are numbered from 0)
    cut = [len(names) * r // n for r in range(n + 1)]

    def share(r: int) -> Any:
        try:
            return stat_names(src, names, dirs, *((cut[r], cut[r + 1]) if whole else (0, len(names))), single)
        except Exception as exc:
            return [], f"{unexpected(exc)} (on rank {me})"

    part = share(node.Get_rank()) if is_root or identity(src) == ident else None
    idle_until_all_arrive(node)
    parts = node.allgather(part) if one_node else node.gather(part, root=0)
    if parts is None:
        return [], [], None
    if None in parts:  # the root stats the shares of ranks that do not see this source
        done = [share(r) if p is None else p for r, p in enumerate(parts)] if is_root else None
        parts = node.bcast(done, root=0) if one_node else done
    stats: List[Any] = []
    for p in parts:
        if p[1] is not None:
            return [], [], p[1]
        stats += p[0]
    try:
        entries, ignored = assemble(names, stats)
        err = None
    except Exception as exc:
        entries, ignored, err = [], [], f"{unexpected(exc)} (on rank {me})"
    if one_node:  # each rank assembled its own: one's error is every rank's
        err = next((e for e in node.allgather(err) if e), None)
    return entries, ignored, err


def _guarded(listing: Any, src: str, nothing: Tuple[Any, Any]) -> Tuple[Any, ...]:
    """``listing(src)``, whose last item is its error; an error no check expects becomes that
    error, after ``nothing``."""
    try:
        return listing(src)
    except Exception as exc:
        return (*nothing, unexpected(exc))


def _stage_on_leader(leaders: Any, entries: List[Entry], ignored: List[str], opts: StageOptions, helpers: Any = None,
                     beat: Optional[Heartbeat] = None, phase: str = "%s") -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """What each node lacks, the transfer; the result on the root. Across nodes, the leaders take
    the listing in rounds (:mod:`.rounds`); on one node, the root copies (``helpers``: a one-node
    job's communicator, whose ranks share the copying); ``beat``: tells the node's other ranks of each
    step; ``phase``: what a timeout says the ranks were doing (``%s``: the step)."""
    tick = beat.beat if beat is not None else (lambda: None)
    if leaders.Get_size() > 1:
        return stage_across_nodes(leaders, entries, ignored, opts, tick, lambda doing: _say(leaders, phase % doing))
    src, dst, durable, progress, names = opts.src, opts.dst, opts.durable, opts.progress, opts.names
    host = socket.gethostname()
    node = Destination(dst, src, entries, durable, host, call=uuid.uuid4().hex)
    err = node.open_destination(uuid.uuid4().hex[:12], 0)
    node.close_probe()
    if err is None:
        try:
            err = node.prepare(whole_folders=True)
        except Exception as exc:  # every rank must still reach the collectives below
            err = f"node {host}: {unexpected(exc)}"
    if err is not None:
        if helpers is not None:
            idle_until_all_arrive(helpers)
            helpers.scatter([None] * helpers.Get_size(), root=0)  # nothing for them to do
        return None, err
    todo = [(i, entries[i].size) for i in np.flatnonzero(node.need).tolist()]
    total = sum(n for _, n in todo)
    reader = Reader(src, entries)
    bar = None
    try:  # an error from here on is this node's: every helper still takes part in the copy
        node.start()  # the journal, then the links: nothing is written where a node cannot take the copy
        bar = Progress(f"staging {os.path.basename(src) or src}", total, enabled=progress)
    except Exception as exc:
        node.note(unexpected(exc))
    try:
        if helpers is not None:
            copy_shared(helpers, src, entries, todo, node, reader, bar)
        elif todo:
            copy_blocks(blocks(entries, [i for i, _ in todo], node.units), src, entries, node, reader, bar)
    finally:
        close_bar(bar, node)
    try:
        err = reader.error or node.finish()
    except Exception as exc:
        err = f"node {host}: {unexpected(exc)}"
    files = [e for e in entries if e.kind == FILE]
    need = node.need.view(bool)
    result = dict(
        source=src, destination=dst, files=len(files), bytes=sum(e.size for e in files),
        dirs=sum(e.kind == DIR for e in entries), symlinks=sum(e.kind == LINK for e in entries),
        copied_files=len(todo), skipped_files=len(files) - len(todo),
        copied=tuple(entries[i].rel for i, _ in todo) if names else None,
        skipped=tuple(e.rel for i, e in enumerate(entries) if e.kind == FILE and not need[i]) if names else None,
        copied_bytes=total, source_reads=reader.read_bytes, broadcasts=0,
        nodes=1, written=((host, node.files_written, node.bytes_written),), ignored=tuple(ignored))
    return result, err
