"""After a preemption stop and its checkpoint: requeue the Slurm job, so it comes back and resumes.

:func:`requeue` is collective. Rank 0 decides and acts, every rank gets the same
:class:`Requeue` and exits with its ``exit_code``::

    if guard.should_stop():
        ckpts.save(step, ...)
        sys.exit(guard.requeue().exit_code)        # or hpcsync.requeue() without a guard

- Under Slurm, rank 0 runs ``scontrol requeue`` with the array-aware id ``<job>_<task>`` (an array
  job requeues only the task that stopped, not every task), while ``SLURM_RESTART_COUNT`` is below
  ``max_restarts`` (``HPCSYNC_MAX_RESTARTS``, default 8). Slurm then ends the job's processes and
  starts the job again later, with ``SLURM_RESTART_COUNT`` one higher.
- **A job that is being ended is never requeued.** A stop on an ending signal (SIGTERM: ``scancel``,
  the time limit, a preemption; ``ending=``), on any rank, or a job that Slurm no longer shows as
  RUNNING (``scancel`` makes it COMPLETING at once) exits ``128 + signal`` (143 for SIGTERM) with
  the checkpoint kept. Slurm accepts a requeue of a job being cancelled, so this is checked first.
- **A job Slurm already requeued** (``PreemptMode=REQUEUE``, an operator's ``scontrol requeue``:
  its ``Restarts`` is above ``SLURM_RESTART_COUNT``, or ``scontrol`` answers "pending") is said to
  be so and exits 0: it comes back and resumes.
- Outside Slurm (``mpirun`` on a workstation) there is nothing to requeue: exit 0 (or 128 +
  signal after an ending signal), the checkpoint is there for the next start.
- Every way it cannot requeue ends with one clear message and its own exit code:
  :data:`EXIT_RESTARTS_SPENT`, :data:`EXIT_NO_SCONTROL` (``scontrol`` not on PATH, as inside many
  containers), :data:`EXIT_REQUEUE_FAILED` (``scontrol`` refused, e.g. a job submitted with
  ``--no-requeue``).

Call it only after a stop: a job whose training finished simply exits, and is not requeued.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

from ..core import settings
from ..observe.logs import reaches_handler

__all__ = [
    "EXIT_REQUEUED", "EXIT_REQUEUE_FAILED", "EXIT_NO_SCONTROL", "EXIT_RESTARTS_SPENT", "EXIT_ENDING_BASE",
    "SCONTROL_TIMEOUT_S", "Requeue", "slurm_job_id", "restart_cap", "job_state", "requeue_job", "requeue"
]

log = logging.getLogger(__name__)

EXIT_REQUEUED = 0  #: requeued (by hpcsync or by Slurm), or nothing to requeue outside Slurm
EXIT_REQUEUE_FAILED = 70  #: scontrol ran and refused (EX_SOFTWARE)
EXIT_NO_SCONTROL = 69  #: scontrol is not on PATH (EX_UNAVAILABLE)
EXIT_RESTARTS_SPENT = 75  #: SLURM_RESTART_COUNT reached the cap (EX_TEMPFAIL)
EXIT_ENDING_BASE = 128  #: + the signal: stopped by an ending signal, or the job is being ended; not requeued
SCONTROL_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Requeue:
    """What :func:`requeue` did: ``requeued`` (Slurm will start the job again), the process's
    ``exit_code``, and the ``message`` rank 0 logged."""

    requeued: bool
    exit_code: int
    message: str
    job_id: Optional[str] = None


def slurm_job_id(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The id ``scontrol requeue`` needs: ``<array job>_<task>`` for an array task (the array's
    own id would requeue every task), ``SLURM_JOB_ID`` otherwise; None outside Slurm."""
    env = os.environ if env is None else env
    array_job, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"{array_job}_{task}"
    return env.get("SLURM_JOB_ID") or None


def restart_cap() -> int:
    """``HPCSYNC_MAX_RESTARTS``: requeue while ``SLURM_RESTART_COUNT`` is below it."""
    value = settings.text("HPCSYNC_MAX_RESTARTS") or "0"
    if not value.strip().isdigit():
        raise ValueError(f"HPCSYNC_MAX_RESTARTS={value!r} is not a whole number, 0 or more")
    return int(value)


