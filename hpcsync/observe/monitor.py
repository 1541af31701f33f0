"""Straggler detection: the slow rank named with its node while the job runs.

A rank that is merely slow -- a bad node, thermal throttling, a noisy neighbour -- slows every
rank, since each collective waits for it, and every rank's step lasts as long. What differs is
the rank's own *compute*: the step's time less the time the rank waited in collectives, long on
the straggler only. A :class:`StepMonitor` measures it at every :meth:`~StepMonitor.step`; every
``steps`` steps (a *window*) the ranks exchange their window's figures with two non-blocking MPI
collectives on a private duplicate of the communicator -- an ``Igather`` of 13 numbers per rank
to rank 0 and an ``Iallreduce`` of one flag -- posted at one step and completed at a later one,
so the exchange never stalls training. Rank 0 divides each rank's median compute by the median
rank's: a rank at ``factor`` or more (``HPCSYNC_STRAGGLER_FACTOR``, default 1.2) in M of the last
N windows (``HPCSYNC_STRAGGLER_WINDOWS``, default 3/5) is named, once, in a WARNING of the
``hpcsync.monitor`` logger ("straggler: rank 3 on node7 is 1.41x slower than the median rank
..."), and a JSON record of the verdict goes to the report folder (:func:`read`;
:func:`hpcsync.observe.failure.report_dir`: none is written where no folder is set).

Waiting time: on the ``hpcsync`` backend the backend counts it (the time callers spent blocked in
its operations); on gloo and NCCL, the time in sections named ``comm``; where both exist, the
larger. torch 2.13's Flight Recorder gives gloo no durations (it records when each operation was
created, never when it started or ended), so it cannot stand in. Without either, compute is the
whole step, the same on every rank, and nobody is named. ::

    mon = hpcsync.monitor()
    for step, batch in enumerate(loader, start):
        with mon.section("data"):          # optional: sections are timed apart
            batch = to_device(batch)
        loss = model(batch); loss.backward()
        with mon.section("comm"):          # gloo/NCCL: the waiting the hpcsync backend counts itself
            average_gradients(model)
        mon.step(step)                     # the reports name this step (without it: the count of calls)
    mon.close()                            # collective, bounded (also run at exit)
"""
from __future__ import annotations

import logging
import os
import statistics
import sys
import time
import zlib
from array import array
from collections import deque
from typing import Any, Deque, Dict, Iterable, List, Optional, Sequence, Tuple

from . import failure
from ..core import jobend, serial, settings
from ..core.errors import CollectiveTimeout

__all__ = [
    "PREFIX", "KIND", "SECTION_SLOTS", "WIDTH", "MIN_EXCESS_S", "MIN_EXCESS_SHARE", "Section", "Judge", "write",
    "read", "slow_nodes", "StepMonitor", "monitor"
]

log = logging.getLogger(__name__)

PREFIX = "hpcsync-straggler-"
KIND = "hpcsync straggler record"
SECTION_SLOTS = 4  # sections exchanged per rank: the first four it used
_HEAD = 5  # window index, steps in it, median compute, mean step, mean wait (seconds per step)
WIDTH = _HEAD + 2 * SECTION_SLOTS  # numbers per rank per window: + (crc32 of the name, seconds per step)
MIN_EXCESS_S, MIN_EXCESS_SHARE = 50e-6, 0.01  # a rank is slow by at least this much per step (and 1 % of a step)
_clock = time.perf_counter


