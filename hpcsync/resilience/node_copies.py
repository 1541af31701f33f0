"""Sharded checkpoints on node-local disks, each rank's files copied to peers on other nodes.

``Checkpoints(root, local_dir=DIR, replicas=1, shared_every=K)`` with ``save(step, sharded=...)``:

- **written where the node is**: every rank writes its shard (torch.distributed.checkpoint's
  files), its ``local`` state and, on rank 0, the shared state and DCP's metadata into its own
  node's ``DIR/hpcsync-<root's name>-<hash>/`` (one folder per checkpoint root, made ``0700``
  where anyone may create names; a symbolic link or another user's folder is refused);
- **copied to ``replicas`` other nodes**: rank ``i`` of node ``k`` sends its files to rank ``i``
  (modulo that node's ranks) of nodes ``k+1 .. k+replicas`` over MPI, in bounded chunks
  (:mod:`hpcsync.resilience.peer_transfer`), so any ``replicas`` nodes may be lost;
- **complete only when every part and every copy is durable**: the ranks agree, then each node's
  first rank writes that node's marker (the files it holds, their sizes and checksums, how many
  the whole checkpoint has; version 2, sealed with its own checksum) and renames the folder into
  place; older ones beyond ``keep`` are removed. Every checksum is taken as the bytes are written
  (DCP's through :func:`~hpcsync.resilience.sharded.summing_writer`), and each copy is summed
  again as it is sent and as it is received, checked against it
  (:func:`~hpcsync.resilience.peer_transfer.send_files`);
- **the shared root every K-th save** (by sequence number; ``shared_every=0``: never): each rank
  copies its own files from the node-local folder into the root (summed as copied, checked
  against the sums taken as written), which is then marked complete as any sharded checkpoint
  there, every file's checksum in its marker. The other saves write no checkpoint data there: rank 0 claims the
  root (its owner record: one job per root) and reads its markers (the next sequence number).

A load gathers every node's list of complete copies to rank 0, which takes the last saved
checkpoint whose files the nodes of this job hold between them (or the root's, if it is newer):
every file is then read whole by one rank and checked against its checksum, a damaged copy
replaced by another node's (:mod:`hpcsync.resilience.node_verify`; no whole copy left: that
checkpoint is skipped on every rank and the previous whole one loaded); each rank then reads the
byte ranges DCP asks of it from those checked bytes, or fetches exactly those from a rank whose
node's copy was found whole (one bounded exchange), and no checkpoint data from the shared root
(rank 0 lists it and reads its markers, to compare). Only when no complete set
survived does it read the root. A copy is one save's: its marker carries a token rank 0 drew for
that save, so copies of two jobs' saves with the same number never pass for one checkpoint; and
one run's: its marker carries the root's run identity (:class:`~hpcsync.resilience.root_owner.RunRecord`,
read by rank 0 once per save and per load, sent with its plan or choice), and a copy of another
identity is never loaded (rank 0 warns; the node's next save removes it): a root that is gone
while copies remain is a new run, which starts fresh. Saves are numbered from the root's counter,
whatever the form, so the root's newer checkpoints win over older copies. The
copies move over MPI (a job under torchrun alone gets a clear error); the ranks must give the same
options (checked).

The node-local folder outlives a job step and a relaunch on the same nodes (it is a folder on the
node's disk), not the allocation when ``DIR`` is the allocation's own (``$SLURM_TMPDIR``, or a
job-named folder the job script removes at its end): clean-up is then the cluster's. Meanwhile
each node keeps at most ``keep`` complete copies while it is in the job; a node left out by a
relaunch keeps what it had until the allocation ends, and hpcsync never removes a ``DIR`` that
outlives the allocation. Each node completes its copy on its own after the ranks agreed: a crash
between two nodes' renames leaves the newest checkpoint incomplete on the nodes (with ``keep=1``,
the root's is then loaded). A job of another world size loads the same copies (DCP reshards; the
ranks' ``local`` states are then not loaded).

Cost at N ranks on M nodes (S the whole state, L a rank's local state, M_d DCP's metadata, a
few files a rank): a save writes S/N + L on each rank and, for each copy, sends and receives as
much point-to-point, all ranks at once; its exchanges are an allgather of hostnames (first use),
rank 0's plan broadcast, an allgather of one count a rank, and the error agreements (O(log N) rounds each, a few
bytes a rank). A load gathers the node leaders' lists of complete copies to rank 0 (a few names
a rank: about 0.2 MB in all at 1,024 ranks and ``keep=2``), broadcasts rank 0's choice with a
holder for each file (about 80 KB a rank at 1,024 ranks), broadcasts the metadata and the shared
state from one holder, and runs one ``Alltoall`` of N integers (8 KB a rank at 1,024); then only
the ranks that ask and those that serve exchange messages: a rank receives S/N + L + M_d, the
lost node's ranks from peers, the others from their own disks. Deadlines: each chunk of a copy or
a fetch waits the timeout plus its own time at ``HPCSYNC_CHECKPOINT_MBPS``; the agreements allow
for the biggest rank's part (save) or a node's share (load) at that speed.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
import uuid
import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..core.errors import CheckpointError, raise_if_any
from ..data.filesync import fsync_dir
from ..data.staging.private import make_private_dirs, not_private
from . import checkpoint_io, checksums, dcp_reader, node_verify, peer_transfer
from . import sharded as _sharded
from .checkpoint_io import from_rank0, loads
from .root_owner import advance, claim

__all__ = ["MARKER", "FOLDER", "Layout", "Chosen", "needs_mpi", "layout", "base", "save", "latest", "load"]

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
FOLDER = _sharded.FOLDER
_SUMS = ".sums-"  # a rank's checksums of what it holds, in a save's temporary folder, for its node's marker


@dataclass(frozen=True)
class Layout:
    """Which ranks of a communicator share a node (its hostname), nodes numbered by their lowest
    rank; where each rank's copies go."""

    node_of: Sequence[int]
    ranks: Sequence[Sequence[int]]
    names: Sequence[str]

    @classmethod
    def of(cls, hosts: Sequence[str]) -> "Layout":
        index: Dict[str, int] = {}
        for h in hosts:
            index.setdefault(h, len(index))
        ranks: List[List[int]] = [[] for _ in index]
        for r, h in enumerate(hosts):
            ranks[index[h]].append(r)
        return cls([index[h] for h in hosts], ranks, list(index))

    def leader(self, rank: int) -> int:
        return self.ranks[self.node_of[rank]][0]

    def peers(self, rank: int, replicas: int) -> List[int]:
        """The ranks that get ``rank``'s copies: the same place on each of the next nodes."""
        k, nodes = self.node_of[rank], len(self.ranks)
        i = self.ranks[k].index(rank)
        out = []
        for j in range(1, min(replicas, nodes - 1) + 1):
            theirs = self.ranks[(k + j) % nodes]
            out.append(theirs[i % len(theirs)])
        return out

    def incoming(self, rank: int, replicas: int) -> List[int]:
        return [r for r in range(len(self.node_of)) if rank in self.peers(r, replicas)]

    def where(self, rank: int) -> str:
        return f"rank {rank} on {self.names[self.node_of[rank]]}"


