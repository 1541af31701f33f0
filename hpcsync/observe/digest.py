"""One failure report for a job of many ranks: the rank that failed first, once, at the top.

When a rank raises, the abort hook (:func:`hpcsync.install_abort_hook`) hands the exception here
instead of printing it. A rank whose node holds a lower rank that goes for this report too
leaves it to that rank (asked at once, :attr:`~hpcsync.core.deadlines.Deadlines.node_mates_s`);
the lowest such rank of each node settles who prints by a min-reduction along the tree of
relays (:func:`hpcsync.observe.relay.ask_all` with ``keep``: O(log N) rounds, each relay passing
up only the least claim of its share, no rank asked more than once a claimant): the least
claim wins, a rank already gathering before any that only claims, then the lowest rank
(:func:`settle`). A frozen rank 0 is one silent rank among others. The winner asks every rank
what it is doing through the relays (bounded: a rank that does not answer within
:attr:`~hpcsync.core.deadlines.Deadlines.gather_s` is said to be silent); of two that gather,
the lower prints. Each rank answers with its error line, its location and a hash of its
traceback (:func:`hpcsync.observe.watchdog.failure_state`: a few hundred bytes, not the 5-20 KB
of a traceback); the printer then asks one rank of each distinct error (by hash) for its whole
traceback. It prints one block: the earliest raise among the answers with its traceback, node
and step, then the other ranks in a few lines, grouped by error into rank ranges with their
nodes, so 64 ranks that fail alike are one line. When every rank that failed failed waiting on
a peer (a timeout, a peer gone: :func:`hpcsync.observe.failure.peer_gone`) and some rank gave no
answer, the silent rank heads the block: it is where a reader must look. A rank that lost, or
left the report to a node-mate, prints nothing to the console (its traceback goes to its log
file, :mod:`hpcsync.observe.logs`), waits for whichever rank prints, and the job ends. Without
MPI, one rank, or no responder threads (below ``THREAD_MULTIPLE``), the rank prints its own
traceback as before.

At 1,000 ranks on 125 nodes of 8 with every node failing: each rank answers one settling
question per failing node (125: 0.1 s at 1,210 answers a second), no rank sends more than 23
questions a round, each message a few dozen bytes; the gathering brings 1,000 states of ~300
bytes (300 KB) and at most 12 tracebacks; the report names the ranks in ranges whatever N.

A gloo or NCCL collective that timed out or lost its peer is not the program's error: it is
reported like a stuck collective of hpcsync's own backend (:func:`hpcsync.observe.watchdog.report_timeout`),
from torch's flight recorder (:mod:`hpcsync.observe.flight`): which ranks are inside it, which never
entered it, where each one is, with nodes.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import sys
import traceback
from typing import Any, Dict, List, Optional, Sequence

from ..core import deadlines, mpi, nodemap, settings
from ..core.errors import SetupError
from . import failure, flight, logs, relay, responder, watchdog

__all__ = ["MAX_LINES", "report", "traceback_hash", "claim_key", "settle", "pick", "build", "format_block"]

log = logging.getLogger(__name__)

MAX_LINES = 12  # groups of other ranks printed (and tracebacks asked for); the rest are counted

_claiming = False  # this rank goes for the failure report (not a hang report's path): see report()
_gathering = False  # ... and won the settling: it gathers
responder.ANSWERS["failed"] = lambda _asker: _claiming  # does this rank go for the failure report?
responder.ANSWERS["claimant"] = lambda _asker: 0 if _gathering else 1 if _claiming else None
responder.ANSWERS["traceback"] = lambda _asker: failure.raised().get("traceback", "")
responder.ANSWERS["failure"] = lambda _asker: {**watchdog.failure_state(), "gathering": _gathering}


def traceback_hash(exc_type: Any, tb: Any) -> str:
    """A hash of a traceback: the exception's type and every frame's file, line and function
    (not the message, whose numbers differ from rank to rank): one error, one hash."""
    where = "".join(f"{f.filename}:{f.lineno}:{f.name}\n" for f in traceback.extract_tb(tb))
    return hashlib.sha1(f"{getattr(exc_type, '__qualname__', exc_type)}\n{where}".encode()).hexdigest()[:16]


def claim_key(rank: int, answer: Any) -> Any:
    """A rank's claim, least first: one already gathering (0) before one that only claims (1),
    then the lower rank; None for a rank that does not go for the report."""
    return None if answer is None else (answer, rank)


relay.KEYS["claim"] = claim_key


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
                        plain=f"{exc_type.__name__}: {exc}" if isinstance(exc, SetupError) else None,
                        peer=failure.peer_gone(exc), digest=traceback_hash(exc_type, tb))
    logs.to_file(logging.ERROR, f"uncaught exception on this rank:\n{text}")
    if watchdog.hang_reported():  # a hang report of this job's stands for this error
        return False
    if failure.peer_gone(exc) and _in_torch_distributed(tb):
        printed = _collective_report()
        if printed is not None:
            return printed
    global _claiming, _gathering
    me, size = mpi.MPI().COMM_WORLD.Get_rank(), mpi.MPI().COMM_WORLD.Get_size()
    job = deadlines.current()
    _claiming = True  # from here this rank's answer to "failed" is yes: it prints this report or waits for it
    if _failed_before(me, job.node_mates_s) is not None or settle(me, size) != me:
        return False if responder.wait_done(None, job.wait_s) else None  # without the report: own traceback
    _gathering = True
    got = relay.ask_all(range(size), ("failure",))
    states = got.answers
    states[me] = {**watchdog.failure_state(), "gathering": True}
    printer = min([r for r, s in states.items() if s.get("gathering")] or [me])  # two gatherers: the lower prints
    if printer != me and responder.wait_done(printer, job.gather_s + deadlines.PRINT_S):
        return False
    rep = build(me, states, size, _tracebacks(states, me, job.tracebacks_s), got.unreached)
    block = format_block(rep, text, job.gather_s)
    path = _write(rep)
    silent = [r for r in rep["silent"] if r not in got.unreached]
    if silent and failure.peer_gone(exc):  # a wait that timed out for ranks that answer nobody: their nodes
        failure.note_silent(silent, sorted(states), line)
    sys.stderr.write(block + (f"\n[hpcsync] failure report written to {path}" if path else
                              watchdog.unkept_line("the failure report")) + "\n")
    sys.stderr.flush()
    responder.notify_done(list(range(size)))
    return True


def _failed_before(me: int, wait_s: float) -> Optional[int]:
    """The lowest rank of this node before this one that failed too and goes for this report
    (asked at once, within ``wait_s``; a rank that does not answer is passed over), or None. A
    rank whose error became a hang report (a collective's) says no: the failure report's words
    never come from it."""
    nodes = nodemap.current()
    if nodes is None or not 0 <= me < len(nodes.node_of):
        return None
    here = [r for r in range(me) if nodes.node_of[r] == nodes.node_of[me]]
    answers = responder.ask(here, ("failed",), wait_s) if here else {}
    return next((r for r in here if answers.get(r)), None)


def settle(me: int, size: int) -> int:
    """The rank that prints: the least claim (:func:`claim_key`) among every rank that answers,
    this one's own included, by a min-reduction along the relays (within the job's
    :attr:`~hpcsync.core.deadlines.Deadlines.settle_s`)."""
    return pick(me, relay.ask_all(range(size), ("claimant",), keep="claim").answers, _gathering)


def pick(me: int, answers: Dict[int, Any], gathering: bool = False) -> int:
    """The rule :func:`settle` applies to what the reduction brought (``{rank: claim}``), this
    rank (``me``, a claimant: gathering already or not) among them: the least claim's rank."""
    keyed = [(claim_key(r, a), r) for r, a in answers.items() if claim_key(r, a) is not None]
    return min(keyed + [(claim_key(me, 0 if gathering else 1), me)])[1]


