"""Lightning integration: ranks from MPI, a routable master address, the socket-free backend.

    import hpcsync.lightning as hl
    trainer = lightning.Trainer(max_epochs=3, **hl.trainer_kwargs())   # under mpirun / srun
    fabric = lightning.Fabric(**hl.fabric_kwargs()); fabric.launch()    # or Fabric

``trainer_kwargs(backend="hpcsync")`` initialises torch.distributed through :func:`hpcsync.init`
(so Lightning finds it ready and opens no TCP store of its own) and returns ``strategy`` (a
``DDPStrategy`` with :class:`HpcsyncEnvironment`), ``accelerator``, ``devices`` (= local ranks)
and ``num_nodes`` from the MPI topology. Needs the ``lightning`` package (``pip install lightning``).
"""
from __future__ import annotations

import logging
from typing import Any, Dict

from .bootstrap import init, master_address
from .errors import MissingDependencyError
from .topology import topology

try:
    from lightning.fabric.plugins.environments import ClusterEnvironment
except ImportError as exc:  # pragma: no cover - optional extra
    raise MissingDependencyError("hpcsync.lightning needs Lightning: pip install lightning") from exc

log = logging.getLogger(__name__)


class HpcsyncEnvironment(ClusterEnvironment):
    """Lightning's view of the job, from MPI (or the launcher) through hpcsync. Collective to create."""

    def __init__(self) -> None:
        super().__init__()
        self._topo = topology()
        self._main_address = master_address(self._topo).address  # collective: every rank constructs one

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
        from . import _mpi

        return _mpi.use_mpi()

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
                             f"{self._topo.world_size} ranks the launcher started; use hpcsync.lightning.trainer_kwargs()")


def _kwargs(strategy_cls: Any, backend: str, ddp_kwargs: Dict[str, Any]) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist

    topo = init(backend=backend)
    gpu = torch.cuda.is_available() and dist.get_backend() == "nccl"
    strategy = strategy_cls(cluster_environment=HpcsyncEnvironment(), process_group_backend=dist.get_backend(),
                            **ddp_kwargs)
    return {"strategy": strategy, "accelerator": "gpu" if gpu else "cpu", "devices": topo.local_size,
            "num_nodes": topo.num_nodes}


def trainer_kwargs(backend: str = "hpcsync", **ddp_kwargs: Any) -> Dict[str, Any]:
    """Keyword arguments for ``lightning.Trainer`` under mpirun or srun."""
    from lightning.pytorch.strategies import DDPStrategy

    return _kwargs(DDPStrategy, backend, ddp_kwargs)


def fabric_kwargs(backend: str = "hpcsync", **ddp_kwargs: Any) -> Dict[str, Any]:
    """Keyword arguments for ``lightning.Fabric`` under mpirun or srun (then ``fabric.launch()``)."""
    from lightning.fabric.strategies import DDPStrategy

    return _kwargs(DDPStrategy, backend, ddp_kwargs)