def needs_mpi(ctl: Any) -> None:
    """The copies move point-to-point over MPI: a job of several ranks without it (torchrun alone)
    gets the same error on every rank (one process needs no exchange)."""
    if ctl.Get_size() > 1 and not hasattr(ctl, "raw"):
        raise CheckpointError("hpcsync.checkpoint: Checkpoints(local_dir=...) needs MPI (mpi4py under mpirun, "
                              "mpiexec or srun): node-local copies move between the ranks over it")


def layout(ckpts: Any, ctl: Any) -> Layout:
    """The layout of ``ctl``'s ranks (one allgather of hostnames, the first time)."""
    if ckpts._layout is None or len(ckpts._layout.node_of) != ctl.Get_size():
        ckpts._layout = Layout.of(ctl.allgather(socket.gethostname()))
    return ckpts._layout


def base(ckpts: Any) -> str:
    """This node's folder for the checkpoints of ``ckpts.root``."""
    name = os.path.basename(ckpts.root.rstrip("/")) or "root"
    return os.path.join(ckpts.local_dir, f"hpcsync-{name}-{zlib.crc32(ckpts.root.encode()):08x}")


def _name(step: int, seq: int, token: str) -> str:
    """A node-local checkpoint's folder: its step, sequence number and the save's own token (two
    jobs' saves of one number, on nodes that met later, never pass for one checkpoint)."""
    return f"step-{step:08d}.{seq}.{token}"


