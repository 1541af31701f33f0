"""Asking every rank of a large job without funnelling the answers through one rank.

The asking rank sends one question to each other rank of its own node and one to each of at
most :data:`FANOUT` relays; a relay is the lowest rank of a share of the other nodes, answers for
itself and asks its share the same way (its own node's ranks directly, the rest of its share
through at most :data:`FANOUT` relays of its own). No rank sends more than ``FANOUT + ranks per
node`` questions; the farthest rank is :func:`hops` away (``1 + ceil(log_FANOUT(nodes))``: 4 at
8,192 ranks on 1,024 nodes). Each hop gets :data:`HOP_S`, so the bound grows with the logarithm
of the job, not with its size (:func:`budget`).

A relay that does not answer in time (its node cut off, its process frozen) leaves its share
unanswered, and every relay says which of its own relays were silent. The asker then asks the
ranks still missing again, in a new round, with the silent relays' nodes asked rank by rank
(so a frozen relay never makes the healthy ranks of its node look silent) and the rest through
relays on other nodes; at most :data:`ROUNDS` rounds, and none once a round finds no silent
relay. The answers are the ranks' own: a rank that answers nobody in time is missing from
them, never guessed."""
from __future__ import annotations

import math
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

from ..core import mpi, nodemap
from . import responder

__all__ = ["FANOUT", "HOP_S", "ROUNDS", "hops", "round_budget", "budget", "job_budget", "shares", "Gathered", "ask_all"]

FANOUT = 16  #: relays a rank asks (besides its own node's ranks)
HOP_S = 1.0  #: one hop's allowance: a responder polls every 0.1 s, under load it answers later
ROUNDS = 3  #: rounds at most: the first, then the ranks behind silent relays


def hops(nodes: int) -> int:
    """Hops from the asker to the farthest rank of a job on ``nodes`` nodes: one level of relays
    per factor of :data:`FANOUT` in the number of nodes, plus a node's own ranks."""
    return 1 + (math.ceil(math.log(nodes, FANOUT) - 1e-9) if nodes > 1 else 0)


def round_budget(nodes: int) -> float:
    """Seconds one round may take on ``nodes`` nodes: :data:`HOP_S` per hop, and one for the way back."""
    return HOP_S * (hops(nodes) + 1)


def budget(nodes: int) -> float:
    """Seconds :func:`ask_all` may take on ``nodes`` nodes: :data:`ROUNDS` rounds at most."""
    return ROUNDS * round_budget(nodes)


def job_budget() -> float:
    """:func:`budget` for this job's nodes (one node before the node map is known)."""
    nodes = nodemap.current()
    return budget(len(nodes.names) if nodes is not None else 1)


