"""A stage never writes into its own source: a destination that is the source, lies inside it or
holds it is refused (a copy nested in its source grows by one copy per call, and one of a folder
onto itself rewrites every file in place)."""
from __future__ import annotations

import os
from typing import Optional

from .transfer import identity

__all__ = ["overlap"]


def _resolved(path: str) -> str:
    """``path`` as the stage uses it -- made absolute with ``..`` taken as written
    (``os.path.abspath``: every file operation of the stage goes to that path) -- with its
    symbolic links resolved: a missing path resolves through its nearest existing ancestor, the
    missing names kept (the path it would have once made)."""
    return os.path.realpath(os.path.abspath(path))


def _within(inner: str, outer: str) -> bool:
    """Whether ``inner`` lies in the folder ``outer`` (both resolved): whole names only, so
    ``/data/set2`` is not in ``/data/set``."""
    return inner.startswith(outer if outer.endswith("/") else outer + "/")


def _folder_on_the_way(path: str, folder: str) -> Optional[str]:
    """The existing folder among ``path`` and its ancestors (all resolved) that *is* ``folder``,
    the same directory under another name (a bind mount, a second mount of one export), or None."""
    want = identity(folder)
    if want is None:
        return None
    at = path
    while True:
        if identity(at) == want:
            return at
        up = os.path.dirname(at)
        if up == at:
            return None
        at = up


def overlap(src: str, dst: str) -> Optional[str]:
    """Why ``src`` (a folder or a file) may not be staged into ``dst``, or None: after links and
    ``..`` are resolved they are the same, or one lies inside the other -- by name, or because a
    folder on the way is the other one mounted elsewhere (its device and inode). Judged in this
    rank's view of both; nothing is created."""
    s, d = _resolved(src), _resolved(dst)
    if s == d:
        how = f"the destination is the source ({s})"
    elif _within(d, s):
        how = f"the destination is inside the source ({d} is in {s})"
    elif _within(s, d):
        how = f"the source is inside the destination ({s} is in {d})"
    elif (at := _folder_on_the_way(d, s)) is not None:
        how = (f"the destination is the source ({d} is {s}, mounted elsewhere)" if at == d else
               f"the destination is inside the source ({at}, on the way to {d}, is {s} mounted elsewhere)")
    elif (at := _folder_on_the_way(s, d)) is not None:
        how = f"the source is inside the destination ({at}, on the way to {s}, is {d} mounted elsewhere)"
    else:
        return None
    return f"source and destination overlap: {how}; stage into a folder apart from the source"