def _copies(folder: str) -> Dict[Tuple[int, str], Tuple[str, dict]]:
    """This node's complete copies: ``{(seq, token): (folder, marker)}``; a copy whose marker is
    damaged (its own checksum: :func:`~hpcsync.resilience.checksums.marker_problem`), another
    folder's, or whose files are missing or differ from it in size is skipped with a warning (the
    files' checksums are checked as they are read, on load)."""
    found: Dict[Tuple[int, str], Tuple[str, dict]] = {}
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return found
    for name in names:
        path = os.path.join(folder, name)
        if not name.startswith("step-"):
            continue
        try:
            with open(os.path.join(path, MARKER)) as f:
                marker = json.load(f)
            why = checksums.marker_problem(marker)
            if why is not None:
                raise ValueError(why)
            bad = [n for n, size in marker["files"].items() if os.path.getsize(os.path.join(path, n)) != size]
            if bad:
                raise ValueError(f"{', '.join(bad[:3])} differ in size from its marker")
            if not all(isinstance(marker.get(k), int) for k in ("step", "seq", "count", "world_size")):
                raise ValueError("its marker lacks a step, sequence number, file count or world size")
            if name != _name(marker["step"], marker["seq"], str(marker.get("token"))):
                raise ValueError(f"its marker is another checkpoint's (step {marker['step']}, number {marker['seq']})")
            found[(marker["seq"], str(marker["token"]))] = (path, marker)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("hpcsync.checkpoint: skipping the node-local copy %s: %s", path, exc)
    return found


def _own(folder: str, rank: int) -> Dict[str, str]:
    """The files this rank wrote into ``folder``: ``{name in the checkpoint: path}``."""
    names = [f"rank-{rank:05d}.pt"] + [f"{FOLDER}/{n}" for n in os.listdir(os.path.join(folder, FOLDER))
                                       if n.startswith(f"__{rank}_")]
    if rank == 0:
        names += [f"{FOLDER}/.metadata", "shared.pt"]
    return {n: os.path.join(folder, n) for n in names}


def _held(folder: str) -> Dict[str, int]:
    """Every checkpoint file in ``folder`` (its own ranks' and the copies), with its size."""
    out = {}
    for sub in ("", FOLDER):
        for n in os.listdir(os.path.join(folder, sub)):
            path = os.path.join(folder, sub, n)
            if n != MARKER and not n.startswith(_SUMS) and os.path.isfile(path):
                out[f"{sub}/{n}" if sub else n] = os.path.getsize(path)
    return out


