"""What every rank was doing when a collective timed out: a flight recorder and a hang report.

Each process keeps, per process group, a ring buffer of its last operations (sequence number,
op, dtype, shape, root, when it started, whether it finished). Each process answers questions
about them on its responder thread (:mod:`hpcsync.observe.responder`). When an operation passes
its timeout, one rank (a lower rank inside the same operation, if one answers) asks every rank
for a small digest (its state in that operation, its last operation, its innermost program
frames) through a tree of relays (:mod:`hpcsync.observe.relay`: O(log N) hops, no rank handling
more than a few dozen messages), groups ranks with equal digests into rank ranges with their nodes,
asks one rank per group for its full stacks (like ``faulthandler``, but sent back over MPI), and
prints one report -- which ranks never entered operation #N and what they did last, which are
inside it, which did not answer and on which nodes -- to stderr, and as JSON to
the report folder (:func:`hpcsync.observe.failure.report_dir`: ``$HPCSYNC_REPORT_DIR``, else
``$HPCSYNC_LOG_DIR``, else no file). Its size grows with the number of
distinct groups, not with the number of ranks.
"""
from __future__ import annotations

import itertools
import os
import sys
import sysconfig
import threading
import time
import traceback
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

from ..core import deadlines, mpi, jobend, nodemap
from . import failure, flight, relay
from .responder import ANSWERS, ask, ask_each, notify_done, responder, wait_done

__all__ = [
    "RING", "OpRecord", "GroupLog", "group_log", "drop_group_log", "snapshot", "digest", "FLIGHT_CACHE_S", "SKEW_S",
    "report_bound", "mark_failed", "failure_state", "flush_before_abort", "collect", "MAX_GROUPS",
    "build_report", "format_report", "LIBRARY_DIRS", "AT_EXIT", "main_frames", "user_frames", "write_report",
    "report_timeout", "report_p2p_timeout", "unkept_line", "hang_reported"
]

RING = 64  # operations kept per group


@dataclass(**({"slots": True} if sys.version_info >= (3, 10) else {}))  # half the cost of making one
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
    timeout_s: float = 0.0  # a per-call timeout (the op's options), when it has one

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
    p2p: Deque[OpRecord] = field(default_factory=lambda: deque(maxlen=RING))  # sends/receives, own numbering
    seq: int = 0
    p2p_seq: int = 0
    timed_out: Optional[int] = None  # seq of the operation that timed out here

    def start(self, op: str, dtype: str, shape: Tuple[int, ...], root: int) -> OpRecord:
        self.seq += 1
        rec = OpRecord(self.seq, op, dtype, shape, root, time.time())
        self.ops.append(rec)
        return rec

    def start_p2p(self, op: str, dtype: str, shape: Tuple[int, ...], peer: int) -> OpRecord:
        """A send or receive: numbered apart from the collectives (ranks make different ones)."""
        self.p2p_seq += 1
        rec = OpRecord(self.p2p_seq, op, dtype, shape, peer, time.time())
        self.p2p.append(rec)
        return rec


_logs: Dict[int, GroupLog] = {}
_lock = threading.Lock()


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
    """This rank's records and stacks, as plain data (what a group's representative sends)."""
    world = mpi.MPI().COMM_WORLD
    with _lock:
        groups = {log.name: {"ranks": log.ranks, "timed_out": log.timed_out, "ops": [asdict(r) for r in log.ops],
                             "p2p": [asdict(r) for r in log.p2p]} for log in _logs.values()}
    return {"rank": world.Get_rank(), "host": os.uname().nodename, "pid": os.getpid(), "time": time.time(),
            "groups": groups, "stacks": _stacks(), "flight_recorder": [flight.describe(e) for e in flight.entries()[-32:]]}


