"""One failure report for a job of many ranks: the rank that failed first, once, at the top.

When a rank raises, the abort hook (:func:`hpcsync.install_abort_hook`) hands the exception here
instead of printing it. A rank whose node holds a lower rank that goes for this report too
leaves it to that rank; the lowest such rank of each node claims the report from an arbiter,
rank 0 (when it does not answer, the first rank of the second node, then of the third): the
first claim wins, and prints. So rank 0 answers about one claim per node, not one per rank, and
a rank 0 that is frozen or gone still gives one report. The winner asks every rank what it is
doing through relays (bounded: a rank that does not answer within
:func:`hpcsync.observe.relay.job_budget` is said to be silent), and prints one block: the
earliest raise among the answers (a claim may reach rank 0 after its own, later one) with its
traceback, node and step, then the other ranks in a few lines, grouped by what they do (still
running at a line, or failed too with an error line), so 64 ranks that fail alike are one line.
A rank that lost the claim, or left it to a node-mate, prints nothing to the console (its
traceback goes to its log file, :mod:`hpcsync.observe.logs`, and to the JSON report), waits for
whichever rank prints, and the job ends. Without MPI, one rank, or no responder threads (below
``THREAD_MULTIPLE``), the rank prints its own traceback as before.

A gloo or NCCL collective that timed out or lost its peer is not the program's error: it is
reported like a stuck collective of hpcsync's own backend (:func:`hpcsync.observe.watchdog.report_timeout`),
from torch's flight recorder (:mod:`hpcsync.observe.flight`): which ranks are inside it, which never
entered it, where each one is, with nodes.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import traceback
from typing import Any, Dict, List, Optional

from ..core import mpi, nodemap, settings
from ..core.errors import SetupError
from . import failure, flight, logs, relay, responder, watchdog

__all__ = [
    "CLAIM_WAIT_S", "LOCAL_WAIT_S", "ARBITERS", "DONE_WAIT_S", "MAX_LINES", "report", "arbiters", "build",
    "format_block"
]

log = logging.getLogger(__name__)

CLAIM_WAIT_S = 2.0  # for an arbiter's answer to a claim (none: the next arbiter; none of them: this rank reports)
LOCAL_WAIT_S = 1.0  # for the answers of this node's lower ranks (has it failed too?)
ARBITERS = 3  # the first rank of each of the job's first nodes, asked in turn
DONE_WAIT_S = 15.0  # and the gathering's bound: a rank that lost the claim waits this long for the report
MAX_LINES = 12  # groups of other ranks printed; the rest are counted

_claiming = False  # this rank goes for the failure report (not a hang report's path): see report()
responder.ANSWERS["failed"] = lambda _asker: _claiming  # does this rank go for the failure report?

def _where(tb: Any) -> str:
    """``file:line`` of the innermost frame of the program in a traceback."""
    frames = traceback.extract_tb(tb)
    mine = [f for f in frames if not any(d in f.filename for d in watchdog.LIBRARY_DIRS)] or frames
    return f"{mine[-1].filename}:{mine[-1].lineno}" if mine else "?"


def _frames(tb: Any) -> List[str]:
    """The traceback's innermost frames of the program, as the hang report prints frames."""
    return watchdog.user_frames([ln.rstrip("\n") for ln in traceback.format_tb(tb)])