def save(ckpts: Any, ctl: Any, step: int, shared: Any, local: Any, state: Any, to_root: bool = False) -> str:
    """:meth:`Checkpoints.save` with ``sharded=`` and ``local_dir``: see the module. Returns this
    node's folder of the new checkpoint (the root's, on a save that also went there). Collective."""
    me, size = ctl.Get_rank(), ctl.Get_size()
    failed = f"hpcsync.checkpoint: step {step} not saved: "
    needs_mpi(ctl)
    lay = layout(ckpts, ctl)
    replicas = min(ckpts.replicas, len(lay.ranks) - 1)
    if replicas < ckpts.replicas and me == 0 and "replicas" not in ckpts._warned:
        ckpts._warned.add("replicas")
        log.warning("hpcsync.checkpoint: replicas=%d, but the job has %d node(s): each checkpoint is on %d node(s); "
                    "losing one loses its newest copies", ckpts.replicas, len(lay.ranks), replicas + 1)
    pg, data, blob, _, plain = _sharded.prepare(ckpts, ctl, step, shared, local, state)
    here, leader, error = base(ckpts), lay.leader(me) == me, None
    if leader:
        try:
            refused = make_private_dirs(here)
            if refused:
                raise CheckpointError(f"local_dir: {refused}")
            for name in os.listdir(here):  # what an interrupted save left
                if name.startswith(".step-") and name.endswith(".tmp"):
                    shutil.rmtree(os.path.join(here, name), ignore_errors=True)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}".removeprefix("CheckpointError: ")
    raise_if_any(ctl, error, CheckpointError, failed)

    def plan() -> Tuple[int, str, float, bool, str]:  # rank 0: the root's counter (every form's), its run
        seq, run = advance(ckpts.root, ckpts._job, ckpts._root_seq())
        return (seq, uuid.uuid4().hex[:12], time.time(),
                to_root or (bool(ckpts.shared_every) and seq % ckpts.shared_every == 0), run)

    seq, token, saved_at, to_root, run = from_rank0(ctl, plan, f"step {step} not saved (rank 0: {{}})")
    name = _name(step, seq, token)
    tmp, final = os.path.join(here, f".{name}.tmp"), os.path.join(here, name)
    error = None
    try:
        if leader:
            os.makedirs(os.path.join(tmp, FOLDER))
    except OSError as exc:
        error = f"cannot make {tmp}: {exc}"
    raise_if_any(ctl, error, CheckpointError, failed)
    error, own, sums = None, {}, {}
    try:
        import torch.distributed.checkpoint as dcp

        writer = _sharded.summing_writer(os.path.join(tmp, FOLDER))
        dcp.save(plain, storage_writer=writer, process_group=pg, no_dist=_sharded.single_process())
        sums = {f"{FOLDER}/{n}": v for n, v in writer.fs.sums.items()}  # (summed as DCP wrote them)
        sums[f"rank-{me:05d}.pt"] = checkpoint_io.write_file(os.path.join(tmp, f"rank-{me:05d}.pt"), data)
        if me == 0:
            sums["shared.pt"] = checkpoint_io.write_file(os.path.join(tmp, "shared.pt"), blob)
        own = _own(tmp, me)
        sums = {n: v for n, v in sums.items() if n in own}
    except _sharded.failed_types() as exc:
        error = _sharded.why_failed(exc)
    raise_if_any(ctl, error, CheckpointError, failed)
    out = {peer: sorted(own.items()) for peer in lay.peers(me, replicas)}
    got, errors = peer_transfer.send_files(ctl, out, lay.incoming(me, replicas), tmp, lay.where, sums)
    error = errors[0] if errors else None
    if error is None:  # what this rank holds on its node and the sums taken as it was written: for its leader
        try:
            held = {**sums, **{n: v for n, (_, v) in got.items() if v is not None}}
            checkpoint_io.write_file(os.path.join(tmp, f"{_SUMS}{me:05d}"), json.dumps(held).encode())
        except OSError as exc:
            error = f"cannot write {tmp}: {exc}"
    raise_if_any(ctl, error, CheckpointError, failed)
    count = sum(ctl.allgather(len(own)))  # every rank's files are on disk, its copies too
    error = None
    if leader:
        try:
            node_sums: Dict[str, str] = {}
            for r in lay.ranks[lay.node_of[me]]:
                path = os.path.join(tmp, f"{_SUMS}{r:05d}")
                with open(path) as f:
                    node_sums.update(json.load(f))
                os.remove(path)
            files = _held(tmp)
            unsummed = sorted(set(files) - set(node_sums))
            if unsummed:
                raise OSError(f"{', '.join(unsummed[:3])} in it, which no rank of this node wrote or received")
            marker = checksums.seal({"step": step, "seq": seq, "token": token, "world_size": size, "count": count,
                                     "files": files, "job": ckpts._job, "time": saved_at, "sharded": True,
                                     "run": run}, node_sums)
            checkpoint_io.write_file(os.path.join(tmp, MARKER), json.dumps(marker, indent=1).encode())
            fsync_dir(os.path.join(tmp, FOLDER))
            fsync_dir(tmp)
            os.rename(tmp, final)
            fsync_dir(here)
            copies = _copies(here)
            for old in [s for s, (_, m) in copies.items() if m.get("run") != run]:  # another run's: never loaded
                gone = copies.pop(old)[0]
                log.info("hpcsync.checkpoint: removing %s, a node-local copy of another run", gone)
                shutil.rmtree(gone, ignore_errors=True)
            for old in sorted(copies, reverse=True)[ckpts.keep:]:
                shutil.rmtree(copies[old][0], ignore_errors=True)
        except OSError as exc:
            error = f"cannot complete {final}: {exc}"
    raise_if_any(ctl, error, CheckpointError, failed)
    if not to_root:
        return final
    return _to_root(ckpts, ctl, step, seq, final, blob, sums)