def digest(group: str, seq: int) -> Dict[str, Any]:
    """This rank's state for operation ``seq`` of ``group`` in a few hundred bytes: what every
    rank sends, so a report gathers O(ranks) small records, not every rank's stacks."""
    with _lock:
        log = next((g for g in _logs.values() if g.name == group), None)
        ops = list(log.ops) if log is not None else []
        timed_out = log is not None and log.timed_out == seq
    me = {"rank": mpi.MPI().COMM_WORLD.Get_rank(), "pid": os.getpid(), "timed_out": timed_out,
          "frames": main_frames(), "gathering": group in _gathering,
          "reporting": _failed or (log is not None and log.timed_out is not None),  # a hang of this group, any operation
          "stuck": _failed or any(g.timed_out is not None for g in _logs.values())}  # a wait of its own timed out
    if log is None:  # a gloo or NCCL group: torch's flight recorder knows where this rank is
        fr = _flight_state(group, seq)
        return {**me, "state": fr["state"], "last": fr["last"], "timed_out": fr["state"] == "inside" and _failed}
    this = next((o for o in ops if o.seq == seq), None)
    # an operation that failed here (not by timing out: that rank is still inside and reports)
    # is over for this rank: counted as inside, a report deferred to it would never be printed
    state = ("never" if this is None else "finished" if this.finished is not None
             else "failed" if this.error is not None and this.error != "timed out" else "inside")
    last = ops[-1] if ops else None
    return {**me, "state": state,
            "last": last and {"seq": last.seq, "op": f"{last.op} #{last.seq}", "finished": last.finished is not None,
                              "age_s": round(time.time() - (last.finished or last.started), 1)}}


FLIGHT_CACHE_S = 1.0
_flight_cache: Dict[Tuple[str, int], Tuple[float, Dict[str, Any]]] = {}


def _flight_state(group: str, seq: int) -> Dict[str, Any]:
    """:func:`hpcsync.observe.flight.group_state`, read once per :data:`FLIGHT_CACHE_S` for one
    operation: reading torch's recorder copies its whole ring (2,000 entries: ~25 ms, measured),
    and rank 0 is asked the same question by every timed-out rank at once (38 answers a second
    without this, 1,210 with it, measured: docs/timeouts.md)."""
    now = time.monotonic()
    with _lock:
        hit = _flight_cache.get((group, seq))
    if hit is not None and now - hit[0] < FLIGHT_CACHE_S:
        return hit[1]
    state = flight.group_state(group, seq)
    with _lock:
        _flight_cache.clear()  # one operation at a time is asked about
        _flight_cache[(group, seq)] = (now, state)
    return state


_gathering: set = set()  # the groups this rank gathers a hang report for: another gatherer defers to the lowest
SKEW_S = 2.0  # a rank defers to one inside the same operation for at most this long less than itself


def report_bound() -> float:
    """Seconds from a rank's timeout to the end of the hang report it is part of: settling who
    prints, the gathering, the stacks and printing, 30 s at least, growing with the job's depth
    of relays (log N): :attr:`hpcsync.core.deadlines.Deadlines.report_bound_s`."""
    return deadlines.current().report_bound_s


_hang_reported = False  # report_timeout ran in this process
_failed = False  # this rank's gloo/NCCL collective failed (its uncaught error is being reported)


def mark_failed() -> None:
    """This rank's own gloo or NCCL collective raised: it counts among the timed-out ranks."""
    global _failed
    _failed = True


def failure_state() -> Dict[str, Any]:
    """This rank's uncaught exception, or where its main thread is: what a failure report asks."""
    mine = failure.raised_state()  # no traceback: a few hundred bytes a rank
    return {"rank": mpi.MPI().COMM_WORLD.Get_rank(), "failed": bool(mine), "step": failure.current_step(),
            "step_words": failure.step_words(), "frames": main_frames(keep=1), **mine}


# What a responder answers for the reports: question kind -> function(asking rank, *arguments)
ANSWERS.update({
    "digest": lambda _asker, group, seq: digest(group, seq),
    "snapshot": lambda _asker: snapshot(),
    "failed": lambda _asker: False,  # (hpcsync.observe.digest answers once imported: it goes for a report)
    "failure": lambda _asker: failure_state(),
    "flush": lambda _asker: jobend.run_before_abort() or True,
})


def flush_before_abort(wait_s: float = 1.0) -> None:
    """Before this rank aborts the job: rank 0 prints what it holds back (the warnings of
    :mod:`hpcsync.observe.logs`), answering within ``wait_s``."""
    if responder() is not None and mpi.MPI().COMM_WORLD.Get_rank() != 0:
        ask([0], ("flush",), wait_s)
    jobend.run_before_abort()


