"""hpcsync: MPI-first helpers for PyTorch training on clusters.

Importing hpcsync initialises nothing: MPI starts on the first call that needs it, and torch,
mpi4py and h5py are imported only by the features that use them. The one thing an import does is
ask torch for huge pages (below), because that must happen before torch's first CPU allocation.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import Any

__version__ = "0.1.0"

from . import settings  # noqa: E402  (no dependencies: the table of HPCSYNC_* variables)

logging.getLogger(__name__).addHandler(logging.NullHandler())

# Huge pages for torch's large CPU tensors (torch's own switch, read once, at its first CPU
# allocation): MPI moves 2 MiB-page memory much faster than 4 KiB pages, and numpy already asks
# for them while torch does not (measured in docs/performance.md). HPCSYNC_HUGEPAGES=0 opts out;
# `hpcsync doctor` says whether it took effect (import hpcsync before torch allocates anything).
if settings.flag("HPCSYNC_HUGEPAGES"):
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# public name -> module that defines it (resolved lazily, PEP 562)
_EXPORTS = {
    "Topology": "topology",
    "local_comm": "topology",
    "init": "bootstrap",
    "shutdown": "bootstrap",
    "is_initialized": "bootstrap",
    "master_address": "bootstrap",
    "install_abort_hook": "bootstrap",
    "setup_logging": "logs",
    "get_world_size": "comm",
    "get_rank": "comm",
    "get_local_rank": "comm",
    "get_local_size": "comm",
    "is_main_process": "comm",
    "synchronize": "comm",
    "all_gather": "comm",
    "gather": "comm",
    "broadcast_object": "comm",
    "shared_random_seed": "comm",
    "reduce_dict": "comm",
    "monitored_barrier": "comm",
    "sync_file": "filesync",
    "SyncedFile": "filesync",
    "stage": "staging",
    "PreemptionGuard": "preemption",
    "Requeue": "requeue",
    "Checkpoints": "checkpoint",
    "StepMonitor": "monitor",
    "StageResult": "staging",
    "HpcsyncError": "errors",
    "LaunchError": "errors",
    "AddressError": "errors",
    "SyncError": "errors",
    "StageError": "errors",
    "CheckpointError": "errors",
    "CollectiveTimeout": "errors",
    "MissingDependencyError": "errors",
}

# submodules reachable as attributes (``hpcsync.filesync.part_path``), imported on first use
_SUBMODULES = ("backend", "bootstrap", "bounded", "checkpoint", "cli", "comm", "doctor", "digest", "environments", "errors", "failure", "filesync", "flight",
               "h5", "jobend", "lightning", "logs", "network", "nodemap", "staging", "store",
               "watchdog")

__all__ = sorted([*_EXPORTS, "monitor", "preemption", "requeue", "topology"]) + ["__version__"]


def _register_backend_if_torch_loaded() -> None:
    """``import torch; import hpcsync`` makes ``init_process_group("hpcsync")`` available."""
    if "torch.distributed" in sys.modules or "torch" in sys.modules:
        try:
            importlib.import_module(".backend", __name__)
        except ImportError:  # torch without distributed support, or no mpi4py
            pass


_register_backend_if_torch_loaded()

# ``topology``, ``preemption``, ``requeue`` and ``monitor`` each name a submodule and its main
# function: the name is the module, callable as that function (``hpcsync.requeue()`` is
# ``hpcsync.requeue.requeue()``), bound eagerly (the modules are light: no MPI, no torch).
from . import monitor, preemption, requeue, topology  # noqa: E402, F401
from .preemption import PreemptionGuard  # noqa: E402, F401
from .topology import Topology, local_comm  # noqa: E402, F401


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hpcsync' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return __all__ + list(_SUBMODULES)
