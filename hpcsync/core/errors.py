"""Exceptions raised by hpcsync. Collective failures raise the same error on every rank."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Hashable, List, Optional, Sequence, Type, TypeVar

from .nodemap import ranges

if TYPE_CHECKING:
    from .protocols import ObjectComm

__all__ = [
    "HpcsyncError", "MissingDependencyError", "LaunchError", "SetupError", "AddressError", "SyncError", "StageError",
    "CheckpointError", "CollectiveTimeout", "StageTimeout", "SyncTimeout", "raise_if_any", "raise_if_any_of",
    "raise_if_settings_differ", "raise_if_differ", "ranks_by_value"
]


class HpcsyncError(RuntimeError):
    """Base class of every hpcsync error."""


class MissingDependencyError(HpcsyncError, ImportError):
    """An optional dependency (mpi4py, torch, h5py) is needed by the feature just used."""


class LaunchError(HpcsyncError):
    """The job was launched in a way that cannot work (e.g. silent singletons)."""


class SetupError(HpcsyncError, ValueError):
    """:func:`hpcsync.init` cannot start as asked: a malformed ``HPCSYNC_*`` setting, a bad
    argument, a second call that asks for something else than the first. A plain error of the
    program or of the job script (not a fault of the job): uncaught, it is said in a few lines,
    without a traceback (``HPCSYNC_DEBUG=1`` shows it). A ``ValueError`` too.

    ``agreed``: every rank of the job raised this same error, having exchanged what each found
    (``init`` does that under MPI before anything else), so each rank may simply exit: no rank
    is left waiting. ``problems``: each problem's line and the ranks that had it."""

    def __init__(self, message: str, problems: Optional[Dict[str, List[int]]] = None, size: int = 1,
                 agreed: bool = False) -> None:
        super().__init__(message)
        self.problems: Dict[str, List[int]] = dict(problems or {})
        self.size = size
        self.agreed = agreed

    @classmethod
    def found(cls, problems: Dict[str, List[int]], size: int, where: Optional[str] = None,
              agreed: bool = False) -> "SetupError":
        """The error for ``problems`` (``{line: ranks}``) among ``size`` ranks: a header naming
        the ranks, a line per problem (marked with its ranks where only some had it), and what
        to change: the job's environment for a setting, the call at ``where`` for an argument."""
        ranks = sorted({r for rs in problems.values() for r in rs})
        who = ("" if size == 1 else f", on all {size} ranks" if len(ranks) == size
               else f", on rank{'s' * (len(ranks) > 1)} {ranges(ranks)} of {size}")
        lines = [f"hpcsync.init() cannot start as asked{who}:"]
        for text, rs in problems.items():
            lines.append(f"  {text}" + ("" if sorted(rs) == ranks else f" [rank{'s' * (len(rs) > 1)} {ranges(rs)}]"))
        fix = []
        names = [text.split("=", 1)[0] for text in problems if text.startswith("HPCSYNC_")]
        if names:
            each, it = ("each", "them") if len(names) > 1 else ("it", "it")
            fix.append(f"set {', '.join(names)} to a value {each} expects, or unset {it} (the default), where the "
                       "job's environment is made (the job script, mpirun -x, srun --export)")
        if len(names) < len(problems):
            fix.append("change the hpcsync.init() call" + (f" at {where}" if where else ""))
        lines.append("fix: " + "; ".join(fix))
        return cls("\n".join(lines), problems, size, agreed)


class AddressError(HpcsyncError):
    """No master address is reachable from every node."""


class SyncError(HpcsyncError):
    """A file sync failed; no part was deleted and the old target, if any, is intact."""


class StageError(HpcsyncError):
    """A stage-in failed; files already staged stay valid and a later call finishes the job."""


class CheckpointError(HpcsyncError):
    """A checkpoint could not be written or read; the previous complete checkpoint is untouched."""


class CollectiveTimeout(HpcsyncError, TimeoutError):
    """A control collective (checkpoint, requeue, address proof) waited past its timeout for the
    other ranks: one raised or is stuck before it, or its node was lost."""


class StageTimeout(StageError, CollectiveTimeout):
    """An exchange of a stage waited past its timeout: a rank or its node stopped (frozen,
    stuck, lost). Caught as either a :class:`StageError` or a :class:`CollectiveTimeout`."""


class SyncTimeout(SyncError, CollectiveTimeout):
    """A round of a file sync waited past its timeout: a rank or its node stopped (frozen, stuck,
    lost). Caught as either a :class:`SyncError` or a :class:`CollectiveTimeout`."""


def raise_if_any(comm: ObjectComm, error: Optional[str], exc_type: Type[Exception], what: str) -> None:
    """Collective: if any rank has an ``error``, raise the same ``exc_type`` on every rank.

    The message names each failing rank, so the cause is visible wherever the job is read.
    """
    raise_if_any_of(comm.allgather(error), exc_type, what)


def raise_if_any_of(errors: Sequence[Optional[str]], exc_type: Type[Exception], what: str) -> None:
    """:func:`raise_if_any` once every rank's error is known (gathered with more, in one exchange)."""
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        lines = "; ".join(f"rank {r}: {e}" for r, e in bad[:8]) + (f"; ... {len(bad) - 8} more" if len(bad) > 8 else "")
        raise exc_type(f"{what}{lines}")


def raise_if_settings_differ(comm: ObjectComm, settings: Dict[str, Any], exc_type: Type[Exception], what: str) -> None:
    """Collective: every rank must call with the same ``settings``; otherwise the same ``exc_type``
    on every rank, ``what`` followed by which ranks gave which value for each differing setting
    (a rank that diverges is an error on all, never silently outvoted)."""
    if comm.Get_size() == 1:
        return
    raise_if_differ(comm.allgather(settings), exc_type, what)


def raise_if_differ(every: Sequence[Dict[str, Any]], exc_type: Type[Exception], what: str) -> None:
    """:func:`raise_if_settings_differ` once every rank's settings are known (gathered with more)."""
    settings = every[0]
    differ = {k: by for k in settings if len(by := ranks_by_value([repr(s[k]) for s in every])) > 1}
    if differ:
        raise exc_type(what + "; ".join(f"{k}: " + ", ".join(f"rank(s) {ranks} {v}" for v, ranks in by.items())
                                        for k, by in differ.items()))


_V = TypeVar("_V", bound=Hashable)


def ranks_by_value(values: Sequence[_V], ranks: Optional[Sequence[int]] = None) -> Dict[_V, List[int]]:
    """Group ranks by what each said (first-seen order): ``{value: [ranks...]}``, for errors that
    name which ranks disagree. ``ranks`` maps positions to rank numbers (default 0, 1, ...)."""
    out: Dict[_V, List[int]] = {}
    for pos, v in enumerate(values):
        out.setdefault(v, []).append(ranks[pos] if ranks is not None else pos)
    return out
