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
:class:`~hpcsync.errors.SyncError` on every rank, with all parts left in place.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from . import _bigmpi, _mpi, settings
from ._torchcomm import world as _world  # MPI's world, else torch.distributed's, else None
from .errors import SyncError, raise_if_any, raise_if_settings_differ
from .progress import Progress

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]
METHODS = ("auto", "copy", "gather", "mpiio")
AUTO_MPIIO_BYTES = 256 * 2**20
_HEADER_SCAN = 1 << 20


def part_path(path: PathLike, rank: Optional[int] = None, parts_dir: Optional[PathLike] = None) -> str:
    """Where rank ``rank`` (default: this rank) keeps its part of ``path``."""
    if rank is None:
        comm = _world()
        rank = comm.Get_rank() if comm is not None else 0
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


@dataclass
class _Part:
    path: str
    size: int = 0
    header: bytes = b""
    ends_newline: bool = True
    skip: int = 0  # bytes dropped from the front (a stripped header)
    newline_after: bool = False
    ident: Tuple[int, int] = (0, 0)  # (st_dev, st_ino): the root checks it sees this very file


@dataclass
class _Source:
    """This rank's contribution: byte ranges of its part files plus inserted newlines."""

    parts: List[_Part] = field(default_factory=list)
    error: Optional[str] = None

    @property
    def pieces(self) -> List[Tuple[Optional[str], int, int]]:
        out: List[Tuple[Optional[str], int, int]] = []
        for p in self.parts:
            if p.size - p.skip > 0:
                out.append((p.path, p.skip, p.size - p.skip))
            if p.newline_after:
                out.append((None, 0, 1))
        return out

    @property
    def size(self) -> int:
        return sum(n for _, _, n in self.pieces)

    def fill(self, view: memoryview, offset: int) -> None:
        """Copy ``len(view)`` bytes from ``offset`` of the contribution into ``view``.

        A read error is remembered and the bytes are zeroed, so this rank keeps taking part in
        the remaining collective rounds (no hang); the error fails the sync afterwards.
        """
        want, pos, start = len(view), 0, 0
        for path, skip, n in self.pieces:
            if offset >= start + n:
                start += n
                continue
            lo = offset - start
            take = min(n - lo, want - pos)
            if path is None:
                view[pos:pos + take] = b"\n" * take
            else:
                try:
                    with open(path, "rb", buffering=0) as f:
                        f.seek(skip + lo)
                        got = f.readinto(view[pos:pos + take])
                    if got != take:
                        raise OSError(f"{path} shrank while being merged")
                except OSError as exc:
                    self.error = self.error or f"reading {path}: {exc}"
                    view[pos:pos + take] = bytes(take)
            pos += take
            offset += take
            start += n
            if pos == want:
                return


def _inspect(path: str, allow_missing: bool, need_header: bool) -> Tuple[Optional[_Part], Optional[str]]:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return (None, None) if allow_missing else (None, f"part {path} does not exist")
    except OSError as exc:
        return None, f"cannot stat part {path}: {exc}"
    if not os.path.isfile(path):
        return None, f"part {path} is not a regular file"
    part = _Part(path, st.st_size, ident=(st.st_dev, st.st_ino))
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


def _plan(comm: Any, my_parts: List[_Part], strip_header: bool, check_headers: bool, text: bool) -> None:
    """Decide header stripping and inserted newlines from every rank's part summaries."""
    summary = [(p.size, p.header, p.ends_newline) for p in my_parts]
    every = comm.allgather(summary) if comm is not None else [summary]
    flat = [(r, i, s) for r, parts in enumerate(every) for i, s in enumerate(parts)]
    nonempty = [(r, i, s) for r, i, s in flat if s[0] > 0]
    if strip_header and nonempty:
        first = nonempty[0][2][1]
        if check_headers:
            differ = sorted({r for r, _, s in nonempty if s[1] != first})
            if differ:
                shown = nonempty[[r for r, _, _ in nonempty].index(differ[0])][2][1]
                raise SyncError(
                    f"headers differ: rank(s) {differ} have {shown[:200]!r} but rank {nonempty[0][0]} has "
                    f"{first[:200]!r} (pass check_headers=False to merge anyway); nothing deleted")
    # effective content per part after stripping, to place newlines only between content
    keep_header_at = (nonempty[0][0], nonempty[0][1]) if nonempty else None
    effective = []
    for r, i, (size, header, ends) in flat:
        skip = len(header) if strip_header and (r, i) != keep_header_at and size else 0
        effective.append((r, i, size - skip, ends, skip))
    last_content = max((k for k, e in enumerate(effective) if e[2] > 0), default=-1)
    me = comm.Get_rank() if comm is not None else 0
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


