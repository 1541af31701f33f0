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
import importlib.abc
import importlib.util
import logging
import os
import sys
from typing import Any

__version__ = "0.1.0"

from .core import settings  # noqa: E402  (no dependencies: the table of HPCSYNC_* variables)

logging.getLogger(__name__).addHandler(logging.NullHandler())

# Huge pages for torch's large CPU tensors (torch's own switch, read once, at its first CPU
# allocation): MPI moves 2 MiB-page memory much faster than 4 KiB pages, and numpy already asks
# for them while torch does not (measured in docs/performance.md). HPCSYNC_HUGEPAGES=0 opts out;
# `hpcsync doctor` says whether it took effect (import hpcsync before torch allocates anything).
if settings.flag("HPCSYNC_HUGEPAGES"):
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# public name -> the module that defines it (resolved lazily, PEP 562)
_EXPORTS = {
    "Topology": "core.topology",
    "topology": "core.topology",
    "local_comm": "core.topology",
    "init": "start.bootstrap",
    "shutdown": "start.bootstrap",
    "is_initialized": "start.bootstrap",
    "master_address": "start.bootstrap",
    "install_abort_hook": "start.bootstrap",
    "setup_logging": "observe.logs",
    "get_world_size": "core.comm",
    "get_rank": "core.comm",
    "get_local_rank": "core.comm",
    "get_local_size": "core.comm",
    "is_main_process": "core.comm",
    "synchronize": "core.comm",
    "all_gather": "core.comm",
    "gather": "core.comm",
    "broadcast_object": "core.comm",
    "shared_random_seed": "core.comm",
    "reduce_dict": "core.comm",
    "monitored_barrier": "core.comm",
    "sync_file": "data.filesync",
    "SyncedFile": "data.filesync",
    "stage": "data.staging",
    "StageResult": "data.staging",
    "preemption": "resilience.preemption",
    "PreemptionGuard": "resilience.preemption",
    "requeue": "resilience.requeue",
    "Requeue": "resilience.requeue",
    "Checkpoints": "resilience.checkpoint",
    "monitor": "observe.monitor",
    "StepMonitor": "observe.monitor",
    "HpcsyncError": "core.errors",
    "LaunchError": "core.errors",
    "AddressError": "core.errors",
    "SyncError": "core.errors",
    "StageError": "core.errors",
    "StageTimeout": "core.errors",
    "SyncTimeout": "core.errors",
    "CheckpointError": "core.errors",
    "CollectiveTimeout": "core.errors",
    "MissingDependencyError": "core.errors",
}

# modules reachable as attributes (``from hpcsync import comm``, ``hpcsync.h5.write_rows``), imported
# on first use, and by their old import paths (``import hpcsync.lightning``, :class:`_OldPaths`):
# the packages, and each module by the name it had before the packages. The four whose name is
# now a function above (topology, preemption, requeue, monitor) are reached by their new path.
_MODULES = {
    "core": "core", "observe": "observe", "backend": "backend", "data": "data", "start": "start",
    "resilience": "resilience", "cli": "cli",
    "comm": "core.comm", "bounded": "core.bounded", "environments": "core.environments", "errors": "core.errors",
    "jobend": "core.jobend", "nodemap": "core.nodemap",
    "digest": "observe.digest", "failure": "observe.failure", "flight": "observe.flight", "logs": "observe.logs",
    "progress": "observe.progress", "watchdog": "observe.watchdog",
    "filesync": "data.filesync", "h5": "data.h5", "staging": "data.staging",
    "bootstrap": "start.bootstrap", "doctor": "start.doctor", "interfaces": "start.interfaces",
    "network": "start.network", "store": "start.store",
    "checkpoint": "resilience.checkpoint", "lightning": "resilience.lightning", "supervisor": "resilience.supervisor",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def _register_backend_if_torch_loaded() -> None:
    """``import torch; import hpcsync`` makes ``init_process_group("hpcsync")`` available."""
    if "torch.distributed" in sys.modules or "torch" in sys.modules:
        try:
            importlib.import_module(".backend", __name__)
        except ImportError:  # torch without distributed support, or no mpi4py
            pass


_register_backend_if_torch_loaded()


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import hpcsync.errors`` and ``from hpcsync.staging.listing import blocks``, as written
    before the packages: the import path ``hpcsync.<old>[.<sub>]`` gives the very module
    ``hpcsync.<package>.<module>[.<sub>]``, one object under two names (never a copy)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        parts = fullname.split(".")
        if len(parts) < 2 or parts[0] != __name__ or parts[1] not in _MODULES or parts[1] in _PACKAGES:
            return None
        real = ".".join([__name__, _MODULES[parts[1]], *parts[2:]])
        return importlib.util.spec_from_loader(fullname, self, origin=real)

    def create_module(self, spec: Any) -> Any:
        return importlib.import_module(spec.origin)

    def exec_module(self, module: Any) -> None:
        """The module ran when it was imported under its own name."""


_PACKAGES = ("core", "observe", "backend", "data", "start", "resilience", "cli")
if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
    sys.meta_path.insert(0, _OldPaths())  # before the path finders: a stale hpcsync/<old>.py never wins


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is not None:
        value = importlib.import_module(f".{module}", __name__)
        globals()[name] = value
        return value
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hpcsync' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return __all__ + list(_MODULES)
