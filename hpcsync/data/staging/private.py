"""A destination only this job's user can use: refused when it is a link, another user's, or
made first by another user where anyone may create names (``/tmp/hpcsync-<job>``)."""
from __future__ import annotations

import os
import stat as st
from typing import Optional

__all__ = ["not_private", "make_private_dirs"]


def _squattable(folder: str) -> bool:
    """A folder anyone may create names in (``/tmp``, ``/dev/shm``: sticky, world-writable)."""
    try:
        mode = os.stat(folder).st_mode
    except OSError:
        return False
    return bool(mode & st.S_ISVTX and mode & st.S_IWOTH)


def not_private(dst: str) -> Optional[str]:
    """Why ``dst`` may not take a copy, or None. Refused: ``dst`` a symbolic link; a symbolic link
    of another user on the way to it; ``dst`` another user's; and while ``dst`` is missing, its
    nearest existing folder when another user made it where anyone may create names (a
    ``/tmp/hpcsync-<job>`` made first by someone else: their files would join the copy, or they
    could swap a folder of it for a link). Root's folders and links (``/tmp``, ``/scratch``) are
    fine, and so is a group's project folder. Nothing is created."""
    me, path = os.geteuid(), os.path.abspath(dst)
    parts = path.strip("/").split("/")
    existing = "/"
    for i in range(1, len(parts) + 1):
        here = "/" + "/".join(parts[:i])
        try:
            s = os.lstat(here)
        except FileNotFoundError:
            break
        if st.S_ISLNK(s.st_mode) and here == path:
            return f"destination {dst} is a symbolic link: give the folder it points to, if it is yours"
        if st.S_ISLNK(s.st_mode) and s.st_uid not in (me, 0):
            return (f"destination {dst}: {here} is a symbolic link of another user (uid {s.st_uid}); stage only "
                    "into a folder of your own (e.g. $SLURM_TMPDIR, or a new one)")
        existing = here
    else:  # dst exists
        s = os.stat(path)
        if s.st_uid not in (me, 0):
            return (f"destination {dst} is a directory of another user (uid {s.st_uid}); stage only into a folder "
                    "of your own (e.g. $SLURM_TMPDIR, or a new one)")
        return None
    s = os.stat(existing)
    if s.st_uid not in (me, 0) and (_squattable(os.path.dirname(existing) or "/") or s.st_mode & st.S_IWOTH):
        return (f"destination {dst}: {existing} is a directory of another user (uid {s.st_uid}) where anyone "
                "may create names; stage only into a folder of your own (e.g. $SLURM_TMPDIR, or a new one)")
    return None


def make_private_dirs(dst: str) -> Optional[str]:
    """Create ``dst`` and its missing parents unless :func:`not_private` refuses it (returned): the
    first made inside a folder where anyone may create names (``/tmp``) is ``0700``, the others
    follow the umask. A folder that appears meanwhile is checked again, so another user's cannot
    slip in between the check and the creation. Raises OSError when a folder cannot be made."""
    refused = not_private(dst)
    if refused is not None:
        return refused
    missing = []
    path = os.path.abspath(dst)
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700 if _squattable(os.path.dirname(path)) else 0o777)
        except FileExistsError:
            refused = not_private(path)
            if refused is not None:
                return refused
    if not missing and not os.path.isdir(dst):
        raise FileExistsError(17, "File exists", dst)
    return None
