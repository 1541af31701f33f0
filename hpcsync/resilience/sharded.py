"""Sharded checkpoints: every rank writes its own part, in torch.distributed.checkpoint's format.

:class:`~hpcsync.resilience.checkpoint.Checkpoints` keeps its guarantees for a state spread over
the ranks (an FSDP2 model's DTensors, from ``get_state_dict(model, optim)``):

- **every rank writes its own shard** with ``torch.distributed.checkpoint`` (DCP) into the new
  checkpoint's temporary directory (replicated tensors once, spread over the ranks by DCP's
  planner), and its own ``local`` state beside it: nothing is gathered to one rank;
- **complete only when every part is durable**: every file is flushed to disk by the rank that
  wrote it, each rank reports the sizes and checksums of its own files (DCP's summed as DCP
  writes them: :class:`~hpcsync.resilience.checksums.SummingFileSystem`), and only then does
  rank 0 write the marker (every file's size and checksum) and rename the directory into place.
  A crash before that leaves the previous complete checkpoint the latest;
- **whole bytes**: on load each file is read whole and checked by one rank (:func:`load_chosen`)
  and the ranks agree before anything is loaded; a damaged checkpoint is skipped on every rank
  together, and the previous whole one loaded;
- **load reads what each rank needs**: DCP reads each rank's part of the state in place into the
  template (at another world size it reshards); each rank reads its own ``local`` file; only the
  small ``shared`` state is read by rank 0 and broadcast;
- **loading runs no code**: DCP's metadata is unpickled with only its own record types allowed,
  and non-tensor values load with ``torch.load(weights_only=True)``.

The root must be a directory every rank sees (a shared filesystem): the ranks write into one
directory. Ordering by save, pruning and one job per root are the same as for the other form.

Cost at N ranks (S the whole state, L a rank's local state, T the tensors): a save writes
S/N + L per rank, in parallel, summing it as written (CRC-32, about 1.9 GB/s a core); its
exchanges are an allgather of one (size, checksum) pair per rank, DCP's gather and scatter of
plans at rank 0 (O(N·T) records through one rank), a gather of each rank's file sizes and
checksums to rank 0 and a broadcast of the outcome. A load first reads each rank's own files
whole and checks them (S/N + L; DCP's reads of them then come from memory), the ranks agreeing
in one allgather of a word each (a few kB at 1,000 ranks); then each receives what it loads from
other ranks' files (at the same size: the replicated values) plus DCP's metadata, which lists
every rank's chunk of every tensor (M about 155 B × T × N: 159 MB at 1,024 ranks and 1,000
tensors): rank 0 reads and checks it whole and broadcasts it (the shared filesystem serves M
once, not N times: 159 MB instead of 163 GB at 1,024 ranks), and every rank parses it with
:func:`~hpcsync.resilience.dcp_reader.agreed_metadata` (C-speed, about 12 s at that size;
refused on one rank, refused on all). Measured and modelled further in docs/performance.md.
"""
from __future__ import annotations

import logging
import os
import re
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..core import comm
from ..core.bounded import default_timeout
from ..core.errors import CheckpointError, raise_if_any
from ..data.filesync import fsync_dir
from . import checkpoint_io, checksums, dcp_reader
from .checkpoint_io import dumps, from_rank0, loads

__all__ = [
    "FOLDER", "process_group", "plain_state", "failed_types", "why_failed", "single_process", "prepare", "visible",
    "mark_complete", "save", "checkpoint_groups", "drop_groups", "save_in_background", "put_back", "load",
    "load_chosen", "summing_writer", "writer_of"
]

log = logging.getLogger(__name__)

FOLDER = "sharded"  #: DCP's files, inside a checkpoint directory
_WRITER = re.compile(rf"^(?:{FOLDER}/__(\d+)_|rank-(\d+)\.pt$)")  # which rank wrote a file

