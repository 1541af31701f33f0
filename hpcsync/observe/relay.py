"""Asking every rank of a large job without funnelling the answers through one rank.

The asking rank sends one question to each other rank of its own node and one to each of at
most ``FANOUT`` relays (:data:`hpcsync.core.deadlines.FANOUT`, 16); a relay is the lowest rank
of a share of the other nodes, answers for itself and asks its share the same way (its own
node's ranks directly, the rest of its share through at most ``FANOUT`` relays of its own). No
rank sends more than ``FANOUT + ranks per node`` questions; the farthest rank is :func:`hops` away (``1 + ceil(log_16(nodes))``: 4 at
8,192 ranks on 1,024 nodes). Each hop gets the job's
:attr:`~hpcsync.core.deadlines.Deadlines.hop_s`, so the bound grows with the logarithm of the
job, not with its size (:func:`budget`; every bound: :mod:`hpcsync.core.deadlines`).

A relay that does not answer in time (its node cut off, its process frozen) leaves its share
unanswered, and every relay says which of its own relays were silent. The asker then asks the
ranks still missing again, in a new round, with the silent relays' nodes asked rank by rank
(so a frozen relay never makes the healthy ranks of its node look silent) and the rest through
relays on other nodes; at most ``ROUNDS`` rounds, and none once a round finds no silent
relay. The answers are the ranks' own: a rank that answers nobody in time is missing from
them, never guessed.

A *reduction* (``keep``: the name of a key in :data:`KEYS`) walks the same tree, but every relay
passes up only the answer of least key of its share (and the ranks that answered, as ranges):
a min-reduction in O(log N) rounds whose messages stay a few dozen bytes, what settles who
prints a failure report (:mod:`hpcsync.observe.digest`). The walk is a pure function of a
:class:`Tree` (this rank, the node map, a hop, a way to ask): :func:`ask_all` asks over MPI,
and a test walks the same code over a simulated job.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

from ..core import deadlines, mpi, nodemap
from . import responder

__all__ = ["KEYS", "hops", "round_budget", "budget", "job_budget", "shares", "Gathered", "Tree", "walk",
           "serve", "ask_all"]

#: reductions by name -> function(rank, answer) -> its key (None: not a candidate); least key wins
KEYS: Dict[str, Callable[[int, Any], Any]] = {}


def hops(nodes: int) -> int:
    """Hops from the asker to the farthest rank of a job on ``nodes`` nodes: one level of relays
    per factor of ``FANOUT`` in the number of nodes, plus a node's own ranks."""
    return deadlines.depth(nodes)


def _job(nodes: int) -> deadlines.Deadlines:
    return deadlines.Deadlines.for_job(nodes, nodes, 1)


def round_budget(nodes: int) -> float:
    """Seconds one round may take on ``nodes`` nodes of one rank: a hop per level, and one for the way back."""
    return _job(nodes).round_s


def budget(nodes: int) -> float:
    """Seconds :func:`ask_all` may take on ``nodes`` nodes (its rounds at most)."""
    return _job(nodes).gather_s


def job_budget() -> float:
    """:func:`budget` for this job (:func:`hpcsync.core.deadlines.current`)."""
    return deadlines.current().gather_s


