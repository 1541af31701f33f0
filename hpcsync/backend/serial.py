"""The process's MPI lock below ``THREAD_MULTIPLE``.

Under ``THREAD_SERIALIZED`` (Cray MPICH's default, many site builds) and ``THREAD_FUNNELED`` MPI
allows one call at a time in the whole process. Every group then holds :data:`SERIAL` around its
MPI calls (each group's own issue lock still orders its operations) and gives it up while it
waits between two tests of a request (:func:`nap`), so a thread on another group goes on: a
wait that kept it would stall the operation its peers need.
"""
from __future__ import annotations

import threading
import time
from typing import Optional

SERIAL = threading.Condition(threading.RLock())


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
