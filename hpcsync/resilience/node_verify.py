"""Whole bytes for node-local checkpoints: every file of the chosen checkpoint read whole by one
rank and checked against its marker's size and checksum before anything is loaded, a damaged copy
replaced by another node's copy of the same file.

:func:`verify` runs in rounds. In each, every file still unchecked is read whole by its **user**
(at the job's world size, the rank that wrote it: ``rank-<w>.pt`` and DCP's ``__<w>_*`` to rank
``w``; DCP's metadata and ``shared.pt`` to rank 0; at another world size, rank ``w`` modulo it)
from the first node that holds a copy not yet found damaged, its own node's first: from its own
disk, else fetched whole from a rank of that node (one
:func:`~hpcsync.resilience.peer_transfer.fetch`, bounded), and summed as it arrives. The ranks
then agree on the copies found damaged (an allgather of each rank's list, empty when all is well);
rank 0 warns of each, naming the folder, the file and the node, and the next round reads those
files from the next node that holds them. A disk that stops answering is not damage: it is that
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

__all__ = ["user", "verify"]

log = logging.getLogger(__name__)


def user(name: str, world: int, size: int) -> int:
    """The rank of a job of ``size`` ranks that checks (and at the same world size, loads) the
    file ``name`` of a checkpoint written by ``world`` ranks."""
    w = writer_of(name)
    return 0 if w is None else w % size if world != size else w


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
        source = {}
        for n in pending:  # (the same on every rank: holders and the damaged lists are)
            u = user(n, world, size)
            source[n] = node_of[u] if node_of[u] in left[n] else left[n][0]
        wants: Dict[int, List[Tuple[str, int, int]]] = {}
        for n in pending:
            if user(n, world, size) == me:
                theirs = ranks[source[n]]
                wants.setdefault(me if node_of[me] == source[n] else theirs[me % len(theirs)], []).append(
                    (n, 0, int(marker["files"][n])))
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
                log.warning("hpcsync.checkpoint: %s: damaged: the copy of %s on %s: %s; %s", folder, n,
                            node_names[source[n]], damaged[n], f"reading {node_names[left[n][0]]}'s copy instead"
                            if left[n] else "no node of this job holds a whole copy of it")
            if not left[n]:
                raise checksums.Damaged(folder, n, f"no node of this job holds a whole copy of {n} (the copy on "
                                        f"{node_names[source[n]]}: {damaged[n]})")
        pending = [n for n in pending if n in damaged]
    return cache, good, read
