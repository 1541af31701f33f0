"""One job per checkpoint root: ``ROOT/OWNER`` names the job that uses it; a second job that still
runs (Slurm's ``squeue``, or a live process on this host) is refused, a job that ended hands the
root on, and a requeued job is the same job."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import time
import uuid
from typing import Any, Dict, Optional, Tuple

from ..core.errors import CheckpointError

__all__ = ["OWNER", "ENDING_WAIT_S", "RunRecord", "start_ticks", "this_job", "job_running", "claim", "advance"]

log = logging.getLogger(__name__)

OWNER = "OWNER"
_SQUEUE_TIMEOUT_S = 30.0
ENDING_WAIT_S = 3.0  # how long a process of this host that holds the root is given to end
_OWNER_MAX = 1 << 16  # an OWNER longer than this is no record of ours
_SHAPE: Dict[str, Any] = {"slurm_job": (str, type(None)), "host": str, "pid": int, "start": (int, type(None))}
_FINISHED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
             "OUT_OF_MEMORY", "")


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """The run a checkpoint root holds, kept in its ``OWNER`` (``"run"``) across the jobs that use
    it: ``id``, drawn at the root's first claim and written into every node-local copy's marker
    (a copy of another id is another run's: never loaded), and ``next_seq``, the sequence number
    the root's next save of any form gets (one counter, whatever the form). Version 1."""

    id: str
    next_seq: int
    version: int = 1


def start_ticks(pid: int) -> Optional[int]:
    """When process ``pid`` started (clock ticks since boot), or None when no such process runs:
    a zombie (ended, not yet reaped by its launcher) or a process already exiting counts as ended."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
        fields = text[text.rindex(")") + 2:].split()
        return None if fields[0] in ("Z", "X", "x") else int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _runs(pid: Any, start: Any) -> bool:
    return isinstance(pid, int) and start is not None and start_ticks(pid) == start


def this_job() -> Dict[str, Any]:
    """Who this job is, for ``OWNER``: its Slurm job id (the same across requeues; each array
    task has its own), and rank 0's host and process."""
    pid = os.getpid()
    return {"slurm_job": os.environ.get("SLURM_JOB_ID") or None, "host": socket.gethostname(), "pid": pid,
            "start": start_ticks(pid)}


def _describe_job(job: Dict[str, Any]) -> str:
    if job.get("slurm_job"):
        return f"Slurm job {job['slurm_job']}"
    return f"process {job.get('pid')} on {job.get('host')}"


def _same_job(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    if a.get("slurm_job") or b.get("slurm_job"):
        return a.get("slurm_job") == b.get("slurm_job")
    return (a.get("host"), a.get("pid"), a.get("start")) == (b.get("host"), b.get("pid"), b.get("start"))


def job_running(job: Dict[str, Any]) -> Optional[bool]:
    """Whether the job that wrote an ``OWNER`` record still runs: True, False, or None when this
    machine cannot tell (no ``squeue``; a process on another host)."""
    if job.get("slurm_job"):
        squeue = shutil.which("squeue")
        if squeue is None:
            return None
        try:
            proc = subprocess.run([squeue, "-h", "-t", "all", "-j", str(job["slurm_job"]), "-o", "%T"], capture_output=True,
                                  text=True, timeout=_SQUEUE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if proc.returncode != 0:  # "Invalid job id specified": gone from the queue
            return False if "Invalid job id" in proc.stderr else None
        return proc.stdout.strip().upper() not in _FINISHED
    if job.get("host") != socket.gethostname():
        return None
    pid, start = job.get("pid"), job.get("start")
    deadline = time.monotonic() + ENDING_WAIT_S  # a job that just failed: its launcher may return
    while _runs(pid, start) and time.monotonic() < deadline:  # before every rank has died
        time.sleep(0.05)
    return _runs(pid, start)


def _record(owner_path: str) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """``ROOT/OWNER``'s job record, or None; and why it cannot be used, when it is there but
    damaged, empty or of another shape (it then names no job, live or not)."""
    try:
        with open(owner_path, "rb") as f:
            data = f.read(_OWNER_MAX + 1)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"unreadable ({exc})"
    try:
        owner = json.loads(data)
    except ValueError as exc:
        return None, f"not JSON ({'empty' if not data.strip() else exc})"
    if not isinstance(owner, dict):
        return None, f"a JSON {type(owner).__name__}, not a job's record"
    wrong = [k for k, kinds in _SHAPE.items() if not isinstance(owner.get(k, ...), kinds)]
    if wrong:
        return None, f"a record without a valid {', '.join(wrong)}"
    return owner, None


_CHECKPOINT = re.compile(r"^step-\d{8,}(?:\.\d+)?$")  # (a checkpoint's folder: hpcsync.resilience.checkpoint's)


def _recovered(root: str) -> Optional[RunRecord]:
    """The run the root's own checkpoints name, when its ``OWNER`` no longer does: the run of the
    newest whole marker that names one (every save's marker names its run), its counter one past
    that marker's; None when no checkpoint names a run. A listing and a read of each marker."""
    from .checksums import marker_problem

    best: Optional[Tuple[int, str]] = None
    try:
        names = [n for n in os.listdir(root) if _CHECKPOINT.match(n)]
    except OSError:
        return None
    for name in names:
        try:
            with open(os.path.join(root, name, "COMPLETE"), "rb") as f:
                marker = json.loads(f.read(_OWNER_MAX * 64))
            seq, run = marker.get("seq"), marker.get("run")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(seq, int) and isinstance(run, str) and run and marker_problem(marker) is None \
                and (best is None or seq > best[0]):
            best = (seq, run)
    return RunRecord(best[1], best[0] + 1) if best else None


def _run(owner: Optional[Dict[str, Any]]) -> Optional[RunRecord]:
    """The run record an ``OWNER`` carries, or None (none, or an older hpcsync's record)."""
    run = (owner or {}).get("run")
    if isinstance(run, dict) and run.get("version") == 1 and isinstance(run.get("id"), str) \
            and isinstance(run.get("next_seq"), int) and run["id"]:
        return RunRecord(run["id"], run["next_seq"])
    return None


def _write(owner_path: str, job: Dict[str, Any], run: RunRecord, new: bool) -> None:
    """Write ``OWNER`` (``job`` and ``run``) through a temporary: atomically replaced, or (``new``)
    linked into place, which fails with FileExistsError when another job was first."""
    tmp = f"{owner_path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump({**{k: job.get(k) for k in _SHAPE}, "run": dataclasses.asdict(run)}, f)
            f.flush()
            os.fsync(f.fileno())
        if new:
            os.link(tmp, owner_path)
        else:
            os.replace(tmp, owner_path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def claim(root: str, job: Dict[str, Any]) -> RunRecord:
    """Record this job in ``ROOT/OWNER``, unless another job that still runs holds the root; the
    run the root holds (made at its first claim, kept across the jobs that use it).

    One bounded step, never recursive: an ``OWNER`` that is damaged, empty or of another shape
    names no job, so it is taken over with a warning; a valid record of a job that still runs
    (or, when two jobs start together, of the one that created ``OWNER`` first) is refused with a
    :class:`CheckpointError`; a job that ended hands the root on. Takes a file read and, when the
    owner changes, a write (``squeue`` once, or at most ``ENDING_WAIT_S``, to judge another job)."""
    owner_path = os.path.join(root, OWNER)
    if os.path.lexists(root) and not os.path.isdir(root):
        raise CheckpointError(f"hpcsync.checkpoint: the checkpoint root {root} is not a directory (a file is there): "
                              "give Checkpoints() a folder")
    for first in (True, False):  # (a second look only when another job created OWNER meanwhile)
        owner, why = _record(owner_path)
        run = _run(owner)
        if owner is not None and _same_job(owner, job) and run is not None:
            return run
        if owner is not None and not _same_job(owner, job):
            running = job_running(owner)
            if running:
                raise CheckpointError(
                    f"{root} is in use by {_describe_job(owner)}, which is still running: two jobs on one "
                    "checkpoint root would load and prune each other's checkpoints; give each job its own root "
                    "(e.g. a folder per SLURM_ARRAY_TASK_ID)")
            if running is None:
                log.warning("hpcsync.checkpoint: %s was used by %s, which this machine cannot tell is over; "
                            "taking it over", root, _describe_job(owner))
        if run is None:  # (a root's first claim; or its OWNER lost its run: the checkpoints' then)
            damage = why or (owner is not None and "run" in owner and f"its run is of another shape "
                             f"({owner['run']!r:.80})")
            run = _recovered(root)
            kept = run is not None
            run = run or RunRecord(uuid.uuid4().hex, 0)
            if damage:
                log.warning("hpcsync.checkpoint: %s is damaged (%s)%s; taking the root over (%s)", owner_path, damage,
                            ": it names no job that could still use the root" if why else "",
                            f"the run its checkpoints name, {run.id}, is kept" if kept else
                            "a new run: node-local copies of an earlier one are not loaded")
        try:
            os.makedirs(root, exist_ok=True)
            _write(owner_path, job, run, new=owner is None and why is None)
            return run
        except FileExistsError:
            if not first:
                break
        except OSError as exc:
            raise CheckpointError(f"hpcsync.checkpoint: cannot record this job in {owner_path}: {exc}") from None
    raise CheckpointError(f"hpcsync.checkpoint: {owner_path} keeps changing under this job: another job uses {root}")


def advance(root: str, job: Dict[str, Any], at_least: int) -> Tuple[int, str]:
    """Rank 0, every form's save: claim the root, take its next sequence number (the root's
    counter, or ``at_least`` when that is higher: markers of an older hpcsync's saves) and
    record the one after it; ``(sequence number, run id)``. One read and one write of ``OWNER``."""
    run = claim(root, job)
    seq = max(run.next_seq, at_least)
    try:
        _write(os.path.join(root, OWNER), job, RunRecord(run.id, seq + 1), new=False)
    except OSError as exc:
        raise CheckpointError(f"hpcsync.checkpoint: cannot record the next sequence number in {root}: {exc}") from None
    return seq, run.id