def collect(group: GroupLog, seq: int, wait_s: Optional[float] = None
            ) -> Tuple[Dict[int, Dict[str, Any]], List[int], List[int]]:
    """Every rank's :func:`digest` of operation ``seq`` (through the relays of
    :mod:`hpcsync.observe.relay`, within ``wait_s``: by default their bound for this job's size),
    the ranks asked that did not answer in time, and those never reached (behind relays silent
    in every round: not known to be silent)."""
    MPI = mpi.MPI()
    me = MPI.COMM_WORLD.Get_rank()
    states = {me: digest(group.name, seq)}
    size = MPI.COMM_WORLD.Get_size()
    if responder() is None:  # no responders (MPI without THREAD_MULTIPLE): this rank's view only
        return states, sorted(set(range(size)) - {me}), []
    got = relay.ask_all(range(size), ("digest", group.name, seq), wait_s)
    states.update(got.answers)
    unreached = sorted(got.unreached)
    return states, sorted(set(range(size)) - set(states) - set(unreached)), unreached


MAX_GROUPS = 12  # rank groups printed (and sent in full) per report; the rest are counted


def build_report(group: GroupLog, rec: OpRecord, timeout_s: float, states: Dict[int, Dict[str, Any]],
                 silent: List[int], full: Optional[Dict[int, Dict[str, Any]]] = None,
                 unreached: Sequence[int] = ()) -> Dict[str, Any]:
    """Who never entered ``rec.seq`` of ``group``, who is inside it, who finished, who is silent;
    ranks with the same state, last operation and program frames form one group (rank ranges and
    nodes, in the manner of torch's flight-recorder analyzer), so the size does not grow with ranks."""
    nodes = nodemap.current()
    host = nodes.host if nodes is not None else (lambda r: "?")
    by: Dict[Any, List[int]] = {}
    for r in group.ranks:
        d = states.get(r)
        if d is None:
            continue
        last = d["last"] or {}
        key = (d["state"], last.get("op"), last.get("finished"), tuple(d["frames"]))
        by.setdefault(key, []).append(r)
    order = {"never": 0, "inside": 1, "finished": 2, "failed": 3}
    groups = []
    for (state, last_op, finished, frames), rs in sorted(by.items(), key=lambda kv: (order[kv[0][0]], kv[1][0])):
        ages = [states[r]["last"]["age_s"] for r in rs if states[r]["last"]]
        rep = rs[0]
        groups.append({"state": state, "ranks": nodemap.ranges(rs), "rank_list": rs,
                       "nodes": nodes.nodes(rs) if nodes is not None else [],
                       "last_op": last_op, "last_finished": finished,
                       "age_s": [min(ages), max(ages)] if ages else None, "frames": list(frames),
                       "representative": rep, "pid": states[rep]["pid"],
                       "stacks": (full or {}).get(rep, {}).get("stacks")})

    def where(rs: List[int]) -> Dict[str, str]:
        return {h: nodemap.ranges(v) for h, v in (nodes.by_node(rs).items() if nodes is not None else [])}

    pick = {k: [r for r in group.ranks if states.get(r, {}).get("state") == k] for k in order}
    no_reply = [r for r in silent if r in group.ranks]
    return {"kind": "hpcsync hang report", "group": group.name, "group_ranks": nodemap.ranges(group.ranks),
            "operation": asdict(rec), "timeout_s": timeout_s, "never_entered": pick["never"],
            "inside": pick["inside"], "finished": pick["finished"], "failed": pick["failed"], "no_reply": no_reply,
            "no_reply_nodes": where(no_reply), "never_entered_nodes": where(pick["never"]),
            "timed_out_ranks": sorted(r for r, d in states.items() if d["timed_out"]),
            "stuck_ranks": sorted(r for r, d in states.items() if d.get("stuck") or d["timed_out"]),
            "unreached": [r for r in unreached if r in group.ranks],
            "groups": groups, "hosts": {str(r): host(r) for r in (no_reply + pick["never"])[:256]}}