def report(exc_type: Any, exc: BaseException, tb: Any) -> Optional[bool]:
    """Report this rank's uncaught exception as the module says: True when this rank printed the
    report, False when another rank did; None when it could not (no MPI, one rank, no
    responders): the caller prints the traceback itself."""
    if not mpi.use_mpi() or responder.responder() is None or mpi.MPI().COMM_WORLD.Get_size() < 2:
        return None
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    line = f"{exc_type.__name__}: {exc}".splitlines()[0] if str(exc) else exc_type.__name__
    failure.note_raised(line, _where(tb), _frames(tb), text,
                        plain=f"{exc_type.__name__}: {exc}" if isinstance(exc, SetupError) else None)
    logs.to_file(logging.ERROR, f"uncaught exception on this rank:\n{text}")
    if watchdog.hang_reported():  # a hang report of this job's stands for this error
        return False
    if failure.peer_gone(exc) and _in_torch_distributed(tb):
        printed = _collective_report()
        if printed is not None:
            return printed
    global _claiming
    me, size = mpi.MPI().COMM_WORLD.Get_rank(), mpi.MPI().COMM_WORLD.Get_size()
    _claiming = True  # from here this rank's answer to "failed" is yes: it prints this report or waits for it
    lower = _failed_before(me)
    if lower is not None:  # it reports, or leaves the report to the winner: whichever prints
        waited = DONE_WAIT_S + relay.job_budget() + LOCAL_WAIT_S + ARBITERS * CLAIM_WAIT_S
        return False if responder.wait_done(None, waited) else None
    winner = _claim(me, size)
    if winner != me:  # its report (or another arbiter's winner's) stands for this error; without it,
        return False if responder.wait_done(None, DONE_WAIT_S + relay.job_budget()) else None  # own traceback
    got = relay.ask_all(range(size), ("failure",))
    states = got.answers
    states[me] = watchdog.failure_state()
    rep = build(me, states, size)
    block = format_block(rep, text)
    path = _write(rep)
    silent = [r for r in rep["silent"] if r not in got.unreached]
    if silent and failure.peer_gone(exc):  # a wait that timed out for ranks that answer nobody: their nodes
        failure.note_silent(silent, sorted(states), line)
    sys.stderr.write(block + (f"\n[hpcsync] failure report written to {path}" if path else
                              watchdog.unkept_line("the failure report")) + "\n")
    sys.stderr.flush()
    responder.notify_done(list(range(size)))
    return True


def _failed_before(me: int) -> Optional[int]:
    """The lowest rank of this node before this one that failed too and goes for this report
    (asked at once, bounded by :data:`LOCAL_WAIT_S`; a rank that does not answer is passed
    over), or None. A rank whose error became a hang report (a collective's) says no: the
    failure report's words never come from it."""
    nodes = nodemap.current()
    if nodes is None or not 0 <= me < len(nodes.node_of):
        return None
    here = [r for r in range(me) if nodes.node_of[r] == nodes.node_of[me]]
    answers = responder.ask(here, ("failed",), LOCAL_WAIT_S) if here else {}
    return next((r for r in here if answers.get(r)), None)


def arbiters(size: int) -> List[int]:
    """The ranks that settle who prints, asked in turn: the first rank of each of the job's first
    :data:`ARBITERS` nodes (without a node map, the first ranks)."""
    nodes = nodemap.current()
    if nodes is None or len(nodes.node_of) != size:
        return list(range(min(ARBITERS, size)))
    first: Dict[int, int] = {}
    for r, k in enumerate(nodes.node_of):
        first.setdefault(k, r)
        if len(first) == ARBITERS:
            break
    return list(first.values())


def _claim(me: int, size: int) -> int:
    """The rank that prints: the first claim an arbiter heard (this rank's own claim where it is
    the arbiter). An arbiter that does not answer within :data:`CLAIM_WAIT_S` is passed over for
    the next; when none answers, this rank prints."""
    for arbiter in arbiters(size):
        if arbiter == me:
            return watchdog.claim(me)
        answer = responder.ask([arbiter], ("claim",), CLAIM_WAIT_S)
        if arbiter in answer:
            return answer[arbiter]
    return me


def build(me: int, states: Dict[int, Dict[str, Any]], size: int) -> Dict[str, Any]:
    """The report as plain data: the first failure, then the other ranks grouped by what they do.
    The first is the earliest raise among the gathered states, not the rank that won the claim
    (``me``, which prints): a claim can reach rank 0 after a later one of its own."""
    failed = [r for r, s in states.items() if s.get("failed")]
    head = min(failed, key=lambda r: (states[r]["time"], r)) if failed else me
    first = states[head]
    others: Dict[Any, List[int]] = {}
    for r, s in sorted(states.items()):
        if r == head:
            continue
        key = ("failed", s["error"], s["where"]) if s["failed"] else ("running", tuple(s.get("frames", [])))
        others.setdefault(key, []).append(r)
    groups = []
    for key, rs in sorted(others.items(), key=lambda kv: (kv[0][0] != "failed", kv[1][0])):
        g: Dict[str, Any] = {"state": key[0], "ranks": rs}
        if key[0] == "failed":
            g.update(error=key[1], where=key[2], after_s=round(min(states[r]["time"] for r in rs) - first["time"], 1))
        else:
            g.update(frames=list(key[1]))
        groups.append(g)
    silent = sorted(set(range(size)) - set(states))
    return {"kind": "hpcsync failure report", "rank": head, "node": _host(head), "reported_by": me, "step": first["step"],
            "step_words": first.get("step_words", ""), "error": first["error"], "where": first["where"], "time": first["time"], "traceback": first["traceback"],
            "plain": first.get("plain"),
            "others": groups, "silent": silent,
            "tracebacks": {str(r): s["traceback"] for r, s in states.items() if s["failed"] and r != head}}


