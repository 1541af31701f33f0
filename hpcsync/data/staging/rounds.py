"""A stage across nodes, one round of the listing at a time.

The root holds the listing (it reads every file); the node leaders receive it in rounds of at
most :data:`ROUND_ENTRIES` entries. In each round every leader compares the round's files with
its node's manifest (read forward, in listing order: :class:`~.manifest.Lines`), the leaders
agree on the files some node lacks, the root broadcasts their bytes (:mod:`.broadcast`), and
each leader adds the round's records to its new manifest. What a leader holds is one round's
entries and records (about 30 MB at the default), its node's folders (their attributes are
set last) and, after a killed stage, that stage's journal; not the dataset's listing.

A node that cannot take a round (disk full, a folder where the source has a file) is an error
for every rank before anything of that round moves; the rounds before it stay done (in the
journal: the next call skips them). Before the first round a node is refused when the source's
bytes less what its manifest and journal record cannot fit (a lower bound on its need).

At N ranks on M nodes only the M leaders take part. Per round of R entries: a broadcast of the
round's listing (about 100 bytes per entry pickled, 6.5 MB at the default: O(log M) steps of
MPI's tree), an allgather of the leaders' errors (a few bytes from each: every leader receives M
of them), an Allreduce of R bytes (which files some node lacks), then the data's broadcast
rounds; F entries take ceil(F / R) rounds (16 at a million). Rank 0 receives no more per round
than any leader, and each exchange is bounded by the stage's timeout, per round.
"""
from __future__ import annotations

import os
import pickle
import socket
import uuid
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ...core import bigmpi, mpi
from ...observe.progress import Progress
from .broadcast import Reader, broadcast, close_bar, unexpected
from .destination import Destination, clear_killed, set_dir_attributes
from .fileops import syncfs
from .journal import journals, read_journals
from .listing import DIR, FILE, LINK, Entry
from .manifest import MANIFEST, Lines, LinesWriter, load, recorded_bytes, remove_journals
from .options import Listing, StageOptions

__all__ = ["ROUND_ENTRIES", "stage_across_nodes", "NodeInRounds"]

ROUND_ENTRIES = 65536  #: listing entries per round: what a node leader holds at once


def stage_across_nodes(leaders: Any, entries: List[Entry], ignored: List[str], opts: StageOptions,
                       tick: Callable[[], None], say: Callable[[str], None]
                       ) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """The leaders' part of a stage across nodes (``entries``, ``ignored``: the root's listing;
    empty elsewhere). Returns ``(result on the root else None, this node's error or None)``.
    ``tick`` tells the node's other ranks of each step, ``say`` what a timeout names."""
    src, dst = opts.src, opts.dst
    me = leaders.Get_rank()
    is_root = me == 0
    files = [e for e in entries if e.kind == FILE]
    total = sum(e.size for e in files)
    single = len(entries) == 1 and entries[0].kind == FILE
    token, total, single, count, per_round = leaders.bcast(
        (uuid.uuid4().hex[:12], total, single, len(entries), ROUND_ENTRIES) if is_root else None, root=0)
    host = socket.gethostname()
    node = NodeInRounds(dst, src, [], opts.durable, host, call=uuid.uuid4().hex)

    def now(doing: str) -> None:
        say(doing)
        tick()

    now("looking at the destination")
    err = node.open_destination(token, me)
    try:
        if not any(leaders.allgather(err)):
            node.writes = _writers(leaders.allgather(node.sees_probes(token, me)))[me] == me
    finally:
        node.close_probe()
    if err is None and node.writes:
        try:
            err = node.open_rounds(total)
        except Exception as exc:  # every rank must still reach the collectives below
            err = f"node {host}: {unexpected(exc)}"
    try:
        if any(leaders.allgather(err)):
            return None, err  # no node moves anything when one cannot take it; every rank raises
        return _rounds(leaders, node, Listing(entries, ignored, files, total, count, per_round, single), opts, tick, now)
    finally:
        node.close_rounds()  # (whatever ended the stage: a round's timeout too)


