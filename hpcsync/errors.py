"""Exceptions raised by hpcsync. Collective failures raise the same error on every rank."""
from __future__ import annotations


class HpcsyncError(RuntimeError):
    """Base class of every hpcsync error."""


class MissingDependencyError(HpcsyncError, ImportError):
    """An optional dependency (mpi4py, torch, h5py) is needed by the feature just used."""


class LaunchError(HpcsyncError):
    """The job was launched in a way that cannot work (e.g. silent singletons)."""


class AddressError(HpcsyncError):
    """No master address is reachable from every node."""


class SyncError(HpcsyncError):
    """A file sync failed; no part was deleted and the old target, if any, is intact."""