def _indented(frames: List[str]) -> List[str]:
    """Program frames as report lines, each (and its source line) indented under its rank."""
    return ["    " + ln.replace("\n", "\n    ") for ln in frames]


def format_report(rep: Dict[str, Any]) -> str:
    """The report for people: a few lines per group of ranks, whatever the number of ranks."""
    op = rep["operation"]
    desc = OpRecord(**{k: op[k] for k in ("seq", "op", "dtype", "shape", "root", "started")}).describe()
    names = nodemap.describe  # ranges with their nodes ("none" when empty)
    lines = [f"[hpcsync] HANG REPORT: {desc} in group {rep['group']!r} (ranks {rep['group_ranks']}) "
             f"did not complete within {rep['timeout_s']:g} s",
             f"  never entered #{op['seq']}: rank(s) {names(rep['never_entered'])}",
             f"  inside #{op['seq']}: rank(s) {names(rep['inside'])}"]
    if rep["finished"]:
        lines.append(f"  finished #{op['seq']}: rank(s) {names(rep['finished'])}")
    if rep.get("failed"):
        lines.append(f"  failed in #{op['seq']} with an error of its own: rank(s) {names(rep['failed'])}")
    if rep["no_reply"]:
        lines.append(f"  no reply: rank(s) {names(rep['no_reply'])} (node lost, process dead or frozen, "
                     "or stuck in C code holding the GIL)")
    if rep.get("unreached"):
        lines.append(f"  not reached: rank(s) {names(rep['unreached'])} (behind relays that did not answer; "
                     "not known to be silent)")
    for g in rep["groups"][:MAX_GROUPS]:
        rs = g["rank_list"]
        who = f"rank {rs[0]}" if len(rs) == 1 else f"ranks {g['ranks']}"
        where = ", ".join(g["nodes"][:4]) + (f" +{len(g['nodes']) - 4} nodes" if len(g["nodes"]) > 4 else "")
        age = g["age_s"] and (f"{g['age_s'][0]:.1f} s" if g["age_s"][0] == g["age_s"][1]
                              else f"{g['age_s'][0]:.1f}-{g['age_s'][1]:.1f} s")
        last = (f"{g['last_op']} ({'finished' if g['last_finished'] else 'running'} {age} ago)"
                if g["last_op"] else "none in this group")
        lines.append(f"  {who} ({where or '?'}): last operation {last}; main thread (innermost frames "
                     "of the program):")
        lines.extend(_indented(g["frames"]))
    if len(rep["groups"]) > MAX_GROUPS:
        lines.append(f"  ... {len(rep['groups']) - MAX_GROUPS} more group(s) of ranks in the JSON")
    return "\n".join(lines)


# hpcsync's own package (all of it: the backend's frames are where a waiting rank is, not where
# its program is), torch's and Python's own library (contextlib's __exit__ is no program's line)
LIBRARY_DIRS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep, f"{os.sep}torch{os.sep}",
                os.path.join(sysconfig.get_paths()["stdlib"], ""))


AT_EXIT = "(the program has returned: hpcsync's exit waits here for the other ranks)"


def main_frames(keep: int = 3) -> List[str]:
    """Where the main thread is in the program: its innermost frames outside hpcsync and torch;
    where it raised, while its uncaught exception is being reported; a note once it returned."""
    raised = failure.raised().get("frames")
    if raised:
        return raised[-keep:]
    main = sys._current_frames().get(threading.main_thread().ident)
    stack = [ln.rstrip("\n") for ln in traceback.format_stack(main)] if main is not None else []
    if any(", in _run_exit\n" in ln for ln in stack):
        return [AT_EXIT]
    return user_frames(stack, keep)


def user_frames(stack: List[str], keep: int = 3) -> List[str]:
    """The innermost frames outside hpcsync and torch: where the program is, not how it waits."""
    mine = [f for f in stack if not any(d in f.split("\n")[0] for d in LIBRARY_DIRS)]
    return (mine or stack)[-keep:]


_written = itertools.count()  # this process's reports, for names no other report takes


