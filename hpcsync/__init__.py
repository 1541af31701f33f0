"""hpcsync: MPI-first helpers for PyTorch training on clusters.

The package is five rooms and the backend, each importing only the ones before it
(``tests/test_layout.py`` holds them to it; docs/architecture.md draws it):

- :mod:`hpcsync.core`: settings, errors, lazy MPI, who is who (launchers, topology, node map),
  bounded collectives, the comm helpers, the job's end.
- :mod:`hpcsync.observe`: seeing a job: logs, flight recorder, hang reports, failure records and
  digest, straggler monitor, progress.
- :mod:`hpcsync.backend` and :mod:`hpcsync.data`: the socket-free torch.distributed backend;
  moving data (file sync and its transports, HDF5, stage-in).
- :mod:`hpcsync.start`: starting a job: ``init()``, the master address, interfaces, the store,
  ``hpcsync doctor``.
- :mod:`hpcsync.resilience`: keeping a job alive: preemption, requeue, checkpoints, ``hpcsync
  run``, Lightning.

Importing hpcsync initialises nothing: MPI starts on the first call that needs it, and torch,
mpi4py and h5py are imported only by the features that use them. The one thing an import does is
ask torch for huge pages (below), because that must happen before torch's first CPU allocation.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import TYPE_CHECKING, Any, List

from .core import settings as _settings

__version__ = "0.1.0"

if TYPE_CHECKING:  # what type checkers and IDEs read; at run time each name is imported on first use
    from .core import comm  # the detectron2-style helpers: ``from hpcsync import comm``
    from .core.comm import (
        all_gather, broadcast_object, gather, get_local_rank, get_local_size, get_rank, get_world_size,
        is_main_process, monitored_barrier, reduce_dict, shared_random_seed, synchronize,
    )
    from .core.errors import (
        AddressError, CheckpointError, CollectiveTimeout, HpcsyncError, LaunchError, MissingDependencyError,
        SetupError, StageError, StageTimeout, SyncError, SyncTimeout,
    )
    from .core.topology import Topology, local_comm, topology
    from .data import h5  # collective HDF5 rows: ``hpcsync.h5.write_rows``
    from .data.filesync import SyncedFile, sync_file
    from .data.staging import StageResult, stage
    from .observe.logs import setup_logging
    from .observe.monitor import StepMonitor, monitor
    from .resilience.checkpoint import Checkpoints
    from .resilience.preemption import PreemptionGuard, preemption
    from .resilience.requeue import Requeue, requeue
    from .start.bootstrap import init, install_abort_hook, is_initialized, master_address, shutdown

# name -> the module that defines it: imported when first asked for (PEP 562), so that ``import
# hpcsync`` imports none of them (not even numpy); tests/test_layout.py checks it against the block above.
_EXPORTS = {
    "comm": "core.comm", "h5": "data.h5",  # the two modules the docs show as attributes
    **dict.fromkeys(["all_gather", "broadcast_object", "gather", "get_local_rank", "get_local_size", "get_rank",
                     "get_world_size", "is_main_process", "monitored_barrier", "reduce_dict", "shared_random_seed",
                     "synchronize"], "core.comm"),
    **dict.fromkeys(["AddressError", "CheckpointError", "CollectiveTimeout", "HpcsyncError", "LaunchError",
                     "MissingDependencyError", "SetupError", "StageError", "StageTimeout", "SyncError", "SyncTimeout"],
                    "core.errors"),
    **dict.fromkeys(["Topology", "local_comm", "topology"], "core.topology"),
    **dict.fromkeys(["SyncedFile", "sync_file"], "data.filesync"),
    **dict.fromkeys(["StageResult", "stage"], "data.staging"),
    "setup_logging": "observe.logs",
    **dict.fromkeys(["StepMonitor", "monitor"], "observe.monitor"),
    "Checkpoints": "resilience.checkpoint",
    **dict.fromkeys(["PreemptionGuard", "preemption"], "resilience.preemption"),
    **dict.fromkeys(["Requeue", "requeue"], "resilience.requeue"),
    **dict.fromkeys(["init", "install_abort_hook", "is_initialized", "master_address", "shutdown"], "start.bootstrap"),
}

logging.getLogger(__name__).addHandler(logging.NullHandler())

# Huge pages for torch's large CPU tensors (torch's own switch, read once, at its first CPU
# allocation): MPI moves 2 MiB-page memory much faster than 4 KiB pages, and numpy already asks
# for them while torch does not (measured in docs/performance.md). HPCSYNC_HUGEPAGES=0 opts out;
# `hpcsync doctor` says whether it took effect (import hpcsync before torch allocates anything).
if _settings.flag("HPCSYNC_HUGEPAGES"):
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__all__ = [
    "__version__",
    # starting and ending a job
    "init", "shutdown", "is_initialized", "master_address", "install_abort_hook", "Topology", "topology",
    "local_comm", "setup_logging",
    # the comm helpers (also as the module: ``from hpcsync import comm``)
    "comm", "get_world_size", "get_rank", "get_local_rank", "get_local_size", "is_main_process", "synchronize",
    "all_gather", "gather", "broadcast_object", "shared_random_seed", "reduce_dict", "monitored_barrier",
    # moving data
    "sync_file", "SyncedFile", "stage", "StageResult", "h5",
    # keeping a job alive
    "preemption", "PreemptionGuard", "requeue", "Requeue", "Checkpoints", "monitor", "StepMonitor",
    # errors
    "HpcsyncError", "LaunchError", "SetupError", "AddressError", "SyncError", "StageError", "StageTimeout", "SyncTimeout",
    "CheckpointError", "CollectiveTimeout", "MissingDependencyError",
]

if "torch" in sys.modules:
    # ``import torch; import hpcsync`` makes ``init_process_group("hpcsync")`` available.
    try:
        from . import backend  # noqa: F401  (registers the backend with torch.distributed)
    except ImportError:  # torch without distributed support, or no mpi4py
        pass


# Where the modules once reached as ``hpcsync.<name>`` live now: only for the error's words.
_MOVED = {"bounded": "core", "environments": "core", "errors": "core", "jobend": "core", "nodemap": "core",
          "settings": "core", "digest": "observe", "failure": "observe", "flight": "observe", "logs": "observe",
          "progress": "observe", "watchdog": "observe", "filesync": "data", "staging": "data", "bootstrap": "start",
          "doctor": "start", "interfaces": "start", "network": "start", "store": "start", "checkpoint": "resilience",
          "lightning": "resilience", "supervisor": "resilience"}

if not TYPE_CHECKING:  # type checkers see the names above only, so a misspelt one is an error there too
    def __getattr__(name: str) -> Any:
        module = _EXPORTS.get(name)
        if module is None:
            moved = f"; the module is hpcsync.{_MOVED[name]}.{name} (from hpcsync.{_MOVED[name]} import {name})" \
                if name in _MOVED else ""
            raise AttributeError(f"module 'hpcsync' has no attribute {name!r}{moved}")
        owner = importlib.import_module(f".{module}", __name__)
        value = owner if name in ("comm", "h5") else getattr(owner, name)
        globals()[name] = value
        return value


def __dir__() -> List[str]:
    return sorted(__all__)