def _fsync_dir(folder: str) -> None:
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
    round_bytes: int = _bigmpi.DEFAULT_ROUND_BYTES,
    progress: Optional[bool] = None,
    comm: Any = None,
) -> SyncResult:
    """Collective core of :func:`sync_file`: each rank contributes the files ``my_parts`` (in order)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    t0 = time.perf_counter()
    comm = comm if comm is not None else _world()
    size = comm.Get_size() if comm is not None else 1
    me = comm.Get_rank() if comm is not None else 0
    if not 0 <= root < size:
        raise ValueError(f"root {root} outside the world of {size} rank(s)")
    target = os.path.abspath(os.fspath(target))
    raise_if_settings_differ(  # every rank must mean the same merge
        comm, {"target": target, "root": root, "strip_header": strip_header, "check_headers": check_headers,
               "text": text, "allow_missing": allow_missing, "keep_parts": keep_parts, "method": method},
        SyncError, "sync_file: ranks called it with different arguments (desync), nothing merged or deleted: ")

    src, err = _Source(), None
    for p in my_parts:
        part, perr = _inspect(os.path.abspath(os.fspath(p)), allow_missing, strip_header)
        err = err or perr
        if part is not None:
            src.parts.append(part)
    _agree(comm, err, f"sync of {target}")
    _plan(comm, src.parts, strip_header, check_headers, text)
    mine = src.size
    sizes = _bigmpi.allgather_sizes(comm, mine) if comm is not None else [mine]
    total = sum(sizes)

    tmp, err = _prepare_target(target, total) if me == root else (None, None)
    if comm is not None:
        tmp = comm.bcast(tmp, root=root)
    _agree(comm, err, f"sync of {target}")
    bar = Progress(f"merging {os.path.basename(target)}", total, enabled=progress) if me == root else None
    chosen = "gather"
    try:
        chosen, everything = _choose_method(comm, method, tmp, total, src, root)
        if chosen == "copy":
            err = _write_copy(tmp, everything, bar) if me == root else None  # type: ignore[arg-type]
        elif chosen == "mpiio":
            err = _write_mpiio(comm, tmp, src, sizes, round_bytes, bar)
        else:
            err = _write_gather(comm, tmp, src, sizes, root, round_bytes, bar)
        err = err or src.error
        if me == root and err is None:
            try:
                os.replace(tmp, target)  # type: ignore[arg-type]
                _fsync_dir(os.path.dirname(target))
            except OSError as exc:
                err = f"cannot rename into {target}: {exc}"
        _agree(comm, err, f"sync of {target}")
    except BaseException:
        if me == root and tmp and os.path.exists(tmp):
            os.unlink(tmp)
        raise
    finally:
        if bar is not None:
            bar.close()
    deleted = False
    if not keep_parts:
        for p in src.parts:
            try:
                os.unlink(p.path)
            except OSError as exc:  # the merge is durable; a stale part is only a warning
                log.warning("rank %d: could not delete part %s: %s", me, p.path, exc)
        deleted = True
    result = SyncResult(target, total, chosen, time.perf_counter() - t0, deleted, size)
    return comm.bcast(result, root=root) if comm is not None else result


def _choose_method(comm: Any, method: str, tmp: Optional[str], total: int, src: _Source, root: int
                   ) -> Tuple[str, Optional[_Source]]:
    """The method every rank uses, and for ``copy`` the root's view of every rank's pieces."""
    if comm is None or comm.Get_size() == 1:
        return ("copy" if method == "copy" else "gather"), src
    if method in ("auto", "copy"):
        everything, why = _root_sees_parts(comm, src, root)
        if method == "copy" and everything is None:
            raise SyncError(f"method='copy' needs the root to open every rank's part files itself: {why}. "
                            "Use method='gather' (parts on node-local storage) or 'auto'.")
        if everything is not None and (method == "copy" or total < AUTO_MPIIO_BYTES or _nodes() == 1):
            return "copy", everything
    if not hasattr(comm, "Gatherv"):  # torch.distributed without MPI
        if method == "mpiio":
            raise SyncError("method='mpiio' needs MPI (mpi4py); this job runs without it")
        return "gather", None
    if method != "auto":
        if method == "mpiio" and not all(comm.allgather(os.path.exists(tmp or ""))):
            raise SyncError(f"method='mpiio' needs the target directory on a filesystem every rank "
                            f"sees; {os.path.dirname(tmp or '')} is not shared. Use method='gather'.")
        return method, None
    # MPI-IO when several nodes see the target directory (Lustre, GPFS, ...) and the merge is
    # large: it spares the root's network link. NFS without special mount options can corrupt
    # concurrent writes: gather there.
    shared = all(comm.allgather(os.path.exists(tmp or "") and not _on_nfs(tmp or "")))
    return ("mpiio" if shared and _nodes() > 1 and total >= AUTO_MPIIO_BYTES else "gather"), None


def _nodes() -> int:
    from .topology import topology

    return topology().num_nodes


def _root_sees_parts(comm: Any, src: _Source, root: int) -> Tuple[Optional[_Source], str]:
    """Whether the root can open the very files every rank merges (same device, inode, size):
    then it gets every rank's parts (with their header cuts and newlines) as one source."""
    mine = [(p.path, p.ident, p.size, p.skip, p.newline_after) for p in src.parts]
    every = comm.gather(mine, root=root)
    verdict: Tuple[bool, str] = (True, "")
    if comm.Get_rank() == root:
        for r, parts in enumerate(every):
            for path, ident, size, _, _ in parts:
                try:
                    st = os.stat(path)
                except OSError as exc:
                    verdict = (False, f"rank {r}'s part {path} is not visible on the root ({exc.strerror})")
                    break
                if (st.st_dev, st.st_ino) != tuple(ident) or st.st_size != size:
                    verdict = (False, f"rank {r}'s part {path} is another file on the root (node-local storage)")
                    break
            if not verdict[0]:
                break
    ok, why = comm.bcast(verdict, root=root)
    if not ok:
        return None, why
    if comm.Get_rank() != root:
        return _Source(), ""
    everything = _Source([_Part(path, size, skip=skip, newline_after=nl, ident=tuple(ident))
                          for parts in every for path, ident, size, skip, nl in parts])
    return everything, ""


