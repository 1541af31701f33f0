"""How every rank's part reaches the target: the root copies the parts in the kernel when it sees
them all, else MPI ``Gatherv`` rounds (bounded root memory, any size) or an MPI-IO write at each
rank's offset. Used by :mod:`hpcsync.data.filesync`, which plans, checks and commits the merge."""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple, Union

from ..core import bigmpi, bounded, mpi
from ..core.errors import CollectiveTimeout, SyncError
from ..core.worker import Stalled, Worker
from ..core.worker import result as worker_result
from ..observe.progress import Progress

__all__ = [
    "PathLike", "AUTO_MPIIO_BYTES", "Part", "Source", "choose_method", "write_copy", "write_gather", "write_mpiio"
]

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]

AUTO_MPIIO_BYTES = 256 * 2**20  # auto picks MPI-IO across nodes from this size


@dataclass
class Part:
    path: str
    size: int = 0
    header: bytes = b""
    ends_newline: bool = True
    skip: int = 0  # bytes dropped from the front (a stripped header)
    newline_after: bool = False
    ident: Tuple[int, int] = (0, 0)  # (st_dev, st_ino): the root checks it sees this very file


@dataclass
class Source:
    """This rank's contribution: byte ranges of its part files plus inserted newlines."""

    parts: List[Part] = field(default_factory=list)
    error: Optional[str] = None
    reading: str = ""  # the part being read (for a stall's error)
    stalled: bool = False  # a read or the root's write made no progress: the merge fails

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
                self.reading = path
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


def choose_method(comm: Any, method: str, tmp: Optional[str], total: int, src: Source, root: int
                   ) -> Tuple[str, Optional[Source]]:
    """The method every rank uses, and for ``copy`` the root's view of every rank's pieces."""
    if comm.Get_size() == 1:
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
    from ..core.topology import topology

    return topology().num_nodes


def _root_sees_parts(comm: Any, src: Source, root: int) -> Tuple[Optional[Source], str]:
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
        return Source(), ""
    everything = Source([Part(path, size, skip=skip, newline_after=nl, ident=tuple(ident))
                          for parts in every for path, ident, size, skip, nl in parts])
    return everything, ""


def write_copy(tmp: str, everything: Source, bar: Optional[Progress]) -> Optional[str]:
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


def write_gather(comm: Any, tmp: str, src: Source, sizes: List[int], root: int, round_bytes: int,
                  bar: Optional[Progress], local_s: Optional[float] = None) -> Optional[str]:
    """Root copies its own part file-to-file in the kernel, then receives the others in rounds.
    ``local_s``: how long a rank's own read, or the root's write, may make no progress."""
    me = comm.Get_rank()
    fd, err = (os.open(tmp, os.O_WRONLY), None) if me == root else (-1, None)
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    try:
        if me == root:
            err = _copy_own(src, fd, starts[root], tmp, bar)
        if comm.Get_size() > 1:
            others = [0 if r == root else n for r, n in enumerate(sizes)]  # same schedule on every rank
            err = _receive_and_write(comm, others, src, root, round_bytes, fd, starts, tmp, bar, local_s) or err
        if me == root and err is None:
            os.fsync(fd)
    except CollectiveTimeout:  # (a TimeoutError, so an OSError: not this file's error)
        raise
    except OSError as exc:
        err = err or f"writing {tmp}: {exc}"
    finally:
        if fd >= 0 and not src.stalled:  # (a stuck write still holds it)
            os.close(fd)
    return err


def _receive_and_write(comm: Any, sizes: List[int], src: Source, root: int, round_bytes: int, fd: int,
                       starts: List[int], tmp: str, bar: Optional[Progress], local_s: Optional[float] = None
                       ) -> Optional[str]:
    """Pipelined: a writer thread writes round k while round k+1 is gathered (and read ahead).
    A write or read that makes no progress for ``local_s`` seconds is left behind, named, and
    this rank keeps taking part in the rounds (the merge fails on every rank afterwards)."""
    host = socket.gethostname()

    def read_stalled(seconds: float) -> None:
        src.stalled = True
        src.error = src.error or (f"node {host}: reading {src.reading}: no progress for {seconds:g} s "
                                  "(a stuck disk or filesystem?)")

    rounds = bigmpi.iter_gatherv_rounds(comm, sizes, src.fill, root, round_bytes, pipeline=True,
                                        read_timeout=local_s, stalled=read_stalled)
    pipeline = Worker("hpcsync-write")
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
            if src.stalled:
                continue  # this rank's disk stopped: the rounds still go by, unwritten
            pending.append(pipeline.submit(write, chunks))
            if len(pending) == 2:  # round k-1's buffer is reused by the next Gatherv: finish it first
                _finish_write(pending.pop(0), local_s, src, errors, tmp, host)
    finally:  # (also when a round timed out: the file is closed only once no write is under way)
        for fut in pending:
            if not src.stalled:
                _finish_write(fut, local_s, src, errors, tmp, host)
        pipeline.shutdown()
    return errors[0] if errors else None


def _finish_write(fut: Any, local_s: Optional[float], src: Source, errors: List[str], tmp: str, host: str) -> None:
    try:
        worker_result(fut, local_s, lambda: f"node {host}: writing {tmp}")
    except Stalled as exc:
        src.stalled = True
        errors.insert(0, str(exc))  # the root's own stuck disk, before any error its writes gave


def _copy_own(src: Source, fd: int, offset: int, tmp: str, bar: Optional[Progress] = None) -> Optional[str]:
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


def write_mpiio(comm: Any, tmp: str, src: Source, sizes: List[int], round_bytes: int,
                 bar: Optional[Progress]) -> Optional[str]:
    MPI = mpi.MPI()
    me = comm.Get_rank()
    offset = sum(sizes[:me])
    step = max(1, min(round_bytes, bigmpi.INT_MAX))
    rounds = max((s + step - 1) // step for s in sizes)
    err: Optional[str] = None
    base, limit = getattr(comm, "base", comm), getattr(comm, "timeout", None)
    try:
        fh = MPI.File.Open(base, tmp, MPI.MODE_WRONLY)  # (every rank is here: the exchanges before were bounded)
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
                if limit is None:
                    fh.Write_at_all(offset + lo, [view, cnt, MPI.BYTE])
                else:  # the collective write, bounded like every other round
                    req = fh.Iwrite_at_all(offset + lo, [view, cnt, MPI.BYTE])
                    try:
                        bounded.wait(req, limit, large=True)
                    except bounded.CollectiveTimeout:
                        why = f"{comm.what}: MPI-IO round {k + 1} of {rounds} timed out after {limit:g} s"
                        bounded.abandon(why, req, (buf, fh))
                        fh = None  # not closed: the write is still in flight
                        raise bounded.CollectiveTimeout(f"{why} (rank {me}): a rank is stuck or frozen, or its "
                                                        "node or the filesystem stopped answering") from None
            except MPI.Exception as exc:  # keep calling: Write_at_all is collective
                err = err or f"MPI-IO write at {offset + lo}: {exc}"
            if bar is not None:
                bar.update(sum(max(0, min(step, s - lo)) for s in sizes))
        fh.Sync()
    except MPI.Exception as exc:
        err = err or f"MPI-IO sync of {tmp}: {exc}"
    finally:
        if fh is not None:
            fh.Close()
    return err