def _to_root(ckpts: Any, ctl: Any, step: int, seq: int, folder: str, blob: bytes, sums: Dict[str, str]) -> str:
    """The checkpoint just completed in the node-local ``folder``, copied into the shared root by
    each rank (its own files, summed as copied and checked against ``sums``, their checksums as
    written: a file its node's disk changed since is an error, never copied), then marked
    complete there, every file's checksum in the root's marker. Collective."""
    me, size = ctl.Get_rank(), ctl.Get_size()
    failed = f"hpcsync.checkpoint: step {step} saved on the nodes, not in {ckpts.root}: "
    tmp, final, _ = from_rank0(ctl, lambda: ckpts._plan_sharded(step, seq), f"step {step} not saved (rank 0: {{}})")
    _sharded.visible(ctl, step, tmp)
    error, sizes = None, {}  # (sizes: {name: (size, checksum)})
    try:
        for name, path in _own(folder, me).items():
            if name == "shared.pt":  # (rank 0 writes it from memory as it completes the checkpoint)
                continue
            crc, n = 0, 0
            with open(path, "rb") as src, open(os.path.join(tmp, name), "xb") as dst:
                while chunk := src.read(16 << 20):
                    crc, n = checksums.digest(chunk, crc), n + len(chunk)
                    dst.write(chunk)
                dst.flush()
                os.fsync(dst.fileno())
            if checksums.hex_sum(crc) != sums.get(name):
                raise OSError(f"{path} changed on its node-local disk since it was written ({checksums.DIGEST} "
                              f"{checksums.hex_sum(crc)}, written as {sums.get(name)})")
            sizes[name] = (n, checksums.hex_sum(crc))
    except OSError as exc:
        error = f"cannot copy into {tmp}: {exc}"
    raise_if_any(ctl, error, CheckpointError, failed)
    every = ctl.gather(sizes, root=0)
    return from_rank0(ctl, lambda: _sharded.mark_complete(ckpts, step, seq, size, tmp, final, blob, every),
                      f"step {step} not saved in the root (rank 0: {{}})")


@dataclass(frozen=True)
class Chosen:
    """Rank 0's choice of a checkpoint the nodes hold between them, sent to every rank."""

    step: int
    key: Tuple[int, str]  #: (sequence number, the save's token)
    world: int  #: the ranks that wrote it
    holders: Dict[str, List[int]]  #: {file: the nodes that hold a copy}
    marker: Dict[str, Any]  #: ``files`` (every file's size) and ``sums`` (checksums), ``version``
    time: Optional[float]


