"""The end of the allocation: a signal on any rank becomes one stop step every rank agrees on.

A job rarely ends because training finished: it hits its time limit or is preempted, and Slurm
warns first (``--signal=USR1@90``). The signal reaches some ranks and not others, or reaches them
in different steps; a rank that checkpoints from inside the handler runs collectives re-entrantly.
:class:`PreemptionGuard` installs handlers that only record the signal. At each step boundary
:meth:`PreemptionGuard.should_stop` agrees across ranks with one non-blocking ``Iallreduce(BOR)``
of 16 bytes on a private communicator, posted at one call and completed at the next (it overlaps
the step), so every rank returns True at the same call, whichever ranks got the signal: one, all,
or the launcher's forward. It also stops before a known end time (``HPCSYNC_JOB_END`` or
``SLURM_JOB_END_TIME``, epoch seconds) when the time left is shorter than the step time plus the
last checkpoint's time plus a margin. :func:`ignore_in_worker` keeps DataLoader workers alive.

Each signal has an action. The warning signal the job asked for (``SIGUSR1`` by default; any
signal but the ending ones below) means *requeue me*: stop, checkpoint, requeue. ``SIGTERM``
(and ``SIGINT``, ``SIGHUP``) means *you are being ended* -- ``scancel``, the time limit itself,
a preemption -- stop and checkpoint while there is time, never requeue: a cancelled job must not
come back. A mapping sets the actions explicitly: ``hpcsync.preemption({signal.SIGUSR2:
"requeue", signal.SIGTERM: "stop"})`` (submitit's warning signal)::

    guard = hpcsync.preemption()                  # SIGUSR1: requeue; SIGTERM: stop
    loader = DataLoader(..., worker_init_fn=guard.worker_init_fn)
    for step, batch in enumerate(loader):
        train_step(batch)
        if guard.should_stop():                   # True on every rank at the same step
            with guard.checkpointing():
                save(step)
            sys.exit(guard.requeue().exit_code)    # Slurm: requeue the job, unless it is being ended
"""
from __future__ import annotations

import functools
import os
import signal
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from ..core import serial, settings
from ..core.errors import CollectiveTimeout

__all__ = [
    "DEFAULT_SIGNALS", "REQUEUE", "STOP", "ENDING_SIGNALS", "Signals", "job_end_time", "actions",
    "ignore_in_worker", "PreemptionGuard", "preemption"
]

DEFAULT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
REQUEUE, STOP = "requeue", "stop"  #: the actions a signal can have
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  #: default action: stop, never requeue

Signals = Union[Sequence[int], Mapping[int, str]]


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


def actions(signals: Signals) -> Dict[int, str]:
    """``{signal: "requeue" | "stop"}``: a mapping as given (checked), a sequence with the default
    actions (:data:`ENDING_SIGNALS` stop, every other signal requeues)."""
    if isinstance(signals, Mapping):
        out = {int(s): a for s, a in signals.items()}
    else:
        out = {int(s): STOP if s in ENDING_SIGNALS else REQUEUE for s in signals}
    for s, a in out.items():
        if a not in (REQUEUE, STOP):
            raise ValueError(f"hpcsync.preemption: the action of {signal.Signals(s).name} must be "
                             f"{REQUEUE!r} or {STOP!r}, not {a!r}")
        if not 0 < s < 63:
            raise ValueError(f"hpcsync.preemption: signal {s} is out of range (1-62)")
    return out


def _names(bits: int) -> List[str]:
    return [signal.Signals(s).name for s in range(1, 63) if bits >> (s - 1) & 1]


def ignore_in_worker(signals: Sequence[int], worker_id: int = 0) -> None:
    """A DataLoader ``worker_init_fn``: the worker ignores ``signals``, so a signal sent to the whole
    process group stops training at the agreed step instead of killing the worker first."""
    for s in signals:
        signal.signal(s, signal.SIG_IGN)


