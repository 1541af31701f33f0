"""Sharded checkpoints: every rank writes its own part, in torch.distributed.checkpoint's format.

:class:`~hpcsync.resilience.checkpoint.Checkpoints` keeps its guarantees for a state spread over
the ranks (an FSDP2 model's DTensors, from ``get_state_dict(model, optim)``):

- **every rank writes its own shard** with ``torch.distributed.checkpoint`` (DCP) into the new
  checkpoint's temporary directory (replicated tensors once, spread over the ranks by DCP's
  planner), and its own ``local`` state beside it: nothing is gathered to one rank;
- **complete only when every part is durable**: every file is flushed to disk by the rank that
  wrote it, each rank reports the sizes of its own files, and only then does rank 0 write the
  marker (every file's size) and rename the directory into place. A crash before that leaves the
  previous complete checkpoint the latest;
- **load reads what each rank needs**: DCP reads each rank's part of the state in place into the
  template (at another world size it reshards); each rank reads its own ``local`` file; only the
  small ``shared`` state is read by rank 0 and broadcast;
- **loading runs no code**: DCP's metadata is unpickled with only its own record types allowed,
  and non-tensor values load with ``torch.load(weights_only=True)``.

The root must be a directory every rank sees (a shared filesystem): the ranks write into one
directory. Ordering by save, pruning and one job per root are the same as for the other form.
"""
from __future__ import annotations

import io
import logging
import os
import pickle
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..core import comm
from ..core.bounded import default_timeout
from ..core.errors import CheckpointError, raise_if_any
from ..data.filesync import fsync_dir
from . import checkpoint_io
from .checkpoint_io import dumps, from_rank0, loads, numpy_safe_globals

log = logging.getLogger("hpcsync.checkpoint")

FOLDER = "sharded"  #: DCP's files, inside a checkpoint directory

# What DCP's metadata file may hold: its own record types, torch's dtypes, sizes, layouts and
# memory formats, and plain containers. Anything else (a callable, a class of the writer's
# choosing) is refused before it is built.
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                     "torch.distributed.checkpoint.planner")
_PLAIN = {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
          ("builtins", "tuple"), ("builtins", "list"), ("builtins", "dict"), ("pathlib", "PosixPath"),
          ("pathlib", "PurePosixPath"), ("torch.serialization", "_get_layout")}  # (a layout by its name)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module in _METADATA_MODULES and not name.startswith("__"):
            found = super().find_class(module, name)
            if isinstance(found, type):
                return found
        elif module == "torch":
            found = getattr(torch, name, None)
            if found is torch.Size or isinstance(found, (torch.dtype, torch.layout, torch.memory_format)):
                return found
        elif (module, name) in _PLAIN:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata")


