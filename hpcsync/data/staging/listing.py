"""The source side of a stage: the listing rank 0 makes, and the schedules every rank derives from it."""
from __future__ import annotations

import contextlib
import gc
import os
import stat as st
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

__all__ = [
    "DEFAULT_CHUNK_BYTES", "MAX_PIECES", "FILE", "DIR", "LINK", "WHOLE_MIN_FILES", "WHOLE_MAX_BYTES", "Entry",
    "collector_paused", "scan", "Names", "walk_names", "Stat", "stat_names", "assemble", "source_path", "Piece",
    "chunks", "trailer_at", "whole", "blocks"
]

DEFAULT_CHUNK_BYTES = 16 * 2**20
MAX_PIECES = 4096  # files (or file pieces) per broadcast: bounds the trailer and the latency of one round
FILE, DIR, LINK = "f", "d", "l"
_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# a folder is copied whole (filled under a hidden name, then renamed into place: no rename per
# file) when it holds only files, at least WHOLE_MIN_FILES, each at most DEFAULT_CHUNK_BYTES and at
# most WHOLE_MAX_BYTES in all (what a kill can cost: its files are recorded once it is in place)
WHOLE_MIN_FILES, WHOLE_MAX_BYTES = 4, 64 * 2**20


class Entry(NamedTuple):
    """One item of the source listing (``rel`` is relative to ``dst``)."""

    rel: str
    kind: str
    mode: int
    atime_ns: int
    mtime_ns: int
    size: int
    target: str = ""  # symbolic links: what they point to


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a stage makes objects that live to its end,
    one or more per file (the listing's entries, the copies' records): each few hundred of them
    would start a collection, and as they pile up, full ones, each of which walks every object of
    the process (after ``hpcsync.init()``, torch's too: 0.3 s of a 1.4 s stage of 100,000 small
    files, measured). None of them forms a cycle; reference counting frees what dies meanwhile.
    The collector is on again afterwards (when it was on), whatever happens. Also a decorator."""
    on = gc.isenabled()
    if on:
        gc.disable()
    try:
        yield
    finally:
        if on:
            gc.enable()


def scan(src: str) -> Tuple[List[Entry], List[str], Optional[str]]:
    """The root's listing of ``src``: directories before what they hold, names sorted (one rank:
    :func:`walk_names`, then :func:`stat_names` of every name)."""
    names, dirs, err = walk_names(src)
    if err is not None:
        return [], [], err
    part, err = stat_names(src, names, dirs, 0, len(names))
    if err is not None:
        return [], [], err
    entries, ignored = assemble(names, part)
    return entries, ignored, None


Names = List[str]  # every path of the listing, in its order ("" is src itself, or a file's name when src is a file)


def walk_names(src: str) -> Tuple[Names, bytearray, Optional[str]]:
    """The names of the listing, in its order, and which are directories (from the directory
    entries' types: no ``stat`` per name, which :func:`stat_names` does, on as many ranks as see
    the source). Depth first, names sorted; a file given as ``src`` is one name."""
    try:
        top = os.stat(src)  # a link given as src is followed
    except FileNotFoundError:
        return [], bytearray(), f"source {src} does not exist"
    except OSError as exc:
        return [], bytearray(), f"cannot stat source {src}: {exc.strerror}"
    if st.S_ISREG(top.st_mode):
        return [os.path.basename(src)], bytearray(1), None
    if not st.S_ISDIR(top.st_mode):
        return [], bytearray(), f"source {src} is neither a file nor a directory"
    names, dirs = [""], bytearray(b"\1")
    todo = [""]
    while todo:
        rel = todo.pop()
        here = f"{src}/{rel}" if rel else src
        try:
            with os.scandir(here) as it:
                items = sorted(it, key=lambda e: e.name)
            subdirs = []
            for item in items:
                r = f"{rel}/{item.name}" if rel else item.name
                names.append(r)
                if item.is_dir(follow_symlinks=False):
                    dirs.append(1)
                    subdirs.append(r)
                else:
                    dirs.append(0)
        except OSError as exc:
            return [], bytearray(), f"cannot read source directory {here}: {exc.strerror}"
        todo.extend(reversed(subdirs))  # depth first, in name order
    return names, dirs, None


Stat = Optional[Tuple[str, int, int, int, int, str]]  # (kind, mode, atime, mtime, size, link target); None: ignored


def stat_names(src: str, names: Names, dirs: bytearray, lo: int, hi: int, single: Optional[bool] = None
               ) -> Tuple[List[Stat], Optional[str]]:
    """``stat`` of names ``[lo, hi)`` from :func:`walk_names`: what :func:`assemble` makes entries
    of, or the first error (a name that cannot be read, or that changed kind since it was listed).
    A folder's names are stat'ed in the open folder (one path component each). ``single``: the
    source is one file (default: ``names`` says so; a share of a listing cannot)."""
    out: List[Stat] = []
    single = (len(names) == 1 and not dirs[0]) if single is None else single
    euid = os.geteuid()
    folder, fd = None, -1
    try:
        for i in range(lo, hi):
            rel = names[i]
            path = src if single or not rel else f"{src}/{rel}"
            try:
                if single or not rel:
                    s, name, at = os.stat(src), src, None
                else:
                    parent, _, name = rel.rpartition("/")
                    if parent != folder:
                        if fd >= 0:
                            os.close(fd)
                            fd = -1
                        fd = os.open(f"{src}/{parent}" if parent else src, _FOLDER)
                        folder = parent
                    at = fd
                    s = os.stat(name, dir_fd=at, follow_symlinks=False)
            except OSError as exc:
                return [], f"cannot stat {path}: {exc.strerror}"
            mode = s.st_mode
            kind = mode & 0o170000
            if (kind == st.S_IFDIR) != bool(dirs[i]):
                return [], f"{path} changed while the source was listed"
            if kind == st.S_IFREG:
                # the owner's read bit decides for the owner (ACLs included); anyone else asks the kernel
                if not (s.st_uid == euid and mode & 0o400) and not os.access(name, os.R_OK, dir_fd=at):
                    return [], f"source file {path} is not readable"
                out.append((FILE, mode & 0o7777, s.st_atime_ns, s.st_mtime_ns, s.st_size, ""))
            elif kind == st.S_IFDIR:
                out.append((DIR, mode & 0o7777, s.st_atime_ns, s.st_mtime_ns, 0, ""))
            elif kind == st.S_IFLNK:
                try:
                    target = os.readlink(name, dir_fd=at)
                except OSError as exc:
                    return [], f"cannot read link {path}: {exc.strerror}"
                out.append((LINK, mode & 0o7777, s.st_atime_ns, s.st_mtime_ns, 0, target))
            else:
                out.append(None)
    finally:
        if fd >= 0:
            os.close(fd)
    return out, None


def assemble(names: Names, stats: Sequence[Stat]) -> Tuple[List[Entry], List[str]]:
    """The listing (entries) and the special files left out (``ignored``), from every name's stat."""
    entries: List[Entry] = []
    ignored: List[str] = []
    make = tuple.__new__  # Entry(rel, *s) without the Python-level __new__ of a named tuple
    for rel, s in zip(names, stats):
        if s is None:
            ignored.append(rel)
        else:
            entries.append(make(Entry, (rel, *s)))
    return entries, ignored


