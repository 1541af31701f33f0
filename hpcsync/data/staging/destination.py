"""One node's copy: what it lacks, temporary files, checks, renames, the manifest and the journal."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat as st
import time
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .fileops import Copier, create, creation_mode, process_umask, pwrite_all, seal, syncfs
from .journal import JOURNAL, Journal, journals, read_journals
from .listing import DEFAULT_CHUNK_BYTES, DIR, FILE, Entry, Piece, trailer_at, whole
from .manifest import MANIFEST, load_all, up_to_date, write_object
from .private import make_private_dirs

__all__ = [
    "TMP_SUFFIX", "JOURNAL_SECONDS", "Destination", "set_dir_attributes", "remove_temporaries", "unlink",
    "clear_killed", "claims_path"
]

log = logging.getLogger(__name__)

TMP_SUFFIX = ".hpcsync-tmp"
JOURNAL_SECONDS = 1.0


class Destination:
    """A node leader's copy: what it lacks, temporary files, checks, renames, manifest and journal."""

    def __init__(self, dst: str, src: str, entries: List[Entry], durable: bool, host: str,
                 journal: str = JOURNAL, call: str = "") -> None:
        """``call``: a mark of this stage call, in the temporary names of its files: a writer
        thread of an earlier call, stuck on a hung disk and then let go, cannot touch this one's."""
        self.dst, self.src, self.entries, self.durable, self.host = dst, src, entries, durable, host
        self.call = f"{call[:6]}." if call else ""
        self.need = np.zeros(len(entries), dtype=np.uint8)
        self.records: Dict[str, Any] = {}  # rel -> [size, mtime, mode, crc, inode, ctime] (a tuple once recorded here)
        self.fds: Dict[int, int] = {}
        self.crcs: Dict[int, int] = {}
        self.failed: Dict[Any, str] = {}
        self.unjournaled: List[Tuple[str, list]] = []
        self.tag = hashlib.sha1(host.encode()).hexdigest()[:8]  # temporary names never collide between nodes
        self.journal = Journal(dst, journal, src, durable, self.tmp_path(os.path.join(dst, journal), mine=False))
        self.last_journal = time.monotonic()
        self.files_written = self.bytes_written = 0
        self.broken: Optional[str] = None  # first write error: later files are not even tried
        self.writes = True  # False: another node's leader writes this very directory (shared dst)
        self.probe: Optional[str] = None
        self.interrupted = False  # journals of a killed stage were found
        self.umask = process_umask()
        self.copier = Copier()
        self.chmod: Dict[int, bool] = {}  # open temporary files still to be given their mode
        self.units: Dict[int, List[int]] = {}  # folders copied whole: folder index -> its file indexes
        self.links: List[int] = []  # links to make (see start)
        self.more: List[str] = []  # other ranks' records, as JSON objects (see add_records)
        self.more_files = 0
        self.writing: Optional[int] = None  # the file the writer thread is at (for a stall's error)
        self.stalled: Optional[str] = None  # the writer made no progress: nothing more touches dst

    def path(self, idx: int) -> str:
        rel = self.entries[idx].rel
        return f"{self.dst}/{rel}" if rel else self.dst

    def tmp_path(self, final: str, mine: bool = True) -> str:
        """The temporary name of ``final`` on this node (``mine``: of this call; the journal's and
        the manifest's are the node's, found again by the next call). All end in the node's
        suffix, which the next call removes after a killed one."""
        folder, _, name = final.rpartition("/")
        if len(name) > 200:  # keep the temporary name within NAME_MAX
            name = hashlib.sha1(name.encode()).hexdigest()
        return f"{folder}/.{name}.{self.call if mine else ''}{self.tag}{TMP_SUFFIX}"

    def _where(self, msg: str) -> str:
        return f"node {self.host}: {msg}"

    # - before the transfer

    def probe_path(self, token: str, index: int) -> str:
        return os.path.join(self.dst, f".probe-{token}-{index}{TMP_SUFFIX}")

    def open_destination(self, token: str, index: int) -> Optional[str]:
        """Create ``dst`` and prove it writable with a probe file, left in place until
        :meth:`close_probe` so that leaders sharing the directory can see each other's."""
        dst = self.dst
        try:
            refused = make_private_dirs(dst)
        except OSError as exc:
            return self._where(f"cannot create destination {dst}: {exc.strerror}")
        if refused is not None:
            return self._where(refused)
        if not os.path.isdir(dst):
            return self._where(f"destination {dst} is not a directory")
        probe = self.probe_path(token, index)
        try:
            _make_writable(dst)
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            self.probe = probe
        except OSError as exc:
            return self._where(f"destination {dst} is not writable: {exc.strerror}")
        return None

    def close_probe(self) -> None:
        if self.probe is not None:
            unlink(self.probe)
            self.probe = None

    def prepare(self, whole_folders: bool = False) -> Optional[str]:
        """Create the directories, check there is room, mark the files this node lacks and the
        links to make (:meth:`start` makes them); with ``whole_folders``, also pick the folders
        to copy whole (:attr:`units`). Returns an error naming node and path, or None."""
        dst = self.dst
        found = journals(dst)
        self.records = load_all(dst, self.src, self.host)
        self.journal.carried = read_journals(dst, found, self.src, self.records, self.host)
        self.interrupted = clear_killed(self, found)
        shutil.rmtree(claims_path(self.dst, self.tag), ignore_errors=True)  # a killed one-node copy's (see transfer)
        return self._compare(self.records, whole_folders)

    def _compare(self, records: Dict[str, Any], whole_folders: bool = False) -> Optional[str]:
        """Mark the files lacking or unlike ``records`` (:attr:`need`), make folders, list links, check room."""
        dst = self.dst
        need_bytes = replaced = largest = 0
        made = set()
        links = []
        needed: List[int] = []  # marked in self.need at once
        try:
            for i, e in enumerate(self.entries):
                kind = e.kind
                if kind == FILE:
                    rec = records.get(e.rel)
                    if rec is None:  # never staged here: needed, whatever lies there now
                        needed.append(i)
                        need_bytes += e.size
                        continue
                    path = self.path(i)
                    try:
                        have: Optional[os.stat_result] = os.lstat(path)
                    except FileNotFoundError:
                        have = None
                    if have is not None and st.S_ISDIR(have.st_mode):
                        return self._where(f"{path} is a directory, the source has a file there")
                    if not up_to_date(e, rec, have):
                        needed.append(i)
                        need_bytes += e.size
                        if have is not None:
                            replaced += have.st_size
                            largest = max(largest, have.st_size)
                elif kind == DIR:
                    if _ensure_dir(self.path(i)):
                        made.add(i)
                else:  # a link
                    links.append(i)
            self.need[needed] = 1
            vfs = os.statvfs(dst)
            if whole_folders:
                self.units = whole(self.entries, self.need, lambda i: i in made or not os.listdir(self.path(i)))
        except OSError as exc:
            return self._where(f"preparing {exc.filename or dst}: {exc.strerror}")
        free = vfs.f_bavail * vfs.f_frsize
        want = need_bytes - replaced + largest  # a replaced file is freed only after its copy is in
        if want > free:
            return self._where(f"not enough space in {dst}: need {want} bytes, {free} free (disk full)")
        self.links = links
        return None

    def start(self) -> None:
        """Once every node said it can take the copy: start the journal if this node lacks files
        (before any temporary name: a kill from then on leaves a journal) and make the links.
        An error here is the node's (:meth:`note`), reported by :meth:`finish`."""
        if self.need.any():
            self.begin()
        try:
            for i in self.links:
                path = self.path(i)
                _ensure_link(path, self.entries[i], self.tmp_path(path), self.begin)
        except OSError as exc:
            self.note(f"making link {exc.filename or self.dst}: {exc.strerror}")

    # - the transfer

    def open(self, idx: int, shared: bool = False) -> Optional[int]:
        """A fresh temporary file for entry ``idx`` (None when this node skips it); ``shared``: other
        ranks open it by name too, so it stays writable by its owner until sealed."""
        if self.broken is not None or idx in self.failed:
            return None
        e = self.entries[idx]
        if e.size > DEFAULT_CHUNK_BYTES or time.monotonic() - self.last_journal > JOURNAL_SECONDS:
            self.checkpoint()  # record what is done before a long file, so a kill loses little
        tmp = self.tmp_path(self.path(idx))
        mode, chmod = (0o600, True) if shared else creation_mode(e.mode, self.umask)
        try:
            fd = create(tmp, mode)
        except OSError as exc:
            self.fail(idx, f"cannot create {tmp}: {exc.strerror}")
            return None
        self.fds[idx], self.crcs[idx], self.chmod[idx] = fd, 0, chmod
        return fd

    def write_round(self, pieces: Sequence[Piece], buf: Any, verify: bool) -> None:
        """Write this node's pieces of one broadcast round (on the writer thread)."""
        trailer = np.frombuffer(buf, dtype=np.int64, count=2 * len(pieces), offset=trailer_at(pieces))
        mv, pos = memoryview(buf), 0
        for j, (idx, off, n) in enumerate(pieces):
            view = mv[pos: pos + n]
            pos += n
            if self.stalled is not None:  # the buffer may be another round's by now: write nothing
                return
            if not self.need[idx]:
                continue
            self.writing = idx
            if trailer[2 * j + 1]:  # the root could not read it: its error fails the stage
                self.fail(idx, None)
                continue
            fd = self.open(idx) if off == 0 else self.fds.get(idx)
            if fd is None:
                continue
            try:
                pwrite_all(fd, view, off)
            except OSError as exc:
                self.fail(idx, f"writing {self.path(idx)}: {exc.strerror}")
                continue
            crc = zlib.crc32(view, self.crcs[idx]) if verify else int(trailer[2 * j])
            self.crcs[idx] = crc
            if self.stalled is not None:  # given up while this write hung: no file is completed
                return
            if crc != int(trailer[2 * j]):
                self.fail(idx, f"{self.path(idx)}: checksum mismatch at byte {off + n} (corrupted in transfer)")
            elif off + n == self.entries[idx].size:
                self.complete(idx, crc)

    def complete(self, idx: int, crc: Optional[int]) -> None:
        """Check size, set mode and times, rename into place, record."""
        final = self.path(idx)
        try:
            done = seal(self.fds.pop(idx), self.entries[idx], self.tmp_path(final), final, self.chmod.pop(idx, True))
        except OSError as exc:
            self.fds[idx] = -1  # closed; fail() removes the temporary file
            self.fail(idx, exc.strerror if exc.errno == 0 else f"finishing {final}: {exc.strerror}")
            return
        self.record(idx, done, crc)

    def record(self, idx: int, done: os.stat_result, crc: Optional[int]) -> None:
        """Entry ``idx`` is in place as ``done``: remember it for the journal and the manifest."""
        self.record_all([(idx, done.st_ino, done.st_ctime_ns)], crc)

    def record_all(self, done: Sequence[Tuple[int, int, int]], crc: Optional[int] = None) -> None:
        """:meth:`record` for each ``(entry index, its copy's inode, its copy's ctime)``. A record
        is a tuple of numbers (written as a JSON list): the garbage collector stops tracking it, so
        the records of a tree of small files do not make it sweep the heap over and over."""
        entries, records, unjournaled = self.entries, self.records, self.unjournaled
        written = 0
        for idx, ino, ctime in done:
            e = entries[idx]
            size = e.size
            rec = (size, e.mtime_ns, e.mode, crc, ino, ctime)
            records[e.rel] = rec
            unjournaled.append((e.rel, rec))
            written += size
        self.bytes_written += written
        self.files_written += len(done)

    def add_records(self, records: str, files: int) -> None:
        """Records of ``files`` files another rank of the node copied, as the JSON object it made
        (so the manifest is encoded in parallel); they go into the manifest as they are."""
        self.more.append(records)
        self.more_files += files
        self.files_written += files

    def fail(self, idx: int, why: Optional[str]) -> None:
        """Drop entry ``idx``'s temporary file; ``why`` (None: the root's error says it) fails the stage."""
        fd = self.fds.pop(idx, None)
        self.chmod.pop(idx, None)
        if fd is not None:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:  # (EIO on a network filesystem) the file is dropped anyway
                    pass
            unlink(self.tmp_path(self.path(idx)))
        if why is not None:
            self.failed.setdefault(idx, why)
            self.broken = self.broken or why

    def begin(self) -> None:
        """Start the journal before this node makes its first temporary name: a stage killed
        from then on leaves a journal, and the next call, finding it, removes the temporary files
        and folders (hidden names, but not hidden from a walk)."""
        self.note(self.journal.start())

    def checkpoint(self) -> None:
        """Append the files finished since the last checkpoint to the journal. A journal that
        cannot be written fails the stage (on every rank), it does not raise here."""
        self.last_journal = time.monotonic()
        if not self.unjournaled or self.journal.error:
            return
        if self.durable:
            try:
                syncfs(self.dst)
            except OSError as exc:
                self.note(f"syncing {self.dst}: {exc.strerror}")
                return
        if not self.note(self.journal.append(self.unjournaled)):
            self.unjournaled.clear()

    def note(self, error: Optional[str]) -> Optional[str]:
        """An ``error`` (None: none) of this node that is no one file's: it fails the stage, and
        later files are not tried. Returns it."""
        if error is not None:
            self.failed[("node", len(self.failed))] = error
            self.broken = self.broken or error
        return error

    def stall(self, why: str) -> None:
        """The writer thread made no progress (``why`` names the file): the node's error, and from
        now on nothing touches ``dst`` (a stuck disk would hang whatever did); the files begun
        stay under their temporary names, which the next stage removes."""
        self.stalled = self.stalled or why
        self.note(why)

    def writing_what(self) -> str:
        """The file the writer thread is at, for an error."""
        return self.path(self.writing) if self.writing is not None else f"into {self.dst}"

    # - after the transfer

    def finish(self, complete: bool = True) -> Optional[str]:
        """Write the manifest (or keep the journal after an error, or when another node's error
        ended the stage before its last round: ``complete`` False), then directories' modes and
        mtimes. Returns this node's first error, named."""
        if not self.writes:
            return None
        if self.stalled is not None:
            return self._where(self.stalled)
        for idx in list(self.fds):
            self.fail(idx, f"{self.path(idx)}: incomplete")
        try:
            if self.failed or not complete:
                for more in self.more:
                    self.unjournaled.extend(json.loads(more).items())
                self.checkpoint()  # what did finish is kept for the next call
                self._no_manifest()
                if not self.failed:
                    return None
                key, first = next(iter(self.failed.items()))
                if isinstance(key, tuple) and key[0] == "rank":  # another rank's, named (see transfer._gathered)
                    return first
                return self._where(first)
            if self.files_written or self.journal.started or self.interrupted or self._stale():
                if self.note(self.journal.start()):  # (the manifest too has a temporary name)
                    return self._where(self.journal.error)  # type: ignore[arg-type]
                self._put_manifest()
            else:
                self._no_manifest()
            self._set_dir_attributes()
        except OSError as exc:
            return self._where(f"finishing {exc.filename or self.dst}: {exc.strerror}")
        finally:
            self.journal.close()
        return None

    def _stale(self) -> bool:  # the manifest found differs from what this stage would write
        return len(self.records) + self.more_files != sum(e.kind == FILE for e in self.entries)

    def _put_manifest(self) -> None:
        write_object(self)

    def _no_manifest(self) -> None:
        """The manifest found stays (an error: the journal keeps what finished; or no change)."""

    def _set_dir_attributes(self) -> None:
        set_dir_attributes(self.entries, self.path)


