"""Join every rank's part file into one target file, in rank order, without losing anything.

Where parts live: :func:`part_path` -- by default beside the target in a hidden folder,
``<dir>/.<name>.parts/rank00007<suffix>``, or under ``parts_dir`` / ``$HPCSYNC_PARTS_DIR`` (a
node-local temp dir is fine for the gather method: each rank reads only its own part).
``sync_file(path)`` looks for each rank's part there, or at ``part=`` (a path, or a pattern with
``{rank}``).

Methods: ``copy`` -- the root opens every part itself and concatenates them in the kernel
(``copy_file_range``): no byte passes through MPI or user memory. Used when the root really sees
the very files the ranks wrote (each rank reports device, inode and size of its parts; the root
checks them with its own ``stat``). In practice that is one node: device numbers are per mount,
so a shared NFS/Lustre file seen from two nodes does not match either, which is the conservative
answer (a node-local file at the same path must never pass for another rank's part).
``gather`` -- parts travel to the root in rounds of MPI ``Gatherv`` on variable-length
byte buffers (no padding) and the root writes them at their offsets: root memory stays below
``round_bytes`` (default 256 MiB) whatever the size. ``mpiio`` -- every rank writes its own bytes
into the target with collective ``File.Write_at_all`` at ``Exscan`` offsets (target on a shared
filesystem). ``auto`` uses ``copy`` when the root sees every part (on several nodes only below
256 MiB), else ``mpiio`` when several nodes see the target's directory (Lustre, GPFS; not NFS)
and the merge is 256 MiB or more, else ``gather``. The gather path is pipelined:
senders read round k+1 while round k travels, the root writes round k while k+1 arrives. The root's own part is
copied file-to-file in the kernel (``copy_file_range``), never through Python memory.

Nothing is lost: the target is written to a temporary file in its directory, flushed, fsynced
and renamed; parts are deleted only after that; every failure (missing or unreadable part,
unequal headers, full disk, bad target directory) is agreed collectively and raised as the same
:class:`~hpcsync.core.errors.SyncError` on every rank, with all parts left in place.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shlex
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ..core import bigmpi, bounded, jobend, settings
from ..core.torchcomm import world as _world  # MPI's world, else torch.distributed's, else SELF
from ..core.errors import CollectiveTimeout, SyncError, SyncTimeout, raise_if_any, raise_if_settings_differ
from . import flags as flags_mod
from .transports import choose_method, Part, Source, write_copy, write_gather, write_mpiio
from ..observe.progress import Progress

__all__ = ["PathLike", "METHODS", "SyncOptions", "part_path", "SyncResult", "fsync_dir", "merge_parts", "sync_file",
           "SyncedFile"]

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]
METHODS = ("auto", "copy", "gather", "mpiio")
_HEADER_SCAN = 1 << 20


@dataclass(frozen=True)
class SyncOptions:
    """How the parts are joined: the keyword arguments of :func:`sync_file`, :func:`merge_parts`
    and :class:`SyncedFile` (their docstring says what each means), checked once, when made."""

    root: int = 0
    strip_header: bool = False
    check_headers: bool = True
    text: bool = True
    allow_missing: bool = False
    keep_parts: bool = False
    method: str = "auto"
    round_bytes: int = bigmpi.DEFAULT_ROUND_BYTES
    progress: Optional[bool] = None
    timeout: Optional[float] = None
    append: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.timeout is not None and not float(self.timeout) > 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")
        if self.append and self.root != 0:  # rank 0 reads the file first: it must be the root's very file
            raise ValueError("append=True needs root=0 (the file's rows come first, read where it is written)")

    def limit(self) -> float:
        """Seconds each exchange waits: ``timeout``, else ``HPCSYNC_TIMEOUT`` (read now)."""
        return bounded.default_timeout() if self.timeout is None else float(self.timeout)

    def agreed(self, target: str) -> Dict[str, Any]:
        """What every rank must give alike for one merge (``round_bytes`` and ``progress`` may differ)."""
        return {"target": target, "root": self.root, "strip_header": self.strip_header,
                "check_headers": self.check_headers, "text": self.text, "allow_missing": self.allow_missing,
                "keep_parts": self.keep_parts, "method": self.method, "timeout": self.limit(), "append": self.append}


def part_path(path: PathLike, rank: Optional[int] = None, parts_dir: Optional[PathLike] = None) -> str:
    """Where rank ``rank`` (default: this rank) keeps its part of ``path``."""
    if rank is None:
        rank = _world().Get_rank()
    path = os.path.abspath(os.fspath(path))
    folder, name = os.path.split(path)
    base = parts_dir or settings.text("HPCSYNC_PARTS_DIR")
    if base:  # one parts_dir serves many targets: out1/m.csv and out2/m.csv must not share parts
        tag = hashlib.sha1(path.encode()).hexdigest()[:8]
        where = os.path.join(os.fspath(base), f"{name}.{tag}.parts")
    else:
        where = os.path.join(folder, f".{name}.parts")
    return os.path.join(where, f"rank{rank:05d}{os.path.splitext(name)[1]}")


@dataclass(frozen=True)
class SyncResult:
    """What a sync did (the same on every rank)."""

    path: str
    bytes: int
    method: str
    seconds: float
    parts_deleted: bool
    ranks: int


def _inspect(path: str, allow_missing: bool, need_header: bool) -> Tuple[Optional[Part], Optional[str]]:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return (None, None) if allow_missing else (None, f"part {path} does not exist")
    except OSError as exc:
        return None, f"cannot stat part {path}: {exc}"
    if not os.path.isfile(path):
        return None, f"part {path} is not a regular file"
    part = Part(path, st.st_size, ident=(st.st_dev, st.st_ino))
    try:
        with open(path, "rb") as f:
            if part.size:
                f.seek(part.size - 1)
                part.ends_newline = f.read(1) == b"\n"
                f.seek(0)
            if need_header and part.size:
                head = b""
                while b"\n" not in head and len(head) < part.size:
                    block = f.read(_HEADER_SCAN)
                    if not block:
                        break
                    head += block
                cut = head.find(b"\n")
                part.header = head[: cut + 1] if cut >= 0 else head
    except OSError as exc:
        return None, f"cannot read part {path}: {exc}"
    return part, None


def _agree(comm: Any, error: Optional[str], what: str) -> None:
    """Raise the same SyncError on every rank if any rank has an error."""
    raise_if_any(comm, error, SyncError, f"{what} failed, nothing deleted: ")


def _plan(comm: Any, my_parts: List[Part], strip_header: bool, check_headers: bool, text: bool,
          target: Optional[str] = None) -> None:
    """Decide header stripping and inserted newlines from every rank's part summaries (``target``:
    the joined file, when it is one of the parts: ``append=True``)."""
    summary = [(p.size, p.header, p.ends_newline, p.path == target) for p in my_parts]
    every = comm.allgather(summary)
    flat = [(r, i, s) for r, parts in enumerate(every) for i, s in enumerate(parts)]
    nonempty = [(r, i, s) for r, i, s in flat if s[0] > 0]
    if strip_header and nonempty:
        first = nonempty[0][2][1]
        differ = [(r, s) for r, _, s in nonempty if s[1] != first]
        if check_headers and differ:
            by = "the joined file" if nonempty[0][2][3] else f"rank {nonempty[0][0]}'s part"
            raise SyncError(
                f"headers differ: {by} starts {first[:200]!r}, the parts of rank(s) {sorted({r for r, _ in differ})} "
                f"start {differ[0][1][1][:200]!r} (pass check_headers=False to merge anyway); nothing deleted")
    # effective content per part after stripping, to place newlines only between content
    keep_header_at = (nonempty[0][0], nonempty[0][1]) if nonempty else None
    effective = []
    for r, i, (size, header, ends, _) in flat:
        skip = len(header) if strip_header and (r, i) != keep_header_at and size else 0
        effective.append((r, i, size - skip, ends, skip))
    last_content = max((k for k, e in enumerate(effective) if e[2] > 0), default=-1)
    me = comm.Get_rank()
    for k, (r, i, eff, ends, skip) in enumerate(effective):
        if r != me:
            continue
        part = my_parts[i]
        part.skip = skip
        part.newline_after = text and eff > 0 and not ends and k < last_content


def _prepare_target(target: str, total: int) -> Tuple[Optional[str], Optional[str]]:
    folder = os.path.dirname(target) or "."
    if not os.path.isdir(folder):
        return None, f"target directory {folder} does not exist"
    if os.path.isdir(target):
        return None, f"target {target} is a directory"
    try:
        st = os.statvfs(folder)
        free = st.f_bavail * st.f_frsize
        if free < total:
            return None, f"not enough space in {folder}: need {total} bytes, {free} free (disk full)"
        tmp = os.path.join(folder, f".{os.path.basename(target)}.hpcsync-{uuid.uuid4().hex[:12]}.tmp")
        with open(tmp, "wb"):
            pass
    except OSError as exc:
        return None, f"cannot write in target directory {folder}: {exc}"
    return tmp, None


def fsync_dir(folder: str) -> None:
    """Flush a directory's entries to disk: a rename into it survives a crash only after this."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def merge_parts(
    target: PathLike,
    my_parts: Sequence[PathLike],
    *,
    root: int = 0,
    strip_header: bool = False,
    check_headers: bool = True,
    text: bool = True,
    allow_missing: bool = False,
    keep_parts: bool = False,
    method: str = "auto",
    round_bytes: int = bigmpi.DEFAULT_ROUND_BYTES,
    progress: Optional[bool] = None,
    timeout: Optional[float] = None,
    group: Any = None,
    append: bool = False,
) -> SyncResult:
    """Collective core of :func:`sync_file`: each rank contributes the files ``my_parts`` (in order).
    ``group``: the ranks taking part (a torch process group or an mpi4py communicator; default the
    world). ``timeout``: as for :func:`sync_file`."""
    options = SyncOptions(root=root, strip_header=strip_header, check_headers=check_headers, text=text,
                          allow_missing=allow_missing, keep_parts=keep_parts, method=method,
                          round_bytes=round_bytes, progress=progress, timeout=timeout, append=append)
    return _merge_parts(target, my_parts, options, group)