def process_group(group: Any, size: int) -> Any:
    """The torch process group DCP runs its planning on: ``group`` when it is one, else the
    default group; None for a one-process job without torch.distributed."""
    import torch.distributed as dist

    if group is not None and not hasattr(group, "Get_rank"):
        return group
    if dist.is_available() and dist.is_initialized():
        if group is not None and dist.get_world_size() != size:
            raise CheckpointError("hpcsync.checkpoint: a sharded checkpoint over an mpi4py communicator needs the "
                                  "torch process group of the same ranks: pass group=<that process group>")
        return None if group is None else dist.group.WORLD
    if size > 1:
        raise CheckpointError("hpcsync.checkpoint: a sharded checkpoint needs torch.distributed (hpcsync.init()); "
                              "the ranks plan their shards over it")
    return None


def plain_state(state: Any) -> Dict[str, Any]:
    """``state`` with each top-level ``Stateful`` replaced by its ``state_dict()``: what DCP would
    do first on each rank, done here where one rank's error is agreed before any collective."""
    from torch.distributed.checkpoint.stateful import Stateful

    if not isinstance(state, dict):
        raise TypeError(f"sharded= takes a dict (a state dict), not {type(state).__name__}")
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}


def _replicated(state: Any, at: str = "") -> Dict[str, int]:
    """A checksum of every value in ``state`` that is not a DTensor, by its key path: DCP writes
    such a value once, from one rank, so it must be the same on every rank."""
    import torch

    if isinstance(state, dict):
        out: Dict[str, int] = {}
        for k, v in state.items():
            out.update(_replicated(v, f"{at}.{k}" if at else str(k)))
        return out
    if isinstance(state, (list, tuple)):
        out = {}
        for i, v in enumerate(state):
            out.update(_replicated(v, f"{at}.{i}"))
        return out
    if isinstance(state, torch.Tensor):
        if hasattr(state, "to_local"):  # a DTensor: each rank's own part
            return {}
        data = state.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        return {at: zlib.crc32(data, zlib.crc32(str((state.dtype, tuple(state.shape))).encode()))}
    return {at: zlib.crc32(dumps(state))}


def failed_types() -> Tuple[type, ...]:
    """What a DCP call raises when it fails: its CheckpointException is a BaseException."""
    from torch.distributed.checkpoint.api import CheckpointException

    return Exception, CheckpointException