def set_dir_attributes(entries: Sequence[Entry], path: Callable[[int], str]) -> None:
    """Directories' modes and mtimes, once their files are in."""
    for i in range(len(entries) - 1, -1, -1):  # children before their parents
        e = entries[i]
        if e.kind == DIR:
            os.chmod(path(i), e.mode)
            os.utime(path(i), ns=(e.atime_ns, e.mtime_ns))


def _make_writable(path: str) -> None:
    mode = st.S_IMODE(os.stat(path).st_mode)
    if mode & 0o700 != 0o700:  # a read-only source directory, staged before: writable until the end
        os.chmod(path, mode | 0o700)


def _ensure_dir(path: str) -> bool:
    """Make ``path`` a writable directory; True when it is new (so empty)."""
    try:
        s = os.lstat(path)
    except FileNotFoundError:
        os.mkdir(path, 0o700)
        return True
    if not st.S_ISDIR(s.st_mode):  # the source has a directory where the copy has something else
        os.unlink(path)
        os.mkdir(path, 0o700)
        return True
    _make_writable(path)
    return False


def _ensure_link(path: str, e: Entry, tmp: str, begin: Callable[[], None]) -> None:
    """Make ``path`` the link ``e`` (through ``tmp``, after ``begin``) unless it is already."""
    try:
        if os.readlink(path) == e.target:
            return
    except FileNotFoundError:
        pass
    except OSError:  # not a link
        if os.path.isdir(path) and not os.path.islink(path):
            raise OSError(21, "the source has a symbolic link here, the copy a directory", path) from None
    begin()
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    os.symlink(e.target, tmp)
    os.utime(tmp, ns=(e.atime_ns, e.mtime_ns), follow_symlinks=False)
    os.replace(tmp, path)


def remove_temporaries(dst: str, suffix: str) -> None:
    """A stage was killed here: this node's temporary files and folders (``suffix``) are not data,
    remove them."""
    for folder, dirs, files in os.walk(dst):
        for name in [d for d in dirs if d.endswith(suffix)]:
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
            dirs.remove(name)
        for name in files:
            if name.endswith(suffix):
                try:
                    os.unlink(os.path.join(folder, name))
                except OSError:
                    pass


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def clear_killed(node: Destination, journals_found: List[str]) -> bool:
    """What a killed stage left in ``node``'s ``dst``: with its journals found, every temporary
    name of this node (True: the stage is resumed); without, only those of a journal or manifest
    being written when the kill came, before any journal began. Raises OSError."""
    if journals_found:
        remove_temporaries(node.dst, f".{node.tag}{TMP_SUFFIX}")
        return True
    for tmp in (node.journal.tmp, node.tmp_path(os.path.join(node.dst, MANIFEST), mine=False)):
        unlink(tmp)
    return False


def claims_path(dst: str, tag: str) -> str:
    """The folder where a one-node copy's ranks claim blocks of work (removed at the end)."""
    return os.path.join(dst, f".hpcsync-claims.{tag}{TMP_SUFFIX}")