def write_report(rep: Dict[str, Any]) -> Optional[str]:
    """Write the JSON report whole or not at all (a temporary file, renamed) under a name no other
    report takes: the job, the second, the rank, the process and a count, so two reports in one
    second (a group's and a send's, two jobs' ranks in one folder) neither overwrite nor tear each
    other. None where no folder is set (:func:`hpcsync.observe.failure.report_dir`); raises
    OSError when it cannot."""
    folder = failure.report_dir()
    if folder is None:
        return None
    rank = mpi.MPI().COMM_WORLD.Get_rank() if mpi.already_initialized() else -1
    name = f"hpcsync-hang-{failure.job_id()}-{int(time.time())}-r{rank}-{os.getpid()}-{next(_written)}.json"
    path = os.path.join(folder, name)
    failure.write_whole(path, rep)
    return path


def report_timeout(group: GroupLog, rec: OpRecord, timeout_s: float) -> Optional[str]:
    """Called by the rank whose wait timed out: gather, print (lowest timed-out rank), abort.

    Returns the report text when this rank printed it. Aborts the job unless the abort hook is
    off (``HPCSYNC_ABORT_ON_EXCEPTION=0`` / ``init(abort_on_exception=False)``).
    """
    global _hang_reported
    group.timed_out = rec.seq
    _hang_reported = True
    me = mpi.MPI().COMM_WORLD.Get_rank()
    about = group.name  # one report for a group's hang, whichever of its operations a rank is stuck in
    peers = responder()  # None: no responder threads
    printer = _printer_before(group, rec, me) if peers is not None else None
    if printer is not None:  # a rank inside the same operation gathers and prints (or one it defers to)
        waited = report_bound() - deadlines.PRINT_S  # the job's wait_s: before this process's own end
        if not wait_done(None, waited, about):
            failure.note_unreported(f"{rec.describe()} in group {group.name!r}", waited)
        return None
    _gathering.add(group.name)
    states, silent, unreached = collect(group, rec.seq)
    rep = build_report(group, rec, timeout_s, states, silent, unreached=unreached)
    printer = min([r for r, d in states.items() if d.get("gathering")] or [me])  # two gatherers: the lower prints
    if printer != me and wait_done(printer, deadlines.current().gather_s + deadlines.PRINT_S, about):
        return None  # (without its word in time, this rank prints its own)
    if peers is not None:  # full stacks from one rank of each group, for the JSON
        reps = [g["representative"] for g in rep["groups"][:MAX_GROUPS]]
        full = ask([r for r in reps if r != me], ("snapshot",), deadlines.current().tracebacks_s)
        full[me] = snapshot()
        rep = build_report(group, rec, timeout_s, states, silent, full, unreached)
    text = format_report(rep)
    failure.note_hang(rep, reached=states)
    try:
        path = write_report(rep)
        text += f"\n[hpcsync] report written to {path}" if path else unkept_line("the hang report")
    except OSError as exc:
        text += f"\n[hpcsync] could not write the JSON report: {exc}"
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
    if peers is not None:  # every rank that may be waiting for this report (some time out just after)
        notify_done(group.ranks, about)
    if jobend.abort_on_error():
        sys.stderr.write(f"[hpcsync] rank {me}: calling MPI_Abort to end the stuck job "
                         "(HPCSYNC_ABORT_ON_EXCEPTION=0 to raise instead)\n")
        sys.stderr.flush()
        flush_before_abort()
        time.sleep(1.0)  # let the launcher forward the report before the abort tears its pipes down
        jobend.abort(1)
    return text