def _reader(path: str) -> Any:
    """DCP's FileSystemReader, its metadata read with :class:`_MetadataUnpickler`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with open(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def _planner(extra: Sequence[Any]) -> Any:
    """DCP's default load planner, non-tensor values loaded with ``weights_only=True``."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element  # DCP's own (a private module)


    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            with torch.serialization.safe_globals([*numpy_safe_globals(), *extra]):
                obj = torch.load(value, map_location="cpu", weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafePlanner()


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


def _failed() -> Tuple[type, ...]:
    """What a DCP call raises when it fails: its CheckpointException is a BaseException."""
    from torch.distributed.checkpoint.api import CheckpointException

    return Exception, CheckpointException


def _why(exc: BaseException) -> str:
    """One line for ``exc``; for DCP's CheckpointException, the first failed rank's own error."""
    failures = getattr(exc, "failures", None)
    if failures:
        rank, (inner, _) = sorted(failures.items())[0]
        return f"rank {rank}: {_why(inner)}"
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _alone() -> bool:
    """One process without torch.distributed: DCP then plans alone (and says nothing of it)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


def _own_files(folder: str, rank: int, names: Sequence[str]) -> Dict[str, int]:
    """The sizes of the files this rank wrote: ``names`` in ``folder`` and DCP's ``__<rank>_*``."""
    sizes = {n: os.path.getsize(os.path.join(folder, n)) for n in names}
    dcp = os.path.join(folder, FOLDER)
    for name in os.listdir(dcp):
        if name.startswith(f"__{rank}_"):
            sizes[f"{FOLDER}/{name}"] = os.path.getsize(os.path.join(dcp, name))
    return sizes


def _begin(ckpts: Any, ctl: Any, step: int, shared: Any, local: Any, state: Any
           ) -> Tuple[Any, bytes, bytes, str, str, int, int]:
    """What a sharded save does first, on every rank: ``(DCP's process group, local state's bytes,
    shared state's bytes (rank 0), temporary dir, final dir, seq, the most bytes one rank writes)``;
    the temporary directory made by rank 0 and seen by every rank; ``ctl``'s waits from here on
    allow for the biggest rank's writes. Collective."""

    me, size = ctl.Get_rank(), ctl.Get_size()
    failed = f"hpcsync.checkpoint: step {step} not saved: "
    error, pg, data, blob = None, None, b"", b""
    try:
        pg = process_group(ckpts._group, size)
        data = dumps(local)
        blob = dumps(shared) if me == 0 else b""
    except CheckpointError as exc:
        error = str(exc).removeprefix("hpcsync.checkpoint: ")
    except Exception as exc:
        error = f"cannot serialise its {'local' if not data else 'shared'} state: {exc!r}"
    raise_if_any(ctl, error, CheckpointError, failed)
    biggest = max(ctl.allgather(checkpoint_io.tensor_bytes(state) + len(data) + len(blob)))
    checkpoint_io.allow_for(ctl, biggest)  # the others wait while the biggest part is written
    tmp, final, seq = from_rank0(ctl, lambda: ckpts._plan_sharded(step), f"step {step} not saved (rank 0: {{}})")
    error = None if os.path.isdir(tmp) else (
        f"does not see {tmp}, which rank 0 made: a sharded checkpoint's root must be a directory every rank sees "
        "(a shared filesystem)")
    raise_if_any(ctl, error, CheckpointError, failed)
    return pg, data, blob, tmp, final, seq, biggest


def _write_part(tmp: str, me: int, data: bytes) -> Dict[str, int]:
    """This rank's local state, on disk; returns its own files' sizes (with DCP's, written by then)."""

    name = f"rank-{me:05d}.pt"
    checkpoint_io.write_file(os.path.join(tmp, name), data)
    return _own_files(tmp, me, [name])


def _complete(ckpts: Any, step: int, seq: int, size: int, tmp: str, final: str, blob: bytes,
              every: Sequence[Dict[str, int]]) -> str:
    """Rank 0, once every rank's part is on disk: the shared state, the marker, the rename."""

    files: Dict[str, int] = {}
    for part in every:
        files.update(part)
    files[f"{FOLDER}/.metadata"] = os.path.getsize(os.path.join(tmp, FOLDER, ".metadata"))
    checkpoint_io.write_file(os.path.join(tmp, "shared.pt"), blob)
    files["shared.pt"] = len(blob)
    fsync_dir(os.path.join(tmp, FOLDER))
    return ckpts._seal(tmp, final, files, {"step": step, "seq": seq, "world_size": size, "sharded": True})


def save(ckpts: Any, ctl: Any, step: int, shared: Any, local: Any, state: Any) -> str:
    """:meth:`Checkpoints.save` with ``sharded=state``: see the module's docstring. Collective."""

    me, size = ctl.Get_rank(), ctl.Get_size()
    pg, data, blob, tmp, final, seq, _ = _begin(ckpts, ctl, step, shared, local, state)
    error, sizes = None, {}
    try:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(tmp, FOLDER), sync_files=True),
                 process_group=pg, no_dist=_alone())
        sizes = _write_part(tmp, me, data)
    except _failed() as exc:  # every rank still reaches the agreement below
        error = _why(exc)
    raise_if_any(ctl, error, CheckpointError, f"hpcsync.checkpoint: step {step} not saved: ")
    every = comm.gather(sizes, dst=0, group=ctl)
    path = from_rank0(ctl, lambda: _complete(ckpts, step, seq, size, tmp, final, blob, every),
                       f"step {step} not saved (rank 0: {{}})")
    log.info("hpcsync.checkpoint: saved step %d (sharded) to %s", step, path)
    return path


