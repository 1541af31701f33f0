"""One file's copy on a node: created under a temporary name, filled in the kernel, sealed.

Small files cost system calls, not bandwidth, so each step here makes as few as it can: a copy
is created with its final mode when the umask leaves that mode whole (no ``fchmod``, unless the
``fstat`` taken anyway shows that a default ACL gave it another mode), filled
with one ``copy_file_range`` (or, where the filesystems cannot, ``sendfile``; the choice is
remembered, so a source on another filesystem costs no failed call per file), given its times
and renamed into place; one ``fstat`` of the open file after the rename gives the inode and
ctime the manifest records.
"""
from __future__ import annotations

import errno
import os
import shutil
from typing import Dict, List, Optional, Sequence, Tuple

from .listing import Entry

__all__ = [
    "process_umask", "creation_mode", "create", "seal", "copy_file", "Failure", "new_folder", "fill_folder",
    "Copier", "source_changed", "pwrite_all", "syncfs"
]

_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_CLOEXEC
_SETID_STICKY = 0o7000
# what copy_file_range / sendfile answer when the pair of files cannot use them
_UNSUPPORTED = (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


def process_umask() -> Optional[int]:
    """This process's umask, read without changing it (``/proc/self/status``, Linux 4.7+); None
    when it cannot be read (then every copy gets an explicit ``fchmod``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


def creation_mode(mode: int, umask: Optional[int]) -> Tuple[int, bool]:
    """``(mode to create the copy with, whether it still needs fchmod)``: a mode that the umask
    leaves whole, without set-id or sticky bits (which creation may drop), is given at creation."""
    if umask is not None and not mode & (_SETID_STICKY | umask):
        return mode, False
    return 0o600, True


def create(tmp: str, mode: int) -> int:
    """A new, empty file at ``tmp`` opened for writing; a leftover there (a killed stage's) is
    replaced, so the creation mode always applies."""
    try:
        return os.open(tmp, _NEW, mode)
    except FileExistsError:
        os.unlink(tmp)
        return os.open(tmp, _NEW, mode)


def seal(fd: int, e: Entry, tmp: str, final: str, chmod: bool) -> os.stat_result:
    """Give the written temporary file ``fd`` the source's mode (when ``chmod``) and times, rename
    it to ``final`` and return its stat taken after the rename (which changes ctime). ``fd`` is
    closed whatever happens. The caller has checked that every byte was written."""
    try:
        if chmod:
            os.fchmod(fd, e.mode)
        os.utime(fd, ns=(e.atime_ns, e.mtime_ns))
        os.replace(tmp, final)
        s = os.fstat(fd)
        if not chmod and s.st_mode & 0o7777 != e.mode:  # a default ACL on the folder replaced the umask
            s = _chmod(fd, e.mode)
    finally:
        os.close(fd)
    if s.st_size != e.size:  # a safety net: the writers count every byte
        os.unlink(final)
        raise OSError(0, f"{final}: wrote {s.st_size} bytes, the source has {e.size}")
    return s


def _chmod(fd: int, mode: int) -> os.stat_result:
    """Give ``fd`` its mode after all and return its new stat: a default ACL on the destination
    folder replaces the umask, so a mode given at creation may not be the one the file got."""
    os.fchmod(fd, mode)
    return os.fstat(fd)


def copy_file(copier: "Copier", umask: Optional[int], e: Entry, source: str, tmp: str, final: str
              ) -> Tuple[int, Optional[os.stat_result], Optional[str], bool]:
    """Copy one whole file from ``source`` into place at ``final`` (through ``tmp``) in the kernel,
    checked against the listing and sealed. Returns ``(bytes read, the copy's stat, error, whether
    the source is to blame)``."""
    try:
        sfd = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        return 0, None, f"reading {source}: {exc.strerror}", True
    fd, copied = -1, 0
    try:
        mode, chmod = creation_mode(e.mode, umask)
        fd = create(tmp, mode)
        copied = copier.copy(sfd, fd, e.size)
        why = source_changed(sfd, e) if copied == e.size else f"source file {source} shrank while being staged"
        if why:
            os.close(fd)
            os.unlink(tmp)
            return copied, None, why, True
        fd, sealed = -1, fd
        return copied, seal(sealed, e, tmp, final, chmod), None, False
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


Failure = Tuple[int, str, bool]  # (entry index, why, whether the source is to blame)


def new_folder(path: str) -> None:
    """A new, empty folder at ``path`` for a hidden copy (a killed stage's leftover there is removed)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        shutil.rmtree(path)
        os.mkdir(path, 0o700)


def fill_folder(copier: "Copier", umask: Optional[int], entries: Sequence[Entry], files: Sequence[int], source: str,
                hidden: str) -> Tuple[List[Tuple[int, int, int]], int, List[Failure]]:
    """Copy ``files`` (entry indexes, all in the folder ``source``) into the new folder ``hidden``
    under their own names: nothing there is visible until the caller renames the folder, so no
    file needs a temporary name (no rename per file), and every name resolves in an open folder.
    Returns ``(copies made, as (entry index, inode, ctime), bytes read, failures)``; a failed copy
    is removed, a failure to write stops the rest. (Plain tuples of numbers, not stat results:
    the garbage collector stops tracking them, so a tree of small files does not make it sweep
    the heap over and over.)"""
    done: List[Tuple[int, int, int]] = []
    failed: List[Failure] = []
    read = 0
    modes: Dict[int, Tuple[int, bool]] = {}
    cfr, fstat, opn, close, utime = os.copy_file_range, os.fstat, os.open, os.close, os.utime  # the loop below is
    range_copy = copier.range_copy  # the cost of a small file
    cut = entries[files[0]].rel.rfind("/") + 1 if files else 0  # where the names start (one folder)
    sdir = opn(source, _FOLDER)
    try:
        hdir = opn(hidden, _FOLDER)
        try:
            for i in files:
                e = entries[i]
                rel, _, emode, atime, mtime, size, _ = e
                name = rel[cut:]
                try:
                    sfd = opn(name, _READ, dir_fd=sdir)
                except OSError as exc:
                    failed.append((i, f"reading {source}/{name}: {exc.strerror}", True))
                    continue
                fd = -1
                try:
                    how = modes.get(emode)
                    if how is None:
                        how = modes[emode] = creation_mode(emode, umask)
                    mode, chmod = how
                    fd = opn(name, _NEW, mode, dir_fd=hdir)
                    copied = -1
                    if range_copy:
                        try:
                            copied = cfr(sfd, fd, size, 0, 0)
                        except OSError:
                            pass  # Copier.copy decides: an error, or another way to copy
                    if copied != size:
                        copied = max(copied, 0)
                        copied += copier.copy(sfd, fd, size - copied, copied)
                        range_copy = copier.range_copy
                    read += copied
                    if copied == size:
                        s = fstat(sfd)
                        why = None if s.st_size == size and s.st_mtime_ns == mtime else \
                            f"source file {source}/{name} changed while being staged"
                    else:
                        why = f"source file {source}/{name} shrank while being staged"
                    if why is None:
                        if chmod:
                            os.fchmod(fd, emode)
                        utime(fd, ns=(atime, mtime))
                        s = fstat(fd)
                        if not chmod and s.st_mode & 0o7777 != emode:  # a default ACL on the folder
                            s = _chmod(fd, emode)
                        if s.st_size == size:  # a safety net: the copy counts every byte
                            done.append((i, s.st_ino, s.st_ctime_ns))
                            continue
                        why = f"{hidden}/{name}: wrote {s.st_size} bytes, the source has {size}"
                    failed.append((i, why, True))
                except OSError as exc:
                    failed.append((i, f"writing {hidden}/{name}: {exc.strerror}", False))
                finally:
                    if fd >= 0:
                        close(fd)
                    close(sfd)
                try:  # only a complete copy stays
                    os.unlink(name, dir_fd=hdir)
                except OSError:
                    pass
                if not failed[-1][2]:
                    break
        finally:
            close(hdir)
    finally:
        close(sdir)
    return done, read, failed


class Copier:
    """Copies byte ranges between open files in the kernel; remembers when ``copy_file_range``
    cannot serve this pair of filesystems and goes straight to ``sendfile`` from then on. A 0
    from ``copy_file_range`` or ``sendfile`` before ``size`` bytes is not taken as the end of the
    file (some kernels and filesystems answer 0 for a file they cannot copy, as ``cp`` knows): the
    next way is tried, and only a plain read's 0 ends the copy."""

    def __init__(self) -> None:
        self.range_copy = True
        self.sendfile = True

    def copy(self, sfd: int, dfd: int, size: int, offset: int = 0) -> int:
        """Copy ``size`` bytes at ``offset`` of ``sfd`` to the same offset of ``dfd``. Returns the
        bytes copied: fewer than ``size`` when the source ended first."""
        done = 0
        if self.range_copy:
            try:
                while done < size:
                    k = os.copy_file_range(sfd, dfd, size - done, offset + done, offset + done)
                    if k == 0:
                        break  # not always the end of the file: some filesystems answer 0 (see below)
                    done += k
                else:
                    return done
            except OSError as exc:
                if exc.errno not in _UNSUPPORTED:
                    raise
                self.range_copy = False
        if self.sendfile:
            try:
                if offset + done:
                    os.lseek(dfd, offset + done, os.SEEK_SET)
                while done < size:
                    k = os.sendfile(dfd, sfd, offset + done, size - done)
                    if k == 0:
                        break
                    done += k
                else:
                    return done
            except OSError as exc:
                if exc.errno not in _UNSUPPORTED:
                    raise
                self.sendfile = False
        return done + _read_write(sfd, dfd, size - done, offset + done)  # only its 0 is the end of the file


def _read_write(sfd: int, dfd: int, size: int, offset: int) -> int:
    buf = bytearray(min(max(size, 1), 8 * 2**20))
    done = 0
    while done < size:
        view = memoryview(buf)[: min(len(buf), size - done)]
        got = os.preadv(sfd, [view], offset + done)
        if got == 0:
            break
        pwrite_all(dfd, view[:got], offset + done)
        done += got
    return done


def source_changed(fd: int, e: Entry) -> Optional[str]:
    """Why a source file read to its end no longer matches the listing (torn copy), or None."""
    s = os.fstat(fd)
    if s.st_size != e.size or s.st_mtime_ns != e.mtime_ns:
        return f"source file {e.rel or '.'} changed while being staged"
    return None


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def syncfs(path: str) -> None:
    """Flush the filesystem that holds ``path`` (``syncfs``; ``sync`` where that fails)."""
    import ctypes

    fd = os.open(path, os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)
