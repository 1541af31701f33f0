"""The verdict on one step of ``hpcsync run``: from the failure records the ranks wrote and the
launcher's words, whether to relaunch (without which nodes), requeue, stop (the program's own
error) or end. A node is left out only on evidence: the ranks that could not reach it (a side of
a split holding more than half of the job's ranks), the launcher's words about it, the resource
manager's state of it."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, List, Optional, Sequence, Set, Tuple

from ..observe.record import Cause, FailureRecord
from .launchers import LauncherWords

__all__ = ["Action", "Verdict", "weigh", "judge"]


class Action(str, Enum):
    """What ``hpcsync run`` does after a step (the values are the words its logs and docs use)."""

    DONE = "done"
    RELAUNCH = "relaunch"
    STOP_PROGRAM = "stop-program"
    REQUEUE = "requeue"


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
    believed record reached are not silent (an answer that came late to one printer); the nodes
    of the rest are blamed. ``contested``: the nodes of records that nobody believes -- an equal
    split, or a minority side alone -- for other evidence to decide; never a reason to leave a
    node out by itself. At N ranks a record carries N integers at most (``reached``: about 40 KB
    of JSON at 8,192 ranks), one per side's printer; weighing is linear in what the records hold."""
    blaming = [r for r in records if r.blame_nodes]
    if not blaming:
        return [], []
    if ranks is None:
        named = [x for r in records for x in (*_reached(r), *r.ranks)]
        ranks = max(named, default=0) + 1
    believed = [r for r in blaming if 2 * len(_reached(r)) > ranks]
    alive = set().union(*(_reached(r) for r in believed)) if believed else set()
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
    return sorted(blamed), sorted(contested)


def judge(rc: int, records: Sequence[FailureRecord], words: LauncherWords, signalled: bool,
          node_state: Optional[Callable[[Sequence[str]], List[str]]] = None, ranks: Optional[int] = None,
          probe: Optional[Callable[[Sequence[str]], List[str]]] = None, nodes: Sequence[str] = ()) -> Verdict:
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
    healthy node is left out on a guess."""
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
        return Verdict(Action.RELAUNCH, "hardware", sorted({n for r in hardware for n in r.blame_nodes}),
                       hardware[0].detail)
    if words.crash_first:  # the program's own crash: the survivors' records blame its healthy node
        return Verdict(Action.STOP_PROGRAM, "crashed", detail=f"a rank crashed ({words.crashes[0]}): the program's own "
                       "crash, its node is not blamed")
    if words.warning:  # sent to every task on purpose: peers' reports of the dead ranks blame no node either;
        # a node the launcher itself names (a node failure, another death) is still left out
        blamed_too = f"; the launcher also blamed {', '.join(words.nodes)}" if words.nodes else "; no node is blamed"
        return Verdict(Action.REQUEUE, f"killed by {words.warning}", list(words.nodes),
                       f"ranks were killed by {words.warning}, the job's warning signal, before the program "
                       f"handled it (no preemption guard yet, or no longer){blamed_too}")
    blamed, contested = weigh(records, ranks)
    if blamed:
        first = next(r for r in records if set(r.blame_nodes) & set(blamed))
        return Verdict(Action.RELAUNCH, first.cause.value, blamed, first.detail)
    if words.nodes:
        return Verdict(Action.RELAUNCH, "killed", list(words.nodes), "; ".join(words.lines[:3]))
    down = node_state(contested) if contested and node_state is not None else []
    if down:
        return Verdict(Action.RELAUNCH, "node down", sorted(down), f"records nobody can believe about {', '.join(contested)}: the "
                       f"resource manager calls {', '.join(sorted(down))} down")
    unsure = bool(contested or records or words.hung or words.launch_failed)
    failing = probe(nodes) if unsure and probe is not None and nodes else []
    if failing:
        why = f"records nobody can believe about {', '.join(contested)}" if contested else \
            "the launcher could not start its daemons" if words.launch_failed else \
            "the launcher hung" if words.hung else "a timeout that names no node"
        return Verdict(Action.RELAUNCH, "unreachable", sorted(failing), f"{why}; the launcher cannot run a process on "
                       f"{', '.join(sorted(failing))} (each of the step's nodes probed)")
    if contested:
        return Verdict(Action.RELAUNCH, "split", [], f"records nobody can believe about {', '.join(contested)} (an equal "
                       "split, or a minority side alone) and no other "
                       "evidence: relaunched on the same nodes, none left out on a guess")
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