def checkpoint_group(ckpts: Any, pg: Any) -> Any:
    """A process group of the world's ranks for sharded saves in the background (made once,
    collectively; the training's own groups stay free), or None for one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    if pg is not None and pg != dist.group.WORLD:
        raise CheckpointError("hpcsync.checkpoint: a sharded save in the background needs Checkpoints over the "
                              "world (group=None): it makes a process group of its own for its thread")
    if ckpts._group_for_thread is None:
        from datetime import timedelta

        ckpts._group_for_thread = dist.new_group(timeout=timedelta(seconds=ckpts.timeout or default_timeout()))
    return ckpts._group_for_thread


def save_in_background(ckpts: Any, ctl: Any, step: int, shared: Any, local: Any, state: Any
                       ) -> Tuple[str, Any, int]:
    """The same in the background: every rank's shard is copied to memory now (DCP's
    ``async_save``), written by a thread of its own, whose ranks then agree and rank 0 marks the
    checkpoint complete over a process group kept for checkpoints (the training's collectives go
    on meanwhile). Returns ``(final dir, a future of (path, error), the most bytes one rank
    writes)``. Collective."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    me, size = ctl.Get_rank(), ctl.Get_size()
    pg, data, blob, tmp, final, seq, biggest = _begin(ckpts, ctl, step, shared, local, state)
    group, error, copied = None, None, None
    try:
        group = checkpoint_group(ckpts, pg)
        copied = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(os.path.join(tmp, FOLDER), sync_files=True),
                                process_group=group, no_dist=_alone())
    except _failed() as exc:
        error = _why(exc)
    raise_if_any(ctl, error, CheckpointError, f"hpcsync.checkpoint: step {step} not saved: ")

    together = size > 1  # (a one-process job may have no torch.distributed at all)
    root = dist.get_global_rank(group, 0) if together and group is not None else 0

    def finish() -> Tuple[Optional[str], Optional[str]]:  # on every rank's checkpoint thread
        sizes, err = {}, None
        try:
            copied.result()
            sizes = _write_part(tmp, me, data)
        except _failed() as exc:  # every rank still reaches the exchange below
            err = f"rank {me}: {_why(exc)}"
        parts: Any = [(sizes, err)]
        if together:
            parts = [None] * size if me == 0 else None
            dist.gather_object((sizes, err), parts, dst=root, group=group)
        outcome: List[Any] = [None]
        if me == 0:
            errs = [e for _, e in parts if e]
            try:
                outcome[0] = (None, errs[0]) if errs else \
                    (_complete(ckpts, step, seq, size, tmp, final, blob, [sz for sz, _ in parts]), None)
            except Exception as exc:
                outcome[0] = (None, f"rank 0: {type(exc).__name__}: {exc}")
        if together:
            dist.broadcast_object_list(outcome, src=root, group=group)
        return outcome[0]

    return final, ckpts._thread().submit(finish), biggest


def load(ckpts: Any, ctl: Any, step: Optional[int], template: Any) -> Optional[Tuple[int, str, int, Any, Any]]:
    """:meth:`Checkpoints.load` with ``sharded=template``: ``(step, folder, seq, shared, local)``
    with ``template`` loaded in place, or None when there is no checkpoint. Collective."""

    me, size = ctl.Get_rank(), ctl.Get_size()
    chosen, error = None, None
    if me == 0:
        try:
            chosen = ckpts._choose(step, sharded=True)
        except Exception as exc:
            error = f"cannot load from {ckpts.root}: {type(exc).__name__}: {exc}"
    chosen, error = ctl.bcast((chosen, error), root=0)
    if error:
        raise CheckpointError(f"hpcsync.checkpoint: rank 0 {error}")
    if chosen is None:
        return None
    found, folder, seq, marker, shared_blob = chosen
    error, local = None, None
    try:
        pg = process_group(ckpts._group, size)
        import torch.distributed.checkpoint as dcp

        dcp.load(template, storage_reader=_reader(os.path.join(folder, FOLDER)),
                 planner=_planner(ckpts.safe_globals), process_group=pg, no_dist=_alone())
        name = f"rank-{me:05d}.pt"
        if marker["world_size"] == size and name in marker["files"]:
            with open(os.path.join(folder, name), "rb") as f:
                local = loads(f.read(), ckpts.safe_globals)
        elif me == 0:
            log.warning("hpcsync.checkpoint: %s was written by %d ranks, this job has %d: the sharded state is "
                        "resharded, the ranks' local states are not loaded", folder, marker["world_size"], size)
    except _failed() as exc:
        error = f"{folder}: {_why(exc)}"
    raise_if_any(ctl, error, CheckpointError, "hpcsync.checkpoint: cannot load: ")
    if me == 0 and step is None:  # the latest: what a supervised attempt resumes from
        from ..observe import failure

        failure.note_resume(found, folder, marker.get("time"))
    shared = loads(shared_blob, ckpts.safe_globals) if shared_blob is not None else None
    return found, folder, seq, shared, local