def shares(ranks: Sequence[int], me: int, nodes: Optional[nodemap.NodeMap],
           suspects: Optional[Set[int]] = None) -> List[Tuple[int, List[int]]]:
    """Who ``me`` asks for ``ranks``: ``[(rank asked, ranks it answers for)]`` -- the ranks on
    ``me``'s node and on ``suspects`` (node indexes whose relay was silent) one by one, the other
    nodes in at most ``FANOUT`` shares of whole consecutive nodes, each asked through its
    lowest rank."""
    if nodes is None:
        return [(r, [r]) for r in sorted(set(ranks) - {me})]
    where = lambda r: nodes.node_of[r] if 0 <= r < len(nodes.node_of) else -1  # noqa: E731
    by_node: Dict[int, List[int]] = {}
    for r in sorted(set(ranks) - {me}):
        by_node.setdefault(where(r), []).append(r)
    direct = {where(me), -1, *(suspects or ())}
    out = [(r, [r]) for k in sorted(by_node) if k in direct for r in by_node[k]]
    others = [by_node[k] for k in sorted(by_node) if k not in direct]
    count = min(deadlines.FANOUT, len(others))
    for i in range(count):
        part = others[i * len(others) // count:(i + 1) * len(others) // count]
        share = [r for node in part for r in node]
        out.append((share[0], share))
    return out


class Gathered(NamedTuple):
    """What :func:`ask_all` got: ``answers`` by rank (for a reduction, the least one alone);
    ``unreached``: ranks that were never asked (behind a relay that stayed silent in every round):
    not known to be silent, never to be blamed; ``heard``: every rank that answered."""

    answers: Dict[int, Any]
    unreached: List[int]
    heard: Tuple[int, ...] = ()


class Tree(NamedTuple):
    """What a walk of the tree needs: the walking rank, the node map, one hop's allowance, and
    ``send({rank: question}, wait_s) -> {rank: answer}`` (the answers that came in time)."""

    me: int
    nodes: Optional[nodemap.NodeMap]
    hop_s: float
    send: Callable[[Dict[int, Tuple[Any, ...]], float], Dict[int, Any]]


def _spans(ranks: Set[int]) -> List[Tuple[int, int]]:
    """``{0, 1, 2, 5}`` -> ``[(0, 2), (5, 5)]``: the ranks that answered, a few numbers long."""
    out: List[Tuple[int, int]] = []
    for r in sorted(ranks):
        if out and out[-1][1] == r - 1:
            out[-1] = (out[-1][0], r)
        else:
            out.append((r, r))
    return out


def _least(answers: Dict[int, Any], keep: str) -> Dict[int, Any]:
    """The answer of least key (none when no answer is a candidate)."""
    key = KEYS[keep]
    keyed = [(k, r) for r, a in answers.items() for k in [key(r, a)] if k is not None]
    return {min(keyed)[1]: answers[min(keyed)[1]]} if keyed else {}


def _ask_tree(tree: Tree, ranks: Sequence[int], question: Tuple[Any, ...], wait_s: float, suspects: Set[int],
              keep: Optional[str]) -> Tuple[Dict[int, Any], Set[int], Set[int], Set[int]]:
    """The answers of ``ranks`` (``tree.me`` excluded) within ``wait_s``, through relays while the
    time allows a relay its own hop; the ranks heard; the nodes of the relays that were silent;
    and the ranks that were asked (by this rank or a relay) and did not answer."""
    nodes = tree.nodes
    plan = shares(ranks, tree.me, nodes, suspects)
    inner = wait_s - tree.hop_s
    if inner < tree.hop_s:  # no time for another level: ask every rank at once
        plan = [(one, [one]) for _, share in plan for one in share]
    questions = {r: question if len(share) == 1 else ("relay", question, share, inner, sorted(suspects), keep)
                 for r, share in plan}
    got = tree.send(questions, wait_s)
    answers: Dict[int, Any] = {}
    heard: Set[int] = set()
    silent_relays: Set[int] = set()
    asked_silent: Set[int] = set()
    for r, share in plan:
        if len(share) == 1:
            if r in got:
                answers[r] = got[r]
                heard.add(r)
            else:
                asked_silent.add(r)
        elif isinstance(got.get(r), dict):
            answers.update({k: v for k, v in got[r]["answers"].items() if k in share})
            heard |= {k for lo, hi in got[r]["heard"] for k in range(lo, hi + 1)} & set(share)
            silent_relays |= set(got[r]["silent"])
            asked_silent |= set(got[r].get("asked_silent", ())) & set(share)
            if got[r].get("expired") and nodes is not None:  # it had no time to ask its share: asked again,
                silent_relays.add(nodes.node_of[r])          # its node rank by rank
        else:
            asked_silent.add(r)
            if nodes is not None:
                silent_relays.add(nodes.node_of[r])
    if keep is not None:
        answers = _least(answers, keep)
    return answers, heard, silent_relays, asked_silent


def serve(tree: Tree, question: Tuple[Any, ...], share: List[int], left: float, suspects: List[int],
          keep: Optional[str], own: Callable[[], Any]) -> Dict[str, Any]:
    """A relay's answer: ``own()`` (its answer to ``question``) and its share's, asked within
    ``left`` seconds (for a reduction, the least of them); the ranks heard, as spans; the nodes
    of its own relays that were silent, and the ranks it found silent."""
    answers: Dict[int, Any] = {}
    heard: Set[int] = set()
    silent: Set[int] = set()
    asked_silent: Set[int] = set()
    expired = left <= tree.hop_s / 2  # its asker is about to give up: its own answer only, at once
    if not expired:
        answers, heard, silent, asked_silent = _ask_tree(tree, [r for r in share if r != tree.me], question, left,
                                                         set(suspects), keep)
    answers[tree.me] = own()
    heard.add(tree.me)
    if keep is not None:
        answers = _least(answers, keep)
    return {"answers": answers, "heard": _spans(heard), "silent": sorted(silent),
            "asked_silent": sorted(asked_silent), "expired": expired}


def _relay(asker: int, question: Tuple[Any, ...], share: List[int], wait_s: float, suspects: List[int],
           keep: Optional[str] = None, arrived: Optional[float] = None) -> Dict[str, Any]:
    """:func:`serve` over MPI, within what is left of ``wait_s`` since the question ``arrived``
    (a question that waited its turn here has less)."""
    left = wait_s - (time.monotonic() - arrived if arrived is not None else 0.0)
    tree = Tree(mpi.MPI().COMM_WORLD.Get_rank(), nodemap.current(), deadlines.current().hop_s, responder.ask_each)
    return serve(tree, question, share, left, suspects, keep, lambda: responder.ANSWERS[question[0]](asker, *question[1:]))


responder.ANSWERS["relay"] = _relay
responder.SLOW.add("relay")


def walk(tree: Tree, ranks: Sequence[int], question: Tuple[Any, ...], total: float, each: float, rounds: int,
         keep: Optional[str] = None) -> Gathered:
    """:func:`ask_all`'s rounds from ``tree``: ``each`` seconds a round, ``total`` in all, at most
    ``rounds``. A rank asked once that did not answer is not asked again (nor made a relay); the
    ranks behind silent relays are asked again, those on the relays' nodes one by one."""
    missing = [r for r in ranks if r != tree.me]
    answers: Dict[int, Any] = {}
    heard: Set[int] = set()
    suspects: Set[int] = set()
    asked: Set[int] = set()  # asked and silent
    for _ in range(rounds):
        got, came, silent, quiet = _ask_tree(tree, missing, question, each, suspects, keep)
        answers.update(got)
        heard |= came
        asked |= quiet
        missing = [r for r in missing if r not in heard and r not in asked]
        total -= each
        if not missing or not silent - suspects or total < each:
            break
        suspects |= silent
    if keep is not None:
        answers = _least(answers, keep)
    return Gathered(answers, missing, tuple(sorted(heard)))


def ask_all(ranks: Sequence[int], question: Tuple[Any, ...], wait_s: Optional[float] = None,
            keep: Optional[str] = None) -> Gathered:
    """Every answer of ``ranks`` (but this rank's) to ``question`` that came in time (with
    ``keep``, the least of them by :data:`KEYS` [keep]): along the tree of relays, in rounds (see
    the module's docstring), within ``wait_s`` in all (default: the job's gathering bound,
    :attr:`~hpcsync.core.deadlines.Deadlines.gather_s`, or its settling bound for a reduction)."""
    job = deadlines.current()
    total = (job.gather_s if keep is None else job.settle_s) if wait_s is None else wait_s
    rounds = deadlines.ROUNDS if keep is None else deadlines.SETTLE_ROUNDS
    tree = Tree(mpi.MPI().COMM_WORLD.Get_rank(), nodemap.current(), job.hop_s, responder.ask_each)
    return walk(tree, ranks, question, total, min(total, job.round_s), rounds, keep)