def _merge_parts(target: PathLike, my_parts: Sequence[PathLike], options: SyncOptions, group: Any) -> SyncResult:
    t0 = time.perf_counter()
    from ..core.comm import group_comm

    base = group_comm(group)
    size, me = base.Get_size(), base.Get_rank()
    if not 0 <= options.root < size:
        raise ValueError(f"root {options.root} outside the world of {size} rank(s)")
    limit = options.limit()
    if not limit > 0:
        raise ValueError(f"timeout must be positive, got {options.timeout}")
    target = os.path.abspath(os.fspath(target))
    try:
        with bounded.owned(base, f"sync of {target} on rank {me} ({socket.gethostname()})", limit) as comm:
            return _merge(comm, target, my_parts, options, limit, t0)
    except CollectiveTimeout as exc:
        if isinstance(exc, SyncError):
            raise
        raise SyncTimeout(f"sync of {target} failed, nothing deleted: {exc}") from None


def _merge(comm: Any, target: str, my_parts: Sequence[PathLike], options: SyncOptions, limit: float,
           t0: float) -> SyncResult:
    """:func:`merge_parts` on a bounded communicator: every round waits at most ``limit``
    seconds; a rank's own read or the root's write gets a quarter of it."""
    size, me = comm.Get_size(), comm.Get_rank()
    root = options.root
    raise_if_settings_differ(  # every rank must mean the same merge
        comm, options.agreed(target),
        SyncError, "sync_file: ranks called it with different arguments (desync), nothing merged or deleted: ")

    src, err = Source(), None
    paths = [os.path.abspath(os.fspath(p)) for p in my_parts]
    if options.append:  # what the target holds comes first: rank 0's first part
        there = comm.bcast(os.path.isfile(target) if me == root else None, root=root)
        if target in paths:
            err = f"append: the target {target} is also one of rank {me}'s parts"
        if there and me == 0:
            paths.insert(0, target)
    for p in paths:
        part, perr = _inspect(p, options.allow_missing and p != target, options.strip_header)
        err = err or perr
        if part is not None:
            src.parts.append(part)
    _agree(comm, err, f"sync of {target}")
    _plan(comm, src.parts, options.strip_header, options.check_headers, options.text, target)
    mine = src.size
    sizes = bigmpi.allgather_sizes(comm, mine)
    total = sum(sizes)

    tmp, err = _prepare_target(target, total) if me == root else (None, None)
    tmp = comm.bcast(tmp, root=root)
    _agree(comm, err, f"sync of {target}")
    bar = Progress(f"merging {os.path.basename(target)}", total, enabled=options.progress) if me == root else None
    chosen = "gather"
    try:
        chosen, everything = choose_method(comm, options.method, tmp, total, src, root)
        if chosen == "copy":
            err = write_copy(tmp, everything, bar) if me == root else None  # type: ignore[arg-type]
        elif chosen == "mpiio":
            err = write_mpiio(comm, tmp, src, sizes, options.round_bytes, bar)
        else:
            err = write_gather(comm, tmp, src, sizes, root, options.round_bytes, bar, limit / 4)
        # every rank's error first: a rank whose read failed sent zeros, which must not become the target
        _agree(comm, err or src.error, f"sync of {target}")
        err = None
        if me == root:
            try:
                os.replace(tmp, target)  # type: ignore[arg-type]
                fsync_dir(os.path.dirname(target))
            except OSError as exc:
                err = f"cannot rename into {target}: {exc}"
        _agree(comm, err, f"sync of {target}")
    except BaseException:
        if me == root and tmp and not src.stalled and os.path.exists(tmp):  # (a stuck disk: touch nothing)
            os.unlink(tmp)
        raise
    finally:
        if bar is not None:
            bar.close()
    deleted = False
    if not options.keep_parts:
        for p in src.parts:
            if p.path == target:  # (the joined file itself, with append=True)
                continue
            try:
                os.unlink(p.path)
            except OSError as exc:  # the merge is durable; a stale part is only a warning
                log.warning("rank %d: could not delete part %s: %s", me, p.path, exc)
        deleted = True
    result = SyncResult(target, total, chosen, time.perf_counter() - t0, deleted, size)
    return comm.bcast(result, root=root)


