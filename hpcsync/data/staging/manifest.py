"""What a stage copied to a node, so that the next call skips what is unchanged: the manifest in
``dst`` (:data:`MANIFEST`).

A record is ``[size, mtime_ns, mode, crc, inode, ctime_ns]``: the source file's size, mtime and
mode, the CRC-32 of the bytes that crossed MPI (None for a kernel copy), the copy's inode and
ctime. Two forms, each read by every stage:

- version 1, one JSON object ``{"version": 1, "source": SRC, "files": {rel: record}}``: what a
  stage on one node writes (its ranks encode their records at the same time, in any order);
- version 2, lines: ``{"version": 2, "source": SRC}``, then lines of ``[[rel, record], ...]`` in
  the order of the source's listing (:func:`order_key`). A stage across nodes writes it one
  round of the listing at a time (:class:`LinesWriter`) and reads it the same way
  (:class:`Lines`): a node leader holds one round's records, not the dataset's.
"""
from __future__ import annotations

import json
import logging
import os
import stat as st
from typing import Any, Dict, IO, List, Optional, Sequence, Tuple, Union

from .fileops import syncfs
from .journal import journals
from .listing import FILE, Entry

__all__ = [
    "MANIFEST", "Record", "order_key", "load", "load_all", "Lines", "recorded_bytes", "LinesWriter",
    "remove_journals", "encode_records", "write_object", "up_to_date"
]

log = logging.getLogger(__name__)

MANIFEST = ".hpcsync-stage.json"
Record = Sequence[Any]


def order_key(rel: str) -> Tuple[List[str], str]:
    """Where ``rel`` comes in a listing (:func:`~.listing.walk_names`: a folder's names together,
    sorted, the folders depth first in name order): its folder's path as components, then its name."""
    folder, _, name = rel.rpartition("/")
    return (folder.split("/") if folder else [], name)


def load(dst: str, src: str, host: str) -> Union[Dict[str, Record], "Lines"]:
    """The manifest in ``dst`` when it is one of a stage of ``src``: version 1 as a dict, version 2
    as :class:`Lines` to read forward; ``{}`` when there is none (or it is unreadable: a warning)."""
    path = os.path.join(dst, MANIFEST)
    try:
        f = open(path)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        log.warning("%s: ignoring unreadable stage manifest in %s: %s", host, dst, exc.strerror)
        return {}
    try:
        head = f.readline()
        doc = _json_or_none(head) if head.endswith("\n") else None  # version 2's first line
        if isinstance(doc, dict) and doc.get("version") == 2:
            if doc.get("source") == src:
                return Lines(f, path, host)
        else:  # version 1: one object (one line as stage writes it)
            doc = json.loads(head + f.read())
            if doc.get("version") == 1 and doc.get("source") == src:
                return doc["files"]
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        log.warning("%s: ignoring unreadable stage manifest in %s: %s", host, dst, exc)
    f.close()
    return {}


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def load_all(dst: str, src: str, host: str) -> Dict[str, Record]:
    """Every record of the manifest in ``dst``, whichever its form."""
    found = load(dst, src, host)
    return found.to_dict() if isinstance(found, Lines) else found


class Lines:
    """A version-2 manifest read forward, one listing round at a time (:meth:`take`). A line that
    does not parse ends it, with a warning: the files after it are copied again."""

    def __init__(self, f: IO[str], path: str, host: str) -> None:
        self.f, self.path, self.host = f, path, host
        self.batch: List[Any] = []
        self.at = 0
        self.passed = 0  # records passed over: names the source no longer has
        self.ended = False

    def _peek(self) -> Optional[Any]:
        while self.at >= len(self.batch):
            if self.ended:
                return None
            try:
                line = self.f.readline()
                if not line.endswith("\n"):
                    if line:
                        raise ValueError("a torn last line")
                    batch = None
                else:
                    batch = json.loads(line)
                    if not (isinstance(batch, list) and all(_is_record(x) for x in batch)):
                        raise ValueError("a line that is not a list of records")
            except ValueError as exc:
                log.warning("%s: ignoring the rest of stage manifest %s: %s", self.host, self.path, exc)
                batch = None
            if batch is None:
                self.close()
                return None
            self.batch, self.at = batch, 0
        return self.batch[self.at]

    def take(self, rels: Sequence[str]) -> Dict[str, Record]:
        """The records of ``rels`` (a round's files, in listing order), reading forward; the
        records of names the listing has dropped are passed over."""
        out: Dict[str, Record] = {}
        for rel in rels:
            key = None
            while True:
                cur = self._peek()
                if cur is None:
                    return out
                if cur[0] == rel:
                    out[rel] = cur[1]
                    self.at += 1
                    break
                if key is None:
                    key = order_key(rel)
                if order_key(cur[0]) >= key:
                    break  # rel has no record
                self.at += 1
                self.passed += 1
        return out

    def rest(self) -> int:
        """Pass over what is left (names after the listing's last); returns how many."""
        n = 0
        while self._peek() is not None:
            self.at += 1
            n += 1
        self.passed += n
        return n

    def to_dict(self) -> Dict[str, Record]:
        out: Dict[str, Record] = {}
        while (cur := self._peek()) is not None:
            out[cur[0]] = cur[1]
            self.at += 1
        return out

    def close(self) -> None:
        self.ended = True
        self.batch, self.at = [], 0
        self.f.close()


