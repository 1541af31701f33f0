"""Every ``HPCSYNC_*`` environment variable in one table, and the MPI tags hpcsync reserves.

Variables are read when used, not at import: a program may set them after ``import hpcsync``.
``hpcsync.core.settings.describe()`` lists them (the API reference prints the same table).
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

__all__ = [
    "Setting", "SETTINGS", "validate", "problems", "debug", "votes", "text", "flag", "number", "describe", "TAG_REPORT_ASK",
    "TAG_REPORT_STATE", "TAG_REPORT_DONE", "TAG_STORE_REQUEST", "TAG_STORE_REPLY", "TAG_BARRIER_FIRST",
    "TAG_BARRIER_COUNT", "TAG_LOG", "TAG_COPY_HEAD", "TAG_COPY_DATA", "TAG_COPY_ASK", "TAG_COPY_RANGE"
]


@dataclass(frozen=True)
class Setting:
    name: str
    default: str  # "" = unset
    doc: str
    # flag, seconds or rate (a positive number), count (an integer >= 0), factor (a number above 1), m/n (two
    # integers, 1 <= m <= n), epoch (a time, seconds since 1970), folder (one this rank can write or make),
    # text, or "a|b|c" (one of these words)
    kind: str = "text"


_FLAG_WORDS = ("0", "1", "false", "true", "no", "yes", "off", "on")

SETTINGS: Dict[str, Setting] = {s.name: s for s in (
    Setting("HPCSYNC_MPI", "auto", "auto: use MPI when the launcher or the program started it; 1: always; 0: never",
            "auto|1|0|true|false|yes|no|on|off"),
    Setting("HPCSYNC_TIMEOUT", "1800", "hpcsync.init's default group timeout, seconds", "seconds"),
    Setting("HPCSYNC_MASTER_ADDR", "", "force the master address (gloo/nccl) instead of choosing one"),
    Setting("HPCSYNC_IFNAME", "", "interfaces each node may use, in NCCL's syntax (eth,ib / =eth0 / ^docker): "
                                  "the master address among rank 0's, and each node's own for gloo and NCCL"),
    Setting("HPCSYNC_CONNECT_TIMEOUT", "3", "seconds each node leader tries a candidate master address, and each "
            "other node's address (gloo/nccl)", "seconds"),
    Setting("HPCSYNC_JOB_END", "", "the job's end, epoch seconds (default: Slurm's SLURM_JOB_END_TIME): "
            "hpcsync.preemption stops in time for a checkpoint", "epoch"),
    Setting("HPCSYNC_MAX_RESTARTS", "8", "hpcsync.requeue requeues a Slurm job while its SLURM_RESTART_COUNT is "
            "below this (0: never)", "count"),
    Setting("HPCSYNC_STORE", "tcp", "tcp (torch's TCPStore) or mpi (a store over MPI: no listening socket)",
            "tcp|mpi"),
    Setting("HPCSYNC_ABORT_ON_EXCEPTION", "1", "0: raise instead of ending the job with MPI_Abort", "flag"),
    Setting("HPCSYNC_ABORT_GRACE", "10", "seconds after MPI_Abort before a still-waiting launcher gets SIGTERM "
            "and an aborting rank that is still alive ends itself", "seconds"),
    Setting("HPCSYNC_REPORT_DIR", "", "folder of hang reports, failure records and straggler records (JSON); "
            "unset: the log folder (HPCSYNC_LOG_DIR or init(log_dir=)), else none are written (the console has the reports, and says once where to "
            "set a folder; `hpcsync run` sets it to each attempt's folder)", "folder"),
    Setting("HPCSYNC_RUN_ATTEMPT", "", "set by hpcsync run for the step it launches: the attempt's number "
            "(failure records carry it; Checkpoints.load notes the checkpoint it resumed from)"),
    Setting("HPCSYNC_DESYNC_CHECK", "1", "0: no fingerprint beside each collective (mismatches may then hang); "
            "the same on every rank", "flag"),
    Setting("HPCSYNC_DEBUG", "0", "1: compare every collective's description before starting it; the same on "
            "every rank. Also: a set-up error (a malformed setting, a bad init() argument) shows its traceback",
            "flag"),
    Setting("HPCSYNC_PARTS_DIR", "", "where sync_file's per-rank parts live; default: beside the target", "folder"),
    Setting("HPCSYNC_CHECKPOINT_MBPS", "50", "the slowest writing speed a checkpoint's deadlines allow for, MB/s: "
            "the ranks waiting for a save's writes wait the timeout plus its bytes at this speed", "rate"),
    Setting("HPCSYNC_WARNINGS", "1", "0: hpcsync's own warnings do not reach the console unless the program "
            "sets up logging (by default they do, folded across ranks)", "flag"),
    Setting("HPCSYNC_PROGRESS", "1", "0: no progress (a bar on a terminal; a line every 10 s where stderr is a pipe)", "flag"),
    Setting("HPCSYNC_HUGEPAGES", "1", "0: do not ask torch for transparent huge pages", "flag"),
    Setting("HPCSYNC_LOG_DIR", "", "a folder: hpcsync.init turns on rank-aware logging (a file per rank there, "
            "rank 0 and every rank's warnings on the console); empty: logging is left to the program", "folder"),
    Setting("HPCSYNC_LOG_PRINT", "0", "1: print output joins each rank's log file (rank 0's still reaches "
            "stdout, the others' only their files)", "flag"),
    Setting("HPCSYNC_MONITOR_STEPS", "50", "hpcsync.monitor: steps per window, the ranks' statistics exchanged "
            "once per window (0: no exchange); the same on every rank", "count"),
    Setting("HPCSYNC_STRAGGLER_FACTOR", "1.2", "hpcsync.monitor: a rank whose compute per step is this many "
            "times the median rank's in a window is slow in it", "factor"),
    Setting("HPCSYNC_STRAGGLER_WINDOWS", "3/5", "hpcsync.monitor: M/N, a rank slow in M of the last N windows is "
            "named a straggler", "m/n"),
)}


def validate() -> None:
    """Raise ``ValueError`` naming every ``HPCSYNC_*`` variable whose value is malformed (a flag
    that is no yes/no word, a number of seconds that is not positive, a word not among its
    choices): :func:`problems`, in one message. ``hpcsync.init`` checks them first, on every rank
    together, so a typo fails at once instead of deep in a job."""
    bad = problems()
    if bad:
        raise ValueError("hpcsync: malformed settings: " + "; ".join(bad))


def problems() -> List[str]:
    """One line for each ``HPCSYNC_*`` variable that is set to a malformed value: its name and
    value, what it expects, and its default (``HPCSYNC_TIMEOUT='5s': expected a positive number
    of seconds (default 1800)``). An empty variable is unset: its default holds."""
    bad = []
    for s in SETTINGS.values():
        value = os.environ.get(s.name)
        if value is None or value.strip() == "":
            continue
        v = value.strip().lower()
        expected = None
        if s.kind == "flag" and v not in _FLAG_WORDS:
            expected = f"one of {', '.join(_FLAG_WORDS)}"
        elif s.kind in ("seconds", "rate") and not 0 < _float(v) < float("inf"):
            expected = f"a positive number{' of seconds' * (s.kind == 'seconds')}"
        elif s.kind == "count" and not v.isdigit():
            expected = "a whole number, 0 or more"
        elif s.kind == "factor" and not 1 < _float(v) < float("inf"):
            expected = "a number above 1"
        elif s.kind == "m/n" and votes(v) is None:
            expected = "M/N, two whole numbers with 1 <= M <= N, such as 3/5"
        elif s.kind == "epoch" and not 0 < _float(v) < float("inf"):
            expected = "a time in seconds since 1970 (date -d '+4 hours' +%s)"
        elif s.kind == "folder" and (why := _unwritable(value.strip())):
            expected = f"a folder this rank can write or create ({why})"
        elif "|" in s.kind and v not in s.kind.split("|"):
            expected = f"one of {s.kind.replace('|', ', ')}"
        if expected is not None:
            bad.append(f"{s.name}={value!r}: expected {expected} (default {s.default or 'unset'})")
    for name, value in os.environ.items():  # a name one letter off a setting's: a typo that would be ignored
        if name.startswith("HPCSYNC_") and name not in SETTINGS:
            near = difflib.get_close_matches(name, SETTINGS, n=1, cutoff=0.85)
            if near:
                bad.append(f"{name}={value!r}: not a setting (did you mean {near[0]}?)")
    return bad


def _unwritable(path: str) -> Optional[str]:
    """Why this process could not write files in the folder ``path`` (or create it), or None;
    nothing is created."""
    at = os.path.abspath(os.path.expanduser(path))
    while not os.path.lexists(at):
        at = os.path.dirname(at)
    if not os.path.isdir(at):
        return f"{at} is not a folder"
    if not os.access(at, os.W_OK | os.X_OK):
        return f"{at} is not writable here"
    try:
        if os.statvfs(at).f_flag & os.ST_RDONLY:
            return f"{at} is on a read-only file system"
    except OSError:
        pass
    return None


def debug() -> bool:
    """``HPCSYNC_DEBUG`` is on: set to a yes word (1, true, yes, on). Unlike :func:`flag`, a
    malformed value is off: this decides whether a set-up error, which may be that very value,
    shows its traceback."""
    return (os.environ.get("HPCSYNC_DEBUG") or "").strip().lower() in ("1", "true", "yes", "on")


def _float(v: str) -> float:
    try:
        return float(v)
    except ValueError:
        return float("nan")


def votes(value: str) -> Optional[Tuple[int, int]]:
    """``"3/5"`` -> ``(3, 5)``; None unless two whole numbers with 1 <= M <= N."""
    m, _, n = value.strip().partition("/")
    if not (m.strip().isdigit() and n.strip().isdigit()):
        return None
    mi, ni = int(m), int(n)
    return (mi, ni) if 1 <= mi <= ni else None


def text(name: str) -> Optional[str]:
    """The variable's value, or its default; None when both are empty."""
    value = os.environ.get(name)
    if value is None or value == "":
        value = SETTINGS[name].default
    return value or None


