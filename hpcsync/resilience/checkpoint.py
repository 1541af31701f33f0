"""Checkpoint directories that resume exactly, whatever each rank's view of the filesystem.

A checkpoint written while the allocation ends must never be read half-written, and every rank
must resume from the same one. :class:`Checkpoints` keeps ``ROOT/step-<N>/`` directories:

- **rank 0 does all the file I/O.** Each rank's own state (RNG states, the sampler's position,
  partial sums) is gathered to rank 0 over MPI and written there; on load rank 0 reads it back and
  broadcasts it. Ranks that see ``ROOT`` differently (node-local disks, a lagging network
  filesystem) cannot disagree, and ROOT need not be shared at all.
- **written under a temporary name, marked complete last.** Files go into a temporary directory,
  each flushed to disk; then a ``COMPLETE`` marker with every file's size and the checkpoint's
  sequence number; then the directory is renamed into place. Nothing complete is renamed or
  removed before the new one is in place, so a job killed at any moment leaves a complete
  checkpoint (the previous one until the rename, the new one after).
- **the latest is the last saved**, by sequence number, not by step: a root that still holds a
  higher step of an abandoned run does not win over this run's newest, and pruning (``keep``)
  never removes the checkpoint just written. Saving a step again writes ``step-<N>.<seq>``.
- **one job per root.** Rank 0 records the job that uses ``ROOT`` (``ROOT/OWNER``); a second job
  that is still running (Slurm's ``squeue``, or a live process on this host) gets a
  :class:`~hpcsync.core.errors.CheckpointError` on every rank instead of loading or pruning the other's
  checkpoints. A requeued job is the same job; a job that ended hands the root on.
- **loading runs no code**: ``torch.load(weights_only=True)``, with numpy's arrays and scalars
  allowed (RNG states) and whatever ``safe_globals`` adds.
- **bounded.** Every exchange between the ranks waits at most ``timeout`` (``HPCSYNC_TIMEOUT``):
  a rank that raised or is stuck gives the others :class:`~hpcsync.core.errors.CollectiveTimeout`.

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
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from ..core import bounded, comm
from ..observe import failure
from ..core.errors import CheckpointError, raise_if_any
from ..data.filesync import fsync_dir

log = logging.getLogger("hpcsync.checkpoint")  # the name users configure, as before the packages

MARKER = "COMPLETE"
OWNER = "OWNER"
_NAME = re.compile(r"^step-(\d{8,})(?:\.(\d+))?$")
_SQUEUE_TIMEOUT_S = 30.0
_FINISHED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
             "OUT_OF_MEMORY", "")


@dataclass(frozen=True)
class Checkpoint:
    """What :meth:`Checkpoints.save` was given: ``shared`` (rank 0's) and this rank's ``local``;
    ``seq`` orders checkpoints by when they were saved."""

    step: int
    path: str
    shared: Any
    local: Any
    seq: int = -1


def _dumps(obj: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def numpy_safe_globals() -> List[Any]:
    """What ``torch.load(weights_only=True)`` needs to rebuild numpy arrays, dtypes and scalars
    (numpy's RNG state is an array): data, no code."""
    import numpy as np

    try:
        from numpy._core import multiarray
    except ImportError:  # numpy 1
        from numpy.core import multiarray  # type: ignore[no-redef]
    dtypes = [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")] if hasattr(np, "dtypes") else []
    return [np.dtype, np.ndarray, multiarray.scalar, multiarray._reconstruct, *dtypes]


def _loads(data: bytes, extra: Sequence[Any]) -> Any:
    import torch

    with torch.serialization.safe_globals([*numpy_safe_globals(), *extra]):
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _write_file(path: str, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _from_rank0(ctl: Any, fn: Any, failed: str) -> Any:
    """Collective: ``fn()`` on rank 0, its result on every rank; its error as one
    :class:`CheckpointError` on every rank (``failed`` with ``{}`` for the error)."""
    value, error = None, None
    if ctl.Get_rank() == 0:
        try:
            value = fn()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    value, error = ctl.bcast((value, error), root=0)
    if error:
        raise CheckpointError(f"hpcsync.checkpoint: {failed.format(error)}; the previous complete checkpoint is untouched")
    return value


# -- which job uses a root ---------------------------------------------------------------------
def _start_ticks(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
        return int(text[text.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def this_job() -> Dict[str, Any]:
    """Who this job is, for ``OWNER``: its Slurm job id (the same across requeues; each array
    task has its own), and rank 0's host and process."""
    pid = os.getpid()
    return {"slurm_job": os.environ.get("SLURM_JOB_ID") or None, "host": socket.gethostname(), "pid": pid,
            "start": _start_ticks(pid)}


def _describe_job(job: Dict[str, Any]) -> str:
    if job.get("slurm_job"):
        return f"Slurm job {job['slurm_job']}"
    return f"process {job.get('pid')} on {job.get('host')}"


def _same_job(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    if a.get("slurm_job") or b.get("slurm_job"):
        return a.get("slurm_job") == b.get("slurm_job")
    return (a.get("host"), a.get("pid"), a.get("start")) == (b.get("host"), b.get("pid"), b.get("start"))


def job_running(job: Dict[str, Any]) -> Optional[bool]:
    """Whether the job that wrote an ``OWNER`` record still runs: True, False, or None when this
    machine cannot tell (no ``squeue``; a process on another host)."""
    if job.get("slurm_job"):
        squeue = shutil.which("squeue")
        if squeue is None:
            return None
        try:
            proc = subprocess.run([squeue, "-h", "-t", "all", "-j", str(job["slurm_job"]), "-o", "%T"], capture_output=True,
                                  text=True, timeout=_SQUEUE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if proc.returncode != 0:  # "Invalid job id specified": gone from the queue
            return False if "Invalid job id" in proc.stderr else None
        return proc.stdout.strip().upper() not in _FINISHED
    if job.get("host") != socket.gethostname():
        return None
    pid = job.get("pid")
    return isinstance(pid, int) and _start_ticks(pid) is not None and _start_ticks(pid) == job.get("start")


class Checkpoints:
    """The checkpoints under ``root`` (created on rank 0). ``keep``: how many complete ones stay
    after a save (older ones are removed; at least 1). Every method is collective over the world
    or ``group`` (a torch process group or an mpi4py communicator), each exchange bounded by
    ``timeout`` seconds (default ``HPCSYNC_TIMEOUT``). ``safe_globals``: further types a
    checkpoint may hold (``torch.serialization.add_safe_globals``'s kind)."""

    def __init__(self, root: str, keep: int = 2, group: Any = None, timeout: Optional[float] = None,
                 safe_globals: Sequence[Any] = ()) -> None:
        if keep < 1:
            raise ValueError(f"Checkpoints(keep={keep}): at least 1 must be kept")
        self.root = os.path.abspath(root)
        self.keep = keep
        self.timeout = timeout
        self.safe_globals = list(safe_globals)
        self._group = group
        self._job = this_job()
        self._warned: Set[str] = set()
        self._pending: Optional[int] = None  # the step a background save is writing (every rank)
        self._future: Any = None  # rank 0: that write
        self._pool: Any = None

    def _ctl(self, what: str) -> Any:
        return bounded.control(f"hpcsync.checkpoint: {what}", self._group, self.timeout)

    def path(self, step: int) -> str:
        """Where ``step`` is written when it is saved once (``step-<N>``; again: ``step-<N>.<seq>``)."""
        return os.path.join(self.root, f"step-{step:08d}")

    # -- rank 0 only ---------------------------------------------------------------------------
    def _claim(self) -> None:
        """Record this job in ``ROOT/OWNER``, unless another job that still runs holds the root."""
        owner_path = os.path.join(self.root, OWNER)
        try:
            with open(owner_path) as f:
                owner = json.load(f)
        except FileNotFoundError:
            owner = None
        except (OSError, ValueError) as exc:
            log.warning("hpcsync.checkpoint: %s unreadable (%s); taking the root over", owner_path, exc)
            owner = None
        if owner is not None and _same_job(owner, self._job):
            return
        if owner is not None:
            running = job_running(owner)
            if running:
                raise CheckpointError(
                    f"{self.root} is in use by {_describe_job(owner)}, which is still running: two jobs on one "
                    "checkpoint root would load and prune each other's checkpoints; give each job its own root "
                    "(e.g. a folder per SLURM_ARRAY_TASK_ID)")
            if running is None:
                log.warning("hpcsync.checkpoint: %s was used by %s, which this machine cannot tell is over; "
                            "taking it over", self.root, _describe_job(owner))
        os.makedirs(self.root, exist_ok=True)
        tmp = f"{owner_path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self._job, f)
            f.flush()
            os.fsync(f.fileno())
        if owner is not None:  # taking over from a job that ended
            os.replace(tmp, owner_path)
            return
        try:  # a root nobody claimed: of two jobs starting together, one creates OWNER (link is atomic)
            os.link(tmp, owner_path)
        except FileExistsError:
            self._claim()  # the other job was first: judge it like any owner
        finally:
            os.unlink(tmp)

    def _marker(self, folder: str) -> Optional[dict]:
        """The marker of a complete checkpoint directory, or None (warned once) when it is not."""
        try:
            with open(os.path.join(folder, MARKER)) as f:
                marker = json.load(f)
            bad = [n for n, size in marker["files"].items() if os.path.getsize(os.path.join(folder, n)) != size]
            why = f"{', '.join(bad)} differ in size from its marker" if bad else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            why = str(exc)
        if why is None:
            return marker
        if folder not in self._warned:
            self._warned.add(folder)
            log.warning("hpcsync.checkpoint: skipping %s: %s", folder, why)
        return None

    def _complete(self) -> List[Tuple[int, int, str]]:
        """``(seq, step, folder)`` of the complete checkpoints under root, the last saved first;
        a marker without a sequence number (an older hpcsync's) counts as older than any with one."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            m = _NAME.match(name)
            if m:
                folder = os.path.join(self.root, name)
                marker = self._marker(folder)
                if marker is not None:
                    found.append((int(marker.get("seq", -1)), int(m.group(1)), folder))
        return sorted(found, reverse=True)

    def _next_seq(self) -> int:
        seqs = [-1]
        for name in os.listdir(self.root):
            if _NAME.match(name):
                try:
                    with open(os.path.join(self.root, name, MARKER)) as f:
                        seqs.append(int(json.load(f).get("seq", -1)))
                except (OSError, ValueError, TypeError, AttributeError):
                    continue
        return max(seqs) + 1

    def _plan(self, step: int, shared: bytes, locals_: List[bytes]) -> Tuple[str, str, Dict[str, bytes], dict]:
        """Claim the root, clear what an interrupted save left, and name the new checkpoint:
        ``(temporary dir, final dir, files, marker)``."""
        self._claim()
        for name in os.listdir(self.root):  # what an earlier, interrupted save of this root left
            if name.startswith(".step-") and name.endswith(".tmp"):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        seq = self._next_seq()
        tmp = os.path.join(self.root, f".step-{step:08d}.{seq}.tmp")
        files = {"shared.pt": shared, **{f"rank-{r:05d}.pt": data for r, data in enumerate(locals_)}}
        marker = {"step": step, "seq": seq, "world_size": len(locals_), "files": {n: len(d) for n, d in files.items()},
                  "job": self._job, "time": time.time()}
        final = self.path(step)
        if os.path.lexists(final):  # the same step saved again: a name of its own, the old one stays
            final = f"{final}.{seq}"
        return tmp, final, files, marker

    def _write(self, tmp: str, final: str, files: Dict[str, bytes], marker: dict) -> str:
        """Write, flush, mark complete, rename into place, prune (rank 0; maybe in the background)."""
        os.makedirs(tmp)
        for name, data in files.items():
            _write_file(os.path.join(tmp, name), data)
        _write_file(os.path.join(tmp, MARKER), json.dumps(marker, indent=1).encode())
        fsync_dir(tmp)
        os.rename(tmp, final)
        fsync_dir(self.root)
        for _, _, folder in self._complete()[self.keep:]:  # the one just written is the newest
            if folder != final:
                shutil.rmtree(folder, ignore_errors=True)
        return final

    def _read(self, step: Optional[int], size: int) -> Optional[Tuple[int, str, int, bytes, List[bytes]]]:
        self._claim()
        chosen = [c for c in self._complete() if step is None or c[1] == step]
        if not chosen:
            if step is not None:
                raise ValueError(f"no complete checkpoint of step {step} under {self.root}")
            return None
        seq, found, folder = chosen[0]
        with open(os.path.join(folder, MARKER)) as f:
            marker = json.load(f)
        world = marker["world_size"]
        if world != size:
            raise ValueError(f"{folder} was written by {world} ranks, this job has {size}")
        with open(os.path.join(folder, "shared.pt"), "rb") as f:
            shared = f.read()
        locals_ = []
        for r in range(world):
            with open(os.path.join(folder, f"rank-{r:05d}.pt"), "rb") as f:
                locals_.append(f.read())
        if step is None:  # the latest: what a supervised attempt resumes from
            failure.note_resume(found, folder, marker.get("time"))
        return found, folder, seq, shared, locals_

    # -- collective ----------------------------------------------------------------------------
    def latest(self) -> Optional[int]:
        """The step of the last saved complete checkpoint (rank 0 looks, every rank gets its answer)."""
        self.wait()
        ctl = self._ctl("latest()")
        found: Optional[int] = None
        error = None
        if ctl.Get_rank() == 0:
            try:
                self._claim()
                complete = self._complete()
                found = complete[0][1] if complete else None
            except Exception as exc:
                error = f"cannot use {self.root}: {exc}"
        found, error = ctl.bcast((found, error), root=0)
        if error:
            raise CheckpointError(f"hpcsync.checkpoint: rank 0 {error}")
        return found

    def save(self, step: int, shared: Any = None, local: Any = None, background: bool = False) -> str:
        """Write checkpoint ``step``: rank 0's ``shared`` (the same on every rank under DDP, so only
        rank 0's is kept) and every rank's ``local``. Returns its directory on every rank once it is
        complete; raises :class:`CheckpointError` on every rank if any part failed.

        ``background``: return once the states are copied to memory (serialised on every rank and
        gathered to rank 0); rank 0 writes the files on a thread of its own while training goes
        on. The next save, :meth:`load`, :meth:`latest` and :meth:`wait` first wait for it (and
        raise its error, if any, on every rank); a crash while it writes leaves the previous
        complete checkpoint the latest. The returned directory exists once it completes."""
        self.wait()
        ctl = self._ctl(f"save of step {step}")
        error, data = None, b""
        try:
            data = _dumps(local)
        except Exception as exc:  # an unpicklable state on one rank: the same error everywhere
            error = f"cannot serialise its local state: {exc!r}"
        raise_if_any(ctl, error, CheckpointError, f"hpcsync.checkpoint: step {step} not saved: ")
        locals_ = comm.gather(data, dst=0, group=ctl)

        def write() -> str:  # rank 0
            plan = self._plan(step, _dumps(shared), locals_)
            if not background:
                return self._write(*plan)
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(1, thread_name_prefix="hpcsync-checkpoint")
            self._future = self._pool.submit(self._write, *plan)
            return plan[1]

        path = _from_rank0(ctl, write, f"step {step} not saved (rank 0: {{}})")
        if background:
            self._pending = step
            log.info("hpcsync.checkpoint: saving step %d to %s in the background", step, path)
        else:
            log.info("hpcsync.checkpoint: saved step %d to %s", step, path)
        return path

    def wait(self) -> Optional[str]:
        """Collective: wait for the save in the background, if any; its directory (None when none
        was pending), or :class:`CheckpointError` on every rank if it failed (the previous complete
        checkpoint is then still the latest)."""
        if self._pending is None:
            return None
        step, self._pending = self._pending, None
        ctl = self._ctl(f"background save of step {step}")
        future, self._future = self._future, None
        path = _from_rank0(ctl, lambda: future.result(), f"step {step} not saved (rank 0, in the background: {{}})")
        log.info("hpcsync.checkpoint: saved step %d to %s", step, path)
        return path

    def close(self) -> None:
        """Collective: wait for a save in the background (:meth:`wait`), stop its thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def __enter__(self) -> "Checkpoints":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def load(self, step: Optional[int] = None) -> Optional[Checkpoint]:
        """The checkpoint ``step`` (default: the last saved complete one), or None when there is none.
        Rank 0 reads every file; each rank gets ``shared`` and its own ``local`` (rank 0 broadcasts
        all of them: keep local states small -- RNG states, positions, sums -- and shard a model too
        big for one rank's memory with torch.distributed.checkpoint instead). A checkpoint written
        by a different number of ranks, or one holding types that ``weights_only`` loading refuses,
        raises :class:`CheckpointError` on every rank."""
        self.wait()
        ctl = self._ctl("load()")
        payload, error = None, None
        if ctl.Get_rank() == 0:
            try:
                payload = self._read(step, ctl.Get_size())
            except Exception as exc:
                error = f"cannot load from {self.root}: {type(exc).__name__}: {exc}"
        payload, error = comm.broadcast_object((payload, error), group=ctl)
        if error:  # rank 0's words, the same on every rank
            raise CheckpointError(f"hpcsync.checkpoint: rank 0 {error}")
        if payload is None:
            return None
        chosen, folder, seq, shared, locals_ = payload
        error, loaded = None, None
        try:
            loaded = (_loads(shared, self.safe_globals), _loads(locals_[ctl.Get_rank()], self.safe_globals))
        except Exception as exc:  # e.g. a type weights_only refuses: never run it, say so everywhere
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            why = next((ln for ln in lines if "GLOBAL" in ln), lines[0] if lines else "")
            error = f"{folder}: {type(exc).__name__}: {why}"
        raise_if_any(ctl, error, CheckpointError, "hpcsync.checkpoint: cannot load (weights_only=True; add "
                     "trusted types with Checkpoints(safe_globals=[...])): ")
        log.info("hpcsync.checkpoint: resuming from step %d (%s)", chosen, folder)
        return Checkpoint(chosen, folder, loaded[0], loaded[1], seq)
