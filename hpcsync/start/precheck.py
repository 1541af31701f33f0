"""What :func:`hpcsync.init` checks before it starts anything, and how a set-up error is said.

A malformed ``HPCSYNC_*`` setting or a bad argument of ``init`` is the job script's or the
program's to fix, and usually the same on every rank. Each rank finds its own (the settings'
:func:`hpcsync.core.settings.problems`, :func:`argument_problems`); under MPI the ranks exchange
them in one bounded collective, and if any rank found one, every rank raises the same
:class:`~hpcsync.core.errors.SetupError` (``agreed``), naming which rank had which. Left
uncaught, the abort hook hands it to :func:`end_agreed`: rank 0 prints it, in a few lines and
without a traceback (``HPCSYNC_DEBUG=1`` adds it), every rank waits until it has, and each exits
non-zero the ordinary way: every rank stops at the same call, so none is left waiting and no
``MPI_Abort`` is needed. A set-up error that is not agreed (a second ``init`` that asks for
something else: each rank checks its own call; ranks without MPI) goes the way of any uncaught
exception, without the traceback (:func:`block`).
"""
from __future__ import annotations

import datetime as _dt
import operator
import os
import sys
import traceback
from typing import Any, Dict, List, Optional, Sequence

from ..core import bounded, jobend, mpi, settings
from ..core.errors import SetupError
from ..core.topology import Topology, topology
from ..observe import failure

__all__ = ["SAID_WAIT_S", "argument_problems", "check", "caller", "rank_label", "block", "end_agreed"]

SAID_WAIT_S = 10.0  # how long the ranks wait for rank 0 to have said an agreed set-up error


def argument_problems(backend: str, backends: Sequence[str], store: Optional[str], timeout: Any,
                      master_port: Any) -> List[str]:
    """A line for each argument of :func:`hpcsync.init` that cannot work, as
    :func:`hpcsync.core.settings.problems` has one for each malformed setting."""
    bad = []
    if backend not in backends:
        bad.append(f"backend={backend!r}: expected one of {', '.join(map(repr, backends))}")
    if store is not None and str(store).lower() not in ("tcp", "mpi"):
        bad.append(f"store={store!r}: expected 'tcp' or 'mpi'")
    if timeout is not None and _seconds(timeout) is None:
        bad.append(f"timeout={timeout!r}: expected a positive number of seconds or a datetime.timedelta")
    if master_port is not None:
        try:
            port = -1 if isinstance(master_port, bool) else operator.index(master_port)
        except TypeError:
            port = -1
        if not 0 <= port <= 65535:
            bad.append(f"master_port={master_port!r}: expected a port number, 0-65535 (0: any free port)")
    return bad


def _seconds(timeout: Any) -> Optional[float]:
    """``timeout`` (a number of seconds or a timedelta) in seconds; None unless positive and finite."""
    try:
        s = timeout.total_seconds() if isinstance(timeout, _dt.timedelta) else float(timeout)
    except (TypeError, ValueError):
        return None
    return s if 0 < s < float("inf") else None


def check(problems: List[str], timeout: Any) -> Topology:
    """This rank's ``problems`` (its arguments'; the settings' are added here) and every other
    rank's, exchanged under MPI within ``timeout`` (init's argument, else ``HPCSYNC_TIMEOUT``,
    else its default): any at all, and every rank raises the same :class:`SetupError`. Without
    MPI a rank raises its own (agreed only in a job of one process). Returns the topology
    (under MPI collective: the first thing init asks of MPI)."""
    mine = settings.problems() + list(problems)
    topo = topology()
    every = {topo.rank: mine}
    if topo.uses_mpi and topo.world_size > 1:
        wait = _seconds(timeout) if timeout is not None else _seconds(settings.text("HPCSYNC_TIMEOUT"))
        ctl = bounded.control("hpcsync.init: every rank's settings and arguments",
                              timeout=wait or float(settings.SETTINGS["HPCSYNC_TIMEOUT"].default))
        every = dict(enumerate(ctl.allgather(mine)))
    found: Dict[str, List[int]] = {}
    for rank, lines in sorted(every.items()):
        for line in lines:
            found.setdefault(line, []).append(rank)
    if found:
        raise SetupError.found(found, topo.world_size, caller(), agreed=topo.uses_mpi or topo.world_size == 1)
    return topo


def caller() -> Optional[str]:
    """``file:line`` of the program's code that called into hpcsync (the innermost frame outside
    the package), for an error that the program's own call caused."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame: Any = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else None


def rank_label() -> str:
    """This rank for a message: MPI's once MPI runs (init exports ``RANK`` only once it gets that
    far), else the launcher's ``RANK``, else ``?``."""
    if mpi.already_initialized():
        return str(mpi.MPI().COMM_WORLD.Get_rank())
    return os.environ.get("RANK", "?")


def block(exc: SetupError, tb: Any, who: str = "") -> str:
    """A set-up error for people: its lines marked ``[hpcsync]`` (``who`` before the first), the
    traceback only with ``HPCSYNC_DEBUG=1``: a plain user error says what to change in its words."""
    lines = str(exc).splitlines() or [type(exc).__name__]
    lines[0] = who + lines[0]
    frames = "Traceback (most recent call last):\n" + "".join(traceback.format_tb(tb)) if settings.debug() else ""
    if not frames:
        lines[-1] += " (HPCSYNC_DEBUG=1 shows the traceback)"
    return frames + "".join(f"[hpcsync] {line}\n" for line in lines)


def end_agreed(exc: SetupError, tb: Any) -> None:
    """An agreed set-up error, uncaught: rank 0 says it for the job, every rank waits (at most
    :data:`SAID_WAIT_S`) until it has -- a launcher ends the job at the first rank that exits
    non-zero, and rank 0's words must be out by then -- and returns, to exit non-zero the
    ordinary way; a rank whose exit (MPI's finalize) is not over within ``HPCSYNC_ABORT_GRACE``
    ends itself."""
    world = mpi.MPI().COMM_WORLD if mpi.already_initialized() else None
    if world is None or world.Get_rank() == 0:
        sys.stderr.write(block(exc, tb))
        sys.stderr.flush()
    failure.note_exception(exc)
    if world is not None and world.Get_size() > 1:
        try:
            bounded.control("hpcsync: a set-up error said, before the ranks exit", timeout=SAID_WAIT_S).Barrier()
        except Exception:  # (the exit is bounded below all the same)
            pass
        jobend.end_within(jobend.grace_s())