def flag(name: str) -> bool:
    """On unless set to 0 / false / no / off (or off by default and not set)."""
    return (text(name) or "0").strip().lower() not in ("0", "false", "no", "off")


def number(name: str) -> float:
    value = text(name)
    try:
        return float(value or 0)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number") from None


def describe() -> str:
    return "\n".join(f"{s.name} (default {s.default or 'unset'}): {s.doc}" for s in SETTINGS.values())


# MPI point-to-point tags, each range on hpcsync's own duplicated communicator and disjoint anyway.
# The MPI standard guarantees tags up to 32767.
TAG_REPORT_ASK, TAG_REPORT_STATE, TAG_REPORT_DONE = 31001, 31002, 31003  # hang reports (watchdog)
TAG_STORE_REQUEST, TAG_STORE_REPLY = 31101, 31102  # MPIStore
TAG_BARRIER_FIRST, TAG_BARRIER_COUNT = 31200, 1000  # monitored_barrier: one tag per call, cycling
TAG_LOG = 32300  # every rank's warnings to rank 0's console (hpcsync.observe.logs)
TAG_COPY_HEAD, TAG_COPY_DATA, TAG_COPY_ASK, TAG_COPY_RANGE = 32401, 32402, 32403, 32404  # node-local checkpoint copies