def _tracebacks(states: Dict[int, Dict[str, Any]], me: int, wait_s: float) -> Dict[int, str]:
    """The whole traceback of one rank of each distinct error (by its hash), the earliest of
    each, at most :data:`MAX_LINES` + 1 asked at once within ``wait_s``: ``{rank: text}``."""
    first: Dict[str, int] = {}
    for r, s in sorted(states.items(), key=lambda kv: (kv[1].get("time", 0.0), kv[0])):
        if s.get("failed"):
            first.setdefault(s.get("hash", ""), r)
    reps = list(first.values())[:MAX_LINES + 1]
    got = responder.ask([r for r in reps if r != me], ("traceback",), wait_s) if len(reps) > 1 or me not in reps else {}
    if me in reps:
        got[me] = failure.raised().get("traceback", "")
    return {r: t for r, t in got.items() if isinstance(t, str) and t}


def _head(states: Dict[int, Dict[str, Any]], silent: Sequence[int], me: int) -> Any:
    """Who heads the report, ``(rank, frozen)``: the earliest raise of a rank's own error (not
    a wait on a peer that timed out or went away); when every rank that failed failed waiting on
    a peer, a silent rank (the one the others waited for); else the earliest raise."""
    failed = sorted((r for r, s in states.items() if s.get("failed")), key=lambda r: (states[r]["time"], r))
    own = [r for r in failed if not states[r].get("peer")]
    if own:
        return own[0], False
    if silent and failed:
        return min(silent), True
    return (failed[0] if failed else me), False