def sync_file(
    path: PathLike,
    part: Optional[PathLike] = None,
    *,
    parts_dir: Optional[PathLike] = None,
    root: int = 0,
    strip_header: bool = False,
    check_headers: bool = True,
    text: bool = True,
    allow_missing: bool = False,
    keep_parts: bool = False,
    method: str = "auto",
    round_bytes: int = bigmpi.DEFAULT_ROUND_BYTES,
    progress: Optional[bool] = None,
    timeout: Optional[float] = None,
    append: bool = False,
) -> SyncResult:
    """Join every rank's part of ``path`` into ``path`` on the root rank (collective).

    ``part``: this rank's part; a path, or a pattern with ``{rank}`` (e.g. ``"out.rank{rank}.csv"``);
    default :func:`part_path` (under ``parts_dir`` if given). ``root``: the rank that writes
    ``path``. ``strip_header``: drop the first line of every part but the first non-empty one;
    ``check_headers``: then require those lines to be equal. ``text``: add a newline after a part
    that lacks one (``False`` for byte-exact binary). ``allow_missing``: a rank without a part
    contributes nothing instead of failing. ``keep_parts``: do not delete the parts. ``method``:
    ``auto``, ``copy`` (the root reads the parts), ``gather`` (MPI ``Gatherv``) or ``mpiio``.
    ``round_bytes``: bytes per gather round (bounds the root's memory). ``progress``: a progress
    bar on the root (default: when stderr is a terminal). ``timeout`` (default
    ``HPCSYNC_TIMEOUT``): how long each exchange waits for the other ranks -- a gather round, not
    the whole merge; a rank's own part read or the root's write gets a quarter of it, so a stuck disk
    is named (the rank, its node, the file, reading or writing) in the same
    :class:`~hpcsync.core.errors.SyncError` on every rank, before any round times out. A rank that
    stops (frozen, lost) makes the others raise :class:`~hpcsync.core.errors.SyncTimeout`.
    ``append``: keep what ``path`` already holds and add the parts after it (one header, with
    ``strip_header``: the parts' must equal the file's), written whole as ever: a resumed run's
    rows continue the joined file of the run before it.
    """
    options = SyncOptions(root=root, strip_header=strip_header, check_headers=check_headers, text=text,
                          allow_missing=allow_missing, keep_parts=keep_parts, method=method,
                          round_bytes=round_bytes, progress=progress, timeout=timeout, append=append)
    return _sync(path, part, parts_dir, options)