def _choose(ckpts: Any, step: Optional[int], every: Sequence[Optional[Dict[Tuple[int, str], dict]]],
            lay: Layout, skip: Optional[Dict[Any, str]] = None) -> Any:
    """Rank 0: ``("local", Chosen)`` for the last saved checkpoint the nodes hold between them (by
    sequence number, then by rank 0's clock when it was saved), ``("root", chosen)`` when the
    root's is newer (or the only one), or None; less those in ``skip`` (``{(seq, token) or root
    folder: why}``: found damaged by an earlier turn of this load). None left but some damaged:
    :class:`~hpcsync.resilience.checksums.Damaged`."""
    run = claim(ckpts.root, ckpts._job).id  # (read once per load, here)
    skip = {} if skip is None else skip
    union: Dict[Tuple[int, str], Dict[str, Any]] = {}
    foreign: Dict[str, List[int]] = {}
    for node, copies in enumerate(every):
        for seq, marker in (copies or {}).items():  # (seq: (sequence number, token))
            if marker.get("run") != run:  # another run's copy (its root removed, moved, replaced): never loaded
                foreign.setdefault(lay.names[node], []).append(marker["step"])
                continue
            if (step is not None and marker["step"] != step) or seq in skip:
                continue
            u = union.setdefault(seq, {"marker": marker, "holders": {}, "sizes": {}, "sums": {},
                                                 "v": checksums.VERSION})
            u["v"] = min(u["v"], marker.get("version", 1))  # (sums are checked only when every copy has them)
            for name, n in marker["files"].items():
                got = (marker.get("sums") or {}).get(name)
                if u["sizes"].setdefault(name, n) != n or (got and u["sums"].setdefault(name, got) != got):
                    u["marker"] = None  # two copies that differ: never chosen
                u["holders"].setdefault(name, []).append(node)
    covered = [s for s, u in union.items() if u["marker"] is not None and len(u["sizes"]) == u["marker"]["count"]]

    def newest(s: Tuple[int, str]) -> Tuple[int, float]:
        return s[0], float(union[s]["marker"].get("time") or 0)

    best = max(covered, key=newest, default=(-1, ""))
    for lost in sorted((s for s in union if s[0] > best[0]), reverse=True)[:1]:  # newer, not whole here: say so
        u = union[lost]
        log.warning("hpcsync.checkpoint: step %s (saved as number %d) cannot be restored: this job's nodes hold %d of "
                    "its %s files (more nodes lost than it has copies, or copies that differ)",
                    u["marker"] and u["marker"]["step"], lost[0], len(u["sizes"]), u["marker"] and u["marker"]["count"])
    if foreign:
        log.warning("hpcsync.checkpoint: not loading %d node-local cop%s of another run (%s): %s holds run %s now, "
                    "which they are not part of -- the root was removed, moved or replaced since they were written "
                    "(a root that is gone is a new run: it starts fresh); the root's own checkpoints are loaded, if "
                    "any, and each node's next save removes them", sum(map(len, foreign.values())),
                    "ies" if sum(map(len, foreign.values())) > 1 else "y",
                    "; ".join(f"{n}: step {', '.join(map(str, sorted(st)))}" for n, st in list(foreign.items())[:8]),
                    ckpts.root, run[:12])
    for seq, st, folder in ckpts._complete():  # (markers only; the last saved first)
        if seq <= best[0]:
            break
        if folder in skip or (step is not None and st != step):
            continue
        in_root = {k: w for k, w in skip.items() if isinstance(k, str)}
        try:
            return ("root", ckpts._choose(st, sharded=True, skip=in_root))
        except checksums.Damaged:  # (every one of that step in the root: left out)
            continue
        finally:
            skip.update(in_root)  # (what it found damaged: left out of later choices)
    if best[0] < 0:
        damaged = {**{f: f"{os.path.basename(f)}: {w}" for f, w in ckpts._damaged.items()}, **skip}
        if damaged:
            raise checksums.Damaged("", "", "", "hpcsync.checkpoint: no whole checkpoint "
                                    f"{f'of step {step} ' if step is not None else ''}is left under {ckpts.root} or "
                                    "on this job's nodes, every one is damaged: " + "; ".join(damaged.values()))
        if step is not None:
            raise ValueError(f"no complete checkpoint of step {step} under {ckpts.root} or on this job's nodes")
        return None
    u = union[best]
    fields = {"files": u["sizes"], "sums": u["sums"], "version": u["v"]}
    return ("local", Chosen(u["marker"]["step"], best, u["marker"]["world_size"], u["holders"], fields,
                            u["marker"].get("time")))