def why_failed(exc: BaseException) -> str:
    """One line for ``exc``; for DCP's CheckpointException, the first failed rank's own error."""
    failures = getattr(exc, "failures", None)
    if failures:
        rank, (inner, _) = sorted(failures.items())[0]
        return f"rank {rank}: {why_failed(inner)}"
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def single_process() -> bool:
    """One process without torch.distributed: DCP then plans alone (and says nothing of it)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


def _own_files(folder: str, rank: int, sums: Dict[str, str], dcp_sums: Dict[str, str]
               ) -> Dict[str, Tuple[int, Optional[str]]]:
    """``(size, checksum)`` of the files this rank wrote: ``sums``' (``{name: sum}``, in
    ``folder``), DCP's ``__<rank>_*`` and, on the rank that wrote it, DCP's ``.metadata``; their
    checksums as written (``dcp_sums``: :class:`~hpcsync.resilience.checksums.SummingFileSystem`'s)."""
    files: Dict[str, Tuple[int, Optional[str]]] = {n: (os.path.getsize(os.path.join(folder, n)), s)
                                                   for n, s in sums.items()}
    dcp = os.path.join(folder, FOLDER)
    for name in os.listdir(dcp):
        if name.startswith(f"__{rank}_") or (name == ".metadata" and name in dcp_sums):
            files[f"{FOLDER}/{name}"] = (os.path.getsize(os.path.join(dcp, name)), dcp_sums.get(name))
    return files


def summing_writer(folder: str) -> Any:
    """DCP's FileSystemWriter into ``folder``, every file flushed to disk and summed as written."""
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(folder, sync_files=True)
    writer.fs = checksums.SummingFileSystem()
    return writer


def writer_of(name: str) -> Optional[int]:
    """The rank that wrote the checkpoint file ``name`` (``rank-<w>.pt``, DCP's ``__<w>_*``), or
    None (DCP's metadata, ``shared.pt``: rank 0's)."""
    m = _WRITER.match(name)
    return int(m.group(1) or m.group(2)) if m else None


def _verify_own(folder: str, marker: Dict[str, Any], me: int, size: int) -> Dict[str, bytes]:
    """The files of the checkpoint in ``folder`` that this rank checks, read whole and checked
    against ``marker`` (:class:`~hpcsync.resilience.checksums.Damaged` when one differs):
    those rank ``w`` wrote (``rank-<w>.pt``, DCP's ``__<w>_*``) when ``w % size == me``, and on
    rank 0 DCP's metadata (rank 0 checked ``shared.pt`` as it chose). Every file is so checked by
    one rank, as a whole, and at the same world size a rank checks what it reads itself: ``{path:
    bytes}``, for its reads to come from memory."""
    out = {}
    for name in sorted(marker["files"]):
        m = _WRITER.match(name)
        if name == "shared.pt" or (int(m.group(1) or m.group(2)) if m else 0) % size != me:
            continue
        out[os.path.normpath(os.path.join(folder, name))] = checksums.read_whole(folder, name, marker)
    return out


def prepare(ckpts: Any, ctl: Any, step: int, shared: Any, local: Any, state: Any
            ) -> Tuple[Any, bytes, bytes, int, Dict[str, Any]]:
    """What a sharded save does first, on every rank: ``(DCP's process group, local state's bytes,
    shared state's bytes (rank 0), the most bytes one rank writes, the state with its Stateful
    objects read)``; every error so far agreed (a value other than a DTensor that differs between
    ranks is one); ``ctl``'s waits from here on allow for the biggest rank's writes. Collective."""

    me = ctl.Get_rank()
    failed = f"hpcsync.checkpoint: step {step} not saved: "
    error, pg, data, blob, plain, sums = None, None, b"", b"", {}, {}
    try:
        pg = process_group(ckpts._group, ctl.Get_size())
        doing = "serialise its local state"
        data = dumps(local)
        doing = "serialise the shared state"
        blob = dumps(shared) if me == 0 else b""
        doing = "read its sharded state"
        plain = plain_state(state)
        sums = _replicated(plain)
    except CheckpointError as exc:
        error = str(exc).removeprefix("hpcsync.checkpoint: ")
    except Exception as exc:
        error = f"cannot {doing}: {exc!r}"
    raise_if_any(ctl, error, CheckpointError, failed)
    seen = ctl.allgather((checkpoint_io.tensor_bytes(plain) + len(data) + len(blob), zlib.crc32(repr(sorted(
        sums.items())).encode())))
    if len({digest for _, digest in seen}) > 1:  # which value differs: rank 0's sums, then each rank's own
        theirs = ctl.bcast(sums if me == 0 else None, root=0)
        differ = sorted(k for k in set(sums) | set(theirs) if sums.get(k) != theirs.get(k))
        raise_if_any(ctl, differ and f"its {differ[0]!r} differs from rank 0's: a sharded state may hold "
                     "values that differ between ranks only in DTensors (DCP writes any other value once, from "
                     "one rank); give per-rank values as local=", CheckpointError, failed)
    biggest = max(n for n, _ in seen)
    checkpoint_io.allow_for(ctl, biggest)  # the others wait while the biggest part is written
    return pg, data, blob, biggest, plain


def visible(ctl: Any, step: int, tmp: str) -> None:
    """Collective: every rank sees ``tmp``, which rank 0 made in the shared root; else the same
    error on every rank."""
    error = None if os.path.isdir(tmp) else (
        f"does not see {tmp}, which rank 0 made: a sharded checkpoint's root must be a directory every rank sees "
        "(a shared filesystem)")
    raise_if_any(ctl, error, CheckpointError, f"hpcsync.checkpoint: step {step} not saved: ")


def _begin(ckpts: Any, ctl: Any, step: int, shared: Any, local: Any, state: Any
           ) -> Tuple[Any, bytes, bytes, str, str, int, int, Dict[str, Any]]:
    """:func:`prepare`, then the checkpoint's temporary directory in the root, made by rank 0 and
    seen by every rank: ``(process group, local bytes, shared bytes, temporary dir, final dir,
    seq, the most bytes one rank writes, the state)``. Collective."""
    pg, data, blob, biggest, plain = prepare(ckpts, ctl, step, shared, local, state)
    tmp, final, seq = from_rank0(ctl, lambda: ckpts._plan_sharded(step), f"step {step} not saved (rank 0: {{}})")
    visible(ctl, step, tmp)
    return pg, data, blob, tmp, final, seq, biggest, plain


def _write_part(tmp: str, me: int, data: bytes, writer: Any) -> Dict[str, Tuple[int, Optional[str]]]:
    """This rank's local state, on disk; returns its own files' ``(size, checksum)`` (with DCP's,
    written by then through ``writer``)."""
    name = f"rank-{me:05d}.pt"
    return _own_files(tmp, me, {name: checkpoint_io.write_file(os.path.join(tmp, name), data)}, writer.fs.sums)


def mark_complete(ckpts: Any, step: int, seq: int, size: int, tmp: str, final: str, blob: bytes,
                  every: Sequence[Dict[str, Any]]) -> str:
    """Rank 0, once every rank's part is on disk (``every``: each rank's ``{name: (size,
    checksum)}``, or ``{name: size}`` for files whose checksum was not taken): the shared state,
    the marker, the rename."""
    files: Dict[str, int] = {}
    sums: Dict[str, str] = {}
    for part in every:
        for name, got in part.items():
            files[name], digest = (got, None) if isinstance(got, int) else got
            if digest is not None:
                sums[name] = digest
    metadata = f"{FOLDER}/.metadata"
    files.setdefault(metadata, os.path.getsize(os.path.join(tmp, FOLDER, ".metadata")))
    sums["shared.pt"] = checkpoint_io.write_file(os.path.join(tmp, "shared.pt"), blob)
    files["shared.pt"] = len(blob)
    fsync_dir(os.path.join(tmp, FOLDER))
    return ckpts._seal(tmp, final, files, {"step": step, "seq": seq, "world_size": size, "sharded": True}, sums)


def save(ckpts: Any, ctl: Any, step: int, shared: Any, local: Any, state: Any) -> str:
    """:meth:`Checkpoints.save` with ``sharded=state``: see the module's docstring. Collective."""
    me, size = ctl.Get_rank(), ctl.Get_size()
    pg, data, blob, tmp, final, seq, _, plain = _begin(ckpts, ctl, step, shared, local, state)
    error, sizes = None, {}
    try:
        import torch.distributed.checkpoint as dcp

        writer = summing_writer(os.path.join(tmp, FOLDER))
        dcp.save(plain, storage_writer=writer, process_group=pg, no_dist=single_process())
        sizes = _write_part(tmp, me, data, writer)
    except failed_types() as exc:  # every rank still reaches the agreement below
        error = why_failed(exc)
    raise_if_any(ctl, error, CheckpointError, f"hpcsync.checkpoint: step {step} not saved: ")
    every = comm.gather(sizes, dst=0, group=ctl)
    path = from_rank0(ctl, lambda: mark_complete(ckpts, step, seq, size, tmp, final, blob, every),
                       f"step {step} not saved (rank 0: {{}})")
    log.info("hpcsync.checkpoint: saved step %d (sharded) to %s", step, path)
    return path


def checkpoint_groups(ckpts: Any, pg: Any) -> Tuple[Any, Any]:
    """Two process groups of the world's ranks for sharded saves in the background (made once,
    collectively, on a CPU backend; the training's own groups stay free): one for DCP's exchanges,
    one for the ranks' agreement after them, so that a rank whose DCP call failed early cannot
    meet the others' DCP exchanges with its agreement. ``(None, None)`` for one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None, None
    if pg is not None and pg != dist.group.WORLD:
        raise CheckpointError("hpcsync.checkpoint: a sharded save in the background needs Checkpoints over the "
                              "world (group=None): it makes process groups of its own for its thread")
    if ckpts._group_for_thread is None:
        from datetime import timedelta

        backend = "gloo" if dist.get_backend() == "nccl" else None  # (the thread's copy is on the CPU)
        timeout = ckpts.timeout or default_timeout()  # the agreement's outlasts a rank's wait in DCP's
        ckpts._group_for_thread = (dist.new_group(backend=backend, timeout=timedelta(seconds=timeout)),
                                   dist.new_group(backend=backend, timeout=timedelta(seconds=2 * timeout + 10)))
    return ckpts._group_for_thread


def drop_groups(ckpts: Any) -> None:
    """After a failed save in the background (agreed on every rank): its groups may be out of step
    for good; the next save makes new ones."""
    import torch.distributed as dist

    for group in ckpts._group_for_thread or ():
        try:
            dist.destroy_process_group(group)
        except Exception as exc:  # (a group whose peer failed) it is dropped either way
            log.debug("hpcsync.checkpoint: destroying a checkpoint group: %s", exc)
    ckpts._group_for_thread = None


def save_in_background(ckpts: Any, ctl: Any, step: int, shared: Any, local: Any, state: Any
                       ) -> Tuple[str, Any, int]:
    """The same in the background: every rank's shard is copied to memory now (on this thread:
    an error there is agreed at once), then written by a thread of its own, whose ranks then agree
    and rank 0 marks the checkpoint complete, over process groups kept for checkpoints (the
    training's collectives go on meanwhile). Returns ``(final dir, a future of (path, error), the
    most bytes one rank writes)``. Collective."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    me, size = ctl.Get_rank(), ctl.Get_size()
    pg, data, blob, tmp, final, seq, biggest, plain = _begin(ckpts, ctl, step, shared, local, state)
    (writing, agreeing), error, copy = (None, None), None, None
    try:
        writing, agreeing = checkpoint_groups(ckpts, pg)
        copy = BlockingAsyncStager().stage(plain)
    except failed_types() as exc:
        error = why_failed(exc)
    raise_if_any(ctl, error, CheckpointError, f"hpcsync.checkpoint: step {step} not saved: ")
    together = size > 1  # (a one-process job may have no torch.distributed at all)
    root = dist.get_global_rank(agreeing, 0) if together and agreeing is not None else 0

    def finish() -> Tuple[Optional[str], Optional[str]]:  # on every rank's checkpoint thread
        sizes: Dict[str, Tuple[int, Optional[str]]] = {}
        err = None
        try:
            writer = summing_writer(os.path.join(tmp, FOLDER))
            dcp.save(copy, storage_writer=writer, process_group=writing, no_dist=single_process())
            sizes = _write_part(tmp, me, data, writer)
        except failed_types() as exc:  # every rank still reaches the exchange below
            err = f"rank {me}: {why_failed(exc)}"
        parts: Any = [(sizes, err)]
        if together:
            parts = [None] * size if me == 0 else None
            dist.gather_object((sizes, err), parts, dst=root, group=agreeing)
        outcome: List[Any] = [None]
        if me == 0:
            # the cause first: a rank's own error before the others' timeouts waiting for it
            errs = sorted((e for _, e in parts if e), key=lambda e: "timed out" in e.lower() or "timeout" in e.lower())
            try:
                outcome[0] = (None, errs[0]) if errs else \
                    (mark_complete(ckpts, step, seq, size, tmp, final, blob, [sz for sz, _ in parts]), None)
            except Exception as exc:
                outcome[0] = (None, f"rank 0: {type(exc).__name__}: {exc}")
        if together:
            dist.broadcast_object_list(outcome, src=root, group=agreeing)
        return outcome[0]

    return final, ckpts._thread().submit(finish), biggest


