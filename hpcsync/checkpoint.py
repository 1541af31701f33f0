"""Checkpoint directories that resume exactly, whatever each rank's view of the filesystem.

A checkpoint written while the allocation ends must never be read half-written, and every rank
must resume from the same one. :class:`Checkpoints` keeps ``ROOT/step-<N>/`` directories:

- **rank 0 does all the file I/O.** Each rank's own state (RNG states, the sampler's position,
  partial sums) is gathered to rank 0 over MPI and written there; on load rank 0 reads it back and
  broadcasts it. Ranks that see ``ROOT`` differently (node-local disks, a lagging network
  filesystem) cannot disagree, and ROOT need not be shared at all.
- **written under a temporary name, marked complete last.** Files go into ``ROOT/.step-<N>.tmp``,
  each flushed to disk; then a ``COMPLETE`` marker with every file's size; then the directory is
  renamed to ``step-<N>``. A job killed at any moment leaves the previous checkpoint the latest.
- **the latest complete one, chosen by rank 0 and broadcast.** A directory whose marker is
  missing, or whose files do not have the sizes it lists, is skipped with a warning.

::

    ckpts = hpcsync.Checkpoints("runs/ckpt")       # every rank
    saved = ckpts.load()                            # None, or the latest: .step, .shared, .local
    ...
    ckpts.save(step, shared={"model": model.state_dict(), "optim": opt.state_dict()},
               local={"rng": torch.get_rng_state()})
"""
from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, List, Optional

from . import comm
from .errors import CheckpointError, raise_if_any
from .filesync import fsync_dir

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
_NAME = re.compile(r"^step-(\d{8,})$")


@dataclass(frozen=True)
class Checkpoint:
    """What :meth:`Checkpoints.save` was given: ``shared`` (rank 0's) and this rank's ``local``."""

    step: int
    path: str
    shared: Any
    local: Any