class Section:
    """``with mon.section(name):`` adds the time of its body to ``name`` (not re-entrant), less
    the hpcsync backend's waiting in collectives inside it (a DDP backward in a ``compute``
    section waits for the slowest rank: counted, every rank's section would be as long as the
    slowest's). A section among the monitor's ``waits`` counts whole, as waiting in its step."""

    __slots__ = ("_mon", "name", "crc", "total", "_t0", "_w0", "_wait")

    def __init__(self, mon: "StepMonitor", name: str, wait: bool) -> None:
        self._mon, self.name, self._wait = mon, name, wait
        self.crc = zlib.crc32(name.encode())
        self.total = 0.0  # seconds in this window
        self._t0 = self._w0 = 0.0

    def __enter__(self) -> "Section":
        self._t0 = _clock()
        counter = self._mon._counter
        self._w0 = counter[0] if counter is not None and not self._wait else 0.0
        return self

    def __exit__(self, *exc: Any) -> None:
        d = _clock() - self._t0
        if self._wait:
            self._mon._comm_s += d
        else:
            counter = self._mon._counter
            if counter is not None:
                d = max(0.0, d - (counter[0] - self._w0))
        self.total += d


class _Exchange:
    """The windows' exchange on a private duplicate of the communicator: per window an ``Igather``
    of every rank's numbers to rank 0 and an ``Iallreduce(MAX)`` of a closing flag, posted in the
    same order on every rank, one window in flight at a time. A flag that is set ends the exchange
    on every rank at the same window, so ranks that stepped a different number of times, or closed
    at different steps, never leave an operation unmatched."""

    def __init__(self, base: Any, timeout: float) -> None:
        import numpy as np

        from ..core import mpi, bounded

        self.MPI = mpi.MPI()
        self.rank, self.size = base.Get_rank(), base.Get_size()
        self.timeout = timeout
        self.serial = serial.lock()  # below THREAD_MULTIPLE: the process's MPI lock
        comm, req = serial.call(base.Idup)
        try:
            bounded.wait(req, timeout)
        except CollectiveTimeout:
            bounded.abandon("hpcsync.monitor: duplicating the communicator timed out", req, (comm,))
            raise CollectiveTimeout(f"hpcsync.monitor: not every rank created the monitor within {timeout:g} s "
                                    "(it is collective)") from None
        self.comm = comm
        self.send = array("d", bytes(8 * WIDTH))  # stdlib arrays: setting an item costs what a list's does
        self.rows = np.zeros((self.size, WIDTH)) if self.rank == 0 else None
        self.flag, self.agreed = array("q", [0]), array("q", [0])
        self.reqs: Optional[List[Any]] = None
        self.ended = False  # a rank closed: no window is posted any more, here or anywhere
        self.broken: Optional[str] = None

    def post(self, closing: bool) -> None:
        MPI = self.MPI
        self.flag[0] = int(closing)
        if self.serial is not None:
            self.serial.acquire()
        try:
            recv = [self.rows, MPI.DOUBLE] if self.rows is not None else None
            self.reqs = [self.comm.Igather([self.send, MPI.DOUBLE], recv, root=0),
                         self.comm.Iallreduce(self.flag, self.agreed, op=MPI.MAX)]
        finally:
            if self.serial is not None:
                self.serial.release()

    def test(self) -> bool:
        """Whether the window in flight completed (progressing it)."""
        if self.serial is not None:
            with self.serial:
                done = self.MPI.Request.Testall(self.reqs)
        else:
            done = self.MPI.Request.Testall(self.reqs)
        if done:
            self.reqs = None
            self.ended = self.ended or bool(self.agreed[0])
        return done

    def wait(self, what: str) -> None:
        """Complete the window in flight within the timeout, else :class:`CollectiveTimeout` (the
        operations stay in MPI with their buffers; the process ends with MPI_Abort at exit)."""
        from ..core import bounded

        end = time.monotonic() + self.timeout
        while not self.test():
            if time.monotonic() > end:
                self.broken = (f"hpcsync.monitor: {what}: the other ranks' statistics did not arrive within "
                               f"{self.timeout:g} s (rank {self.rank} of {self.size}): a rank stopped calling "
                               "step() and close(), or is stuck")
                bounded.abandon(self.broken, self.reqs, (self.send, self.rows, self.flag, self.agreed, self.comm))
                self.reqs = None
                raise CollectiveTimeout(self.broken)
            time.sleep(0.0005)

    def free(self) -> None:
        if self.broken is None and self.reqs is None and not self.MPI.Is_finalized():
            serial.call(self.comm.Free)
        self.comm = None


