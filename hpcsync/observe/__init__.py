"""Seeing a job of many ranks as one: logs, hang reports, failure records, stragglers, progress.

What it owns: logs that carry rank and node, a file per rank and one console
(:mod:`~hpcsync.observe.logs`); the flight recorder of gloo and NCCL groups
(:mod:`~hpcsync.observe.flight`); every group's operation recorder, the responder thread that answers
the other ranks when a collective stalls, and the hang report (:mod:`~hpcsync.observe.watchdog`); the failure records that ``hpcsync run`` reads
(:mod:`~hpcsync.observe.failure`) and the one report with the first failure first
(:mod:`~hpcsync.observe.digest`); the straggler monitor (:mod:`~hpcsync.observe.monitor`); the
progress bar of long merges (:mod:`~hpcsync.observe.progress`). ``hpcsync doctor`` checks a job
before it starts and lives with starting a job (:mod:`hpcsync.start.doctor`). May import:
:mod:`hpcsync.core`.
"""

__all__ = []