def _write_copy(tmp: str, everything: _Source, bar: Optional[Progress]) -> Optional[str]:
    """The root concatenates every rank's part into ``tmp`` in the kernel."""
    fd = os.open(tmp, os.O_WRONLY)
    try:
        err = _copy_own(everything, fd, 0, tmp, bar)
        if err is None:
            os.fsync(fd)
        return err
    except OSError as exc:
        return f"writing {tmp}: {exc}"
    finally:
        os.close(fd)


def _on_nfs(path: str) -> bool:
    """Whether ``path`` lies on NFS (longest matching mount point in /proc/mounts)."""
    best, fstype = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and path.startswith(parts[1].rstrip("/") + "/") and len(parts[1]) >= len(best):
                    best, fstype = parts[1], parts[2]
    except OSError:
        return False
    return fstype.startswith("nfs")


def _write_gather(comm: Any, tmp: str, src: _Source, sizes: List[int], root: int, round_bytes: int,
                  bar: Optional[Progress]) -> Optional[str]:
    """Root copies its own part file-to-file in the kernel, then receives the others in rounds."""
    me = comm.Get_rank() if comm is not None else 0
    fd, err = (os.open(tmp, os.O_WRONLY), None) if me == root else (-1, None)
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    try:
        if me == root:
            err = _copy_own(src, fd, starts[root], tmp, bar)
        if comm is not None:
            others = [0 if r == root else n for r, n in enumerate(sizes)]  # same schedule on every rank
            err = _receive_and_write(comm, others, src, root, round_bytes, fd, starts, tmp, bar) or err
        if me == root and err is None:
            os.fsync(fd)
    except OSError as exc:
        err = err or f"writing {tmp}: {exc}"
    finally:
        if fd >= 0:
            os.close(fd)
    return err