def build(me: int, states: Dict[int, Dict[str, Any]], size: int, full: Optional[Dict[int, str]] = None,
          unreached: Sequence[int] = ()) -> Dict[str, Any]:
    """The report as plain data: the first failure (or the silent rank the others waited for),
    then the other ranks grouped by error (its hash and location) into rank ranges with their nodes;
    ``full``: the whole tracebacks gathered (one per distinct error), kept once each. The first
    is the earliest raise among the gathered states, not the rank that won the settling (``me``,
    which prints)."""
    silent = sorted(set(range(size)) - set(states) - set(unreached))
    head, frozen = _head(states, silent, me)
    first = states.get(head, {})
    nodes = nodemap.current()
    others: Dict[Any, List[int]] = {}
    for r, s in sorted(states.items()):
        if r == head:
            continue
        key = ("failed", s.get("hash") or s["error"], s["where"]) if s["failed"] else \
            ("running", tuple(s.get("frames", [])))
        others.setdefault(key, []).append(r)
    t0 = first.get("time") if not frozen else min((s["time"] for s in states.values() if s.get("failed")), default=0)
    groups = []
    for key, rs in sorted(others.items(), key=lambda kv: (kv[0][0] != "failed", kv[1][0])):
        g: Dict[str, Any] = {"state": key[0], "ranks": nodemap.ranges(rs), "count": len(rs), "first": rs[0],
                             "nodes": nodes.nodes(rs) if nodes is not None else []}
        if key[0] == "failed":  # one error (by hash) is one group, whatever numbers its message holds
            lines = {states[r]["error"] for r in rs}
            g.update(hash=states[rs[0]].get("hash", ""), error=states[rs[0]]["error"], messages=len(lines),
                     where=key[2], after_s=round(min(states[r]["time"] for r in rs) - (t0 or 0.0), 1))
        else:
            g.update(frames=list(key[1]))
        groups.append(g)
    tracebacks: Dict[str, Dict[str, Any]] = {}
    for r, text in sorted((full or {}).items()):
        h = states.get(r, {}).get("hash", "")
        if h not in tracebacks:
            tracebacks[h] = {"rank": r, "text": text}
    return {"kind": "hpcsync failure report", "rank": head, "node": _host(head), "reported_by": me,
            "frozen": frozen, "step": first.get("step"), "step_words": first.get("step_words", ""),
            "error": first.get("error"), "where": first.get("where"), "time": first.get("time"),
            "hash": first.get("hash"), "plain": first.get("plain"), "others": groups, "silent": silent,
            "unreached": list(unreached), "tracebacks": tracebacks}


