"""What every rank was doing when a collective timed out: a flight recorder and a hang report.

Each process keeps, per process group, a ring buffer of its last operations (sequence number,
op, dtype, shape, root, when it started, whether it finished). A responder thread per process
listens on a private duplicate of ``COMM_WORLD`` (polled every 0.1 s: a few µs a second). When an
operation passes its timeout, the rank that noticed asks every rank for its records and the
Python stacks of its threads (like ``faulthandler``, but sent back over MPI), and builds one
report: which ranks never entered operation #N and what they did last, which are inside it,
which did not answer, and each rank's main-thread stack. The lowest timed-out rank prints it
(stderr) and writes it as JSON to ``$HPCSYNC_REPORT_DIR`` (default: the working directory).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Deque, Dict, List, Optional, Tuple

from . import _mpi

RING = 64  # operations kept per group
_TAG_ASK, _TAG_STATE, _TAG_DONE = 31001, 31002, 31003
POLL_S = 0.1


@dataclass
class OpRecord:
    """One collective as this rank saw it."""

    seq: int
    op: str
    dtype: str
    shape: Tuple[int, ...]
    root: int
    started: float  # time.time()
    finished: Optional[float] = None
    error: Optional[str] = None

    def describe(self) -> str:
        root = f" root={self.root}" if self.root >= 0 else ""
        what = f"{self.dtype}{list(self.shape)}" if self.dtype != "-" else ""
        return f"{self.op} #{self.seq}" + (f" ({what}{root})".replace("( ", "(") if what or root else "")


@dataclass
class GroupLog:
    """The flight recorder of one process group on this rank."""

    name: str
    ranks: List[int]
    ops: Deque[OpRecord] = field(default_factory=lambda: deque(maxlen=RING))
    seq: int = 0
    timed_out: Optional[int] = None  # seq of the operation that timed out here

    def start(self, op: str, dtype: str, shape: Tuple[int, ...], root: int) -> OpRecord:
        self.seq += 1
        rec = OpRecord(self.seq, op, dtype, shape, root, time.time())
        self.ops.append(rec)
        return rec


_logs: Dict[int, GroupLog] = {}
_lock = threading.Lock()
_responder: Optional["Responder"] = None
_inflight: List[Any] = []  # sends that may still be in flight when their caller returns: kept alive


def group_log(key: int, name: str, ranks: List[int]) -> GroupLog:
    with _lock:
        log = _logs.get(key)
        if log is None:
            log = _logs[key] = GroupLog(name, list(ranks))
        return log


def drop_group_log(key: int) -> None:
    with _lock:
        _logs.pop(key, None)


def _stacks() -> Dict[str, List[str]]:
    """Python stacks of every thread of this process (the main thread first)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out: Dict[str, List[str]] = {}
    frames = sys._current_frames()
    main = threading.main_thread().ident
    for ident in sorted(frames, key=lambda i: i != main):
        if ident == threading.get_ident() and ident != main:
            continue  # the thread answering the request
        label = "main" if ident == main else names.get(ident, str(ident))
        out[label] = [line.rstrip("\n") for line in traceback.format_stack(frames[ident])]
    return out


def snapshot() -> Dict[str, Any]:
    """This rank's records and stacks, as plain data."""
    world = _mpi.MPI().COMM_WORLD
    with _lock:
        groups = {log.name: {"ranks": log.ranks, "timed_out": log.timed_out,
                             "ops": [asdict(r) for r in log.ops]} for log in _logs.values()}
    return {"rank": world.Get_rank(), "host": os.uname().nodename, "pid": os.getpid(), "time": time.time(),
            "groups": groups, "stacks": _stacks()}