def _receive_and_write(comm: Any, sizes: List[int], src: _Source, root: int, round_bytes: int, fd: int,
                       starts: List[int], tmp: str, bar: Optional[Progress]) -> Optional[str]:
    """Pipelined: a writer thread writes round k while round k+1 is gathered (and read ahead)."""
    from concurrent.futures import ThreadPoolExecutor

    rounds = _bigmpi.iter_gatherv_rounds(comm, sizes, src.fill, root, round_bytes, pipeline=True)
    pipeline = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpcsync-write")
    errors: List[str] = []

    def write(chunks: List[Tuple[int, int, memoryview]]) -> None:
        for r, off, chunk in chunks:
            if not errors:
                try:
                    _pwrite_all(fd, chunk, starts[r] + off)
                except OSError as exc:
                    errors.append(f"writing {tmp}: {exc}")  # keep receiving: the others must not hang
            if bar is not None:
                bar.update(len(chunk))

    pending: List[Any] = []
    try:
        for chunks in rounds:
            pending.append(pipeline.submit(write, chunks))
            if len(pending) == 2:  # round k-1's buffer is reused by the next Gatherv: finish it first
                pending.pop(0).result()
        for fut in pending:
            fut.result()
    finally:
        pipeline.shutdown(wait=True)
    return errors[0] if errors else None