class Judge:
    """Rank 0's verdicts over the windows: ``factor`` (slow in a window at this many times the
    median rank's compute, and longer by at least 50 µs and 1 % of rank 0's step), ``votes``
    ``(M, N)`` (named when slow in M of the last N judged windows; no longer a straggler once slow
    in none of them). ``ranks``: the world rank of each rank of the group, ``hosts``: its node."""

    def __init__(self, factor: float, votes: Tuple[int, int], steps: int, ranks: Sequence[int],
                 hosts: Sequence[str]) -> None:
        import numpy as np

        self.factor, (self.m, self.n), self.steps = factor, votes, steps
        self.ranks, self.hosts = list(ranks), list(hosts)
        self.history: Deque[Tuple[Any, Any]] = deque()  # (slow, ratio) of the last n judged windows
        self.counts = np.zeros(len(self.ranks), np.int64)  # per rank: slow in how many of them
        self.named: Dict[int, Dict[str, Any]] = {}  # world rank -> its latest verdict, while a straggler
        self.verdicts: List[Dict[str, Any]] = []
        self._least = max(1, steps // 2)  # a window in which a rank made fewer steps is not judged
        self._k = (len(self.ranks) - 1) // 2  # the lower median: with two ranks, the faster one

    def window(self, rows: Any, step: int, names: Dict[int, str]) -> List[Dict[str, Any]]:
        """Judge one window (``rows``: every rank's numbers, ending at rank 0's ``step``); the new
        verdicts. A window in which a rank made fewer than half the steps (one closed) is skipped.
        A few numpy calls per window, whatever the number of ranks."""
        import numpy as np

        if rows[:, 1].min() < self._least:
            return []
        compute = rows[:, 2]
        ref = float(np.partition(compute, self._k)[self._k])
        if ref <= 0:
            return []
        ratio = compute / ref
        # slow: at factor x the reference, and by enough to matter (timer noise on a step that is
        # nearly all communication is no straggler)
        slow_now = compute >= max(self.factor * ref, ref + max(MIN_EXCESS_S, MIN_EXCESS_SHARE * float(rows[0, 3])))
        if len(self.history) == self.n:
            self.counts -= self.history.popleft()[0]
        self.history.append((slow_now, ratio))
        self.counts += slow_now
        slow = self.counts
        if not self.named and slow.max() < self.m:
            return []
        out = []
        for i in np.flatnonzero(slow >= self.m):
            if self.ranks[i] not in self.named:
                out.append(self._verdict("straggler", int(i), rows, ref, step, int(slow[i]), names))
        for r in [r for r, v in self.named.items() if slow[v["group_rank"]] == 0]:
            out.append(self._verdict("recovered", self.named[r]["group_rank"], rows, ref, step, 0, names))
        return out

    def _verdict(self, verdict: str, i: int, rows: Any, ref: float, step: int, slow: int,
                 names: Dict[int, str]) -> Dict[str, Any]:
        import numpy as np

        ratios = [float(r[i]) for s, r in self.history if s[i]] or [float(self.history[-1][1][i])]
        compute = max(float(rows[i, 2]), 0.0)
        factor = float(np.median(ratios))
        rank, node = self.ranks[i], self.hosts[i]
        sections = {}
        for j in range(SECTION_SLOTS):
            crc, mine = rows[i, _HEAD + 2 * j], rows[i, _HEAD + 2 * j + 1]
            if crc:  # against this section's median over the ranks that timed it
                med = float(np.median(rows[:, _HEAD + 2 * j + 1][rows[:, _HEAD + 2 * j] == crc]))
                if med > 0:
                    sections[names.get(int(crc), f"#{int(crc)}")] = round(float(mine) / med, 3)
        ms = 1e3
        if verdict == "straggler":
            slowest = max(((v, k) for k, v in sections.items()), default=None)
            line = (f"hpcsync: straggler: rank {rank} on {node} is {factor:.2f}x slower than the median rank "
                    f"(compute {compute * ms:.2f} ms vs {ref * ms:.2f} ms per step, step {rows[i, 3] * ms:.2f} ms"
                    f"{f'; slowest section {slowest[1]!r} {slowest[0]:.2f}x' if slowest else ''}); slow in {slow} of the "
                    f"last {len(self.history)} windows of {self.steps} steps; named at step {step}")
        else:
            line = (f"hpcsync: rank {rank} on {node} is no longer a straggler ({compute / ref:.2f}x the median "
                    f"rank's compute; slow in none of the last {len(self.history)} windows; step {step})")

        record = {"kind": KIND, "verdict": verdict, "rank": rank, "group_rank": i, "node": node,
                  "factor": round(factor, 3), "threshold": self.factor, "step": step, "steps_per_window": self.steps,
                  "slow_windows": [slow, len(self.history)], "votes": [self.m, self.n],
                  "compute_s": compute, "median_compute_s": ref, "step_s": float(rows[i, 3]),
                  "wait_s": float(rows[i, 4]), "sections": sections, "detail": line,
                  "reporter": {"rank": self.ranks[0], "node": self.hosts[0]}, "job": failure.job_id(), "time": time.time(),
                  "attempt": settings.text("HPCSYNC_RUN_ATTEMPT")}
        if verdict == "straggler":
            self.named[rank] = record
            log.warning("%s", line)
        else:
            self.named.pop(rank, None)
            log.info("%s", line)
        self.verdicts.append(record)
        record["path"] = write(record)
        note = None if record["path"] else failure.unkept("the straggler records")
        if note:
            log.warning("hpcsync: %s", note)
        return record


def write(record: Dict[str, Any], folder: Optional[str] = None) -> Optional[str]:
    """Write a verdict's record as ``hpcsync-straggler-<job>-r<rank>-s<step>-t<time>.json`` in ``folder``
    (default :func:`hpcsync.observe.failure.report_dir`: none when no folder is set); its path, or
    None when it was not written (never raises: a report must not end training)."""
    folder = folder or failure.report_dir()
    if folder is None:
        return None
    name = f"{PREFIX}{record['job']}-r{record['rank']}-s{record['step']}-t{int(record['time'])}.json"
    return failure.write_json(os.path.join(folder, name), record, "straggler record")


def read(folder: str) -> List[Dict[str, Any]]:
    """Every straggler record in ``folder``, the earliest first."""
    return sorted(failure.read_json(folder, PREFIX, KIND), key=lambda r: (r.get("time", 0), r.get("step", 0)))


def slow_nodes(records: Iterable[Dict[str, Any]]) -> List[str]:
    """The nodes whose latest verdict (in ``records``, earliest first) names a straggler on them:
    what a relaunch would leave out, or run last on, when it has spare nodes."""
    latest: Dict[Tuple[Any, ...], Dict[str, Any]] = {}
    for rec in records:  # a rank of one attempt of one job
        latest[(rec.get("job"), rec.get("attempt"), rec["rank"])] = rec
    return sorted({r["node"] for r in latest.values() if r.get("verdict") == "straggler"})


def _settings(steps: Any, factor: Any, windows: Any) -> Tuple[int, float, Tuple[int, int], List[str]]:
    """The arguments, else their settings, checked: (steps, factor, (M, N), what is malformed)."""
    bad: List[str] = []
    raw_steps = steps if steps is not None else settings.text("HPCSYNC_MONITOR_STEPS")
    k = int(raw_steps) if str(raw_steps).strip().isdigit() else -1
    if k < 0:
        bad.append(f"steps={raw_steps!r} (expected a whole number, 0 or more: HPCSYNC_MONITOR_STEPS)")
    raw_factor = factor if factor is not None else settings.text("HPCSYNC_STRAGGLER_FACTOR")
    try:
        f = float(raw_factor)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        f = float("nan")
    if not 1 < f < float("inf"):
        bad.append(f"factor={raw_factor!r} (expected a number above 1: HPCSYNC_STRAGGLER_FACTOR)")
    raw_windows = windows if windows is not None else settings.text("HPCSYNC_STRAGGLER_WINDOWS")
    text = "/".join(map(str, raw_windows)) if isinstance(raw_windows, (tuple, list)) else str(raw_windows)
    votes = settings.votes(text)
    if votes is None or votes[1] > 100:
        bad.append(f"windows={raw_windows!r} (expected M/N with 1 <= M <= N <= 100, such as 3/5: "
                   "HPCSYNC_STRAGGLER_WINDOWS)")
    return k, f, votes or (1, 1), bad


class StepMonitor:
    """Times every step of this rank and, with the other ranks, names the stragglers (see the
    module's text). Made by :func:`monitor`, on every rank of the group.

    On rank 0, :attr:`stragglers` maps the world rank of each rank named (and not recovered) to
    its verdict, and :attr:`verdicts` lists every verdict; on every rank, :attr:`window` holds this
    rank's figures of its latest window (seconds per step): ``steps``, ``compute_s``, ``step_s``,
    ``wait_s``, ``sections``. :attr:`steps` counts the calls of :meth:`step`; :attr:`at` is the
    step the reports name: the program's (``step(step)``, ``failure.note_step``), else that count.
    """

    def __init__(self, steps: Optional[int] = None, factor: Optional[float] = None, windows: Any = None,
                 waits: Sequence[str] = ("comm",), group: Any = None, timeout: Optional[float] = None) -> None:
        from ..core import bounded, errors
        from ..core import comm as comm_mod

        self.steps_per_window, self.factor, self.votes, bad = _settings(steps, factor, windows)
        self.timeout = float(timeout) if timeout is not None else bounded.default_timeout()
        if not self.timeout > 0:
            bad.append(f"timeout={timeout!r} (expected a positive number of seconds)")
        self.waits = frozenset(waits)
        base = comm_mod.group_comm(group)
        self.rank, self.size = base.Get_rank(), base.Get_size()
        over_mpi = hasattr(base, "Idup")
        if over_mpi and self.size > 1:  # every rank raises the same error, or none does
            from ..core.topology import topology

            topology()  # collective the first time: the node map, which names a straggler's node
            ctl = bounded.control("hpcsync.monitor()", group, self.timeout if self.timeout > 0 else None)
            errors.raise_if_any(ctl, "; ".join(bad) or None, ValueError, "hpcsync.monitor: malformed settings: ")
            errors.raise_if_settings_differ(ctl, {"steps": self.steps_per_window, "factor": self.factor,
                                                  "windows": self.votes}, ValueError,
                                            "hpcsync.monitor: every rank must use the same settings: ")
        elif bad:
            raise ValueError("hpcsync.monitor: malformed settings: " + "; ".join(bad))
        self.steps = 0  #: step() calls so far
        self.at = 0  #: the step the reports name: the program's (step(step), failure.note_step), else the count
        self.window: Dict[str, Any] = {}
        self.verdicts: List[Dict[str, Any]] = []
        self._sections: Dict[str, Section] = {}
        self._slots: List[Section] = []
        self._compute: List[float] = []
        self._step_sum = self._wait_sum = self._comm_s = 0.0
        self._counter: Optional[List[float]] = None  # the hpcsync backend's waiting total, once loaded
        self._counted = 0.0
        self._index = 0  # windows posted
        self._posted_at = 0  # the step of the window in flight (as the reports name it)
        self._posted_call = 0  # ... and the count of step() calls then
        self._overdue_said = False
        self._x: Optional[_Exchange] = None
        self._judge: Optional[Judge] = None
        self._closed = False
        if self.steps_per_window and self.size > 1 and over_mpi:
            self._x = _Exchange(base, self.timeout)
            if self.rank == 0:
                self._judge = Judge(self.factor, self.votes, self.steps_per_window, *_where(base))
                self.verdicts = self._judge.verdicts
            jobend.at_exit("store", self._at_exit)  # before MPI_Finalize: nothing left in flight
        elif self.steps_per_window and self.size > 1 and self.rank == 0:
            log.warning("hpcsync.monitor: comparing ranks needs MPI (a job launched by mpirun, mpiexec or srun, "
                        "with mpi4py); each rank only times its own steps")
        self._find_counter()
        self._last = _clock()

    @property
    def stragglers(self) -> Dict[int, Dict[str, Any]]:
        """Rank 0: world rank -> verdict of each rank named a straggler and not recovered since."""
        return dict(self._judge.named) if self._judge is not None else {}

    def section(self, name: str) -> Section:
        """``with mon.section("data"):`` -- time the body apart (the first four names used are
        compared across ranks in a verdict); a name among ``waits`` (default ``comm``) is waiting."""
        sec = self._sections.get(name)
        if sec is None:
            sec = self._sections[name] = Section(self, name, name in self.waits)
            if len(self._slots) < SECTION_SLOTS:
                self._slots.append(sec)
        return sec

    def step(self, step: Optional[int] = None) -> None:
        """Call once per training step, on every rank (the same number of times, give or take
        the last window): ends this step's timing and moves the window exchange on. ``step``:
        the program's number of the step that ended (``mon.step(step)``), which the verdicts,
        their records and a failure report name; without it, the step the program noted
        (:func:`hpcsync.observe.failure.note_step`), else the count of calls."""
        now = _clock()
        dt = now - self._last
        self._last = now
        wait = self._comm_s
        self._comm_s = 0.0
        counter = self._counter
        if counter is not None:
            total = counter[0]
            if total - self._counted > wait:
                wait = total - self._counted
            self._counted = total
        self._compute.append(dt - wait)
        self._step_sum += dt
        self._wait_sum += wait
        self.steps += 1
        if step is not None:
            failure.note_step(int(step), ended=True)  # the program's: a failure report names it too
        else:
            failure.note_count(self.steps)  # named only while the program notes no step of its own
        noted = failure.noted_step()
        self.at = noted if noted is not None else self.steps
        x = self._x
        if x is not None and x.reqs is not None:
            if not x.test():
                self._overdue()
                return
            self._completed()
        if len(self._compute) >= self.steps_per_window > 0:
            self._end_window(closing=False)

    # -- windows ------------------------------------------------------------------------------
    def _find_counter(self) -> None:
        work = sys.modules.get("hpcsync.backend.work")  # loaded with the hpcsync backend
        if self._counter is None and work is not None:
            self._counter = work.WAITED
            self._counted = work.WAITED[0]

    def _end_window(self, closing: bool) -> None:
        """This rank's figures of the window (posted when the exchange runs), and a new window."""
        n = len(self._compute)
        x = self._x
        med = statistics.median(self._compute) if n else 0.0
        if n:
            self.window = {"steps": n, "compute_s": med, "step_s": self._step_sum / n, "wait_s": self._wait_sum / n,
                           "sections": {s.name: s.total / n for s in self._sections.values()}}
        if x is not None and not x.ended and not x.broken:
            v = x.send
            v[0], v[1], v[2] = self._index, n, med
            v[3], v[4] = (self._step_sum / n, self._wait_sum / n) if n else (0.0, 0.0)
            for j, sec in enumerate(self._slots):
                v[_HEAD + 2 * j] = sec.crc
                v[_HEAD + 2 * j + 1] = sec.total / n if n else 0.0
            x.post(closing)
            self._index += 1
            self._posted_at, self._posted_call = self.at, self.steps
        if self._index == 1 and self.rank == 0 and n and not self._wait_sum and self._x is not None:
            log.warning("hpcsync.monitor: no waiting time measured in the first window (not the hpcsync backend, "
                        "and no %s section): every rank's compute is its whole step, so no straggler can be named",
                        " or ".join(repr(w) for w in sorted(self.waits)) or "waiting")
        self._compute = []
        self._step_sum = self._wait_sum = 0.0
        for sec in self._sections.values():
            sec.total = 0.0
        self._find_counter()

    def _completed(self) -> None:
        """The window in flight has arrived: rank 0 judges it."""
        if self._judge is not None and self._x is not None and self._x.rows is not None:
            names = {s.crc: s.name for s in self._sections.values()}
            self._judge.window(self._x.rows, self._posted_at, names)

    def _overdue(self) -> None:
        if not self._overdue_said and len(self._compute) >= 4 * self.steps_per_window:
            self._overdue_said = True
            log.warning("hpcsync.monitor: rank %d: the window posted at step %d has not completed %d steps later: "
                        "every rank must call step() once per step", self.rank, self._posted_at,
                        self.steps - self._posted_call)

    # -- the end ------------------------------------------------------------------------------
    def close(self) -> None:
        """Collective, once training is over (``with`` does it; so does the exit): complete the
        exchange, so that no MPI operation is left in flight. Bounded by the timeout: past it
        :class:`~hpcsync.core.errors.CollectiveTimeout` (the process then ends with MPI_Abort at exit).
        Ranks may close after different numbers of steps: the first to close ends the exchange
        for all at the window it posts, which the others complete at their next window."""
        if self._closed:
            return
        self._closed = True
        x = self._x
        if x is None or x.broken:
            return
        try:
            if x.reqs is not None:
                x.wait(f"close() at step {self.at}")
                self._completed()
            if not x.ended:
                self._end_window(closing=True)
                x.wait(f"close() at step {self.at}")
                self._completed()
        finally:
            x.free()

    def _at_exit(self) -> None:
        try:
            self.close()
        except CollectiveTimeout as exc:
            log.warning("%s", exc)

    def __enter__(self) -> "StepMonitor":
        return self

    def __exit__(self, *exc: Any) -> None:
        if jobend.exception_ends_job(exc[0]):  # the job is ending: post the closing flag, wait for nobody
            x = self._x
            if x is not None and not x.broken and x.reqs is None and not x.ended and not self._closed:
                self._end_window(closing=True)  # (the others complete it at their next window, or close)
            return  # close() at exit completes what is in flight, bounded
        self.close()


def _where(base: Any) -> Tuple[List[int], List[str]]:
    """The world rank and the node of every rank of ``base``."""
    from ..core import mpi, nodemap

    MPI = mpi.MPI()

    def translate() -> List[int]:
        mine, world = base.Get_group(), MPI.COMM_WORLD.Get_group()
        try:
            return [int(r) for r in MPI.Group.Translate_ranks(mine, list(range(base.Get_size())), world)]
        finally:
            mine.Free()
            world.Free()

    ranks = serial.call(translate)  # (local calls, but MPI calls: one at a time below THREAD_MULTIPLE)
    nodes = nodemap.current()
    return ranks, [nodes.host(r) if nodes is not None else "?" for r in ranks]


def monitor(steps: Optional[int] = None, factor: Optional[float] = None, windows: Any = None,
            waits: Sequence[str] = ("comm",), group: Any = None, timeout: Optional[float] = None) -> StepMonitor:
    """A :class:`StepMonitor`; collective: call it on every rank of ``group`` (default the world;
    a torch process group or an mpi4py communicator), with the same settings.

    ``steps``: steps per window (``HPCSYNC_MONITOR_STEPS``, default 50; 0: no exchange).
    ``factor``: slow in a window at this many times the median rank's compute
    (``HPCSYNC_STRAGGLER_FACTOR``, default 1.2). ``windows``: ``"M/N"`` or ``(M, N)``, named when slow
    in M of the last N windows (``HPCSYNC_STRAGGLER_WINDOWS``, default 3/5). ``waits``: the names of
    the sections that are waiting in collectives. ``timeout``: how long creating the monitor and
    :meth:`~StepMonitor.close` wait for the other ranks (default ``HPCSYNC_TIMEOUT``). Malformed or
    differing settings raise the same ``ValueError`` on every rank.
    """
    return StepMonitor(steps, factor, windows, waits, group, timeout)
