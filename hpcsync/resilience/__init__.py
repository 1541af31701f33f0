"""Keeping a job alive through its end: preemption, requeue, checkpoints, ``hpcsync run``.

What it owns: the warning signal on any rank made one agreed stop step
(:mod:`~hpcsync.resilience.preemption`); the Slurm requeue after it
(:mod:`~hpcsync.resilience.requeue`); checkpoint directories that resume exactly
(:mod:`~hpcsync.resilience.checkpoint`); ``hpcsync run``, the step relaunched without a failed
node (:mod:`~hpcsync.resilience.supervisor`), with the launchers it starts and reads back
(:mod:`~hpcsync.resilience.launchers`); Lightning's Trainer on all of it
(:mod:`~hpcsync.resilience.lightning`). May import every other package but the command line.
"""

__all__ = []