def _dumps(obj: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    import torch

    # our own files: RNG states hold numpy arrays and tuples, which weights_only refuses
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class Checkpoints:
    """The checkpoints under ``root`` (created on rank 0). ``keep``: how many complete ones stay
    after a save (older ones are removed; at least 1). Every method is collective over the world
    (or ``group``, a torch process group)."""

    def __init__(self, root: str, keep: int = 2, group: Any = None) -> None:
        if keep < 1:
            raise ValueError(f"Checkpoints(keep={keep}): at least 1 must be kept")
        self.root = os.path.abspath(root)
        self.keep = keep
        self._group = group

    def _rank(self) -> int:
        return comm._comm(self._group).Get_rank()

    def _size(self) -> int:
        return comm._comm(self._group).Get_size()

    def _agree(self, error: Optional[str], what: str) -> None:
        raise_if_any(comm._comm(self._group), error, CheckpointError, what)

    def path(self, step: int) -> str:
        return os.path.join(self.root, f"step-{step:08d}")

    # -- rank 0 only ---------------------------------------------------------------------------
    def _complete_steps(self) -> List[int]:
        """Steps of the complete checkpoints under root, newest first (rank 0)."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        steps = []
        for name in names:
            m = _NAME.match(name)
            if m and self._is_complete(os.path.join(self.root, name)):
                steps.append(int(m.group(1)))
        return sorted(steps, reverse=True)

    def _is_complete(self, folder: str) -> bool:
        try:
            with open(os.path.join(folder, MARKER)) as f:
                marker = json.load(f)
            bad = [n for n, size in marker["files"].items() if os.path.getsize(os.path.join(folder, n)) != size]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("hpcsync.checkpoint: skipping %s: %s", folder, exc)
            return False
        if bad:
            log.warning("hpcsync.checkpoint: skipping %s: %s differ in size from its marker", folder, ", ".join(bad))
        return not bad

    def _write_all(self, step: int, shared: bytes, locals_: List[bytes]) -> str:
        os.makedirs(self.root, exist_ok=True)
        for name in os.listdir(self.root):  # what an earlier, interrupted save left
            if name.startswith(".step-") and name.endswith(".tmp"):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        tmp = os.path.join(self.root, f".step-{step:08d}.tmp")
        os.makedirs(tmp)
        files = {"shared.pt": shared, **{f"rank-{r:05d}.pt": data for r, data in enumerate(locals_)}}
        for name, data in files.items():
            _write(os.path.join(tmp, name), data)
        marker = {"step": step, "world_size": len(locals_), "files": {n: len(d) for n, d in files.items()}}
        _write(os.path.join(tmp, MARKER), json.dumps(marker, indent=1).encode())
        fsync_dir(tmp)
        final = self.path(step)
        if os.path.exists(final):  # the same step saved again: the new one replaces it
            old = os.path.join(self.root, f".step-{step:08d}.old.tmp")
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_dir(self.root)
        for old_step in self._complete_steps()[self.keep:]:
            shutil.rmtree(self.path(old_step), ignore_errors=True)
        return final

    # -- collective ----------------------------------------------------------------------------
    def latest(self) -> Optional[int]:
        """The step of the newest complete checkpoint (rank 0 looks, every rank gets its answer)."""
        steps: Optional[List[int]] = None
        error = None
        if self._rank() == 0:
            try:
                steps = self._complete_steps()
            except OSError as exc:
                error = f"cannot list {self.root}: {exc}"
        found = comm.broadcast_object((steps[0] if steps else None, error), group=self._group)
        if found[1]:
            raise CheckpointError(f"hpcsync.checkpoint: rank 0 {found[1]}")
        return found[0]

    def save(self, step: int, shared: Any = None, local: Any = None) -> str:
        """Write checkpoint ``step``: rank 0's ``shared`` (the same on every rank under DDP, so only
        rank 0's is kept) and every rank's ``local``. Returns its directory on every rank once it is
        complete; raises :class:`CheckpointError` on every rank if any part failed."""
        error, data = None, b""
        try:
            data = _dumps(local)
        except Exception as exc:  # an unpicklable state on one rank: the same error everywhere
            error = f"cannot serialise its local state: {exc!r}"
        self._agree(error, f"hpcsync.checkpoint: step {step} not saved: ")
        locals_ = comm.gather(data, dst=0, group=self._group)
        path, error = None, None
        if self._rank() == 0:
            try:
                path = self._write_all(step, _dumps(shared), locals_)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        path, error = comm.broadcast_object((path, error), group=self._group)
        if error:
            raise CheckpointError(f"hpcsync.checkpoint: step {step} not saved (rank 0: {error}); "
                                  "the previous complete checkpoint is untouched")
        log.info("hpcsync.checkpoint: saved step %d to %s", step, path)
        return path

    def load(self, step: Optional[int] = None) -> Optional[Checkpoint]:
        """The checkpoint ``step`` (default: the latest complete one), or None when there is none.
        Rank 0 reads every file; each rank gets ``shared`` and its own ``local`` (rank 0 broadcasts
        all of them: keep local states small -- RNG states, positions, sums -- and shard a model too
        big for one rank's memory with torch.distributed.checkpoint instead). A checkpoint written
        by a different number of ranks raises :class:`CheckpointError` on every rank."""
        payload, error = None, None
        if self._rank() == 0:
            try:
                chosen = step if step is not None else (self._complete_steps() or [None])[0]
                if chosen is not None:
                    folder = self.path(chosen)
                    with open(os.path.join(folder, MARKER)) as f:
                        world = json.load(f)["world_size"]
                    if world != self._size():
                        raise ValueError(f"{folder} was written by {world} ranks, this job has {self._size()}")
                    with open(os.path.join(folder, "shared.pt"), "rb") as f:
                        shared = f.read()
                    locals_ = []
                    for r in range(world):
                        with open(os.path.join(folder, f"rank-{r:05d}.pt"), "rb") as f:
                            locals_.append(f.read())
                    payload = (chosen, folder, shared, locals_)
            except Exception as exc:
                error = f"cannot load from {self.root}: {type(exc).__name__}: {exc}"
        payload, error = comm.broadcast_object((payload, error), group=self._group)
        if error:  # rank 0's words, the same on every rank
            raise CheckpointError(f"hpcsync.checkpoint: rank 0 {error}")
        if payload is None:
            return None
        chosen, folder, shared, locals_ = payload
        log.info("hpcsync.checkpoint: resuming from step %d (%s)", chosen, folder)
        return Checkpoint(chosen, folder, _loads(shared), _loads(locals_[self._rank()]))
