"""Lightning integration: ranks from MPI, a routable master address, the socket-free backend::

    import hpcsync.resilience.lightning as hl
    trainer = lightning.Trainer(max_epochs=3, **hl.trainer_kwargs())   # under mpirun / srun
    fabric = lightning.Fabric(**hl.fabric_kwargs()); fabric.launch()    # or Fabric

``trainer_kwargs(backend="hpcsync")`` initialises torch.distributed through :func:`hpcsync.init`
(so Lightning finds it ready and opens no TCP store of its own) and returns ``strategy`` (a
``DDPStrategy`` with :class:`HpcsyncEnvironment`), ``accelerator``, ``devices`` (= local ranks)
and ``num_nodes`` from the MPI topology, and ``callbacks`` with :class:`PreemptionCallback`:
Lightning's SLURM auto-requeue (which :class:`HpcsyncEnvironment`, not being its
``SLURMEnvironment``, does not get), done with :func:`hpcsync.preemption`. Pass your own callbacks
as ``trainer_kwargs(callbacks=[...])``. Needs the ``lightning`` package (``pip install lightning``).
"""
from __future__ import annotations

import logging
import os
import uuid
from typing import Any, Dict, Optional, Sequence

from ..start.bootstrap import init, is_initialized, master_address
from ..core.errors import MissingDependencyError
from .preemption import DEFAULT_SIGNALS, PreemptionGuard
from ..core.topology import topology

try:
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.fabric.utilities.rank_zero import rank_zero_only
    from lightning.pytorch.callbacks import Callback
except ImportError as exc:  # pragma: no cover - optional extra
    raise MissingDependencyError("hpcsync.resilience.lightning needs Lightning: pip install lightning") from exc

__all__ = ["HpcsyncEnvironment", "PreemptionCallback", "trainer_kwargs", "fabric_kwargs"]

log = logging.getLogger(__name__)


class HpcsyncEnvironment(ClusterEnvironment):
    """Lightning's view of the job, from MPI (or the launcher) through hpcsync. Collective to create."""

    def __init__(self) -> None:
        super().__init__()
        self._topo = topology()
        self._main_address = master_address(self._topo).address  # collective: every rank constructs one
        # rank_zero_only read RANK/SLURM_PROCID when Lightning was imported: under mpirun, none is
        # set, and every rank would log as rank 0 until the Trainer sets it, if it does
        rank_zero_only.rank = self._topo.rank

    @property
    def creates_processes_externally(self) -> bool:
        return True  # mpirun / srun started every rank

    @property
    def main_address(self) -> str:
        return self._main_address

    @property
    def main_port(self) -> int:
        import os

        return int(os.environ.get("MASTER_PORT", 0))

    @staticmethod
    def detect() -> bool:
        from ..core import mpi

        return mpi.use_mpi()

    def world_size(self) -> int:
        return self._topo.world_size

    def set_world_size(self, size: int) -> None:
        if size != self._topo.world_size:
            log.warning("Lightning computed world size %d, MPI says %d; MPI wins", size, self._topo.world_size)

    def global_rank(self) -> int:
        return self._topo.rank

    def set_global_rank(self, rank: int) -> None:
        if rank != self._topo.rank:
            log.warning("Lightning computed rank %d, MPI says %d; MPI wins", rank, self._topo.rank)

    def local_rank(self) -> int:
        return self._topo.local_rank

    def node_rank(self) -> int:
        return self._topo.node_rank

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        if num_devices * num_nodes != self._topo.world_size:
            raise ValueError(f"Trainer(devices={num_devices}, num_nodes={num_nodes}) does not match the "
                             f"{self._topo.world_size} ranks the launcher started; use hpcsync.resilience.lightning.trainer_kwargs()")