class PreemptionGuard:
    """Signal handlers that only record, and :meth:`should_stop`, agreed by every rank.

    ``signals``: the signals to catch, a sequence (default actions, see :func:`actions`) or a
    ``{signal: "requeue" | "stop"}`` mapping. ``group``: the ranks that must agree (default: the
    world; a torch process group or an mpi4py communicator -- MPI's, duplicated, under MPI; torch's
    own collectives without MPI). ``end_time``: epoch seconds (default :func:`job_end_time`).
    ``margin_s``: time kept in hand before the end. Waiting for the other ranks' flags is bounded by
    ``timeout`` (default ``HPCSYNC_TIMEOUT``): past it :meth:`should_stop` raises
    :class:`~hpcsync.core.errors.CollectiveTimeout` (a ``TimeoutError``).
    """

    def __init__(self, signals: Signals = DEFAULT_SIGNALS, group: Any = None, end_time: Optional[float] = None,
                 margin_s: float = 30.0, timeout: Optional[float] = None) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("hpcsync.preemption: signal handlers can only be installed from the main thread")
        import numpy as np

        from ..core import comm as comm_mod

        self.actions = actions(signals)
        self.signals = tuple(self.actions)
        self.received: Optional[int] = None  # the first signal this rank got
        self.stop_step: Optional[int] = None  # how many steps ran before every rank stopped
        self.reason: Optional[str] = None  # "signal SIGUSR1" / "time limit"
        self.requeue_wanted = False  # once stopped: whether the stop asks for a requeue
        self.end_time = end_time if end_time is not None else job_end_time()
        self.margin_s = margin_s
        self.step_s: Optional[float] = None  # the longest recent step (what the next one may take)
        self.checkpoint_s = 0.0  # the last checkpoint's time
        self._timeout = float(timeout if timeout is not None else settings.number("HPCSYNC_TIMEOUT"))
        self._group = group  # what requeue() agrees over
        base = comm_mod.group_comm(self._group)
        self._mode = "mpi" if hasattr(base, "Iallreduce") else "torch" if hasattr(base, "group") else "local"
        self._bits = 0  # every signal this rank got, bit (signum - 1)
        self._broken: Optional[str] = None
        self._flag = np.zeros(2, np.int64)  # [signal bits, time limit]
        self._agreed = np.zeros(2, np.int64)
        self._req: Any = None
        self._steps = 0
        self._last: Optional[float] = None
        self._recent: list = []
        if self._mode == "mpi":
            from ..core import bounded

            self._comm, req = serial.call(base.Idup)
            try:
                bounded.wait(req, self._timeout)
            except CollectiveTimeout as exc:  # MPI may still complete it: kept for good, the job ends at exit
                why = "hpcsync.preemption: duplicating the communicator timed out"
                bounded.abandon(why, req, (self._comm,))
                raise CollectiveTimeout(f"{why} after {self._timeout:g} s: not every rank of the group made a "
                                        "guard") from exc
        elif self._mode == "torch":
            import torch.distributed as dist

            self._comm = comm_mod.global_gloo_group() if base.group is None else base.group
            if dist.get_backend(self._comm) == "nccl":
                raise ValueError("hpcsync.preemption: the guard agrees on CPU tensors; give it a gloo group")
        else:
            self._comm = base
        self._previous = {s: signal.signal(s, self._record) for s in self.signals}
        self.worker_init_fn = functools.partial(ignore_in_worker, self.signals)

    def reinstall(self) -> None:
        """Install the recording handlers again, after a framework replaced them with its own
        (Lightning installs a SIGTERM handler that runs a collective inside the handler)."""
        for s in self.signals:
            signal.signal(s, self._record)

    def _record(self, signum: int, frame: Any) -> None:
        """The handler: remember the signal, nothing else (no I/O, no MPI, no allocation)."""
        if self.received is None:
            self.received = signum
        self._bits |= 1 << (signum - 1)

    def _time_is_short(self) -> bool:
        if self.end_time is None or self.step_s is None:
            return False
        return self.end_time - time.time() < self.step_s + self.checkpoint_s + self.margin_s

    def _stop_only(self, bits: int) -> List[str]:
        return [signal.Signals(s).name for s, a in self.actions.items() if a == STOP and bits >> (s - 1) & 1]

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
        if self._broken:
            raise CollectiveTimeout(self._broken)
        if self._req is not None:
            self._complete()
            bits, short = int(self._agreed[0]), int(self._agreed[1])
            if bits or short:
                self.stop_step = self._steps
                names = _names(bits)
                self.reason = (f"signal{'s' if len(names) > 1 else ''} {', '.join(names)}" if names else "time limit")
                self.requeue_wanted = not self._stop_only(bits)
                return True
        self._flag[0], self._flag[1] = self._bits, int(self._time_is_short())
        self._post()
        self._steps += 1
        return False

    def _post(self) -> None:
        if self._mode == "mpi":
            from ..core.mpi import MPI

            self._req = serial.call(self._comm.Iallreduce, self._flag, self._agreed, op=MPI().BOR)
        elif self._mode == "torch":
            import torch
            import torch.distributed as dist

            self._tensor = torch.from_numpy(self._flag.copy())
            self._req = dist.all_reduce(self._tensor, op=dist.ReduceOp.BOR, group=self._comm, async_op=True)
        else:  # one process
            self._agreed[:] = self._flag
            self._req = True

    def _complete(self) -> None:
        req, self._req = self._req, None
        if req is True:
            return
        what = (f"hpcsync.preemption: should_stop() #{self._steps} waited {self._timeout:g} s for the other "
                "ranks' flags: a rank stopped calling it (every rank must call it once per step)")
        try:
            if self._mode == "mpi":
                from ..core import bounded

                bounded.wait(req, self._timeout)
            else:
                req.wait(timeout=timedelta(seconds=self._timeout))
                self._agreed[:] = self._tensor.numpy()
        except (CollectiveTimeout, RuntimeError) as exc:
            self._broken = what
            if self._mode == "mpi":  # MPI may still write into the flags: kept, and the job ends at exit
                from ..core import bounded

                bounded.abandon(what, req, (self._flag, self._agreed))
            raise CollectiveTimeout(what) from (exc if self._mode != "mpi" else None)

    def requeue(self, max_restarts: Optional[int] = None) -> Any:
        """Collective, after the checkpoint: :func:`hpcsync.requeue` if this guard stopped
        for a requeue signal or the time limit, and no rank has got an ending signal (SIGTERM) since;
        a guard that never stopped (training finished) requeues nothing, exit code 0. Returns a
        :class:`hpcsync.resilience.requeue.Requeue`; exit with its ``exit_code``."""
        from .requeue import EXIT_REQUEUED, Requeue, requeue

        if self.stop_step is None:
            return Requeue(False, EXIT_REQUEUED, "hpcsync.requeue: training finished, the job is not requeued")
        ending = self._stop_only(self._bits | int(self._agreed[0]))
        return requeue(max_restarts, group=self._group, ending=ending[0] if ending else None,
                       timeout=self._timeout)

    @contextmanager
    def checkpointing(self) -> Iterator[None]:
        """Time the checkpoint inside: the next time-limit judgement keeps that much in hand."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.checkpoint_s = time.monotonic() - t0

    def close(self) -> None:
        """Give back the handlers that are still this guard's (one that :func:`~hpcsync.requeue`
        or a framework installed since stays), and free the private communicator (collective under
        MPI, bounded by the timeout; after a timeout nothing is waited for again)."""
        self._give_back_handlers()
        if self._broken:
            self._req = None
            return
        try:
            if self._req is not None:
                self._complete()
        finally:
            if self._mode == "mpi" and not self._broken:
                serial.call(self._comm.Free)
            self._mode = "closed"

    def _give_back_handlers(self) -> None:
        for s, prev in self._previous.items():
            if signal.getsignal(s) == self._record:
                signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._previous = {}

    def __enter__(self) -> "PreemptionGuard":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def preemption(signals: Signals = DEFAULT_SIGNALS, **kwargs: Any) -> PreemptionGuard:
    """A :class:`PreemptionGuard` for ``signals`` (default SIGUSR1: requeue, SIGTERM: stop): call it
    on every rank."""
    return PreemptionGuard(signals, **kwargs)
