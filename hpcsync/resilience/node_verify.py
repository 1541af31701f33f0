"""Whole bytes for node-local checkpoints: every file of the chosen checkpoint read whole by one
rank and checked against its marker's size and checksum before anything is loaded, a damaged copy
replaced by another node's copy of the same file.

:func:`verify` runs in rounds. In each, every file still unchecked is read whole by its **user**
(at the job's world size, the rank that wrote it: ``rank-<w>.pt`` and DCP's ``__<w>_*`` to rank
``w``; DCP's metadata and ``shared.pt`` to rank 0; at another world size, rank ``w`` modulo it)
from its own node's disk when that holds a copy not yet found damaged, else fetched whole from a
rank of the nodes that do, spread over all their ranks (:func:`server`; one
:func:`~hpcsync.resilience.peer_transfer.fetch`, bounded), and summed as it arrives. The ranks
then agree on the copies found damaged (an allgather of each rank's list, empty when all is well);
rank 0 warns of each, naming the folder, the file and the node, and the next round reads those
files from the other nodes that hold them. A disk that stops answering is not damage: it is that
rank's error, the same CheckpointError on every rank (naming the rank, node, file and phase). A file with no whole copy left makes the checkpoint
:class:`~hpcsync.resilience.checksums.Damaged` on every rank alike (the caller loads the previous
one). At most as many rounds as a file has copies (``replicas + 1``).

What the ranks then load comes from these checked bytes: each rank's own files from memory, the
metadata and ``shared.pt`` broadcast from rank 0; the byte ranges a rank reads of another rank's
file (replicated values, a resharded load) from the node whose copy was found whole.

Cost at N ranks (S the whole state, L a rank's local state): each rank reads S/N + L whole (what
it loads itself at the same world size), rank 0 also the metadata and ``shared.pt``; per round
one ``Alltoall`` of N integers (inside the fetch) and an allgather of each rank's damaged list (a
few bytes a rank when all is well: about 10 kB a rank at 1,000 ranks).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..core.errors import CheckpointError, raise_if_any_of
from . import checksums, peer_transfer
from .sharded import writer_of

__all__ = ["user", "server", "sources", "verify"]

log = logging.getLogger(__name__)


def user(name: str, world: int, size: int) -> int:
    """The rank of a job of ``size`` ranks that checks (and at the same world size, loads) the
    file ``name`` of a checkpoint written by ``world`` ranks."""
    w = writer_of(name)
    return 0 if w is None else w % size if world != size else w


def _turns(nodes: Sequence[int], ranks: Sequence[Sequence[int]]) -> List[int]:
    """The ranks of ``nodes`` taken in turn across them: the first rank of each, the second, ..."""
    turn: List[int] = []
    for i in range(max(len(ranks[k]) for k in nodes)):
        turn += [ranks[k][i] for k in nodes if i < len(ranks[k])]
    return turn


def server(me: int, nodes: Sequence[int], ranks: Sequence[Sequence[int]]) -> int:
    """The rank that serves rank ``me``'s reads of a file held on ``nodes`` (none of them
    ``me``'s own), when the requesters do not know of each other: the holders' ranks taken in
    turn across the nodes, ``me`` modulo their count. Consecutive requesters (a lost node's ranks)
    so reach distinct ranks of every holder node, every holder rank serving once they are as
    many (``nodes[me % n]`` then ``ranks[me % ppn]`` would use half the ranks of two holder
    nodes: the two choices correlate)."""
    turn = _turns(nodes, ranks)
    return turn[me % len(turn)]


def sources(pending: Sequence[str], world: int, size: int, left: Mapping[str, Sequence[int]],
            node_of: Sequence[int], ranks: Sequence[Sequence[int]]) -> Dict[str, int]:
    """For each file in ``pending``, the rank its user (:func:`user`) reads it from this round:
    itself when its own node holds a copy not yet found damaged (``left``: ``{file: [node]}``),
    else a rank of the nodes in ``left``: the files of each set of holders, by user and name, go
    to those nodes' ranks in turn (:func:`server`'s order), so every holder rank serves once there
    are as many files, and no two files share one while there are fewer. The same on every rank
    (every rank knows every file's user and holders). Cost: O(files) a round, on every rank (2
    files a rank: about 2,000 at 1,000 ranks)."""
    out: Dict[str, int] = {}
    remote: Dict[Tuple[int, ...], List[Tuple[int, str]]] = {}
    for n in pending:
        u = user(n, world, size)
        if node_of[u] in left[n]:
            out[n] = u
        else:
            remote.setdefault(tuple(left[n]), []).append((u, n))
    for nodes, files in remote.items():
        turn = _turns(nodes, ranks)
        for i, (_, n) in enumerate(sorted(files)):
            out[n] = turn[i % len(turn)]
    return out


def verify(ctl: Any, names: Sequence[str], world: int, holders: Mapping[str, Sequence[int]], marker: Mapping[str, Any],
           folder: str, node_of: Sequence[int], ranks: Sequence[Sequence[int]], node_names: Sequence[str],
           path_of: Callable[[str], Optional[str]], where: Callable[[int], str]
           ) -> Tuple[Dict[str, bytes], Dict[str, int], Dict[str, int]]:
    """Collective: the files ``names`` of the checkpoint in ``folder`` (on each node that holds
    it: ``holders``, ``{name: [node]}``), checked against ``marker`` (``files``: sizes, ``sums``:
    checksums) as described in the module. Returns ``(this rank's checked files, {name: bytes},
    {name: the node whose copy was found whole}, {"node": bytes read from this node, "peers":
    bytes fetched})``; :class:`~hpcsync.resilience.checksums.Damaged` on every rank when a file
    has no whole copy left."""
    me, size = ctl.Get_rank(), ctl.Get_size()
    left = {n: list(holders[n]) for n in names}
    pending = sorted(names)
    cache: Dict[str, bytes] = {}
    good: Dict[str, int] = {}
    read = {"node": 0, "peers": 0}
    for _ in range(max((len(v) for v in left.values()), default=0)):
        if not pending:
            break
        chosen = sources(pending, world, size, left, node_of, ranks)  # (the same on every rank)
        source = {n: node_of[r] for n, r in chosen.items()}
        wants: Dict[int, List[Tuple[str, int, int]]] = {}
        for n in pending:
            if user(n, world, size) == me:
                wants.setdefault(chosen[n], []).append((n, 0, int(marker["files"][n])))
        got, errors = peer_transfer.fetch(ctl, wants, path_of, where)
        bad = []
        for peer, items in wants.items():
            for item in items:
                data = got.get(item)
                why = checksums.file_problem(marker, item[0], None if data is None else bytes(data))
                if data is None:
                    why = "; ".join(errors[:2]) or f"{item[0]} cannot be read"
                if why is None:
                    cache[item[0]] = bytes(data)  # type: ignore[arg-type]
                    read["node" if peer == me else "peers"] += item[2]
                else:
                    bad.append((item[0], why))
        stuck = next((e for e in errors if peer_transfer.STUCK in e), None)  # (not damage: this rank's error)
        parts = ctl.allgather((bad, stuck))
        raise_if_any_of([s for _, s in parts], CheckpointError, "hpcsync.checkpoint: cannot load: ")
        damaged = {n: why for part, _ in parts for n, why in part}
        for n in pending:
            if n not in damaged:
                good[n] = source[n]
                continue
            left[n].remove(source[n])
            if me == 0:
                rest = ", ".join(node_names[k] for k in left[n])
                log.warning("hpcsync.checkpoint: %s: damaged: the copy of %s on %s: %s; %s", folder, n,
                            node_names[source[n]], damaged[n], f"reading the copy on {rest} instead" if len(left[n]) == 1
                            else f"reading a copy on {rest} instead" if left[n] else
                            "no node of this job holds a whole copy of it")
            if not left[n]:
                raise checksums.Damaged(folder, n, f"no node of this job holds a whole copy of {n} (the copy on "
                                        f"{node_names[source[n]]}: {damaged[n]})")
        pending = [n for n in pending if n in damaged]
    return cache, good, read
