"""The process's MPI lock below ``THREAD_MULTIPLE``.

Under ``THREAD_SERIALIZED`` (Cray MPICH's default, many site builds) and ``THREAD_FUNNELED`` MPI
allows one call at a time in the whole process. Every backend group, and every bounded control or
helper exchange (:mod:`hpcsync.core.bounded`), then holds :data:`SERIAL` around its MPI calls
(each group's own issue lock still orders its operations) and gives it up while it waits between
two tests of a request (:func:`nap`), so a thread on another group goes on: a wait that kept it
would stall the operation its peers need.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, List, Optional

__all__ = ["SERIAL", "lock", "call", "nap", "check_thread"]

SERIAL = threading.Condition(threading.RLock())


_level: List[Optional[threading.Condition]] = []  # below THREAD_MULTIPLE: [SERIAL], else [None] (asked once)


def lock() -> Optional[threading.Condition]:
    """:data:`SERIAL` when MPI was started below ``THREAD_MULTIPLE``, else None (threads may call
    MPI at once)."""
    if not _level:
        from . import mpi

        MPI = mpi.MPI()
        _level.append(SERIAL if MPI.Query_thread() < MPI.THREAD_MULTIPLE else None)
    return _level[0]


def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` (an MPI call) holding :data:`SERIAL` where MPI needs it (:func:`lock`)."""
    held = lock()
    if held is None:
        return fn(*args, **kwargs)
    with held:
        return fn(*args, **kwargs)


def nap(serial: Optional[threading.Condition], seconds: float) -> None:
    """Sleep between two tests of a request: below THREAD_MULTIPLE give the process's MPI lock
    (held) to another thread meanwhile."""
    try:
        if serial is not None:
            serial.wait(seconds)
            return
    except RuntimeError:  # not held by this thread: nothing to give up
        pass
    time.sleep(seconds)


def check_thread(main_only: bool, group: str) -> None:
    """Under THREAD_FUNNELED (``main_only``) only the main thread may call MPI: an operation from
    another thread is a clear error, not undefined behaviour inside MPI."""
    if main_only and threading.current_thread() is not threading.main_thread():
        raise RuntimeError(f"hpcsync backend: MPI provides THREAD_FUNNELED (only the main thread may call MPI), "
                           f"but thread {threading.current_thread().name!r} issued an operation on group "
                           f"{group!r}; ask for THREAD_MULTIPLE (MPI4PY_RC_THREAD_LEVEL=multiple) or issue it "
                           "from the main thread")
