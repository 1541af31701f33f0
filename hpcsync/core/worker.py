"""One background thread for a pipeline's reads or writes, whose every wait has a deadline.

File sync and stage-in overlap their disk work with MPI: a thread reads round k+1 or writes round
k while round k travels. A disk or network filesystem that stops answering leaves that thread in
a system call that nothing can cancel. :class:`Worker` is built so that this costs the job a
clear error, never a hang: the thread is a daemon (unlike ``concurrent.futures``' workers,
which the interpreter joins at exit, so a stuck one would hold the process forever), and
:func:`result` waits for a call at most a given time, then raises :class:`Stalled` naming what
the call was doing. The caller then stops handing the worker new calls and goes on without it
(taking part in the remaining exchanges, so that no other rank waits for this one).
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as _FutureTimeout
from typing import Any, Callable, Optional

__all__ = ["Stalled", "Worker", "result"]


class Stalled(Exception):
    """A background call did not finish within its deadline (a stuck disk or source)."""


class Worker:
    """Runs submitted calls one after another on a daemon thread (started at the first call)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._calls: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self.doing: Optional[str] = None  # what the call under way says it does (for Stalled)

    def submit(self, fn: Callable[..., Any], *args: Any) -> "Future[Any]":
        fut: "Future[Any]" = Future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()
        self._calls.put((fut, fn, args))
        return fut

    def _loop(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # the caller sees it in result()
                fut.set_exception(exc)

    def shutdown(self) -> None:
        """Let the thread end after the calls queued so far, without waiting for it: a thread
        stuck in a system call stays behind as a daemon, and the process can still exit."""
        if self._thread is not None:
            self._calls.put(None)


def result(fut: "Future[Any]", timeout: Optional[float], what: Callable[[], str]) -> Any:
    """``fut``'s result, waiting at most ``timeout`` seconds (None: for ever); past it,
    :class:`Stalled` with ``what()`` (called only then) and the time waited."""
    try:
        return fut.result(timeout=timeout)
    except _FutureTimeout:
        raise Stalled(f"{what()}: no progress for {timeout:g} s (a stuck disk or filesystem?)") from None