def shares(ranks: Sequence[int], me: int, nodes: Optional[nodemap.NodeMap],
           suspects: Optional[Set[int]] = None) -> List[Tuple[int, List[int]]]:
    """Who ``me`` asks for ``ranks``: ``[(rank asked, ranks it answers for)]`` -- the ranks on
    ``me``'s node and on ``suspects`` (node indexes whose relay was silent) one by one, the other
    nodes in at most :data:`FANOUT` shares of whole consecutive nodes, each asked through its
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
    count = min(FANOUT, len(others))
    for i in range(count):
        part = others[i * len(others) // count:(i + 1) * len(others) // count]
        share = [r for node in part for r in node]
        out.append((share[0], share))
    return out


class Gathered(NamedTuple):
    """What :func:`ask_all` got: ``answers`` by rank; ``unreached``: ranks that were never asked
    (behind a relay that stayed silent in every round): not known to be silent, never to be blamed."""

    answers: Dict[int, Any]
    unreached: List[int]


def _ask_tree(ranks: Sequence[int], question: Tuple[Any, ...], wait_s: float,
              suspects: Set[int]) -> Tuple[Dict[int, Any], Set[int], Set[int]]:
    """The answers of ``ranks`` (this rank excluded) within ``wait_s``, through relays while the
    time allows a relay its own hop; the nodes of the relays that were silent; and the ranks that
    were asked (by this rank or a relay) and did not answer."""
    me = mpi.MPI().COMM_WORLD.Get_rank()
    nodes = nodemap.current()
    plan = shares(ranks, me, nodes, suspects)
    inner = wait_s - HOP_S
    if inner < HOP_S:  # no time for another level: ask every rank at once
        plan = [(one, [one]) for _, share in plan for one in share]
    questions = {r: question if len(share) == 1 else ("relay", question, share, inner, sorted(suspects))
                 for r, share in plan}
    got = responder.ask_each(questions, wait_s)
    answers: Dict[int, Any] = {}
    silent_relays: Set[int] = set()
    asked_silent: Set[int] = set()
    for r, share in plan:
        if len(share) == 1:
            if r in got:
                answers[r] = got[r]
            else:
                asked_silent.add(r)
        elif isinstance(got.get(r), dict):
            answers.update({k: v for k, v in got[r]["answers"].items() if k in share})
            silent_relays |= set(got[r]["silent"])
            asked_silent |= set(got[r].get("asked_silent", ())) & set(share)
            if got[r].get("expired") and nodes is not None:  # it had no time to ask its share: asked again,
                silent_relays.add(nodes.node_of[r])          # its node rank by rank
        else:
            asked_silent.add(r)
            if nodes is not None:
                silent_relays.add(nodes.node_of[r])
    return answers, silent_relays, asked_silent


def _relay(asker: int, question: Tuple[Any, ...], share: List[int], wait_s: float,
           suspects: List[int], arrived: Optional[float] = None) -> Dict[str, Any]:
    """A relay's answer: its own to ``question`` and its share's, asked within what is left of
    ``wait_s`` since the question ``arrived`` (a question that waited its turn here has less);
    the nodes of its own relays that were silent, and the ranks it found silent."""
    me = mpi.MPI().COMM_WORLD.Get_rank()
    left = wait_s - (time.monotonic() - arrived if arrived is not None else 0.0)
    answers: Dict[int, Any] = {}
    silent: Set[int] = set()
    asked_silent: Set[int] = set()
    expired = left <= HOP_S / 2  # its asker is about to give up: its own answer only, at once
    if not expired:
        answers, silent, asked_silent = _ask_tree([r for r in share if r != me], question, left, set(suspects))
    answers[me] = responder.ANSWERS[question[0]](asker, *question[1:])
    return {"answers": answers, "silent": sorted(silent), "asked_silent": sorted(asked_silent), "expired": expired}


responder.ANSWERS["relay"] = _relay
responder.SLOW.add("relay")


def ask_all(ranks: Sequence[int], question: Tuple[Any, ...], wait_s: Optional[float] = None) -> Gathered:
    """Every answer of ``ranks`` (but this rank's) to ``question`` that came in time: along the
    tree of relays, in rounds (see the module's docstring), within ``wait_s`` in all (default:
    :func:`job_budget`). A rank asked once that did not answer is not asked again (nor made a
    relay); the ranks behind silent relays are asked again, those on the relays' nodes one by one."""
    total = job_budget() if wait_s is None else wait_s
    nodes = nodemap.current()
    each = min(total, round_budget(len(nodes.names) if nodes is not None else 1))
    me = mpi.MPI().COMM_WORLD.Get_rank()
    missing = [r for r in ranks if r != me]
    answers: Dict[int, Any] = {}
    suspects: Set[int] = set()
    asked: Set[int] = set()  # asked and silent
    for _ in range(ROUNDS):
        got, silent, quiet = _ask_tree(missing, question, each, suspects)
        answers.update(got)
        asked |= quiet
        missing = [r for r in missing if r not in answers and r not in asked]
        total -= each
        if not missing or not silent - suspects or total < each:
            break
        suspects |= silent
    return Gathered(answers, missing)