def job_state(job: str, scontrol: Optional[str]) -> Optional[Tuple[str, int]]:
    """``(JobState, Restarts)`` of ``job`` from ``scontrol show job``, or None when it cannot tell."""
    if scontrol is None:
        return None
    try:
        proc = subprocess.run([scontrol, "show", "job", "-o", job], capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    state, restarts = re.search(r"\bJobState=(\S+)", proc.stdout), re.search(r"\bRestarts=(\d+)", proc.stdout)
    if proc.returncode != 0 or state is None or restarts is None:
        return None
    return state.group(1), int(restarts.group(1))


def _ending_code(name: Optional[str]) -> int:
    return EXIT_ENDING_BASE + int(getattr(signal, name or "SIGTERM", signal.SIGTERM))


def _decide(cap: int, env: Mapping[str, str], scontrol: Optional[str], ending: Optional[str] = None) -> Requeue:
    """Rank 0's decision and action. ``ending``: the ending signal some rank got (e.g. "SIGTERM")."""
    job = slurm_job_id(env)
    if job is None:
        if ending:
            return Requeue(False, _ending_code(ending), f"hpcsync.requeue: stopped on {ending}, which ends a job; "
                           "not a Slurm job, nothing to requeue; the checkpoint is there for the next start")
        return Requeue(False, EXIT_REQUEUED, "hpcsync.requeue: not a Slurm job, nothing to requeue; the checkpoint "
                                             "is there for the next start")
    restarts = int(env.get("SLURM_RESTART_COUNT") or 0)
    state = job_state(job, scontrol)
    already = Requeue(True, EXIT_REQUEUED, f"hpcsync.requeue: Slurm has already requeued job {job} (restart "
                      f"{state[1] if state else restarts + 1}); it resumes from the checkpoint when it starts again",
                      job)
    if state is not None and state[1] > restarts:
        return already
    if ending:
        return Requeue(False, _ending_code(ending), f"hpcsync.requeue: job {job} stopped on {ending}, which ends a "
                       "job (scancel, the time limit, a preemption): not requeued; the checkpoint is kept, "
                       "resubmit to continue", job)
    if state is not None and state[0] != "RUNNING":
        return Requeue(False, _ending_code("SIGTERM"), f"hpcsync.requeue: job {job} is being ended (state "
                       f"{state[0]}: scancel or its end): not requeued; the checkpoint is kept, resubmit to "
                       "continue", job)
    if restarts >= cap:
        return Requeue(False, EXIT_RESTARTS_SPENT, f"hpcsync.requeue: job {job} not requeued: it has restarted "
                       f"{restarts} time(s), the cap (HPCSYNC_MAX_RESTARTS) is {cap}; the checkpoint is kept, "
                       f"resubmit to continue", job)
    if scontrol is None:
        return Requeue(False, EXIT_NO_SCONTROL, f"hpcsync.requeue: job {job} not requeued: scontrol is not on "
                       "PATH (inside a container? bind Slurm's binaries in, or requeue from the batch script); "
                       "the checkpoint is kept", job)
    try:
        proc = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT_S)
        ok, detail = proc.returncode == 0, (proc.stderr or proc.stdout).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        ok, detail = False, str(exc)
    if not ok and "pending" in detail.lower():  # requeued meanwhile ("Job is pending execution")
        state = job_state(job, scontrol)
        return already if state is None or state[1] > restarts else Requeue(
            False, EXIT_REQUEUE_FAILED, f"hpcsync.requeue: `scontrol requeue {job}` failed: {detail}; "
            "the checkpoint is kept", job)
    if not ok:
        return Requeue(False, EXIT_REQUEUE_FAILED, f"hpcsync.requeue: `scontrol requeue {job}` failed: {detail}; "
                       "the checkpoint is kept", job)
    return Requeue(True, EXIT_REQUEUED, f"hpcsync.requeue: requeued Slurm job {job} (restart {restarts + 1} of at "
                   f"most {cap}); it resumes from the checkpoint when it starts again", job)


def requeue_job(max_restarts: Optional[int] = None, ending: Optional[str] = None) -> Requeue:
    """Not collective: decide and act as :func:`requeue`'s rank 0 does (the cap, a job being ended,
    one Slurm already requeued) and return the outcome; the caller reports its ``message``. For a
    process beside the ranks, e.g. ``hpcsync run`` when the warning signal killed them first."""
    cap = restart_cap() if max_restarts is None else max_restarts
    return _decide(cap, os.environ, shutil.which("scontrol"), ending)


def requeue(max_restarts: Optional[int] = None, group: Any = None, ending: Optional[str] = None,
            timeout: Optional[float] = None) -> Requeue:
    """Collective: rank 0 requeues the Slurm job (see the module's text); every rank returns the same
    :class:`Requeue`. ``ending``: the ending signal this rank got (``"SIGTERM"``), if any -- one
    rank's is enough to keep the job from coming back. Each exchange is bounded by ``timeout``
    (``HPCSYNC_TIMEOUT``). From here on SIGTERM is ignored: Slurm sends it to end the requeued
    job's processes, which are exiting anyway (its SIGKILL follows after ``KillWait``)."""
    from ..core import bounded

    cap = restart_cap() if max_restarts is None else max_restarts
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctl = bounded.control("hpcsync.requeue", group, timeout)
    endings = ctl.allgather(ending)
    ending = next((e for e in endings if e), None)
    result = None
    if ctl.Get_rank() == 0:
        result = requeue_job(cap, ending)
        level = logging.INFO if result.exit_code == EXIT_REQUEUED else logging.ERROR
        if result.exit_code >= EXIT_ENDING_BASE:
            level = logging.WARNING
        log.log(level, "%s", result.message)
        # never only in a log nobody configured (hpcsync.init puts warnings on the console; this
        # is for a program without it), and never where HPCSYNC_WARNINGS=0 asks for no console
        if level >= logging.WARNING and not reaches_handler(log, level) and settings.flag("HPCSYNC_WARNINGS"):
            sys.stderr.write(f"[hpcsync] {result.message}\n")
            sys.stderr.flush()
    return ctl.bcast(result, root=0)
