"""The end of the allocation: a signal on any rank becomes one stop step every rank agrees on.

A job rarely ends because training finished: it hits its time limit or is preempted, and Slurm
warns first (``--signal=USR1@90``). The signal reaches some ranks and not others, or reaches them
in different steps; a rank that checkpoints from inside the handler runs collectives re-entrantly.
:class:`PreemptionGuard` installs handlers that only record the signal. At each step boundary
:meth:`PreemptionGuard.should_stop` agrees across ranks with one non-blocking ``Iallreduce(MAX)``
of 8 bytes on a private communicator, posted at one call and completed at the next (it overlaps
the step), so every rank returns True at the same call, whichever ranks got the signal: one, all,
or the launcher's forward. It also stops before a known end time (``HPCSYNC_JOB_END`` or
``SLURM_JOB_END_TIME``, epoch seconds) when the time left is shorter than the step time plus the
last checkpoint's time plus a margin. :func:`ignore_in_worker` keeps DataLoader workers alive::

    guard = hpcsync.preemption()                  # SIGUSR1 and SIGTERM
    loader = DataLoader(..., worker_init_fn=guard.worker_init_fn)
    for step, batch in enumerate(loader):
        train_step(batch)
        if guard.should_stop():                   # True on every rank at the same step
            with guard.checkpointing():
                save(step)
            sys.exit(guard.requeue().exit_code)    # Slurm: requeue the job (hpcsync.requeue)
"""
from __future__ import annotations

import functools
import os
import signal
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

from . import settings

DEFAULT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
TIME_LIMIT = 1 << 16  # the agreed value when a rank judged the time left too short (above any signal number)


def job_end_time(env: Optional[dict] = None) -> Optional[float]:
    """The job's end, epoch seconds: ``HPCSYNC_JOB_END``, else Slurm's ``SLURM_JOB_END_TIME``; None
    when neither is set (or either is malformed)."""
    env = os.environ if env is None else env
    for var in ("HPCSYNC_JOB_END", "SLURM_JOB_END_TIME"):
        value = env.get(var, "").strip()
        if value:
            try:
                return float(value)
            except ValueError:
                continue
    return None


def ignore_in_worker(signals: Sequence[int], worker_id: int = 0) -> None:
    """A DataLoader ``worker_init_fn``: the worker ignores ``signals``, so a signal sent to the whole
    process group stops training at the agreed step instead of killing the worker first."""
    for s in signals:
        signal.signal(s, signal.SIG_IGN)