class Responder:
    """Answers hang-report requests from other ranks, on its own communicator and thread."""

    def __init__(self) -> None:
        self.comm = _mpi.MPI().COMM_WORLD.Dup()  # collective: created with the default group
        self._stop = threading.Event()
        self._sends: List[Any] = []
        self.thread = threading.Thread(target=self._loop, name="hpcsync-watchdog", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        MPI = _mpi.MPI()
        while not self._stop.wait(POLL_S):
            try:
                while True:
                    msg = self.comm.improbe(source=MPI.ANY_SOURCE, tag=_TAG_ASK)
                    if msg is None:
                        break
                    status = MPI.Status()
                    msg.recv(status=status)  # mprobe-matched: any size
                    self._sends.append(self.comm.isend(snapshot(), dest=status.Get_source(), tag=_TAG_STATE))
                self._sends = [r for r in self._sends if not r.Test()]
            except Exception:  # never let the flight recorder take the job down
                if MPI.Is_finalized():
                    return

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=2 * POLL_S + 1)


def start() -> Responder:
    """Start the responder once per process (collective over COMM_WORLD the first time)."""
    global _responder
    if _responder is None:
        _responder = Responder()  # stopped at exit by hpcsync.backend, before MPI_Finalize
    return _responder


def collect(wait_s: float = 5.0) -> Tuple[Dict[int, Dict[str, Any]], List[int]]:
    """Ask every rank for its snapshot; return the answers and the ranks that did not answer."""
    MPI = _mpi.MPI()
    me = MPI.COMM_WORLD.Get_rank()
    states = {me: snapshot()}
    if _responder is None:  # no responders (MPI without THREAD_MULTIPLE): this rank's view only
        return states, sorted(set(range(MPI.COMM_WORLD.Get_size())) - {me})
    comm = _responder.comm
    size = comm.Get_size()
    sends = [comm.isend(me, dest=r, tag=_TAG_ASK) for r in range(size) if r != me]
    deadline = time.monotonic() + wait_s
    while len(states) < size and time.monotonic() < deadline:
        msg = comm.improbe(source=MPI.ANY_SOURCE, tag=_TAG_STATE)
        if msg is None:
            time.sleep(0.01)
            continue
        status = MPI.Status()
        data = msg.recv(status=status)
        states[status.Get_source()] = data
    _inflight.extend(s for s in sends if not s.Test())  # their buffers must outlive them
    return states, sorted(set(range(size)) - set(states))


def build_report(group: GroupLog, rec: OpRecord, timeout_s: float, states: Dict[int, Dict[str, Any]],
                 silent: List[int]) -> Dict[str, Any]:
    """Who never entered ``rec.seq`` of ``group``, who is inside it, and every rank's stack."""
    never, inside, done, per_rank = [], [], [], {}
    for r in group.ranks:
        if r not in states:
            continue
        g = states[r]["groups"].get(group.name, {"ops": []})
        ops = g["ops"]
        last = ops[-1] if ops else None
        this = next((o for o in ops if o["seq"] == rec.seq), None)
        if this is None:
            never.append(r)
        elif this["finished"] is None:
            inside.append(r)
        else:
            done.append(r)
        per_rank[r] = {"host": states[r]["host"], "pid": states[r]["pid"],
                       "last_op": last and {k: last[k] for k in ("seq", "op", "dtype", "shape", "root", "finished")},
                       "last_op_age_s": last and round(states[r]["time"] - (last["finished"] or last["started"]), 3),
                       "main_stack": states[r]["stacks"].get("main", []),
                       "stacks": states[r]["stacks"]}
    return {"kind": "hpcsync hang report", "group": group.name, "group_ranks": group.ranks,
            "operation": asdict(rec), "timeout_s": timeout_s, "never_entered": never, "inside": inside,
            "finished": done, "no_reply": [r for r in silent if r in group.ranks],
            "timed_out_ranks": sorted(r for r, s in states.items()
                                      if s["groups"].get(group.name, {}).get("timed_out") == rec.seq),
            "ranks": per_rank}