def report_p2p_timeout(group: GroupLog, rec: OpRecord, timeout_s: float) -> str:
    """A send or receive that did not complete within the timeout: this rank's report, with what
    its peer is doing (asked through the responders, bounded); printed, and written as JSON."""
    me = mpi.MPI().COMM_WORLD.Get_rank()
    peer = group.ranks[rec.root] if 0 <= rec.root < len(group.ranks) else None
    wait_s = deadlines.current().tracebacks_s
    answer = ask([peer], ("digest", group.name, group.seq), wait_s).get(peer) if peer is not None and responder() else None
    names = nodemap.describe
    toward = "to" if rec.op.startswith("send") else "from"
    lines = [f"[hpcsync] HANG REPORT: {rec.op} {toward} rank {names([peer]) if peer is not None else 'any'} "
             f"({rec.dtype}{list(rec.shape)}) in group {group.name!r} on rank {names([me])} did not complete "
             f"within {timeout_s:g} s"]
    mine = digest(group.name, group.seq)
    lines.append(f"  rank {me}: main thread (innermost frames of the program):")
    lines.extend(_indented(mine["frames"]))
    if answer is not None:
        last = answer["last"]
        lines.append(f"  rank {peer}: last operation {last['op'] if last else 'none'} in this group; main thread:")
        lines.extend(_indented(answer["frames"]))
    elif peer is not None:
        lines.append(f"  rank {peer}: no reply (node lost, process dead or frozen)")
    text = "\n".join(lines)
    failure.note_p2p_hang(peer, answer is not None, lines[0].replace("[hpcsync] HANG REPORT: ", ""))
    try:
        path = write_report({"kind": "hpcsync p2p hang report", "group": group.name, "operation": asdict(rec),
                             "rank": me, "peer": peer, "timeout_s": timeout_s, "peer_state": answer,
                             "frames": mine["frames"]})
        text += f"\n[hpcsync] report written to {path}" if path else unkept_line("the hang report")
    except OSError as exc:
        text += f"\n[hpcsync] could not write the JSON report: {exc}"
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
    return text


def unkept_line(what: str) -> str:
    """:func:`hpcsync.observe.failure.unkept` as a report's last line ("" once said, or where a
    folder keeps the reports)."""
    note = failure.unkept(what)
    return f"\n[hpcsync] {note}" if note else ""


def _printer_before(group: GroupLog, rec: OpRecord, me: int, tries: int = 3) -> Optional[int]:
    """The rank this one leaves the report to, always one before it in the group (no two ranks
    wait for each other): the lowest rank of this node before it that is inside operation
    ``rec.seq`` too (asked at once, the job's ``node_mates_s``: it times out as well, and reports or leaves the report
    to others in turn); when there is none, the lowest such rank on the group's first ``tries``
    nodes (asked at once, as long). So one rank a node looks beyond its node, and rank 0's node
    answers about one question per node, not one per rank; a first rank that is late or lost
    hands its part to the next rank of its node, not to every rank. A rank that already reports a
    hang of this group (a later operation of it) counts as inside: ranks stuck one operation
    apart, as a frozen rank leaves its node's peers, make one report, not two. A rank that
    entered the operation more than :data:`SKEW_S` after this one would time out too late to
    report within :func:`report_bound`: it is passed over."""
    nodes = nodemap.current()
    job = deadlines.current()
    mine = time.time() - rec.started if rec.started else None
    order = {r: i for i, r in enumerate(group.ranks)}
    where = (lambda r: nodes.node_of[r] if 0 <= r < len(nodes.node_of) else -1 - r) if nodes is not None \
        else (lambda r: -1 - r)  # without a node map, every rank a node of its own
    before = [r for r in group.ranks if order[r] < order.get(me, -1)]

    def good(answer: Optional[Dict[str, Any]]) -> bool:
        if answer is None:
            return False
        if answer.get("reporting") and answer["state"] != "inside":
            return True
        age = (answer.get("last") or {}).get("age_s")
        return answer["state"] == "inside" and (mine is None or age is None or age >= mine - SKEW_S)

    def first_good(ranks: List[int]) -> Optional[int]:
        answers = ask_each({r: ("digest", group.name, rec.seq) for r in ranks}, job.node_mates_s) if ranks else {}
        return next((r for r in ranks if good(answers.get(r))), None)

    here = first_good([r for r in before if where(r) == where(me)])
    if here is not None:
        return here
    first_nodes: List[int] = []
    for r in group.ranks:  # the group's first nodes, in the group's order
        if where(r) not in first_nodes:
            first_nodes.append(where(r))
        if len(first_nodes) == tries:
            break
    return first_good([r for r in before if where(r) in first_nodes and where(r) != where(me)])


def hang_reported() -> bool:
    """A hang report of this process's ran (printed here or by the rank this one waited for)."""
    return _hang_reported
