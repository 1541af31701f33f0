"""Deadlines of operations that block inside MPI: one thread per process enforces them.

In the default mode (a timeout ends the job with a report and ``MPI_Abort``) an operation runs
as a plain blocking MPI call in the caller's thread: no polling, no thread hand-off. The caller
cannot notice its own deadline then, so this thread does, as torch's NCCL watchdog does: it
reads each group's current ``(record, deadline)`` every :data:`POLL_S` seconds and, once a
deadline has passed with the operation still open, has the group report the hang and abort.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Optional

log = logging.getLogger(__name__)

POLL_S = 0.05  # how late a deadline may be seen: a few µs of GIL 20 times a second

_groups: "weakref.WeakSet[Any]" = weakref.WeakSet()
_thread: Optional[threading.Thread] = None
_stop = threading.Event()
_lock = threading.Lock()


def watch(group: Any) -> None:
    """Watch ``group``'s ``_current`` and ``_current_worker`` (``(record, deadline, watched)`` or
    None); start the thread once."""
    global _thread
    with _lock:
        _groups.add(group)
        if _thread is None or not _thread.is_alive():
            _stop.clear()
            _thread = threading.Thread(target=_loop, name="hpcsync-deadline", daemon=True)
            _thread.start()


def _loop() -> None:
    while not _stop.wait(POLL_S):
        now = time.monotonic()
        for group in list(_groups):
            for slot in ("_current", "_current_worker"):  # the caller's operation, the worker's
                current = getattr(group, slot)  # one attribute: read whole, never half-updated
                if current is None or not current[2] or now <= current[1]:
                    continue
                rec = current[0]
                if rec.finished is None and rec.error is None and getattr(group, slot) is current:
                    try:
                        group._expired(rec)  # reports, then ends the job
                    except BaseException as exc:  # noqa: BLE001  keep watching the other groups
                        log.error("hpcsync: deadline handling failed: %s", exc)


def stop() -> None:
    """Stop the thread (before MPI_Finalize: it may call MPI)."""
    _stop.set()
    t = _thread
    if t is not None and t is not threading.current_thread():
        t.join(timeout=2 * POLL_S + 1)
