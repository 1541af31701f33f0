"""The verdict on one step of ``hpcsync run``: from the failure records the ranks wrote and the
launcher's words, whether to relaunch (without which nodes), requeue, stop (the program's own
error, crash or desync) or end. A node is left out only on evidence: none of its ranks reachable
by a side of a split holding more than half of the job's ranks, the launcher's words about it,
the resource manager's state of it, a probe -- and no more nodes than the spares on one source
alone."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, List, Optional, Sequence, Set, Tuple

from ..observe.record import Cause, FailureRecord
from .launchers import Evidence

__all__ = ["Action", "PROCESS_KILLED", "Verdict", "weigh", "judge"]


class Action(str, Enum):
    """What ``hpcsync run`` does after a step (the values are the words its logs and docs use)."""

    DONE = "done"
    RELAUNCH = "relaunch"
    STOP_PROGRAM = "stop-program"
    REQUEUE = "requeue"


PROCESS_KILLED = "process killed"  #: the cause of ranks killed while their nodes ran on


@dataclass
class Verdict:
    """Why a step ended: ``action`` is ``done`` (exit with the step's code), ``relaunch`` (without
    ``blamed``), ``stop-program`` (the program's own error: not retried) or ``requeue`` (the job's
    warning signal killed ranks before the program could act on it: requeue the job, without
    ``blamed`` if the launcher named a node too)."""

    action: Action
    cause: str
    blamed: List[str] = field(default_factory=list)
    detail: str = ""


def _reached(record: FailureRecord) -> Set[int]:
    """The ranks a record's reporter could reach, itself included: its side of a split (a record
    without them stands for its reporter alone)."""
    return set(record.reached_ranks())


def weigh(records: Sequence[FailureRecord], ranks: Optional[int] = None) -> Tuple[List[str], List[str]]:
    """Which nodes the records blame, by evidence: ``(blamed, contested)``.

    A node cut off from the others reports them silent, as they report it, and either side may
    be the first (or the only one) to write. A record is believed only when its reporter reached
    more than half of the job's ``ranks`` (default: the highest rank any record names, plus one):
    two sides cannot both hold that. Of the believed records' silent ranks, those another
    believed record reached are not silent (an answer that came late to one printer). A node is
    blamed only when none of its ranks answered: a node one of whose ranks a believed record
    reached (``reached_nodes``, the reporter's own) runs -- its silent ranks are their processes'
    fault (frozen, stopped, a GIL held), not its. ``contested``: the nodes of records that nobody
    believes -- an equal split, or a minority side alone -- for other evidence to decide; never
    a reason to leave a node out by itself. At N ranks a record carries N integers at most
    (``reached``: about 40 KB of JSON at 8,192 ranks), one per side's printer; weighing is linear
    in what the records hold."""
    blamed, contested, _ = _weigh(records, ranks)
    return blamed, contested


def _weigh(records: Sequence[FailureRecord], ranks: Optional[int]) -> Tuple[List[str], List[str], Set[str]]:
    """:func:`weigh`, and the nodes the believed records show running (a rank of each answered)."""
    blaming = [r for r in records if r.blame_nodes]
    if not blaming:
        return [], [], set()
    if ranks is None:
        named = [x for r in records for x in (*_reached(r), *r.ranks)]
        ranks = max(named, default=0) + 1
    believed = [r for r in blaming if 2 * len(_reached(r)) > ranks]
    alive = set().union(*(_reached(r) for r in believed)) if believed else set()
    running = {n for r in believed for n in (*r.reached_nodes, r.reporter.node)}
    blamed: Set[str] = set()
    for r in believed:
        if r.silent_at:
            blamed |= {node for rank, node in r.silent_at.items() if rank not in alive}
        else:  # a record that does not say which rank is where: its nodes, as it blames them
            blamed |= set(r.blame_nodes)
    contested: Set[str] = set()
    if not believed:
        for r in blaming:
            contested |= {r.reporter.node, *r.blame_nodes}
    return sorted(blamed - running), sorted(contested), running


def judge(rc: int, records: Sequence[FailureRecord], words: Evidence, signalled: bool,
          node_state: Optional[Callable[[Sequence[str]], List[str]]] = None, ranks: Optional[int] = None,
          probe: Optional[Callable[[Sequence[str]], List[str]]] = None, nodes: Sequence[str] = (),
          spares: Optional[int] = None) -> Verdict:
    """The records first (hpcsync saw the failure from inside), the launcher's words second; but
    ranks the job's warning signal killed decide before any record blaming a node (the survivors
    report the dead ranks' nodes, which are healthy).

    The records are weighed (:func:`weigh`, ``ranks``: the job's): in a split, a side holding more
    than half of the job's ranks decides, wherever the supervisor runs. Records nobody can believe
    (an equal split, a minority side alone) are decided by the launcher's words, then by
    ``node_state`` (the contested nodes the resource manager calls down), then by ``probe`` (of the
    step's ``nodes``, those the launcher cannot run a process on: :mod:`~hpcsync.resilience.probe`),
    asked too when the launcher hung, could not start its daemons, or the ranks timed out without
    naming a node; without any, the step is relaunched on the same nodes (bounded by the cap): no
    healthy node is left out on a guess.

    A node is blamed only when (nearly) all of its ranks are unreachable: none answered a believed
    record's gathering, or the launcher lost each of its ranks (``ranks`` / ``nodes``: ranks a
    node; unknown, one death stands for its node, as before) -- or the launcher itself calls it
    failed (srun's node failure, Open MPI's lost daemon), or the scheduler does. Ranks killed while
    their nodes ran on are their processes' (:data:`PROCESS_KILLED`: the same nodes once more); a
    desync (a ``stall`` record whose missing ranks wait in another operation of their own, no
    rank silent anywhere) is the program's (``stop-program``); ranks merely late are not. With
    ``spares`` given, one source that blames more nodes than the spares leaves out only the nodes
    a second, independent one confirms (the launcher's words, ``node_state``, ``probe``)."""
    if rc == 0:
        return Verdict(Action.DONE, "completed")
    if signalled:
        return Verdict(Action.DONE, "the run was signalled", detail="not relaunched: the signal ends the run")
    program = [r for r in records if r.program_error]
    if program:
        first = program[0]
        who = f"rank {first.reporter.rank} on {first.reporter.node}"
        return Verdict(Action.STOP_PROGRAM, "exception", detail=f"{who} raised {first.detail}")
    hardware = [r for r in records if r.cause is Cause.HARDWARE]
    if hardware:  # a GPU's fault reached the program: its node, whatever the launcher saw die next
        faulty = sorted({n for r in hardware for n in r.blame_nodes})
        return _capped(Verdict(Action.RELAUNCH, "hardware", faulty, hardware[0].detail), spares,
                       lambda: (set(words.nodes) | set(node_state(faulty) if node_state else ())) & set(faulty))
    if words.crash_first:  # the program's own crash: the survivors' records blame its healthy node
        return Verdict(Action.STOP_PROGRAM, "crashed", detail=f"a rank crashed ({words.crashes[0]}): the program's own "
                       "crash, its node is not blamed")
    if words.warning:  # sent to every task on purpose: peers' reports of the dead ranks blame no node either;
        # a node the launcher itself names (a node failure, another death) is still left out
        blamed_too = f"; the launcher also blamed {', '.join(words.nodes)}" if words.nodes else "; no node is blamed"
        named = list(words.nodes)
        return _capped(Verdict(Action.REQUEUE, f"killed by {words.warning}", named,
                               f"ranks were killed by {words.warning}, the job's warning signal, before the program "
                               f"handled it (no preemption guard yet, or no longer){blamed_too}"), spares,
                       lambda: set(node_state(named) if node_state else ()) & set(named))
    blamed, contested, running = _weigh(records, ranks)
    asked: List[List[str]] = []  # the probe's answer, asked once

    def probed() -> Set[str]:
        """The step's nodes the probe cannot start a process on -- all of them while they are no
        more than half of them; past that (it is as likely the supervisor's side that was cut
        off) only those the scheduler calls down too."""
        if probe is None or not nodes:
            return set()
        if not asked:
            failing = list(probe(nodes))
            if 2 * len(failing) > len(nodes):
                failing = list(node_state(failing)) if node_state is not None and failing else []
            asked.append(failing)
        return set(asked[0])

    def second_sign(named: Sequence[str], besides_words: bool) -> Set[str]:
        """Of ``named``, the nodes another, independent source calls failed."""
        signs = set(words.nodes) if besides_words else set()
        if node_state is not None:
            signs |= set(node_state(named))
        return (signs | probed()) & set(named)

    def besides_probe(failing: Sequence[str]) -> Set[str]:
        """Of the nodes the probe failed, those a record nobody believes, the launcher or the
        scheduler names too."""
        return (set(contested) | set(words.nodes) | set(node_state(failing) if node_state else ())) & set(failing)

    if blamed:
        first = next(r for r in records if set(r.blame_nodes) & set(blamed))
        blamed = sorted({*blamed, *words.failed})  # (the scheduler's word of a node failure too)
        return _capped(Verdict(Action.RELAUNCH, first.cause.value, blamed, first.detail), spares,
                       lambda: second_sign(blamed, True))
    per_node = ranks // len(nodes) if ranks and nodes and ranks % len(nodes) == 0 else None
    # the launcher's words: a node it says failed (srun's, from slurmctld), a node whose every rank
    # died; a daemon Open MPI lost is as much its own node's link as the other's: with a second sign
    lost = [n for n in words.lost if n not in words.failed]
    sure_lost = second_sign(lost, False) if lost else set()
    dead = [n for n in words.nodes if n in words.failed or n in sure_lost or
            (n in words.deaths and _all_died(n, words, per_node, running))]
    if dead:
        also = sorted(probed() - set(dead)) if contested or asked else []  # a second failure, if any
        dead = [*dead, *also]
        return _capped(Verdict(Action.RELAUNCH, "killed", dead, "; ".join(words.lines[:3])), spares,
                       lambda: second_sign(dead, False))
    if words.deaths:  # ranks killed, their nodes running on: the processes', not the nodes'
        where = ", ".join(f"{n} (rank {', '.join(sorted(r))})" for n, r in sorted(words.deaths.items()))
        failing = sorted(probed())  # before the same nodes once more: is one of them down as well?
        if failing:  # a node the launcher cannot reach: a second failure
            return _capped(Verdict(Action.RELAUNCH, "unreachable", failing, f"ranks killed on {where}, and the launcher "
                                   f"cannot run a process on {', '.join(failing)} (each of the step's nodes probed)"),
                           spares, lambda: besides_probe(failing))
        return Verdict(Action.RELAUNCH, PROCESS_KILLED, [], f"ranks killed by a signal on {where} while their nodes ran "
                       "on (their node-mates answered or lived till the end, and the node's own daemon reported the "
                       f"death): no node blamed, the same nodes once more ({words.lines[0]})")
    stalls = [r for r in records if r.cause is Cause.STALL and r.elsewhere]  # (ranks merely late: a slow start,
    # a long step, a file system: relaunched on the same nodes as before)
    if stalls and not contested and not any(r.silent for r in records) and not words.launch_failed:
        return Verdict(Action.STOP_PROGRAM, "desync", detail=f"a desync: every rank answered and some never entered the "
                       f"collective ({stalls[0].detail}): the program's (ranks in different collectives, or a "
                       "deadlock), not retried: the same code stalls again")
    down = node_state(contested) if contested and node_state is not None else []
    if down:
        return Verdict(Action.RELAUNCH, "node down", sorted(down), f"records nobody can believe about {', '.join(contested)}: the "
                       f"resource manager calls {', '.join(sorted(down))} down")
    unsure = bool(contested or records or words.hung or words.launch_failed or lost)
    failing = sorted(probed()) if unsure else []
    if failing:
        why = f"records nobody can believe about {', '.join(contested)}" if contested else \
            "the launcher could not start its daemons" if words.launch_failed else \
            "the launcher hung" if words.hung else "a timeout that names no node"
        return _capped(Verdict(Action.RELAUNCH, "unreachable", failing, f"{why}; the launcher cannot run a process "
                               f"on {', '.join(failing)} (each of the step's nodes probed)"), spares,
                       lambda: besides_probe(failing))
    if contested:
        return Verdict(Action.RELAUNCH, "split", [], f"records nobody can believe about {', '.join(contested)} (an equal "
                       "split, or a minority side alone) and no other "
                       "evidence: relaunched on the same nodes, none left out on a guess")
    if lost:  # Open MPI lost daemons that no second sign blames: the step failed, nobody left out
        return Verdict(Action.RELAUNCH, "lost daemon", [], f"mpirun lost its daemon on {', '.join(lost)}, and nothing "
                       "else says those nodes failed (its own node's link may be the one that failed): relaunched on "
                       "the same nodes, none left out on a guess")
    if records:  # a timeout nobody could pin on a node: the same nodes once more
        return Verdict(Action.RELAUNCH, records[0].cause.value, [], records[0].detail)
    if words.hung and words.never_started:
        return Verdict(Action.RELAUNCH, "did not start", [], "the ranks were not all up in time and no launcher message "
                       "names a node: relaunched on the same nodes")
    if words.hung:  # the ranks ended without a word and the launcher never did: the same nodes once more
        return Verdict(Action.RELAUNCH, "launcher hung", [], "the launcher did not end after the step failed, and no "
                       "record or launcher message blames a node: relaunched on the same nodes")
    if words.launch_failed:  # the step never ran: not the program's exit code
        return Verdict(Action.RELAUNCH, "launch failed", [], "the launcher could not start its daemons and no node failed "
                       "a probe: relaunched on the same nodes")
    return Verdict(Action.DONE, f"exit code {rc}", detail="no record and no launcher message blames a node: not relaunched")


def _all_died(node: str, words: Evidence, per_node: Optional[int], running: Set[str]) -> bool:
    """Whether the launcher's deaths on ``node`` are its node's: every one of its ``per_node``
    ranks died (unknown ranks a node: as before, yes) and nothing shows one living on (a believed
    record reached it, ``running``; the launcher ended it at cleanup, ``words.alive``)."""
    if node in running or node in words.alive:
        return False
    return per_node is None or len(words.deaths.get(node, ())) >= per_node


def _capped(verdict: Verdict, spares: Optional[int], confirm: Callable[[], Set[str]]) -> Verdict:
    """``verdict`` when it leaves out no more nodes than the ``spares`` (None: no bound); else
    only the nodes a second, independent sign (``confirm``) names too -- none without one: one
    source of evidence that names more nodes than there are spares (a gathering that timed out
    on many ranks at once, a launcher that lost many daemons) is as likely its own failure. One
    node is always believed, even with no spare (Slurm's requeue leaves it out; without it, the
    same failed node would be retried to the cap)."""
    if spares is None or len(verdict.blamed) <= max(spares, 1):
        return verdict
    sure = sorted(confirm())
    said = f"{len(verdict.blamed)} node(s) blamed ({', '.join(verdict.blamed)}), more than the {spares} spare(s)"
    if sure:
        return Verdict(verdict.action, verdict.cause, sure, f"{verdict.detail}; {said}: left out only those a "
                       f"second, independent sign confirms ({', '.join(sure)})")
    return Verdict(verdict.action, verdict.cause, [], f"{verdict.detail}; {said}, and no second, independent sign "
                   "(the launcher, the scheduler, a probe) confirms any: none left out, the same nodes once more")