def put_back(template: Dict[str, Any], plain: Dict[str, Any]) -> None:
    """``plain``'s loaded values into ``template``: what DCP's own load does with a Stateful."""
    from torch.distributed.checkpoint.stateful import Stateful

    for key, value in template.items():
        if isinstance(value, Stateful):
            value.load_state_dict(plain[key])
        else:
            template[key] = plain[key]


def load(ckpts: Any, ctl: Any, step: Optional[int], template: Any) -> Optional[Tuple[int, str, int, Any, Any]]:
    """:meth:`Checkpoints.load` with ``sharded=template``: ``(step, folder, seq, shared, local)``
    with ``template`` loaded in place, or None when there is no checkpoint. A checkpoint that a
    rank finds damaged (:func:`load_chosen`) is left out on every rank and the previous whole one
    loaded, the same on every rank; each turn is bounded, and there are at most as many turns as
    checkpoints under the root. Collective."""
    me = ctl.Get_rank()
    skip: Dict[str, str] = {}
    while True:  # (each turn leaves one more checkpoint out)
        chosen, error = None, None
        if me == 0:
            try:
                chosen = ckpts._choose(step, sharded=True, skip=skip)
            except Exception as exc:
                error = f"cannot load from {ckpts.root}: {checksums.said(exc)}"
        chosen, error = ctl.bcast((chosen, error), root=0)
        if error:
            raise CheckpointError(f"hpcsync.checkpoint: rank 0 {error}")
        if chosen is None:
            return None
        try:
            return load_chosen(ckpts, ctl, chosen, template, latest=step is None)
        except checksums.Damaged as exc:  # (raised on every rank alike)
            skip[exc.folder] = exc.why
            if me == 0:
                log.warning("hpcsync.checkpoint: skipping %s: damaged: %s; an older whole checkpoint is "
                            "looked for instead", exc.folder, exc.why)