def _sync(path: PathLike, part: Optional[PathLike], parts_dir: Optional[PathLike], options: SyncOptions) -> SyncResult:
    comm = _world()
    rank = comm.Get_rank()
    if part is None:
        mine = part_path(path, rank, parts_dir)
    else:
        mine = os.fspath(part).format(rank=rank) if "{rank" in os.fspath(part) else os.fspath(part)
    result = _merge_parts(path, [mine], options, comm)
    if result.parts_deleted and part is None:
        # Remove the parts folder once every rank deleted its part, and let no rank go on (and
        # create its next part there) before every rank's rmdir is done: without the second
        # barrier a fast rank's next SyncedFile raced a slow rank's rmdir (FileNotFoundError).
        folder = os.path.dirname(mine)
        try:
            with bounded.owned(comm, f"sync of {os.fspath(path)}: removing the parts folder on rank {rank}",
                               options.limit()) as done:
                done.Barrier(idle=True) if done is not comm else comm.Barrier()
                try:
                    os.rmdir(folder)
                except OSError:
                    pass
                done.Barrier(idle=True) if done is not comm else comm.Barrier()
        except CollectiveTimeout as exc:
            raise SyncTimeout(f"sync of {os.fspath(path)}: the merge is done, but {exc}") from None
    return result