def _copy_own(src: _Source, fd: int, offset: int, tmp: str, bar: Optional[Progress] = None) -> Optional[str]:
    """Write ``src``'s bytes at ``offset`` without passing them through user memory."""
    for path, skip, n in src.pieces:
        try:
            if path is None:
                _pwrite_all(fd, memoryview(b"\n" * n), offset)
            else:
                with open(path, "rb", buffering=0) as f:
                    done = 0
                    while done < n:
                        k = os.copy_file_range(f.fileno(), fd, n - done, skip + done, offset + done)
                        if k == 0:
                            raise OSError(f"{path} shrank while being merged")
                        done += k
                        if bar is not None:
                            bar.update(k)
        except OSError as exc:
            return f"copying {path or 'newline'} into {tmp}: {exc}"
        offset += n
    return None


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _write_mpiio(comm: Any, tmp: str, src: _Source, sizes: List[int], round_bytes: int,
                 bar: Optional[Progress]) -> Optional[str]:
    MPI = _mpi.MPI()
    me = comm.Get_rank()
    offset = sum(sizes[:me])
    step = max(1, min(round_bytes, _bigmpi.INT_MAX))
    rounds = max((s + step - 1) // step for s in sizes)
    err: Optional[str] = None
    try:
        fh = MPI.File.Open(comm, tmp, MPI.MODE_WRONLY)
    except MPI.Exception as exc:
        return f"MPI-IO cannot open {tmp}: {exc}"
    buf = bytearray(min(step, max(sizes[me], 1)))
    try:
        for k in range(rounds):
            lo = k * step
            cnt = max(0, min(step, sizes[me] - lo))
            view = memoryview(buf)[:cnt]
            if cnt:
                src.fill(view, lo)
            try:
                fh.Write_at_all(offset + lo, [view, cnt, MPI.BYTE])
            except MPI.Exception as exc:  # keep calling: Write_at_all is collective
                err = err or f"MPI-IO write at {offset + lo}: {exc}"
            if bar is not None:
                bar.update(sum(max(0, min(step, s - lo)) for s in sizes))
        fh.Sync()
    except MPI.Exception as exc:
        err = err or f"MPI-IO sync of {tmp}: {exc}"
    finally:
        fh.Close()
    return err


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
    round_bytes: int = _bigmpi.DEFAULT_ROUND_BYTES,
    progress: Optional[bool] = None,
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
    bar on the root (default: when stderr is a terminal).
    """
    options = dict(root=root, strip_header=strip_header, check_headers=check_headers, text=text,
                   allow_missing=allow_missing, keep_parts=keep_parts, method=method, round_bytes=round_bytes,
                   progress=progress)
    comm = _world()
    rank = comm.Get_rank() if comm is not None else 0
    if part is None:
        mine = part_path(path, rank, parts_dir)
    else:
        mine = os.fspath(part).format(rank=rank) if "{rank" in os.fspath(part) else os.fspath(part)
    result = merge_parts(path, [mine], comm=comm, **options)
    if result.parts_deleted and part is None:
        # Remove the parts folder once every rank deleted its part, and let no rank go on (and
        # create its next part there) before every rank's rmdir is done: without the second
        # barrier a fast rank's next SyncedFile raced a slow rank's rmdir (FileNotFoundError).
        folder = os.path.dirname(mine)
        if comm is not None:
            comm.Barrier()
        try:
            os.rmdir(folder)
        except OSError:
            pass
        if comm is not None:
            comm.Barrier()
    return result


class SyncedFile:
    """A file every rank writes its own part of during training, joined on exit.

    >>> with SyncedFile("metrics.csv", strip_header=True) as part:
    ...     with open(part.path, "w") as f:
    ...         f.write("step,loss\\n")

    Each rank's part is created (empty) up front, so every rank has one. If any rank leaves the
    block with an exception, no rank merges: every rank raises :class:`SyncError` (the failing
    rank its own exception) and all parts are kept.
    """

    def __init__(self, path: PathLike, *, parts_dir: Optional[PathLike] = None, mode: str = "w",
                 root: int = 0, strip_header: bool = False, check_headers: bool = True, text: bool = True,
                 allow_missing: bool = False, keep_parts: bool = False, method: str = "auto",
                 round_bytes: int = _bigmpi.DEFAULT_ROUND_BYTES, progress: Optional[bool] = None) -> None:
        """``mode``: ``"w"`` starts a new part, ``"a"`` appends to this rank's existing one; the
        other arguments are :func:`sync_file`'s."""
        if mode not in ("w", "a"):
            raise ValueError("mode must be 'w' (start a new part) or 'a' (append to an existing one)")
        self.target = os.path.abspath(os.fspath(path))
        self.options: Dict[str, Any] = dict(
            root=root, strip_header=strip_header, check_headers=check_headers, text=text,
            allow_missing=allow_missing, keep_parts=keep_parts, method=method, round_bytes=round_bytes,
            progress=progress)
        self.parts_dir = parts_dir
        self.path = part_path(self.target, None, parts_dir)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "ab" if mode == "a" else "wb"):
            pass
        self.result: Optional[SyncResult] = None

    def open(self, mode: str = "w", **kwargs: Any):
        """``open()`` this rank's part (a shortcut for ``open(synced.path, ...)``)."""
        return open(self.path, mode, **kwargs)

    def sync(self) -> SyncResult:
        """Join all parts into the target now (collective)."""
        self.result = sync_file(self.target, parts_dir=self.parts_dir, **self.options)
        return self.result

    def __enter__(self) -> "SyncedFile":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        comm = _world()
        failed = None if exc_type is None else f"{exc_type.__name__}: {exc}"
        if exc_type is not None and comm is None:
            return False
        try:
            _agree(comm, failed, f"SyncedFile({self.target})")
        except SyncError:
            if exc_type is not None:
                return False  # re-raise this rank's own exception
            raise
        self.sync()
        return False
