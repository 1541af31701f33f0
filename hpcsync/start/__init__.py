"""Starting a job: ``hpcsync.init()`` and what it needs, and ``hpcsync doctor``.

What it owns: the bootstrap, torch.distributed from MPI with the backend it picks
(:mod:`~hpcsync.start.bootstrap`); a master address that every node can reach
(:mod:`~hpcsync.start.network`) and each rank's own interface for gloo and NCCL
(:mod:`~hpcsync.start.interfaces`); a torch.distributed ``Store`` over MPI
(:mod:`~hpcsync.start.store`); the checks that say what would break training, with the fix
(:mod:`~hpcsync.start.doctor`). May import: :mod:`hpcsync.core`, :mod:`hpcsync.observe`,
:mod:`hpcsync.backend` and :mod:`hpcsync.data`; ``init()`` wires the backend and the observers
together, so it sits above them.
"""

__all__ = []