class SyncedFile:
    """A file every rank writes its own part of during training, joined on exit.

    >>> with SyncedFile("metrics.csv", strip_header=True) as part:
    ...     with part.open("w") as f:
    ...         f.write("step,loss\\n")

    Each rank's part is created (empty) up front, so every rank has one; creating one is local
    (with ``append=True`` collective: the ranks check for parts a crash left), entering the block
    is collective. A rank that leaves the
    block with an exception merges nothing and waits for nobody: under :func:`hpcsync.init` the
    exception ends the job in seconds, its traceback first (the other ranks are in the program's
    next collective, not here), every rank's part kept on disk for ``hpcsync merge`` (the
    traceback's last line says the command). Where the job goes on instead
    (``HPCSYNC_ABORT_ON_EXCEPTION=0``, no ``init``), the ranks agree at the end of the block: no
    rank merges, every rank raises :class:`SyncError` (the failing rank its own exception), the
    parts are kept. A ``SystemExit`` (the preemption guard's stop) is an end like any other: the
    parts are joined, then the exit goes on.
    """

    def __init__(self, path: PathLike, *, parts_dir: Optional[PathLike] = None, mode: str = "w",
                 root: int = 0, strip_header: bool = False, check_headers: bool = True, text: bool = True,
                 allow_missing: bool = False, keep_parts: bool = False, method: str = "auto",
                 round_bytes: int = bigmpi.DEFAULT_ROUND_BYTES, progress: Optional[bool] = None,
                 timeout: Optional[float] = None, append: bool = False) -> None:
        """``mode``: ``"w"`` starts a new part, ``"a"`` appends to this rank's existing one; the
        other arguments are :func:`sync_file`'s. ``append=True`` continues the joined file of a
        run before this one (a resumed run: the rows it had joined are kept, this run's follow)."""
        if mode not in ("w", "a"):
            raise ValueError("mode must be 'w' (start a new part) or 'a' (append to an existing one)")
        if append and keep_parts:  # the block's join would add the parts a sync() kept a second time
            raise ValueError("SyncedFile: append=True with keep_parts=True would join the kept parts' rows twice")
        self.target = os.path.abspath(os.fspath(path))
        self.options = SyncOptions(root=root, strip_header=strip_header, check_headers=check_headers, text=text,
                                   allow_missing=allow_missing, keep_parts=keep_parts, method=method,
                                   round_bytes=round_bytes, progress=progress, timeout=timeout, append=append)
        self.parts_dir = parts_dir
        self.path = part_path(self.target, None, parts_dir)
        if append and mode == "w":
            self._refuse_unjoined()
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(self.path, "ab" if mode == "a" else "wb"):
                pass
        except OSError as exc:
            raise SyncError(f"SyncedFile({self.target}): cannot create this rank's part {self.path}: "
                            f"{exc.strerror or exc} (a folder this rank can write: parts_dir= or "
                            "HPCSYNC_PARTS_DIR)") from exc
        self.result: Optional[SyncResult] = None
        self._flags: Any = None  # made on entering the block (collective)

    def _refuse_unjoined(self) -> None:
        """``append=True`` continues the joined file: parts a run before this one left unjoined (a
        crash) hold rows that ``mode="w"`` would erase; the same SyncError on every rank instead.
        One bounded allgather of each rank's error (None, or a line): O(log N) rounds, every rank
        receives N small objects, only where ``append=True``."""
        try:
            size = os.path.getsize(self.path)
        except OSError:
            size = 0
        folder = os.path.dirname(self.path)
        what = (f"SyncedFile({self.target}, append=True): parts a run before this one never joined (it ended "
                "before its block's end) hold rows that starting anew would erase: ")
        advice = (f". Keep them: hpcsync merge --append --delete-parts {shlex.quote(self.target)} "
                  f"{shlex.quote(folder)}/*" + (" --strip-header" if self.options.strip_header else "")
                  + f"; or drop them: rm -r {shlex.quote(folder)}")
        err = f"{size} bytes in {self.path}" if size else None
        try:
            with bounded.owned(_world(), f"SyncedFile({self.target}): parts left unjoined", self.options.limit()) as c:
                raise_if_any(c, err, SyncError, what)
        except SyncError as exc:
            raise SyncError(f"{exc}{advice}") from None
        except CollectiveTimeout as exc:
            raise SyncTimeout(f"SyncedFile({self.target}): not every rank made it: {exc}") from None

    def open(self, mode: str = "w", **kwargs: Any):
        """``open()`` this rank's part (``open(synced.path, ...)``), line-buffered in text mode
        unless ``buffering=`` says otherwise: every row written is on disk (in the page cache) at
        once, so a rank killed when another fails keeps its rows."""
        if "b" not in mode:
            kwargs.setdefault("buffering", 1)
        f = open(self.path, mode, **kwargs)
        flags_mod.track(f)
        return f

    def _check_flags(self, failed: bool) -> bool:
        """Every rank's flag (bounded): a rank that left the block with an exception posted its own
        without waiting; then every rank here raises SyncError (this one its own exception)."""
        import numpy as np

        from ..core import mpi

        flags, self._flags = self._flags, None
        send, recv = flags_mod.vectors(flags, failed)
        try:
            flags.Allreduce(send, recv, op=mpi.MPI().MAX)
        except CollectiveTimeout as exc:
            if failed:
                return True
            raise SyncTimeout(f"SyncedFile({self.target}): nothing merged or deleted: {exc}") from None
        flags.free()
        bad = [int(r) for r in np.flatnonzero(recv[0])]
        if bad and not failed:
            raise SyncError(f"SyncedFile({self.target}) failed, nothing deleted: rank(s) {bad} left the block with "
                            "an exception (its traceback says which); every part is kept")
        return bool(bad)

    def sync(self) -> SyncResult:
        """Join all parts into the target now (collective)."""
        self.result = _sync(self.target, None, self.parts_dir, self.options)
        return self.result

    def __enter__(self) -> "SyncedFile":
        """Collective (every rank enters the block): the ranks' failure flags are set up."""
        self._flags = flags_mod.make(f"SyncedFile({self.target})", self.options.limit())
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        comm = _world()
        if exc_type is not None and issubclass(exc_type, SystemExit):  # a stop (the preemption guard's): joined
            exc_type = None
        failed = None if exc_type is None else f"{exc_type.__name__}: {exc}"
        if exc_type is not None and (comm.Get_size() == 1 or (self._flags is not None
                                                               and jobend.exception_ends_job(exc_type))):
            flags_mod.flush_open()
            if self._flags is not None:
                flags_mod.post_failed(self._flags)
            if isinstance(exc, BaseException):
                folder = os.path.dirname(self.path)
                how = (f"hpcsync merge{' --append' if self.options.append else ''} {shlex.quote(self.target)} "
                       f"{shlex.quote(folder)}/*" + (" --strip-header" if self.options.strip_header else ""))
                exc.add_note(f"hpcsync: {self.target} was not joined; every rank's part is kept in {folder}. "
                             f"To keep their rows, before a rerun: {how}")
            return False
        if self._flags is not None and self._check_flags(exc_type is not None):
            return False  # (this rank's own exception; the others raised SyncError)
        try:
            with bounded.owned(comm, f"SyncedFile({self.target}): agreeing that every rank is done with its part",
                               self.options.limit()) as agree:
                _agree(agree, failed, f"SyncedFile({self.target})")
        except SyncError:
            if exc_type is not None:
                return False  # re-raise this rank's own exception
            raise
        except CollectiveTimeout as exc:
            if exc_type is not None:
                return False
            raise SyncTimeout(f"SyncedFile({self.target}): nothing merged or deleted: {exc}") from None
        self.sync()
        return False
