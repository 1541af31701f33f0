"""Checkpoint directories that resume exactly, whatever each rank's view of the filesystem.

A checkpoint written while the allocation ends must never be read half-written, and every rank
must resume from the same one. :class:`Checkpoints` keeps ``ROOT/step-<N>/`` directories:

- **rank 0 does all the file I/O** (a replicated model's form). Each rank's own state (RNG states,
  the sampler's position, partial sums) is gathered to rank 0 over MPI and written there; on load
  rank 0 reads it back and sends each rank its own. Ranks that see ``ROOT`` differently
  (node-local disks, a lagging network filesystem) cannot disagree, and ROOT need not be shared.
- **or every rank writes its own part** (``sharded=``: a state spread over the ranks, e.g. FSDP2's):
  :mod:`hpcsync.resilience.sharded`, with the same guarantees below; ROOT must then be shared.
- **written under a temporary name, marked complete last.** Files go into a temporary directory,
  each flushed to disk; then a ``COMPLETE`` marker with every file's size and checksum and the
  checkpoint's sequence number; then the directory is renamed into place. Nothing complete is
  renamed or removed before the new one is in place, so a job killed at any moment leaves a
  complete checkpoint (the previous one until the rename, the new one after).
- **whole bytes, or the previous one.** Each file is checked as it is read (size, checksum:
  :mod:`hpcsync.resilience.checksums`); a damaged checkpoint is skipped with a warning naming
  the folder and the file and the previous whole one loaded, the same on every rank; none left
  whole is a :class:`~hpcsync.core.errors.CheckpointError` on every rank that says "damaged".
- **the latest is the last saved**, by sequence number, not by step: a root that still holds a
  higher step of an abandoned run does not win over this run's newest, and pruning (``keep``)
  never removes the checkpoint just written. Saving a step again writes ``step-<N>.<seq>``.
- **one job per root.** Rank 0 records the job that uses ``ROOT`` (``ROOT/OWNER``); a second job
  that is still running (Slurm's ``squeue``, or a live process on this host) gets a
  :class:`~hpcsync.core.errors.CheckpointError` on every rank instead of loading or pruning the other's
  checkpoints. A requeued job is the same job; a job that ended hands the root on.
- **loading runs no code**: ``torch.load(weights_only=True)``, with numpy's arrays and scalars
  allowed (RNG states) and whatever ``safe_globals`` adds (a sharded checkpoint's metadata:
  :mod:`hpcsync.resilience.dcp_reader`).
- **bounded.** Every exchange between the ranks waits at most ``timeout`` (``HPCSYNC_TIMEOUT``),
  plus the time to write what the others wait for at ``HPCSYNC_CHECKPOINT_MBPS``: a rank that
  raised or is stuck gives the others :class:`~hpcsync.core.errors.CollectiveTimeout`.

::

    ckpts = hpcsync.Checkpoints("runs/ckpt")       # every rank
    saved = ckpts.load()                            # None, or the latest: .step, .shared, .local
    ...
    ckpts.save(step, shared={"model": model.state_dict(), "optim": opt.state_dict()},
               local={"rng": torch.get_rng_state()})
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from ..core import bounded, comm, jobend
from ..core.worker import result
from ..observe import failure
from ..core.errors import (CheckpointError, raise_if_any, raise_if_any_of, raise_if_differ, raise_if_settings_differ,
                           ranks_by_value)
from ..data.filesync import fsync_dir
from . import checkpoint_io, checksums
from . import node_copies as _node_copies
from . import sharded as _sharded
from .checkpoint_io import dumps, from_rank0, loads
from .checksums import Damaged
from .root_owner import advance, claim, this_job
from .steps import STEP_RULE, as_step, said, step_problem, who

__all__ = ["MARKER", "read_marker", "next_seq", "Checkpoint", "Checkpoints"]

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
_NAME = re.compile(r"^step-(\d{8,})(?:\.(\d+))?$")


def read_marker(folder: str, warned: Set[str], damaged: Optional[Dict[str, str]] = None) -> Optional[dict]:
    """The marker of a complete checkpoint directory whose files all have their marker's sizes
    (the checksums are checked as each file is read: :mod:`hpcsync.resilience.checksums`), or
    None when it is not: a damaged checkpoint (what is wrong recorded in ``damaged``), warned
    once (through ``warned``)."""
    try:
        with open(os.path.join(folder, MARKER)) as f:
            marker = json.load(f)
        why = checksums.marker_problem(marker)
        missing = [n for n in marker["files"] if why is None and not os.path.isfile(os.path.join(folder, n))]
        bad = [n for n, size in marker["files"].items()
               if why is None and not missing and os.path.getsize(os.path.join(folder, n)) != size]
        why = why or (f"{', '.join(missing)} missing" if missing else None) or \
            (f"{', '.join(bad)} differ in size from its marker" if bad else None)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        why = f"its marker ({MARKER}) cannot be read: {exc}"
    if why is None:
        return marker
    if damaged is not None:
        damaged[folder] = why
    if folder not in warned:
        warned.add(folder)
        log.warning("hpcsync.checkpoint: skipping %s: damaged: %s", folder, why)
    return None


def _step_of(folder: str) -> Optional[int]:
    m = _NAME.match(os.path.basename(folder))
    return int(m.group(1)) if m else None


def next_seq(root: str) -> int:
    """The sequence number the next checkpoint under ``root`` gets (one past every marker's)."""
    seqs = [-1]
    for name in os.listdir(root):
        if _NAME.match(name):
            try:
                with open(os.path.join(root, name, MARKER)) as f:
                    seqs.append(int(json.load(f).get("seq", -1)))
            except (OSError, ValueError, TypeError, AttributeError):
                continue
    return max(seqs) + 1


_DIFFER = "hpcsync.checkpoint: the ranks' Checkpoints differ: "


@dataclass(frozen=True)
class Checkpoint:
    """What :meth:`Checkpoints.save` was given: ``shared`` (rank 0's) and this rank's ``local``;
    ``seq`` orders checkpoints by when they were saved."""

    step: int
    path: str
    shared: Any
    local: Any
    seq: int = -1
    read: Optional[Dict[str, Any]] = None  #: with ``local_dir``: this rank's bytes read from its node, peers, the root


class Checkpoints:
    """The checkpoints under ``root`` (created on rank 0). ``keep``: how many complete ones stay
    after a save (older ones are removed; at least 1). Every method is collective over the world
    or ``group`` (a torch process group or an mpi4py communicator), each exchange bounded by
    ``timeout`` seconds (default ``HPCSYNC_TIMEOUT``). ``safe_globals``: further types a
    checkpoint may hold (``torch.serialization.add_safe_globals``'s kind).

    ``local_dir``: sharded saves go to this node-local folder on every node (``$SLURM_TMPDIR``),
    each rank's files copied to ``replicas`` other nodes, and into ``root`` only every
    ``shared_every``-th save (by sequence number; 0: only when ``save(to_root=True)``); a load
    after a lost node reads from the surviving copies, not from ``root``:
    :mod:`hpcsync.resilience.node_copies`."""

    def __init__(self, root: str, keep: int = 2, group: Any = None, timeout: Optional[float] = None,
                 safe_globals: Sequence[Any] = (), local_dir: Optional[str] = None, replicas: int = 1,
                 shared_every: int = 10) -> None:
        if keep < 1:
            raise ValueError(f"Checkpoints(keep={keep}): at least 1 must be kept")
        if replicas < 0 or shared_every < 0:
            raise ValueError(f"Checkpoints(replicas={replicas}, shared_every={shared_every}): neither may be negative")
        self.local_dir = os.path.abspath(local_dir) if local_dir else None
        self.replicas, self.shared_every = replicas, shared_every
        self._layout: Any = None  # with local_dir: which ranks share a node (learned on first use)
        self.root = os.path.abspath(root)
        self.keep = keep
        self.timeout = timeout
        self.safe_globals = list(safe_globals)
        self._group = group
        self._job = this_job()
        self._warned: Set[str] = set()
        self._damaged: Dict[str, str] = {}  # rank 0: the damaged checkpoints its last look found, and why
        self._pending: Optional[int] = None  # the step a background save is writing (every rank)
        self._future: Any = None  # rank 0: that write
        self._pool: Any = None
        self._pending_sharded = False  # the pending save is sharded: every rank has a future
        self._pending_bytes = 0  # what the pending save writes (its wait allows for it)
        self._stuck = False  # the thread is stuck in a write: close() does not wait for it
        self._group_for_thread: Any = None  # the process group of sharded saves in the background

    def _ctl(self, what: str) -> Any:
        return bounded.control(f"hpcsync.checkpoint: {what}", self._group, self.timeout)

    def path(self, step: int) -> str:
        """Where ``step`` is written when it is saved once (``step-<N>``; again: ``step-<N>.<seq>``);
        ``ValueError`` for a step that is none (:data:`~hpcsync.resilience.steps.STEP_RULE`)."""
        number = as_step(step)
        if number is None:
            raise ValueError(f"hpcsync.checkpoint: {STEP_RULE}, not {said(step)}")
        return os.path.join(self.root, f"step-{number:08d}")

    # -- rank 0 only ---------------------------------------------------------------------------
    def _complete(self) -> List[Tuple[int, int, str]]:
        """``(seq, step, folder)`` of the complete checkpoints under root, the last saved first;
        a marker without a sequence number (an older hpcsync's) counts as older than any with one."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        found = []
        self._damaged = {}
        for name in names:
            m = _NAME.match(name)
            folder = os.path.join(self.root, name)
            if m:
                marker = read_marker(folder, self._warned, self._damaged)
                if marker is not None:
                    found.append((int(marker.get("seq", -1)), int(m.group(1)), folder))
            elif name.startswith("step-") and folder not in self._warned and os.path.isfile(os.path.join(folder, MARKER)):
                self._warned.add(folder)  # (an older hpcsync saved a negative step as step--<N>)
                log.warning("hpcsync.checkpoint: skipping %s: it is marked complete, but its name is not step-<N> "
                            "or step-<N>.<seq> (N a step, 0 or more, in 8 digits or more), so no step can be "
                            "read from it; rename it to load it", folder)
        return sorted(found, reverse=True)

    def _root_seq(self) -> int:
        """Claim the root; the sequence number its next checkpoint would get."""
        claim(self.root, self._job)
        return next_seq(self.root)

    def _name(self, step: int, seq: Optional[int] = None) -> Tuple[str, str, int]:
        """Claim the root, clear what an interrupted save left, and name the new checkpoint:
        ``(temporary dir, final dir, sequence number)`` (``seq`` when given: a node-local save's)."""
        claim(self.root, self._job)
        for name in os.listdir(self.root):  # what an earlier, interrupted save of this root left
            if name.startswith(".step-") and name.endswith(".tmp"):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        seq = advance(self.root, self._job, next_seq(self.root))[0] if seq is None else seq  # (one counter)
        tmp = os.path.join(self.root, f".step-{step:08d}.{seq}.tmp")
        final = self.path(step)
        if os.path.lexists(final):  # the same step saved again: a name of its own, the old one stays
            final = f"{final}.{seq}"
        return tmp, final, seq

    def _plan(self, step: int, shared: bytes, locals_: List[bytes]) -> Tuple[str, str, Dict[str, bytes], dict]:
        """:meth:`_name`, and the files rank 0 writes: ``(temporary dir, final dir, files, marker)``."""
        tmp, final, seq = self._name(step)
        files = {"shared.pt": shared, **{f"rank-{r:05d}.pt": data for r, data in enumerate(locals_)}}
        return tmp, final, files, {"step": step, "seq": seq, "world_size": len(locals_)}

    def _plan_sharded(self, step: int, seq: Optional[int] = None) -> Tuple[str, str, int]:
        """:meth:`_name`, the temporary directory made for every rank to write its part into."""
        tmp, final, seq = self._name(step, seq)
        os.makedirs(os.path.join(tmp, "sharded"))
        return tmp, final, seq

    def _write(self, tmp: str, final: str, files: Dict[str, bytes], marker: dict) -> str:
        """Write, flush, mark complete, rename into place, prune (rank 0; maybe in the background)."""
        os.makedirs(tmp)
        sums = {name: checkpoint_io.write_file(os.path.join(tmp, name), data) for name, data in files.items()}
        return self._seal(tmp, final, {n: len(d) for n, d in files.items()}, marker, sums)

    def _seal(self, tmp: str, final: str, sizes: Dict[str, int], fields: dict,
              sums: Optional[Dict[str, str]] = None) -> str:
        """The files in ``tmp`` are on disk: write the marker (every file's size, the checksums
        ``sums`` taken as they were written, and ``fields``), rename into place, prune (rank 0)."""
        marker = checksums.seal({"run": claim(self.root, self._job).id, **fields, "files": sizes, "job": self._job,
                                 "time": time.time()}, sums or {})  # (the run: what heals a damaged OWNER)
        checkpoint_io.write_file(os.path.join(tmp, MARKER), json.dumps(marker, indent=1).encode())
        fsync_dir(tmp)
        os.rename(tmp, final)
        fsync_dir(self.root)
        for _, _, folder in self._complete()[self.keep:]:  # the one just written is the newest
            if folder != final:
                shutil.rmtree(folder, ignore_errors=True)
        return final

    def _choose(self, step: Optional[int], sharded: bool, skip: Optional[Dict[str, str]] = None
                ) -> Optional[Tuple[int, str, int, dict, Optional[bytes]]]:
        """The checkpoint to load: ``(step, folder, seq, marker, shared.pt's bytes)``, or None: the
        last saved (of ``step``, when given) that is whole so far (marker, sizes, shared.pt's
        checksum), less those in ``skip`` (``{folder: why}``, found damaged on a later read). A
        damaged one is skipped with a warning; :class:`Damaged` when none is left whole."""
        claim(self.root, self._job)
        skip = skip if skip is not None else {}
        for seq, found, folder in self._complete():
            if (step is not None and found != step) or folder in skip:
                continue
            with open(os.path.join(folder, MARKER)) as f:
                marker = json.load(f)
            if bool(marker.get("sharded")) != sharded:
                raise ValueError(f"{folder} was saved {'with' if marker.get('sharded') else 'without'} sharded=: load "
                                 f"it with load({'sharded=<a state dict of the same structure>' if not sharded else ''})")
            try:
                shared = checksums.read_whole(folder, "shared.pt", marker) if "shared.pt" in marker["files"] else None
            except Damaged as exc:
                self._skip(exc, skip)
                continue
            return found, folder, seq, marker, shared
        damaged = {f: w for f, w in {**self._damaged, **skip}.items() if step is None or _step_of(f) == step}
        if damaged:
            raise Damaged(max(damaged), "", "", f"hpcsync.checkpoint: no whole checkpoint "
                          f"{f'of step {step} ' if step is not None else ''}is left under {self.root}, every one is "
                          "damaged: " + "; ".join(f"{os.path.basename(f)}: {w}" for f, w in sorted(damaged.items())[::-1]))
        if step is not None:
            raise ValueError(f"no complete checkpoint of step {step} under {self.root}")
        return None

    def _skip(self, exc: Damaged, skip: Dict[str, str]) -> None:
        """(rank 0) ``exc``'s checkpoint is damaged: left out of the next choice, with a warning."""
        skip[exc.folder] = exc.why
        log.warning("hpcsync.checkpoint: skipping %s: damaged: %s; an older whole checkpoint is looked for "
                    "instead", exc.folder, exc.why)

    def _read(self, step: Optional[int], size: int) -> Optional[Tuple[int, str, int, bytes, List[bytes]]]:
        skip: Dict[str, str] = {}
        while True:  # (each turn skips one more checkpoint: as many turns as there are, at most)
            chosen = self._choose(step, False, skip)
            if chosen is None:
                return None
            found, folder, seq, marker, shared = chosen
            world = marker["world_size"]
            if world != size:
                raise ValueError(f"{folder} was written by {world} ranks, this job has {size}")
            try:
                locals_ = [checksums.read_whole(folder, f"rank-{r:05d}.pt", marker) for r in range(world)]
            except Damaged as exc:
                self._skip(exc, skip)
                continue
            if step is None:  # the latest: what a supervised attempt resumes from
                failure.note_resume(found, folder, marker.get("time"))
            return found, folder, seq, shared or b"", locals_

    # -- collective ----------------------------------------------------------------------------
    def latest(self) -> Optional[int]:
        """The step of the last saved complete checkpoint (rank 0 looks, every rank gets its answer):
        from the markers (their own checksums, every file present at its size; with
        ``local_dir``, also the run identity and copies that cover it), not the files' bytes,
        which :meth:`load` checks as it reads them. So it names the step :meth:`load` tries first:
        a file damaged at the same size makes that load read another node's copy, or load an older
        step (never a newer one): resume from the returned :attr:`Checkpoint.step`."""
        self.wait()
        ctl = self._ctl("latest()")
        self._same_options(ctl, True)
        if self.local_dir:
            return _node_copies.latest(self, ctl)
        found: Optional[int] = None
        error = None
        if ctl.Get_rank() == 0:
            try:
                claim(self.root, self._job)
                complete = self._complete()
                found = complete[0][1] if complete else None
            except Exception as exc:
                error = f"cannot use {self.root}: {exc}"
        found, error = ctl.bcast((found, error), root=0)
        if error:
            raise CheckpointError(f"hpcsync.checkpoint: rank 0 {error}")
        return found

    def save(self, step: int, shared: Any = None, local: Any = None, background: bool = False,
             sharded: Any = None, to_root: bool = False) -> str:
        """Write checkpoint ``step``: rank 0's ``shared`` (the same on every rank under DDP, so only
        rank 0's is kept) and every rank's ``local``. Returns its directory on every rank once it is
        complete; raises :class:`CheckpointError` on every rank if any part failed.

        ``step``: :data:`~hpcsync.resilience.steps.STEP_RULE`, the same on every rank; a step that is none on any rank, or
        ranks that give different steps, are one :class:`CheckpointError` on every rank (naming
        which rank gave what) before anything is written.

        ``sharded``: this rank's part of a state spread over the ranks (a state dict whose tensors
        may be DTensors, e.g. ``get_state_dict(model, optim)`` of an FSDP2 model). Every rank then
        writes its own shard and its own ``local`` into the checkpoint (torch.distributed.checkpoint's
        format; the root must be a directory every rank sees): :mod:`hpcsync.resilience.sharded`.

        ``background``: return once the states are copied to memory (serialised on every rank and
        gathered to rank 0; with ``sharded=``, each rank's shard copied on that rank); rank 0 (with
        ``sharded=``, every rank) writes the files on a thread of its own while training goes on.
        The next save, :meth:`load`, :meth:`latest` and :meth:`wait` first wait for it (and raise
        its error, if any, on every rank); a crash while it writes leaves the previous complete
        checkpoint the latest. The returned directory exists once it completes.

        ``to_root``: with ``local_dir``, write this save into the root too (as every
        ``shared_every``-th): a stop before the allocation ends, whose node-local disks go with it."""
        self.wait()
        number = as_step(step)
        ctl = self._ctl(f"save of step {step if number is None else number}")
        error, data = None, b""
        if sharded is None and not self.local_dir:  # the rank-0 form: its first error goes in the same exchange
            try:
                data = dumps(local)
            except Exception as exc:  # an unpicklable state on one rank: the same error everywhere
                error = f"cannot serialise its local state: {exc!r}"
        step = self._agree_save(ctl, step, number, sharded, error)
        if self.local_dir:
            if sharded is None or background:
                raise ValueError("Checkpoints(local_dir=...) takes sharded saves written before save() returns "
                                 "(sharded=..., background=False): node-local copies are of a sharded state")
            return _node_copies.save(self, ctl, step, shared, local, sharded, to_root)
        if sharded is not None:
            if background:
                return self._save_sharded_background(ctl, step, shared, local, sharded)
            return _sharded.save(self, ctl, step, shared, local, sharded)
        locals_ = comm.gather(data, dst=0, group=ctl)
        blob = b""

        def serialise() -> int:  # rank 0: the shared state, kept here; every rank learns the bytes to write
            nonlocal blob
            blob = dumps(shared)
            return len(blob) + sum(map(len, locals_))

        total = from_rank0(ctl, serialise, f"step {step} not saved (rank 0 cannot serialise the shared state: {{}})")
        checkpoint_io.allow_for(ctl, total)  # rank 0 writes it all while the others wait

        def write() -> str:  # rank 0
            plan = self._plan(step, blob, locals_)
            if not background:
                return self._write(*plan)
            self._future = self._thread().submit(self._write, *plan)
            return plan[1]

        path = from_rank0(ctl, write, f"step {step} not saved (rank 0: {{}})")
        if background:
            self._pending, self._pending_bytes = step, total
            log.info("hpcsync.checkpoint: saving step %d to %s in the background", step, path)
        else:
            log.info("hpcsync.checkpoint: saved step %d to %s", step, path)
        return path

    def _options(self) -> Dict[str, Any]:
        """What decides a sharded call's path: the same on every rank."""
        return {"local_dir": self.local_dir is not None, "replicas": self.replicas, "shared_every": self.shared_every}

    def _same_options(self, ctl: Any, sharded: Any) -> None:
        """Collective (sharded forms): the ranks take one path, or all raise the same error."""
        if sharded is not None:
            raise_if_settings_differ(ctl, self._options(), CheckpointError, _DIFFER)

    def _agree_save(self, ctl: Any, step: Any, number: Optional[int], sharded: Any, error: Optional[str]) -> int:
        """Collective, a save's first exchange (one allgather): every rank's step is a step
        (``number``, :func:`~hpcsync.resilience.steps.as_step`) and the same as the others', it takes the same form (``sharded``
        or not) with the same options, and none has an ``error`` yet; else the same
        :class:`CheckpointError` on every rank, before anything is written. The step, an int."""
        every = ctl.allgather((number, None if number is not None else said(step),
                               self._options() if sharded is not None else None, error))
        refused = "hpcsync.checkpoint: save() refused on every rank, nothing written: "
        problem = step_problem([(n, s) for n, s, _, _ in every], "saves")
        if problem:
            raise CheckpointError(refused + problem)
        forms = ranks_by_value([options is not None for _, _, options, _ in every])
        if len(forms) > 1:  # (each form's exchanges next are its own)
            raise CheckpointError(refused + f"sharded= given on {who(forms[True])}, not on {who(forms[False])}")
        if sharded is not None and len(every) > 1:
            raise_if_differ([options for _, _, options, _ in every], CheckpointError, _DIFFER)
        agreed = every[0][0]
        raise_if_any_of([e for _, _, _, e in every], CheckpointError, f"hpcsync.checkpoint: step {agreed} not saved: ")
        return agreed

    def _thread(self) -> Any:
        """The thread that writes in the background (one, made on first use)."""
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="hpcsync-checkpoint")
        return self._pool

    def _save_sharded_background(self, ctl: Any, step: int, shared: Any, local: Any, state: Any) -> str:
        path, self._future, biggest = _sharded.save_in_background(self, ctl, step, shared, local, state)
        self._pending, self._pending_sharded, self._pending_bytes = step, True, biggest
        log.info("hpcsync.checkpoint: saving step %d (sharded) to %s in the background", step, path)
        return path

    def wait(self) -> Optional[str]:
        """Collective: wait for the save in the background, if any; its directory (None when none
        was pending), or :class:`CheckpointError` on every rank if it failed (the previous complete
        checkpoint is then still the latest)."""
        if self._pending is None:
            return None
        step, self._pending = self._pending, None
        ctl = self._ctl(f"background save of step {step}")
        checkpoint_io.allow_for(ctl, self._pending_bytes)
        future, self._future = self._future, None
        if self._pending_sharded:  # every rank's thread has its outcome, the same on every rank
            self._pending_sharded = False
            path, error = None, None
            try:  # (its exchanges wait at most the groups' timeouts: DCP's, then the agreement's, 2 t + 10 s)
                path, error = result(future, 3 * (self.timeout or bounded.default_timeout()) + 10 + getattr(ctl, "timeout", 0),
                                     lambda: f"the background save of step {step}")
            except Exception as exc:  # (a Stalled: the thread is left to its stuck write)
                error, self._stuck = f"{type(exc).__name__}: {exc}", True
            try:
                raise_if_any(ctl, error and f"in the background: {error}", CheckpointError,
                             f"hpcsync.checkpoint: step {step} not saved: ")
            except CheckpointError:
                _sharded.drop_groups(self)  # out of step, perhaps: the next save makes new ones
                raise
            log.info("hpcsync.checkpoint: saved step %d (sharded) to %s", step, path)
            return path
        path = from_rank0(ctl, lambda: future.result(), f"step {step} not saved (rank 0, in the background: {{}})")
        log.info("hpcsync.checkpoint: saved step %d to %s", step, path)
        return path

    def close(self) -> None:
        """Collective: wait for a save in the background (:meth:`wait`), stop its thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=not self._stuck, cancel_futures=True)
                self._pool = None

    def __enter__(self) -> "Checkpoints":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """:meth:`close`; but when the exception leaving the block ends the job
        (:func:`hpcsync.core.jobend.exception_ends_job`), no collective: the other ranks are in
        the program's next collective, and waiting for a save in the background would hold this
        rank's traceback back for the timeout. That save is left as it is: it is marked complete
        only once fully written (the previous complete checkpoint stays the latest until then)."""
        if jobend.exception_ends_job(exc_type):
            if self._pending is not None and isinstance(exc, BaseException):
                exc.add_note(f"hpcsync: the background save of step {self._pending} was not waited for (the job "
                             "ends): unless it completed, the previous complete checkpoint is the latest")
            return
        self.close()

    def load(self, step: Optional[int] = None, sharded: Any = None) -> Optional[Checkpoint]:
        """The checkpoint ``step`` (default: the last saved complete one), or None when there is none.
        Rank 0 reads every file; each rank gets ``shared`` (broadcast) and its own ``local`` (sent
        to that rank alone: keep local states small -- RNG states, positions, sums). A checkpoint
        written by a different number of ranks, or one holding types that ``weights_only`` loading
        refuses, raises :class:`CheckpointError` on every rank.

        ``sharded``: for a checkpoint saved with ``sharded=``, a state dict of the same structure
        (this rank's template), loaded in place; each rank reads its own part and its own
        ``local``, and a job of another size reshards (its ``local`` is then None)."""
        self.wait()
        ctl = self._ctl("load()")
        number = None if step is None else as_step(step)  # (one allgather: a step, the same on every rank)
        problem = step_problem(ctl.allgather((number, None if step is None or number is not None else said(step))),
                                "loads")
        if problem:
            raise CheckpointError("hpcsync.checkpoint: load() refused on every rank: " + problem)
        step = number
        self._same_options(ctl, sharded)
        if self.local_dir and sharded is None:
            raise ValueError("Checkpoints(local_dir=...) loads sharded checkpoints: load(sharded=<a state dict>)")
        if sharded is not None:
            got = (_node_copies if self.local_dir else _sharded).load(self, ctl, step, sharded)
            if got is None:
                return None
            found, folder, seq, shared, local, *read = got
            log.info("hpcsync.checkpoint: resuming from step %d (%s, sharded)", found, folder)
            return Checkpoint(found, folder, shared, local, seq, *read)
        payload, error = None, None
        if ctl.Get_rank() == 0:
            try:
                payload = self._read(step, ctl.Get_size())
            except Exception as exc:
                error = f"cannot load from {self.root}: {checksums.said(exc)}"
        head = None if payload is None else payload[:4]
        head, error = comm.broadcast_object((head, error), group=ctl)
        if error:  # rank 0's words, the same on every rank
            raise CheckpointError(f"hpcsync.checkpoint: rank 0 {error}")
        if head is None:
            return None
        chosen, folder, seq, shared = head
        mine = ctl.scatter(payload[4] if payload is not None else None, root=0)  # each rank its own alone
        error, loaded = None, None
        try:
            loaded = (loads(shared, self.safe_globals), loads(mine, self.safe_globals))
        except Exception as exc:  # e.g. a type weights_only refuses: never run it, say so everywhere
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            why = next((ln for ln in lines if "GLOBAL" in ln), lines[0] if lines else "")
            error = f"{folder}: {type(exc).__name__}: {why}"
        raise_if_any(ctl, error, CheckpointError, "hpcsync.checkpoint: cannot load (weights_only=True; add "
                     "trusted types with Checkpoints(safe_globals=[...])): ")
        log.info("hpcsync.checkpoint: resuming from step %d (%s)", chosen, folder)
        return Checkpoint(chosen, folder, loaded[0], loaded[1], seq)
