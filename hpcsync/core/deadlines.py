"""Every deadline of the failure and hang reports, derived in one place from the job's size.

A report asks other ranks questions while the job may be broken, and every wait is bounded. The
bounds are not constants: they follow the job's size (ranks, nodes, the most ranks on a node)
through the depth of the relay tree (:mod:`hpcsync.observe.relay`) and an answer rate, the
answers one responder gives a second (:data:`ANSWER_RATE`: gloo's measured rate, the slowest of
the measured ones, ``docs/timeouts.md``). A hop is allowed :data:`HOP_BASE_S` (a responder polls
every 0.1 s, and under load answers later) plus the time the widest rank of a hop takes to hear
all its answers at that rate; a node's ranks asked at once get the base and one answer per
node-mate. :class:`Deadlines` holds the values; :meth:`Deadlines.for_job` computes them;
:func:`rows` writes them as the table of ``docs/timeouts.md`` (a test compares the two).

At 1,000 ranks on 125 nodes of 8: a hop is 1.02 s, the tree 3 hops deep, one round 4.08 s,
settling who prints and the gathering 12.2 s each at most, the whole report 32.5 s and its
bound 37.5 s (computing the values: a few µs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["FANOUT", "HOP_BASE_S", "ANSWER_RATE", "ROUNDS", "SETTLE_ROUNDS", "PRINT_S", "MIN_BOUND_S", "LOGS_BASE_S",
           "SIZES", "FORMULAS", "depth", "Deadlines", "current", "rows"]

FANOUT = 16  #: relays a rank asks (besides its own node's ranks)
HOP_BASE_S = 1.0  #: one hop's allowance before the answers' own time
ANSWER_RATE = 1210.0  #: answers a second one responder gives (gloo's, measured: docs/timeouts.md)
ROUNDS = 3  #: rounds of a gathering at most: the first, then the ranks behind silent relays
SETTLE_ROUNDS = 3  #: rounds of the min-reduction that settles who prints (k frozen relays: k + 1)
PRINT_S = 5.0  #: printing the report, writing its JSON, the launcher forwarding it
MIN_BOUND_S = 30.0  #: a report's whole bound is never shorter (a loaded machine's slow start)
LOGS_BASE_S = 30.0  #: rank 0's console waits at exit this long, and one answer's time per rank

#: the job sizes the table of docs/timeouts.md states: (ranks, nodes)
SIZES: Tuple[Tuple[int, int], ...] = ((2, 1), (1024, 128), (8192, 1024))


def depth(nodes: int, fanout: Optional[int] = None) -> int:
    """Hops from an asker to the farthest rank of a job on ``nodes`` nodes: one level of relays
    per factor of ``fanout`` (default :data:`FANOUT`) in the number of nodes, plus a node's own
    ranks."""
    fanout = FANOUT if fanout is None else fanout
    return 1 + (math.ceil(math.log(nodes, fanout) - 1e-9) if nodes > 1 else 0)


@dataclass(frozen=True)
class Deadlines:
    """The bounds (seconds) of one job's reports; each field's formula is in :data:`FORMULAS`."""

    ranks: int
    nodes: int
    per_node: int
    rate: float
    hops: int  #: the relay tree's depth
    hop_s: float  #: one hop
    node_mates_s: float  #: a node's lower ranks asked at once (have they failed too?)
    round_s: float  #: one round along the tree: a hop per level and one for the way back
    settle_s: float  #: who prints: the min-reduction along the tree
    gather_s: float  #: the gathering: every rank's state along the tree
    tracebacks_s: float  #: one representative per distinct error (or stacks), asked at once
    report_s: float  #: the whole report, from a rank's failure to its printing
    report_bound_s: float  #: how long a rank waits for the report before its own end
    wait_s: float  #: a rank that left the report to another waits this long for it
    logs_close_s: float  #: rank 0's console waits at exit for the other ranks' last warnings

    @classmethod
    def for_job(cls, ranks: int, nodes: int, per_node: Optional[int] = None,
                rate: float = ANSWER_RATE) -> "Deadlines":
        """The deadlines of a job of ``ranks`` on ``nodes`` nodes (``per_node``: the most ranks on
        a node, by default as even as can be), at ``rate`` answers a second."""
        ranks, nodes = max(1, ranks), max(1, nodes)
        per = per_node if per_node is not None else -(-ranks // nodes)
        hops = depth(nodes)
        hop = HOP_BASE_S + (FANOUT + per) / rate  # (FANOUT read now: a test may set it)
        mates = HOP_BASE_S + per / rate
        round_s = hop * (hops + 1)
        settle, gather, tracebacks = SETTLE_ROUNDS * round_s, ROUNDS * round_s, 2 * hop
        report = mates + settle + gather + tracebacks + PRINT_S
        bound = max(MIN_BOUND_S, report + PRINT_S)
        return cls(ranks, nodes, per, rate, hops, hop, mates, round_s, settle, gather, tracebacks, report, bound,
                   bound - PRINT_S, LOGS_BASE_S + ranks / rate)


#: each deadline's formula, as docs/timeouts.md states it
FORMULAS: Tuple[Tuple[str, str], ...] = (
    ("hops", "1 + ceil(log16(nodes))"),
    ("hop_s", "1 s + (16 + ranks a node) / R"),
    ("node_mates_s", "1 s + ranks a node / R"),
    ("round_s", "hop × (hops + 1)"),
    ("settle_s", "3 rounds"),
    ("gather_s", "3 rounds"),
    ("tracebacks_s", "2 hops"),
    ("report_s", "node mates + settle + gather + tracebacks + 5 s"),
    ("report_bound_s", "max(30 s, report + 5 s)"),
    ("wait_s", "report bound − 5 s"),
    ("logs_close_s", "30 s + ranks / R"),
)


def current() -> Deadlines:
    """The deadlines of this job: its ranks and the node map (one node before it is known)."""
    from . import mpi, nodemap

    nodes = nodemap.current()
    if nodes is not None and len(nodes.node_of):
        counts: Dict[int, int] = {}
        for k in nodes.node_of:
            counts[k] = counts.get(k, 0) + 1
        return Deadlines.for_job(len(nodes.node_of), len(nodes.names), max(counts.values()))
    ranks = mpi.MPI().COMM_WORLD.Get_size() if mpi.already_initialized() else 1
    return Deadlines.for_job(ranks, 1)


def rows(sizes: Sequence[Tuple[int, int]] = SIZES) -> List[str]:
    """The table of docs/timeouts.md: a line per deadline, its formula, its value at ``sizes``."""
    jobs = [Deadlines.for_job(r, n) for r, n in sizes]
    head = " | ".join(f"{r:,} ranks ({n:,} node{'s' if n > 1 else ''})" for r, n in sizes)
    out = [f"| deadline | formula | {head} |", "|---" * (2 + len(sizes)) + "|"]
    for name, formula in FORMULAS:
        values = [getattr(d, name) for d in jobs]
        cells = " | ".join(str(v) if isinstance(v, int) else f"{v:.2f} s" for v in values)
        out.append(f"| `{name}` | {formula} | {cells} |")
    return out
