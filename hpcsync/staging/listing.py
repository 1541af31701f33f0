"""The source side of a stage: the listing rank 0 makes, and the schedules every rank derives from it."""
from __future__ import annotations

import os
import stat as st
from typing import Iterator, List, NamedTuple, Optional, Sequence, Tuple

DEFAULT_CHUNK_BYTES = 16 * 2**20
MAX_PIECES = 4096  # files (or file pieces) per broadcast: bounds the trailer and the latency of one round
FILE, DIR, LINK = "f", "d", "l"


class Entry(NamedTuple):
    """One item of the source listing (``rel`` is relative to ``dst``)."""

    rel: str
    kind: str
    mode: int
    atime_ns: int
    mtime_ns: int
    size: int
    target: str = ""  # symbolic links: what they point to


def scan(src: str) -> Tuple[List[Entry], List[str], Optional[str]]:
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
    kind = DIR if st.S_ISDIR(s.st_mode) else LINK if st.S_ISLNK(s.st_mode) else FILE
    return Entry(rel, kind, st.S_IMODE(s.st_mode), s.st_atime_ns, s.st_mtime_ns,
                 s.st_size if kind == FILE else 0, target)


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