class PreemptionCallback(Callback):
    """SLURM auto-requeue for ``lightning.Trainer``, without Lightning's pitfalls: the handlers only
    record (Lightning's checkpoint from inside the handler, and its SIGTERM handler's broadcast, run
    collectives re-entrantly on whichever rank got the signal); every rank stops after the same
    batch (:meth:`~hpcsync.resilience.preemption.PreemptionGuard.should_stop` at each batch end), whatever
    ``min_epochs`` / ``min_steps`` say (the allocation is ending), without the validation pass a
    stop would otherwise start (it would eat the warning time); the checkpoint is Lightning's own
    ``hpc_ckpt_<N>.ckpt`` in ``default_root_dir``, written under a unique temporary name first
    (created exclusively), flushed to disk and renamed, so Lightning resumes from it by itself when
    the job starts again under Slurm. After ``fit`` returns, rank 0 requeues the job
    (:func:`hpcsync.requeue`: never after SIGTERM, nor when the stop came at training's
    last batch) and, with ``exit_on_stop``, every rank exits with its exit code (the rest of the
    script must not run on a half-trained model)."""

    def __init__(self, signals: Any = DEFAULT_SIGNALS, max_restarts: Optional[int] = None,
                 exit_on_stop: bool = True) -> None:
        self.signals, self.max_restarts, self.exit_on_stop = signals, max_restarts, exit_on_stop
        self.guard: Optional[PreemptionGuard] = None
        self.checkpoint: Optional[str] = None  # where the stop's checkpoint went
        self.finished = False  # the stop came at the last batch of training: nothing to requeue

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and self.guard is None:
            self.guard = PreemptionGuard(self.signals)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.guard is not None:  # Lightning installed its own handlers when fit started
            self.guard.reinstall()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.guard is None or self.checkpoint is not None or not self.guard.should_stop():
            return
        with self.guard.checkpointing():
            final = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
            self.checkpoint = self._save(trainer, final)
        loop = trainer.fit_loop
        self.finished = (0 < trainer.max_steps <= trainer.global_step) or (
            trainer.max_epochs is not None and 0 <= trainer.max_epochs <= trainer.current_epoch + 1
            and loop.epoch_loop.batch_progress.is_last_batch)
        loop.min_epochs = 0  # Lightning ignores should_stop until the minimums are met
        loop.epoch_loop.min_steps = None
        trainer.limit_val_batches = 0  # no validation pass on the way out
        trainer.should_stop = True
        if trainer.is_global_zero:
            log.info("hpcsync.lightning: every rank stopped at global step %d (%s); checkpoint %s",
                     trainer.global_step, self.guard.reason, final)

    @staticmethod
    def _save(trainer: Any, final: str) -> str:
        """``trainer.save_checkpoint`` (collective) into a unique temporary name that Lightning's
        search for ``hpc_ckpt_<N>`` cannot match, flushed, renamed to ``final``. The name is rank
        0's (the strategies write to the path rank 0 gives): a file (rank 0 writes it), or the
        directory a sharded strategy makes there, every rank writing its part, made whole on disk
        before the rename."""
        from ..data.filesync import fsync_dir

        folder = os.path.dirname(final) or "."
        partial = os.path.join(folder, ".hpcsync-incomplete.ckpt")  # ranks other than 0 write nothing
        if trainer.is_global_zero:  # a name of its own, nothing made there: a sharded strategy's ranks
            os.makedirs(folder, exist_ok=True)  # all make the directory, and would race to replace a file
            partial = os.path.join(folder, f".hpcsync-incomplete-{uuid.uuid4().hex}.ckpt")
        trainer.save_checkpoint(partial)
        trainer.strategy.barrier("hpcsync-preemption-checkpoint-written")  # every rank's part is written
        if trainer.is_global_zero:
            _flush_tree(partial)
            os.replace(partial, final)
            fsync_dir(folder)
        trainer.strategy.barrier("hpcsync-preemption-checkpoint")
        return final

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.guard is None or self.checkpoint is None:
            return
        if self.finished:
            if trainer.is_global_zero:
                log.info("hpcsync.lightning: the stop came at the last batch of training: not requeued")
            self._close()
            return
        outcome = self.guard.requeue(self.max_restarts)
        self._close()
        if self.exit_on_stop:
            raise SystemExit(outcome.exit_code)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._close()

    def _close(self) -> None:
        if self.guard is not None:
            self.guard.close()
            self.guard = None


def _flush_tree(path: str) -> None:
    """A checkpoint file, or every file and folder of a checkpoint directory, flushed to disk."""
    from ..data.filesync import fsync_dir

    if not os.path.isdir(path):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        return
    for here, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(here, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(here)


def _kwargs(strategy_cls: Any, backend: str, ddp_kwargs: Dict[str, Any]) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist

    # a job already initialised (hpcsync.init() first, any backend) keeps its process group
    topo = init() if is_initialized() else init(backend=backend)
    gpu = torch.cuda.is_available() and dist.get_backend() == "nccl"
    strategy = strategy_cls(cluster_environment=HpcsyncEnvironment(), process_group_backend=dist.get_backend(),
                            **ddp_kwargs)
    return {"strategy": strategy, "accelerator": "gpu" if gpu else "cpu", "devices": topo.local_size,
            "num_nodes": topo.num_nodes}


def trainer_kwargs(backend: str = "hpcsync", callbacks: Sequence[Any] = (), preemption: bool = True,
                   **ddp_kwargs: Any) -> Dict[str, Any]:
    """Keyword arguments for ``lightning.Trainer`` under mpirun or srun: ``callbacks`` are yours,
    with a :class:`PreemptionCallback` added unless ``preemption=False``."""
    from lightning.pytorch.strategies import DDPStrategy

    kwargs = _kwargs(DDPStrategy, backend, ddp_kwargs)
    kwargs["callbacks"] = [*callbacks, *([PreemptionCallback()] if preemption else [])]
    return kwargs


def fabric_kwargs(backend: str = "hpcsync", **ddp_kwargs: Any) -> Dict[str, Any]:
    """Keyword arguments for ``lightning.Fabric`` under mpirun or srun (then ``fabric.launch()``)."""
    from lightning.fabric.strategies import DDPStrategy

    return _kwargs(DDPStrategy, backend, ddp_kwargs)