def format_report(rep: Dict[str, Any]) -> str:
    op = rep["operation"]
    desc = OpRecord(**{k: op[k] for k in ("seq", "op", "dtype", "shape", "root", "started")}).describe()

    def names(rs: List[int]) -> str:
        return ", ".join(str(r) for r in rs) or "none"

    lines = [f"[hpcsync] HANG REPORT: {desc} in group {rep['group']!r} (ranks {names(rep['group_ranks'])}) "
             f"did not complete within {rep['timeout_s']:g} s",
             f"  never entered #{op['seq']}: rank(s) {names(rep['never_entered'])}"]
    for r in rep["never_entered"]:
        info = rep["ranks"][r]
        last = info["last_op"]
        lines.append(f"    rank {r} ({info['host']}): last operation "
                     + (f"{last['op']} #{last['seq']} ({'finished' if last['finished'] else 'running'} "
                        f"{info['last_op_age_s']:.1f} s ago)" if last else "none in this group"))
    lines.append(f"  inside #{op['seq']}: rank(s) {names(rep['inside'])}")
    if rep["finished"]:
        lines.append(f"  finished #{op['seq']}: rank(s) {names(rep['finished'])}")
    if rep["no_reply"]:
        lines.append(f"  no reply: rank(s) {names(rep['no_reply'])} (dead, or stuck in C code holding the GIL)")
    for r in rep["never_entered"] + [r for r in rep["ranks"] if r not in rep["never_entered"]]:
        lines.append(f"  rank {r} main thread (innermost frames of the program; full stacks in the JSON):")
        lines.extend("    " + ln.replace("\n", "\n    ") for ln in user_frames(rep["ranks"][r]["main_stack"]))
    return "\n".join(lines)


_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(__file__)) + os.sep, f"{os.sep}torch{os.sep}")


def user_frames(stack: List[str], keep: int = 3) -> List[str]:
    """The innermost frames outside hpcsync and torch: where the program is, not how it waits."""
    mine = [f for f in stack if not any(d in f.split("\n")[0] for d in _LIBRARY_DIRS)]
    return (mine or stack)[-keep:]


def write_report(rep: Dict[str, Any]) -> str:
    folder = os.environ.get("HPCSYNC_REPORT_DIR") or os.getcwd()
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("OMPI_MCA_orte_ess_jobid") or str(os.getpid())
    path = os.path.join(folder, f"hpcsync-hang-{job}-{int(time.time())}.json")
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(rep, f, indent=1, default=str)
    return path


def report_timeout(group: GroupLog, rec: OpRecord, timeout_s: float) -> Optional[str]:
    """Called by the rank whose wait timed out: gather, print (lowest timed-out rank), abort.

    Returns the report text when this rank printed it. Aborts the job unless the abort hook is
    off (``HPCSYNC_ABORT_ON_EXCEPTION=0`` / ``init(abort_on_exception=False)``).
    """
    group.timed_out = rec.seq
    states, silent = collect()
    rep = build_report(group, rec, timeout_s, states, silent)
    me = _mpi.MPI().COMM_WORLD.Get_rank()
    printer = min(rep["timed_out_ranks"] or [me])
    comm = _responder.comm if _responder is not None else None
    if printer != me and comm is not None:
        # let the printing rank finish before this one raises (an uncaught error here aborts the job)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and comm.iprobe(source=printer, tag=_TAG_DONE) is False:
            time.sleep(0.05)
        return None
    text = format_report(rep)
    try:
        path = write_report(rep)
        text += f"\n[hpcsync] report written to {path}"
    except OSError as exc:
        text += f"\n[hpcsync] could not write the JSON report: {exc}"
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
    if comm is not None:  # every rank that may be waiting for this report (some time out just after)
        for r in group.ranks:
            if r != me:
                _inflight.append(comm.isend(None, dest=r, tag=_TAG_DONE))
    if _abort_enabled():
        sys.stderr.write(f"[hpcsync] rank {me}: calling MPI_Abort to end the stuck job "
                         "(HPCSYNC_ABORT_ON_EXCEPTION=0 to raise instead)\n")
        sys.stderr.flush()
        time.sleep(1.0)  # let the launcher forward the report before the abort tears its pipes down
        _mpi.MPI().COMM_WORLD.Abort(1)
    return text


def _abort_enabled() -> bool:
    if os.environ.get("HPCSYNC_ABORT_ON_EXCEPTION", "1") == "0":
        return False
    from . import bootstrap

    return bool(bootstrap._state.get("abort", True))