class PreemptionGuard:
    """Signal handlers that only record, and :meth:`should_stop`, agreed by every rank.

    ``comm``: the ranks that must agree (default: the world -- MPI's COMM_WORLD, duplicated, or the
    torch.distributed world without MPI, where the agreement is a blocking all-gather).
    ``end_time``: epoch seconds (default :func:`job_end_time`). ``margin_s``: time kept in hand
    before the end. Waiting for the other ranks' flags is bounded by ``timeout`` (default
    ``HPCSYNC_TIMEOUT``): past it :meth:`should_stop` raises ``TimeoutError``.
    """

    def __init__(self, signals: Sequence[int] = DEFAULT_SIGNALS, comm: Any = None,
                 end_time: Optional[float] = None, margin_s: float = 30.0, timeout: Optional[float] = None) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("hpcsync.preemption: signal handlers can only be installed from the main thread")
        import numpy as np

        from ._torchcomm import world

        self.signals = tuple(signals)
        self.received: Optional[int] = None  # the first signal this rank got
        self.stop_step: Optional[int] = None  # how many steps ran before every rank stopped
        self.reason: Optional[str] = None  # "signal SIGUSR1" / "time limit"
        self.end_time = end_time if end_time is not None else job_end_time()
        self.margin_s = margin_s
        self.step_s: Optional[float] = None  # the longest recent step (what the next one may take)
        self.checkpoint_s = 0.0  # the last checkpoint's time
        self._timeout = float(timeout if timeout is not None else settings.number("HPCSYNC_TIMEOUT"))
        self._group = comm  # what requeue() agrees over (None: the world)
        base = comm if comm is not None else world()
        self._mpi = hasattr(base, "Iallreduce")
        self._comm = base.Dup() if self._mpi else base
        self._flag = np.zeros(1, np.int64)
        self._agreed = np.zeros(1, np.int64)
        self._req: Any = None
        self._steps = 0
        self._last: Optional[float] = None
        self._recent: list = []
        self._previous = {s: signal.signal(s, self._record) for s in self.signals}
        self.worker_init_fn = functools.partial(ignore_in_worker, self.signals)

    def reinstall(self) -> None:
        """Install the recording handlers again, after a framework replaced them with its own
        (Lightning installs a SIGTERM handler that runs a collective inside the handler)."""
        for s in self.signals:
            signal.signal(s, self._record)

    def _record(self, signum: int, frame: Any) -> None:
        """The handler: remember the first signal, nothing else (no I/O, no MPI, no allocation)."""
        if self.received is None:
            self.received = signum

    def _time_is_short(self) -> bool:
        if self.end_time is None or self.step_s is None:
            return False
        return self.end_time - time.time() < self.step_s + self.checkpoint_s + self.margin_s

    def should_stop(self) -> bool:
        """Call once per step, on every rank: True on every rank at the same call once any rank got
        a signal (or judged the time left too short) at or before the previous call; stays True."""
        now = time.monotonic()
        if self._last is not None:
            self._recent = (self._recent + [now - self._last])[-8:]
            self.step_s = max(self._recent)
        self._last = now
        if self.stop_step is not None:
            return True
        if self._req is not None:
            self._complete()
            if self._agreed[0]:
                value = int(self._agreed[0])
                self.stop_step = self._steps
                self.reason = "time limit" if value >= TIME_LIMIT else f"signal {signal.Signals(value).name}"
                return True
        self._flag[0] = max(self.received or 0, TIME_LIMIT if self._time_is_short() else 0)
        if self._mpi:
            from ._mpi import MPI

            self._req = self._comm.Iallreduce(self._flag, self._agreed, op=MPI().MAX)
        else:  # torch.distributed or one process: blocking, at this call
            self._agreed[0] = max(self._comm.allgather(int(self._flag[0])))
            self._req = True
        self._steps += 1
        return False

    def _complete(self) -> None:
        if self._req is True:
            self._req = None
            return
        # MPI progresses the reduction only inside MPI calls: spin on Test (a few µs when the others
        # posted theirs), and sleep between tests only once the others are late
        now = time.monotonic()
        spin_until, deadline = now + 0.05, now + self._timeout
        while not self._req.Test():
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"hpcsync.preemption: should_stop() #{self._steps} waited {self._timeout:g} s for "
                                   "the other ranks' flags: a rank stopped calling it (every rank must call it once "
                                   "per step)")
            if now > spin_until:
                time.sleep(0.001)
        self._req = None

    def requeue(self, max_restarts: Optional[int] = None) -> Any:
        """Collective, after the checkpoint: :func:`hpcsync.requeue.requeue` if this guard stopped
        training; a guard that never stopped (training finished) requeues nothing, exit code 0.
        Returns a :class:`hpcsync.requeue.Requeue`; exit with its ``exit_code``."""
        from .requeue import EXIT_REQUEUED, Requeue, requeue

        if self.stop_step is None:
            return Requeue(False, EXIT_REQUEUED, "hpcsync.requeue: training finished, the job is not requeued")
        return requeue(max_restarts, group=self._group)

    @contextmanager
    def checkpointing(self) -> Iterator[None]:
        """Time the checkpoint inside: the next time-limit judgement keeps that much in hand."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.checkpoint_s = time.monotonic() - t0

    def close(self) -> None:
        """Restore the previous handlers and free the private communicator (collective under MPI)."""
        for s, prev in self._previous.items():
            signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._previous = {}
        if self._mpi:
            if self._req is not None:
                self._complete()
            self._comm.Free()
            self._mpi = False

    def __enter__(self) -> "PreemptionGuard":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def preemption(signals: Sequence[int] = DEFAULT_SIGNALS, **kwargs: Any) -> PreemptionGuard:
    """A :class:`PreemptionGuard` for ``signals`` (default SIGUSR1 and SIGTERM): call it on every rank."""
    return PreemptionGuard(signals, **kwargs)