def _is_record(item: Any) -> bool:
    """``[rel, [size, mtime, mode, crc, inode, ctime]]``, as :class:`LinesWriter` writes them."""
    return (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], list)
            and len(item[1]) == 6)


def recorded_bytes(found: Union[Dict[str, Record], "Lines"], path: str) -> Optional[int]:
    """The bytes the manifest ``found`` (at ``path``) records: what a node already holds at most;
    None when any part of it is not a record (nothing can be said then)."""
    try:
        if not isinstance(found, Lines):
            return _sizes([[rel, rec] for rel, rec in found.items()])
        total = 0
        with open(path) as f:
            f.readline()
            while line := f.readline():
                n = _sizes(json.loads(line)) if line.endswith("\n") else None
                if n is None:
                    return None
                total += n
        return total
    except Exception:  # (a damaged file: the rounds' own checks still apply)
        return None


def _sizes(items: Any) -> Optional[int]:
    """The sizes of ``items`` summed, or None unless each is a record with a size in bytes."""
    if not isinstance(items, list) or not all(_is_record(x) and isinstance(x[1][0], int) and x[1][0] >= 0
                                              for x in items):
        return None
    return sum(x[1][0] for x in items)


class LinesWriter:
    """A version-2 manifest written round by round under a temporary name (``tmp``), put in place
    by :meth:`commit` (or removed by :meth:`discard`). Each round's line goes straight to the
    file (no buffer that a close would have to flush on a disk that stopped answering)."""

    def __init__(self, dst: str, tmp: str, src: str) -> None:
        self.final, self.tmp = os.path.join(dst, MANIFEST), tmp
        self.committed = False
        self.fd: Optional[int] = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        self._write(json.dumps({"version": 2, "source": src}) + "\n")

    def _write(self, text: str) -> None:
        data = memoryview(text.encode("utf-8", "surrogateescape"))
        while data:
            data = data[os.write(self.fd, data):]  # type: ignore[arg-type]

    def add(self, records: List[Tuple[str, Record]]) -> None:
        """One round's records, in listing order (the C encoder's JSON)."""
        if records and self.fd is not None:
            self._write(json.dumps(records, separators=(",", ":")) + "\n")

    def commit(self, durable: bool) -> None:
        assert self.fd is not None
        if durable:
            os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
        os.replace(self.tmp, self.final)
        self.committed = True

    def discard(self) -> None:
        """Remove the temporary manifest (nothing once :meth:`commit` put it in place)."""
        if self.committed:
            return
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None
        try:
            os.unlink(self.tmp)
        except OSError:
            pass


def remove_journals(dst: str) -> None:
    """The stage ended: its journals (and a killed one's) are no longer needed."""
    for name in journals(dst):
        try:
            os.unlink(os.path.join(dst, name))
        except FileNotFoundError:
            pass


def encode_records(node: Any, files: Sequence[int]) -> None:
    """Encode the records of ``files`` (entry indexes this rank copied and recorded) for the
    manifest now, as :meth:`~.destination.Destination.add_records` takes another rank's: the root
    of a one-node copy does it before it waits for the other ranks, which encode theirs at the
    same time."""
    records, entries = node.records, node.entries
    mine = {}
    for i in files:
        rel = entries[i].rel
        rec = records.pop(rel, None)
        if rec is not None:
            mine[rel] = rec
    if mine:
        node.more.append(json.dumps(mine, separators=(",", ":")))
        node.more_files += len(mine)


def write_object(node: Any) -> None:
    """Replace ``node``'s manifest with its records (its own and the other ranks'), as version 1,
    then remove the journals."""
    mine = "{}"
    if node.records:  # (the records of the files copied here may be encoded already: add_records, encode_records())
        current = {e.rel for e in node.entries if e.kind == FILE}
        mine = json.dumps({rel: rec for rel, rec in node.records.items() if rel in current}, separators=(",", ":"))
    files = ",".join(part[1:-1] for part in (mine, *node.more) if part != "{}")  # objects joined
    if node.durable:
        syncfs(node.dst)
    tmp = node.tmp_path(os.path.join(node.dst, MANIFEST), mine=False)
    with open(tmp, "w") as f:  # the C encoder; json.dump is pure Python
        f.write(f'{{"version":1,"source":{json.dumps(node.src)},"files":{{{files}}}}}')
        if node.durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, os.path.join(node.dst, MANIFEST))
    remove_journals(node.dst)


def up_to_date(e: Entry, rec: Optional[Record], have: Optional[os.stat_result]) -> bool:
    """The copy is the one this stage recorded, with the source's permissions (a copy made under
    a default ACL by an older version may lack them), and the source is unchanged since."""
    if rec is None or have is None or not st.S_ISREG(have.st_mode):
        return False
    size, mtime, mode, _crc, ino, ctime = rec
    return ((size, mtime, mode, have.st_mode & 0o777) == (e.size, e.mtime_ns, e.mode, e.mode & 0o777)
            and (have.st_ino, have.st_size, have.st_mtime_ns, have.st_ctime_ns) == (ino, size, mtime, ctime))