def _decide(ckpts: Any, ctl: Any, lay: Layout, step: Optional[int], skip: Optional[Dict[Any, str]] = None) -> Any:
    """Collective: every node's complete copies gathered to rank 0, its choice (:func:`_choose`)
    on every rank; rank 0's error as one CheckpointError on every rank."""
    me = ctl.Get_rank()
    copies, error = None, None
    if lay.leader(me) == me:
        try:
            refused = not_private(base(ckpts))  # (a folder another user made first: never read)
            if refused:
                raise CheckpointError(f"local_dir: {refused}")
            copies = {seq: marker for seq, (_, marker) in _copies(base(ckpts)).items()}
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}".removeprefix("CheckpointError: ")
    raise_if_any(ctl, error, CheckpointError, "hpcsync.checkpoint: cannot load: ")
    every = ctl.gather(copies, root=0)
    chosen, error = None, None
    if me == 0:
        try:
            chosen = _choose(ckpts, step, [every[ranks[0]] for ranks in lay.ranks], lay, skip)
        except Exception as exc:
            error = f"cannot load from {ckpts.root} or the nodes' copies: {checksums.said(exc)}"
    chosen, error = ctl.bcast((chosen, error), root=0)
    if error:
        raise CheckpointError(f"hpcsync.checkpoint: rank 0 {error}")
    return chosen


def latest(ckpts: Any, ctl: Any) -> Optional[int]:
    """:meth:`Checkpoints.latest` with ``local_dir``: the step :func:`load` tries first, from the
    markers (their own checksums, every file present at its size, the run, copies that cover the
    checkpoint) and ``shared.pt`` of a root checkpoint; the files' bytes are checked by the load
    that reads them (a copy damaged at the same size is then replaced by another node's, or that
    checkpoint skipped). Collective."""
    chosen = _decide(ckpts, ctl, layout(ckpts, ctl), None)
    return None if chosen is None else chosen[1][0] if chosen[0] == "root" else chosen[1].step


def load(ckpts: Any, ctl: Any, step: Optional[int], template: Any) -> Optional[Tuple[int, str, int, Any, Any, dict]]:
    """:meth:`Checkpoints.load` with ``sharded=`` and ``local_dir``: ``(step, folder, seq, shared,
    local, bytes read by where from)``, ``template`` loaded in place; None when there is none.
    A checkpoint found damaged as it is read (a file with no whole copy on this job's nodes, see
    :mod:`hpcsync.resilience.node_verify`, or a damaged root checkpoint) is left out on every rank
    alike and the previous whole one loaded: at most as many turns as there are checkpoints.
    Collective."""
    needs_mpi(ctl)
    lay = layout(ckpts, ctl)
    skip: Dict[Any, str] = {}
    while True:  # (each turn leaves one more checkpoint out)
        chosen = _decide(ckpts, ctl, lay, step, skip)
        if chosen is None:
            return None
        try:
            if chosen[0] == "root":
                got = _sharded.load_chosen(ckpts, ctl, chosen[1], template, latest=step is None)
                return (*got, {"from": "root"})
            return _load_local(ckpts, ctl, lay, step, chosen[1], template)
        except checksums.Damaged as exc:  # (raised on every rank alike)
            where = chosen[1][1] if chosen[0] == "root" else exc.folder
            skip[chosen[1][1] if chosen[0] == "root" else chosen[1].key] = f"{os.path.basename(where)}: {exc.why}"
            if ctl.Get_rank() == 0:
                log.warning("hpcsync.checkpoint: skipping %s: damaged: %s; the previous complete checkpoint is "
                            "loaded instead", where, exc.why)