def load_chosen(ckpts: Any, ctl: Any, chosen: Tuple[int, str, int, dict, Optional[bytes]], template: Any,
                latest: bool) -> Tuple[int, str, int, Any, Any]:
    """The rest of :func:`load`, from the checkpoint in the root that rank 0 chose (``(step, folder,
    seq, marker, shared.pt's bytes)`` on every rank). First each rank checks its share of the
    files whole (:func:`_verify_own`), and the ranks agree (an allgather of one word each): one
    that differs from the marker is :class:`~hpcsync.resilience.checksums.Damaged` on every rank,
    before anything is loaded. Collective."""
    me, size = ctl.Get_rank(), ctl.Get_size()
    found, folder, seq, marker, shared_blob = chosen
    why, cache = None, {}
    try:
        cache = _verify_own(folder, marker, me, size)
    except checksums.Damaged as exc:
        why = exc.why
    found_by = [(r, w) for r, w in enumerate(ctl.allgather(why)) if w]
    if found_by:
        raise checksums.Damaged(folder, "", f"{found_by[0][1]} (found by rank {found_by[0][0]})")
    error, pg, plain = None, None, {}
    try:
        pg = process_group(ckpts._group, size)
        plain = plain_state(template)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}".removeprefix("CheckpointError: hpcsync.checkpoint: ")
    raise_if_any(ctl, error, CheckpointError, "hpcsync.checkpoint: cannot load: ")
    where = os.path.normpath(os.path.join(folder, FOLDER, ".metadata"))
    data = ctl.bcast(cache.get(where) if me == 0 else None, root=0)  # (checked whole by rank 0)
    metadata = dcp_reader.agreed_metadata(ctl, data, f"{folder}/{FOLDER}/.metadata")
    error, local, shared = None, None, None
    try:
        import torch.distributed.checkpoint as dcp

        dcp.load(plain, storage_reader=dcp_reader.reader(os.path.join(folder, FOLDER), cache, metadata),
                 planner=dcp_reader.planner(ckpts.safe_globals), process_group=pg, no_dist=single_process())
        put_back(template, plain)
        shared = loads(shared_blob, ckpts.safe_globals) if shared_blob is not None else None
        name = f"rank-{me:05d}.pt"
        if marker["world_size"] == size and name in marker["files"]:
            mine = cache.get(os.path.normpath(os.path.join(folder, name)))
            local = loads(mine if mine is not None else checksums.read_whole(folder, name, marker), ckpts.safe_globals)
        elif me == 0:
            log.warning("hpcsync.checkpoint: %s was written by %d ranks, this job has %d: the sharded state is "
                        "resharded, the ranks' local states are not loaded", folder, marker["world_size"], size)
    except failed_types() as exc:
        error = f"{folder}: {why_failed(exc)}"
    raise_if_any(ctl, error, CheckpointError, "hpcsync.checkpoint: cannot load: ")
    if me == 0 and latest:  # the latest: what a supervised attempt resumes from
        from ..observe import failure

        failure.note_resume(found, folder, marker.get("time"))
    return found, folder, seq, shared, local