def _host(rank: int) -> str:
    nodes = nodemap.current()
    return nodes.host(rank) if nodes is not None else "?"


def format_block(rep: Dict[str, Any], text: str, waited_s: Optional[float] = None) -> str:
    """The block for people: a header naming the first failure (or the silent rank the others
    waited for), its traceback, a line per group; ``waited_s``: how long silent ranks were
    waited for (default: this job's gathering bound)."""
    words = rep.get("step_words") or (f"at step {rep['step']}" if rep["step"] is not None else "")
    step = f", {words}" if words else ""
    waited = deadlines.current().gather_s if waited_s is None else waited_s
    if rep.get("frozen"):
        head = (f"[hpcsync] ===== rank {rep['rank']} ({rep['node']}) gave no answer within {waited:.0f} s: the other "
                "ranks failed waiting on it =====")
        lines = [head, "  (no traceback: a rank that answers nobody is frozen, stuck in C code holding the GIL, "
                       "dead, or its node is lost)"]
    else:
        head = f"[hpcsync] ===== uncaught exception on rank {rep['rank']} ({rep['node']}), the first to fail{step} ====="
        own = rep.get("tracebacks", {}).get(rep.get("hash") or "", {})
        body = own.get("text") or (text if rep.get("reported_by") == rep["rank"] else
                                   f"{rep.get('error') or '?'}\n  at {rep.get('where') or '?'} (its traceback did "
                                   f"not reach rank {rep.get('reported_by')} in time)")
        if rep.get("plain") and not settings.debug():  # a plain user error: its words say what to change
            body = f"{rep['plain']}\n  at {rep['where']} (HPCSYNC_DEBUG=1 shows the traceback)"
        lines = [head, body.rstrip("\n")]
    silent = [r for r in rep["silent"] if not (rep.get("frozen") and r == rep["rank"])]
    if rep["others"] or silent:
        lines.append("[hpcsync] the other ranks, when it was reported:")
    for g in rep["others"][:MAX_LINES]:
        who = _who(g)
        alike = f", {g['messages']} messages like it" if g.get("messages", 1) > 1 else ""
        if g["state"] == "failed" and (g["error"] == rep["error"] or (g.get("hash") and g["hash"] == rep.get("hash"))):
            lines.append(f"  {who}: raised the same, {g['after_s']:+.1f} s ({g['where']}{alike})")
        elif g["state"] == "failed":
            lines.append(f"  {who}: raised too, {g['after_s']:+.1f} s: {g['error'][:200]} ({g['where']}{alike})")
        else:
            lines.append(f"  {who}: still running, at {_at(g['frames'][-1]) if g['frames'] else '?'}")
    if len(rep["others"]) > MAX_LINES:
        lines.append(f"  ... {len(rep['others']) - MAX_LINES} more group(s) of ranks in the JSON report")
    if silent:
        lines.append(f"  {_ranks(silent)}: no answer within {waited:.0f} s")
    if rep.get("unreached"):
        lines.append(f"  {_ranks(rep['unreached'])}: not reached (behind relays that did not answer; not known "
                     "to be silent)")
    lines.append("[hpcsync] " + "=" * (len(head) - 10))
    return "\n".join(lines)


def _who(group: Dict[str, Any], max_nodes: int = 8) -> str:
    """A group's ranks as ``rank 3 on n1`` or ``ranks 0-2, 5 on n0, n1``."""
    names = group["nodes"]
    more = f" and {len(names) - max_nodes} more node(s)" if len(names) > max_nodes else ""
    where = f" on {', '.join(names[:max_nodes])}{more}" if names else ""
    return f"{'rank' if group['count'] == 1 else 'ranks'} {group['ranks']}{where}"


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