def _rounds(leaders: Any, node: "NodeInRounds", listing: Listing, opts: StageOptions, tick: Callable[[], None],
            now: Callable[[str], None]) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """The rounds, once every node can take the copy, then what each node wrote."""
    entries, ignored, files, total = listing.entries, listing.ignored, listing.files, listing.total
    count, per_round, single = listing.count, listing.per_round, listing.single
    src, dst, chunk_bytes, progress, limit, names = opts.src, opts.dst, opts.chunk_bytes, opts.progress, opts.limit, opts.names
    is_root = leaders.Get_rank() == 0
    host = node.host
    err = None
    reader = Reader(src, [], single) if is_root else None
    bar = None
    done = {"files": 0, "bytes": 0, "rounds": 0}
    copied: List[str] = []
    skipped: List[str] = []
    complete = False
    try:
        try:
            if is_root:
                bar = Progress(f"staging {os.path.basename(src) or src}", total, enabled=progress)
        except Exception as exc:
            node.note(unexpected(exc))
        rounds = max(1, -(-count // per_round))
        for r in range(rounds):
            now(f"sending round {r + 1} of {rounds} of the listing to the node leaders")
            stop = is_root and reader.stopped is not None  # type: ignore[union-attr]
            part = entries[r * per_round:(r + 1) * per_round] if is_root and not stop else []
            part, stop = pickle.loads(bigmpi.bcast_bytes(leaders, pickle.dumps((part, stop), protocol=5)
                                                         if is_root else b"", root=0))
            if stop:  # the root's reader stopped: its error is the stage's
                break
            stopped, err = _round(leaders, node, reader, part, chunk_bytes, bar, limit, tick, now, done,
                                  (copied, skipped) if names and is_root else None)
            if stopped:  # a node cannot take this round: nothing of it moved
                break
        else:
            complete = True
    finally:
        close_bar(bar, node)
    try:  # (also after an error: the journal keeps what finished, the next call skips it)
        finished = node.finish(complete=complete)
        err = err or (reader.error if reader is not None else None) or finished
    except Exception as exc:  # every leader must still reach the gather below
        err = err or f"node {host}: {unexpected(exc)}"
    stats = (host, node.files_written, node.bytes_written)
    now("gathering what each node wrote")
    every = leaders.gather(stats, root=0)
    if not is_root:
        return None, err
    result = dict(
        source=src, destination=dst, files=len(files), bytes=total,
        dirs=sum(e.kind == DIR for e in entries), symlinks=sum(e.kind == LINK for e in entries),
        copied_files=done["files"], skipped_files=len(files) - done["files"],
        copied=tuple(copied) if names else None, skipped=tuple(skipped) if names else None,
        copied_bytes=done["bytes"], source_reads=reader.read_bytes, broadcasts=done["rounds"],  # type: ignore[union-attr]
        nodes=leaders.Get_size(), written=tuple(tuple(s) for s in every), ignored=tuple(ignored))
    return result, err


class NodeInRounds(Destination):
    """A node leader's copy when the listing comes in rounds: the manifest found is read forward,
    the new one written round by round (:mod:`.manifest`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.out: Optional[LinesWriter] = None  # the new manifest, written round by round
        self.old: Any = {}  # the manifest found (Lines, read forward; a dict for version 1)
        self.resumed: Dict[str, Any] = {}  # a killed stage's records (its journal)
        self.round_old: Dict[str, Any] = {}  # the round's records kept from before
        self.dirs: List[Entry] = []  # every round's folders: their attributes are set last
        self.listed = self.emitted = 0  # files listed, records written to the new manifest

    def _stale(self) -> bool:
        """The new manifest differs from the one found (another form, names gone or new)."""
        if isinstance(self.old, Lines):
            return self.old.rest() > 0 or self.old.passed > 0 or self.emitted != self.listed
        return bool(self.old) or self.emitted != self.listed

    def open_rounds(self, total_bytes: int) -> Optional[str]:
        """Before the first round: a killed stage's journals and temporary names, the manifest
        found (read forward from here), the new one begun under its temporary name. A node needs
        at least the source's ``total_bytes`` less what its manifest and journal record: refused
        now, before any byte moves, if they cannot fit (each round checks its own need again).
        Returns an error naming node and path, or None."""
        dst = self.dst
        found = journals(dst)
        self.old = load(dst, self.src, self.host)
        self.journal.carried = read_journals(dst, found, self.src, self.resumed, self.host)
        try:
            manifest = os.path.join(dst, MANIFEST)
            self.interrupted = clear_killed(self, found)
            held = None if self.old == {} and os.path.lexists(manifest) else recorded_bytes(self.old, manifest)
            resumed = recorded_bytes(self.resumed, "")
            vfs = os.statvfs(dst)
            free = vfs.f_bavail * vfs.f_frsize
            if held is not None and resumed is not None and total_bytes - held - resumed > free:
                return self._where(f"not enough space in {dst}: need at least {total_bytes - held - resumed} bytes, "
                                   f"{free} free (disk full)")
            self.out = LinesWriter(dst, self.tmp_path(manifest, mine=False), self.src)
        except OSError as exc:
            return self._where(f"preparing {exc.filename or dst}: {exc.strerror}")
        return None

    def begin_round(self, entries: List[Entry]) -> Optional[str]:
        """The next round of the listing: what this node lacks of it (:attr:`need`), its folders
        made, its links listed, room for it checked. Returns an error naming node and path, or None."""
        self.skip_round(entries)
        rels = [e.rel for e in entries if e.kind == FILE]
        old = self.old.take(rels) if isinstance(self.old, Lines) else {r: self.old[r] for r in rels if r in self.old}
        if self.resumed:
            old.update((r, self.resumed[r]) for r in rels if r in self.resumed)
        self.round_old = old
        self.listed += len(rels)
        self.dirs.extend(e for e in entries if e.kind == DIR)
        return self._compare(old)

    def skip_round(self, entries: List[Entry]) -> None:
        """A round this node writes nothing of (another leader writes its ``dst``, or it failed)."""
        self.entries, self.need, self.links, self.records = entries, np.zeros(len(entries), dtype=np.uint8), [], {}

    def end_round(self) -> None:
        """The round's bytes are in: its records (copied now, or kept) go to the new manifest, in
        listing order. A node that failed writes none (its journal keeps what finished)."""
        if self.out is None or self.failed:
            return
        new, old, need = self.records, self.round_old, self.need
        out = []
        for i, e in enumerate(self.entries):
            if e.kind == FILE:
                rec = new.get(e.rel) if need[i] else old.get(e.rel)
                if rec is not None:
                    out.append((e.rel, rec))
        self.emitted += len(out)
        try:
            self.out.add(out)
            self.checkpoint()  # the round's copies into the journal: a kill from here on keeps them
        except OSError as exc:
            self.note(f"writing the stage manifest in {self.dst}: {exc.strerror}")
        except Exception as exc:  # this node's error, reported by finish; every leader goes on
            self.note(unexpected(exc))
        self.round_old = {}

    def close_rounds(self) -> None:
        """Whatever happened: the manifest found closed, the new one removed unless put in place
        (but on a node whose disk stopped answering: nothing more touches it, the next call
        removes the temporary name)."""
        if self.stalled is not None:
            return
        if isinstance(self.old, Lines):
            self.old.close()
        if self.out is not None:
            self.out.discard()

    def at(self, rel: str) -> str:
        return f"{self.dst}/{rel}" if rel else self.dst

    def sees_probes(self, token: str, index: int) -> Tuple[bool, bool]:
        """Whether leader 0's and the previous leader's probe files are visible in our ``dst``."""
        if index == 0:
            return False, False
        return (os.path.exists(self.probe_path(token, 0)),
                index > 1 and os.path.exists(self.probe_path(token, index - 1)))

    def _put_manifest(self) -> None:
        if self.durable:
            syncfs(self.dst)
        self.out.commit(self.durable)  # type: ignore[union-attr]
        remove_journals(self.dst)

    def _no_manifest(self) -> None:
        if self.out is not None:
            self.out.discard()

    def _set_dir_attributes(self) -> None:
        set_dir_attributes(self.dirs, lambda i: self.at(self.dirs[i].rel))


def _round(leaders: Any, node: NodeInRounds, reader: Optional[Reader], part: List[Entry], chunk_bytes: int,
           bar: Optional[Progress], limit: Optional[float], tick: Callable[[], None], now: Callable[[str], None],
           done: Dict[str, int], names: Optional[Tuple[List[str], List[str]]]) -> Tuple[bool, Optional[str]]:
    """One round of the listing: what the nodes lack of it, then its bytes. Returns ``(stop, this
    node's error)``: ``stop`` on every leader when a node cannot take the round (nothing of it
    moves, the stage ends)."""
    err = None
    if node.writes and node.broken is None:
        try:
            err = node.begin_round(part)
        except Exception as exc:  # every leader must still reach the collectives below
            err = f"node {node.host}: {unexpected(exc)}"
    else:  # another leader writes this directory, or this node already failed: nothing to write
        node.skip_round(part)
    now("agreeing on which files the nodes lack")
    if any(leaders.allgather(err)):
        return True, err
    union = node.need.copy()
    leaders.Allreduce(node.need, union, op=mpi.MPI().MAX)
    todo = [(i, part[i].size) for i in np.flatnonzero(union).tolist()]
    if reader is not None:  # the root counts
        done["files"] += len(todo)
        done["bytes"] += sum(n for _, n in todo)
        if names is not None:
            _sort(part, union, *names)
        if bar is not None:
            try:
                bar.update(sum(e.size for i, e in enumerate(part) if e.kind == FILE and not union[i]))
            except Exception as exc:
                reader.stop(unexpected(exc))
                bar = None
        reader.next_round(part)
    try:
        if node.writes and node.broken is None:
            node.start()  # the journal, then the links
    except Exception as exc:
        node.note(unexpected(exc))
    now("the transfer")
    done["rounds"] += broadcast(leaders, todo, chunk_bytes, reader, node, bar, limit / 4 if limit else None, tick)
    if node.writes:
        node.end_round()
    return False, None


def _sort(part: Sequence[Entry], union: Any, copied: List[str], skipped: List[str]) -> None:
    for i, e in enumerate(part):
        if e.kind == FILE:
            (copied if union[i] else skipped).append(e.rel)


def _writers(sees: Sequence[Tuple[bool, bool]]) -> List[int]:
    """Which leader writes for each node, from whether each sees the probe file of leader 0 and of
    the leader before it in ``dst``: nodes that share ``dst`` (a shared filesystem given as the
    destination) write it once. Sharing that is neither with leader 0 nor between neighbours goes
    undetected; it stays correct (per-node temporary names, atomic renames), only redundant."""
    writer: List[int] = []
    for i, (first, previous) in enumerate(sees):
        writer.append(0 if i and first else writer[i - 1] if i and previous else i)
    return writer
