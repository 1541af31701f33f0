"""One job per checkpoint root: ``ROOT/OWNER`` names the job that uses it; a second job that still
runs (Slurm's ``squeue``, or a live process on this host) is refused, a job that ended hands the
root on, and a requeued job is the same job."""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import time
from typing import Any, Dict, Optional

from ..core.errors import CheckpointError

__all__ = ["OWNER", "ENDING_WAIT_S", "start_ticks", "this_job", "job_running", "claim"]

log = logging.getLogger(__name__)

OWNER = "OWNER"
_SQUEUE_TIMEOUT_S = 30.0
ENDING_WAIT_S = 3.0  # how long a process of this host that holds the root is given to end
_FINISHED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
             "OUT_OF_MEMORY", "")


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


def claim(root: str, job: Dict[str, Any]) -> None:
    """Record this job in ``ROOT/OWNER``, unless another job that still runs holds the root."""
    owner_path = os.path.join(root, OWNER)
    try:
        with open(owner_path) as f:
            owner = json.load(f)
    except FileNotFoundError:
        owner = None
    except (OSError, ValueError) as exc:
        log.warning("hpcsync.checkpoint: %s unreadable (%s); taking the root over", owner_path, exc)
        owner = None
    if owner is not None and _same_job(owner, job):
        return
    if owner is not None:
        running = job_running(owner)
        if running:
            raise CheckpointError(
                f"{root} is in use by {_describe_job(owner)}, which is still running: two jobs on one "
                "checkpoint root would load and prune each other's checkpoints; give each job its own root "
                "(e.g. a folder per SLURM_ARRAY_TASK_ID)")
        if running is None:
            log.warning("hpcsync.checkpoint: %s was used by %s, which this machine cannot tell is over; "
                        "taking it over", root, _describe_job(owner))
    os.makedirs(root, exist_ok=True)
    tmp = f"{owner_path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(job, f)
        f.flush()
        os.fsync(f.fileno())
    if owner is not None:  # taking over from a job that ended
        os.replace(tmp, owner_path)
        return
    try:  # a root nobody claimed: of two jobs starting together, one creates OWNER (link is atomic)
        os.link(tmp, owner_path)
    except FileExistsError:
        claim(root, job)  # the other job was first: judge it like any owner
    finally:
        os.unlink(tmp)
