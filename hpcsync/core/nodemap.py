"""Which node every rank runs on, and rank lists written for people: ``0-2, 4-31 on n0, n1``.

A rank that no longer answers (its node lost, its process frozen) cannot say where it is, so
every rank learns the whole map once, while all are healthy: one ``Allgather`` of a node index
per rank, and each node's hostname gathered among the node leaders only (``4 * ranks + ~20 *
nodes`` bytes per rank, not a hostname per rank).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence

__all__ = ["ranges", "NodeMap", "build", "set_current", "current", "describe"]

_current: Optional["NodeMap"] = None


def ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 4, 6, 7]`` -> ``"0-2, 4, 6-7"`` (sorted, duplicates dropped); ``"none"`` if empty."""
    rs = sorted(set(ranks))
    if not rs:
        return "none"
    out, start, prev = [], rs[0], rs[0]
    for r in rs[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(out)


@dataclass(frozen=True)
class NodeMap:
    """``node_of[rank]`` indexes ``names`` (nodes numbered by their lowest world rank)."""

    node_of: Sequence[int]
    names: Sequence[str]

    def host(self, rank: int) -> str:
        if 0 <= rank < len(self.node_of):
            return self.names[self.node_of[rank]]
        return "?"

    def nodes(self, ranks: Iterable[int]) -> List[str]:
        """The distinct nodes of ``ranks``, in node order."""
        return [self.names[k] for k in sorted({self.node_of[r] for r in ranks if 0 <= r < len(self.node_of)})]

    def describe(self, ranks: Iterable[int], max_nodes: int = 8) -> str:
        """``"2-3 on n1"``; many nodes are cut to ``max_nodes`` names and a count."""
        rs = sorted(set(ranks))
        if not rs:
            return "none"
        names = self.nodes(rs)
        more = f" and {len(names) - max_nodes} more node(s)" if len(names) > max_nodes else ""
        return f"{ranges(rs)} on {', '.join(names[:max_nodes])}{more}"

    def by_node(self, ranks: Iterable[int]) -> Dict[str, List[int]]:
        out: Dict[str, List[int]] = {}
        for r in sorted(set(ranks)):
            out.setdefault(self.host(r), []).append(r)
        return out


def build(world: Any, local: Any, node_rank: int, hostname: str) -> NodeMap:
    """Collective over ``world``: every rank gets the map (see the module docstring)."""
    from array import array

    from mpi4py import MPI

    size = world.Get_size()
    mine = array("i", [node_rank])
    every = array("i", bytes(4 * size))
    world.Allgather([mine, MPI.INT], [every, MPI.INT])
    leaders = world.Split(0 if local.Get_rank() == 0 else MPI.UNDEFINED, world.Get_rank())
    names = None
    if leaders != MPI.COMM_NULL:
        names = leaders.allgather(hostname)  # ordered by the leaders' world rank = node order
        leaders.Free()
    names = local.bcast(names, root=0)
    return NodeMap(list(every), list(names))


def set_current(nodes: NodeMap) -> None:
    global _current
    _current = nodes


def current() -> Optional[NodeMap]:
    """The map of this job, once :func:`hpcsync.topology` ran under MPI; None before or without MPI."""
    return _current


def describe(ranks: Iterable[int]) -> str:
    """``ranges(ranks)`` plus their nodes when the map is known."""
    nodes = _current
    return nodes.describe(ranks) if nodes is not None else ranges(ranks)
