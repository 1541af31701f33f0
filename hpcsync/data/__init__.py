"""Moving data between ranks and nodes: file sync, HDF5, stage-in.

What it owns: joining every rank's part into one file (:mod:`~hpcsync.data.filesync`, which plans,
checks and commits) through the transports that carry the bytes, a kernel copy, MPI ``Gatherv``
rounds or MPI-IO (:mod:`~hpcsync.data.transports`); collective HDF5 output
(:mod:`~hpcsync.data.h5`); copying a dataset that one rank can read onto every node's local disk
(:mod:`hpcsync.data.staging`). May import: :mod:`hpcsync.core` and :mod:`hpcsync.observe`
(progress); not the backend, which moves tensors, not files.
"""

__all__ = []