def _host(rank: int) -> str:
    nodes = nodemap.current()
    return nodes.host(rank) if nodes is not None else "?"


def format_block(rep: Dict[str, Any], text: str) -> str:
    """The block for people: a header naming the first failure, its traceback, a line per group."""
    words = rep.get("step_words") or (f"at step {rep['step']}" if rep["step"] is not None else "")
    step = f", {words}" if words else ""
    head = f"[hpcsync] ===== uncaught exception on rank {rep['rank']} ({rep['node']}), the first to fail{step} ====="
    body = rep.get("traceback") or text
    if rep.get("plain") and not settings.debug():  # a plain user error: its words say what to change
        body = f"{rep['plain']}\n  at {rep['where']} (HPCSYNC_DEBUG=1 shows the traceback)"
    lines = [head, body.rstrip("\n")]
    if rep["others"] or rep["silent"]:
        lines.append("[hpcsync] the other ranks, when it was reported:")
    for g in rep["others"][:MAX_LINES]:
        who = _ranks(g["ranks"])
        if g["state"] == "failed" and g["error"] == rep["error"]:
            lines.append(f"  {who}: raised the same, {g['after_s']:+.1f} s ({g['where']})")
        elif g["state"] == "failed":
            lines.append(f"  {who}: raised too, {g['after_s']:+.1f} s: {g['error'][:200]} ({g['where']})")
        else:
            lines.append(f"  {who}: still running, at {_at(g['frames'][-1]) if g['frames'] else '?'}")
    if len(rep["others"]) > MAX_LINES:
        lines.append(f"  ... {len(rep['others']) - MAX_LINES} more group(s) of ranks in the JSON report")
    if rep["silent"]:
        lines.append(f"  {_ranks(rep['silent'])}: no answer within {relay.job_budget():g} s")
    lines.append("[hpcsync] " + "=" * (len(head) - 10))
    return "\n".join(lines)


def _ranks(ranks: List[int]) -> str:
    """``rank 3 on n1`` or ``ranks 0-2, 5 on n0, n1``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + nodemap.describe(ranks)


def _at(frame: str) -> str:
    """``File "train.py", line 88, in main`` + its source line -> ``train.py:88 (loss.backward())``."""
    m = re.match(r'\s*File "(.+)", line (\d+), in .+?\n\s*(.*)', frame, re.S)
    return f"{m[1]}:{m[2]} ({m[3].strip()})" if m else frame.strip()


def _write(rep: Dict[str, Any]) -> Optional[str]:
    """The JSON beside the failure records (only where a folder is set: failure.report_dir)."""
    folder = failure.report_dir()
    if not folder:
        return None
    return failure.write_json(os.path.join(folder, f"hpcsync-first-failure-{failure.job_id()}-r{rep['rank']}.json"),
                              rep, "failure report")


def _in_torch_distributed(tb: Any) -> bool:
    """The error came out of torch.distributed (a collective, DDP's reducer), not the program's
    own code that happens to say "timed out" (a data loader)."""
    marks = (f"{os.sep}torch{os.sep}distributed{os.sep}", f"{os.sep}torch{os.sep}nn{os.sep}parallel{os.sep}")
    return any(any(m in f.filename for m in marks) for f in traceback.extract_tb(tb))


def _collective_report() -> Optional[bool]:
    """A gloo/NCCL collective of this rank failed: the hang report from the flight recorder (True:
    this rank printed it). None when the recorder has no entry (the error came from elsewhere)."""
    entry = flight.latest()
    if entry is None:
        return None
    name = str(entry["process_group"][0])
    group = watchdog.GroupLog(f"{name}", flight.group_ranks(name))
    rec = watchdog.OpRecord(entry["collective_seq_id"], str(entry.get("profiling_name", "?")).split(":")[-1],
                            str((entry.get("input_dtypes") or ["-"])[0]), tuple((entry.get("input_sizes") or [[]])[0]),
                            -1, (entry.get("time_created_ns") or 0) / 1e9)
    watchdog.mark_failed()
    return watchdog.report_timeout(group, rec, (entry.get("timeout_ms") or 0) / 1000.0) is not None