def _load_local(ckpts: Any, ctl: Any, lay: Layout, step: Optional[int], chosen: Chosen, template: Any
                ) -> Tuple[int, str, int, Any, Any, dict]:
    """The rest of :func:`load`, from the copies rank 0 chose: every file checked
    (:func:`~hpcsync.resilience.node_verify.verify`), then DCP's load from the checked bytes."""
    me, size = ctl.Get_rank(), ctl.Get_size()
    found, (seq, token), world, sizes = chosen.step, chosen.key, chosen.world, chosen.marker["files"]
    folder = os.path.join(base(ckpts), _name(found, seq, token))
    checkpoint_io.allow_for(ctl, sum(sizes.values()) // len(lay.ranks))  # (a node's share, fetched by its ranks)

    def path_of(name: str) -> Optional[str]:
        path = os.path.join(folder, name)
        return path if os.path.isfile(path) else None

    cache, good, counted = node_verify.verify(ctl, sorted(sizes), world, chosen.holders, chosen.marker, folder,
                                              lay.node_of, lay.ranks, lay.names, path_of, lay.where)
    read = {"from": "nodes", "node": counted["node"], "peers": counted["peers"], "root": 0}

    def fetch(ranges: List[Tuple[str, int, int]]) -> Dict[Tuple[str, int, int], Any]:
        out: Dict[Tuple[str, int, int], Any] = {}
        wants: Dict[int, List[Tuple[str, int, int]]] = {}
        error = None
        for r in ranges:
            if r[0] in cache:  # (checked whole by this rank)
                out[r] = memoryview(cache[r[0]])[r[1]: r[1] + r[2]]
            elif r[0] not in good:
                error = f"the checkpoint's metadata names {r[0]}, which is not among its files"
            else:  # from the node whose copy was found whole
                held = good[r[0]]  # (the one copy checked whole: its node's ranks serve, spread)
                wants.setdefault(me if lay.node_of[me] == held else node_verify.server(me, [held], lay.ranks),
                                 []).append(r)
        raise_if_any(ctl, error, CheckpointError, "hpcsync.checkpoint: cannot load: ")
        got, errors = peer_transfer.fetch(ctl, wants, path_of, lay.where)
        raise_if_any(ctl, errors[0] if errors else None, CheckpointError, "hpcsync.checkpoint: cannot load: ")
        read["node"] += sum(n for _, _, n in wants.get(me, []))
        read["peers"] += sum(n for peer, items in wants.items() if peer != me for _, _, n in items)
        return {**got, **out}

    metadata, blob = ctl.bcast((cache.get(f"{FOLDER}/.metadata"), cache.get("shared.pt")) if me == 0 else None,
                               root=0)  # (checked by rank 0)
    if me != 0:
        read["peers"] += len(metadata or b"") + len(blob or b"")
    error, pg, plain = None, None, {}
    try:
        pg = _sharded.process_group(ckpts._group, size)
        plain = _sharded.plain_state(template)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}".removeprefix("CheckpointError: hpcsync.checkpoint: ")
    raise_if_any(ctl, error, CheckpointError, "hpcsync.checkpoint: cannot load: ")
    parsed = dcp_reader.agreed_metadata(ctl, metadata, f"{folder}/{FOLDER}/.metadata")
    mine = f"rank-{me:05d}.pt"
    error, local, shared = None, None, None
    try:
        import torch.distributed.checkpoint as dcp

        dcp.load(plain, storage_reader=dcp_reader.ranged_reader(parsed, fetch, FOLDER),
                 planner=dcp_reader.planner(ckpts.safe_globals), process_group=pg, no_dist=_sharded.single_process())
        _sharded.put_back(template, plain)
        shared = loads(bytes(blob), ckpts.safe_globals) if blob is not None else None
        if world == size and mine in cache:
            local = loads(cache[mine], ckpts.safe_globals)
        elif me == 0:
            log.warning("hpcsync.checkpoint: step %d was written by %d ranks, this job has %d: the sharded state is "
                        "resharded, the ranks' local states are not loaded", found, world, size)
    except _sharded.failed_types() as exc:
        error = f"{folder}: {_sharded.why_failed(exc)}"
    raise_if_any(ctl, error, CheckpointError, "hpcsync.checkpoint: cannot load: ")
    every = ctl.gather((read["node"], read["peers"]), root=0)
    if me == 0:
        log.info("hpcsync.checkpoint: step %d restored from the nodes' copies: %d B read from the ranks' own nodes, "
                 "%d B from peers, 0 B from the shared root", found, sum(n for n, _ in every), sum(p for _, p in every))
        if step is None:
            from ..observe import failure

            failure.note_resume(found, folder, chosen.time)
    return found, folder, seq, shared, local, read
