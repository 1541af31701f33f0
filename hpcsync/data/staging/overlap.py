"""A stage never writes into its own source: a destination that is the source, lies inside it or
holds it is refused (a copy nested in its source grows by one copy per call, and one of a folder
onto itself rewrites every file in place)."""
from __future__ import annotations

import os
from typing import Optional

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


def overlap(src: str, dst: str) -> Optional[str]:
    """Why ``src`` (a folder or a file) may not be staged into ``dst``, or None: after links and
    ``..`` are resolved they are the same, or one lies inside the other. Judged in this rank's
    view of both; nothing is created."""
    s, d = _resolved(src), _resolved(dst)
    if s == d:
        how = f"the destination is the source ({s})"
    elif _within(d, s):
        how = f"the destination is inside the source ({d} is in {s})"
    elif _within(s, d):
        how = f"the source is inside the destination ({s} is in {d})"
    else:
        return None
    return f"source and destination overlap: {how}; stage into a folder apart from the source"
