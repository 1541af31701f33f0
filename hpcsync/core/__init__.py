"""The core every other package stands on: settings, errors, MPI, who is who, control messages.

What it owns: the table of ``HPCSYNC_*`` settings (:mod:`~hpcsync.core.settings`) and the errors
(:mod:`~hpcsync.core.errors`); lazy access to mpi4py (:mod:`~hpcsync.core.mpi`) and the byte
collectives that work past 2 GiB (:mod:`~hpcsync.core.bigmpi`); who is who in the job: what each
launcher says through the environment (:mod:`~hpcsync.core.environments`), world, local and node
ranks (:mod:`~hpcsync.core.topology`), which node each rank is on (:mod:`~hpcsync.core.nodemap`),
communicators for jobs without MPI (:mod:`~hpcsync.core.torchcomm`); collectives with a deadline
for hpcsync's own control messages (:mod:`~hpcsync.core.bounded`); the detectron2-style helpers
(:mod:`~hpcsync.core.comm`); and the job's end, ``MPI_Abort`` that surely ends it
(:mod:`~hpcsync.core.jobend`). The topology sits here, not with starting a job, because the
helpers and the bounded collectives ask it who is who. May import: nothing else of hpcsync.
"""

__all__ = []