def source_path(src: str, entries: Sequence[Entry], e: Entry) -> str:
    single = len(entries) == 1 and entries[0].kind == FILE
    return src if single else f"{src}/{e.rel}"


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


def trailer_at(pieces: Sequence[Piece]) -> int:
    """Where the per-piece CRC trailer starts in a round's buffer (8-byte aligned after the data)."""
    n = sum(p[2] for p in pieces)
    return (n + 7) & ~7


def whole(entries: Sequence[Entry], need: Sequence[int], empty: Callable[[int], bool]) -> Dict[int, List[int]]:
    """The folders to copy whole, ``{folder index: its file indexes}``: below ``src``, holding only
    files (see :data:`WHOLE_MIN_FILES`), every one of them needed, and ``empty(folder index)`` at
    the destination (what a hidden copy may replace with one rename)."""
    folder = {e.rel: i for i, e in enumerate(entries) if e.kind == DIR}
    files: Dict[int, List[int]] = {}
    bad = set()
    need = bytes(need)  # (a numpy array's items are slow to read one at a time)
    parent, p, mine = None, None, []
    for i, e in enumerate(entries):
        rel = e.rel
        if not rel:
            continue
        here = rel.rpartition("/")[0]
        if here != parent:  # (a folder's names follow each other in the listing)
            parent, p = here, folder.get(here)
            if p:
                mine = files.setdefault(p, [])
        if not p:  # src itself is never replaced (it holds the manifest)
            continue
        if e.kind == FILE and need[i] and e.size <= DEFAULT_CHUNK_BYTES:
            mine.append(i)
        else:
            bad.add(p)
    return {p: f for p, f in files.items() if p not in bad and len(f) >= WHOLE_MIN_FILES
            and sum(entries[i].size for i in f) <= WHOLE_MAX_BYTES and empty(p)}


def blocks(entries: Sequence[Entry], files: Sequence[int], units: Dict[int, List[int]], most_files: int = 64,
           most_bytes: int = 64 * 2**20) -> List[Tuple[int, List[int]]]:
    """Cut ``files`` (entry indexes, in listing order) into the blocks a one-node copy's ranks
    claim one at a time, so a rank that runs faster (or is not slowed by other jobs) does more:
    ``(folder index, its files)`` for a folder of ``units`` (copied whole), ``(-1, files)`` for up
    to ``most_files`` other files or ``most_bytes``."""
    first = {f[0]: (p, f) for p, f in units.items()}
    out: List[Tuple[int, List[int]]] = []
    cur: List[int] = []
    used = k = 0
    while k < len(files):
        unit = first.get(files[k])
        if unit is not None and list(files[k: k + len(unit[1])]) == unit[1]:
            if cur:
                out.append((-1, cur))
                cur, used = [], 0
            out.append(unit)
            k += len(unit[1])
            continue
        cur.append(files[k])
        used += entries[files[k]].size
        k += 1
        if len(cur) >= most_files or used >= most_bytes:
            out.append((-1, cur))
            cur, used = [], 0
    if cur:
        out.append((-1, cur))
    return out
