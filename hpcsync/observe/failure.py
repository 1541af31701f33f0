"""What ended a job, as a small JSON record: for the people who read the report, and for
``hpcsync run``, which relaunches without a failed node but never retries the program's own bug.

A rank that sees the job end writes one record, ``hpcsync-failure-<job>-r<rank>-<cause>-<n>.json``,
beside the hang report in :func:`report_dir` (``HPCSYNC_REPORT_DIR``, else ``HPCSYNC_LOG_DIR``; with
neither, no file: the console has the report; an exception's record only where
``HPCSYNC_REPORT_DIR`` is set, as ``hpcsync run`` does):

- ``cause``: ``exception`` (an uncaught exception), ``hang`` (a collective or a send/receive past
  its timeout with ranks that did not answer: the hang report's verdict), ``stall`` (the same, but
  every rank answered: some are stuck elsewhere), ``timeout`` (a wait bounded by hpcsync's timeout that
  another rank never met, or an error out of torch.distributed: a peer failed), ``hardware`` (a
  GPU's uncorrectable ECC error, a GPU fallen off the bus: this rank's node is blamed). Ranks killed by a signal write nothing: ``hpcsync run`` reads their
  deaths from the launcher's words;
- ``program_error``: True only when the program's own code raised: the same code at the same
  step fails again, so it is not retried by default;
- ``ranks`` and ``nodes``: whom the failure implicates (the ranks that did not answer or never
  arrived, the rank that raised, the ranks that died), and ``blame_nodes``: the nodes to leave out
  of a relaunch (empty for a program error);
- ``reporter`` (rank and node), ``time`` (epoch seconds) and ``detail`` (one line);
- for a hang, ``reached`` and ``reached_nodes``: the ranks (and their nodes) that answered the
  reporter, its side of a split (``hpcsync run`` believes a side holding more than half of the
  job's ranks), and ``silent_at``: each silent rank's node.

The record is a :class:`~hpcsync.observe.record.FailureRecord` (versioned; its JSON written and
read by that one class): each ``note_*`` builds it with a pure function of what it saw
(:func:`exception_record`, :func:`hang_record`, :func:`silent_record`, :func:`p2p_record`: what
the tests' failure simulator calls too) and :func:`save` writes it; :func:`read` skips, with a
warning, every file that is not a record this code wrote. Writing a record never raises: a job
that is ending must not fail a second time on its report.
"""
from __future__ import annotations

import errno
import glob
import itertools
import json
import logging
import os
import re
import socket
import stat
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, TextIO

from ..core import settings
from ..core.nodemap import NodeMap
from .record import Cause, FailureRecord, RecordError, Reporter

__all__ = [
    "PREFIX", "RESUMED", "STARTED", "use_log_folder", "report_dir", "unkept", "note_step", "note_count", "noted_step", "step_words",
    "current_step", "note_raised", "raised", "raised_state", "job_id",
    "nodes_of", "build", "save", "write", "write_whole", "write_json", "peer_gone", "hardware_fault",
    "exception_record", "hang_record", "silent_record", "p2p_record", "note_exception", "note_hang", "private_folder",
    "note_silent", "note_unreported", "note_p2p_hang", "note_started", "note_resume", "read_json", "read"
]

log = logging.getLogger(__name__)

PREFIX = "hpcsync-failure-"
_written = itertools.count()
_UMASK = os.umask(0o022)
os.umask(_UMASK)  # (read once, at import: the mode a file written whole is given)
RESUMED = "hpcsync-resumed.json"
STARTED = "hpcsync-started.json"


_log_folder: Optional[str] = None  # the log folder this process logs to (init(log_dir=...), setup_logging)


def use_log_folder(folder: str) -> None:
    """The job's log folder, as :func:`hpcsync.observe.logs.setup_logging` set it up: where
    reports go when ``HPCSYNC_REPORT_DIR`` is unset."""
    global _log_folder
    _log_folder = folder


def report_dir() -> Optional[str]:
    """Where reports and records go: ``HPCSYNC_REPORT_DIR``, else the job's log folder
    (``HPCSYNC_LOG_DIR``, or ``init(log_dir=...)``'s), else None: no such files at all, never the
    working directory by surprise (every report is on the console too)."""
    return settings.text("HPCSYNC_REPORT_DIR") or settings.text("HPCSYNC_LOG_DIR") or _log_folder or None


_unkept_said = False


def unkept(what: str) -> Optional[str]:
    """Where :func:`report_dir` is None, the first time this process leaves a report unwritten:
    the words that say so and where to set a folder (``what``: "the hang report"); None after
    that, and where a folder is set. Once: a job's console does not repeat it each report."""
    global _unkept_said
    if _unkept_said or report_dir() is not None:
        return None
    _unkept_said = True
    return (f"no file kept of {what} (nor of later reports and records): set HPCSYNC_REPORT_DIR, "
            "or HPCSYNC_LOG_DIR, to a folder to keep them")


_step: Optional[int] = None  # the program's step, when it says (note_step, StepMonitor.step(step))
_counted: Optional[int] = None  # else the step monitor's count of its step() calls


_ended = False  # whether the step noted has ended (the step monitor's: mon.step(step) ends it)


def note_step(step: int, ended: bool = False) -> None:
    """The program's current step, for the failure report ("raised first, at step 40") and the
    step monitor's verdicts; ``ended``: that step is over (a report then says "after step 39")."""
    global _step, _ended
    _step, _ended = step, ended


def note_count(count: int) -> None:
    """The step monitor's count of ``step()`` calls: the step reports name while the program
    notes none of its own."""
    global _counted
    _counted = count


def noted_step() -> Optional[int]:
    """The step the program last noted (:func:`note_step`, ``mon.step(step)``); None when it
    noted none."""
    return _step


def current_step() -> Optional[int]:
    """The step a report names: the program's (:func:`noted_step`), else the step monitor's count."""
    return _step if _step is not None else _counted


def step_words() -> str:
    """How a report names :func:`current_step`: "at step 40", "after step 39" (a step the monitor
    was told had ended, or a count of ended steps), or "" when nothing was noted."""
    if _step is None and _counted is None:
        return ""
    return f"{'after' if _ended or _step is None else 'at'} step {current_step()}"


_raised: Dict[str, Any] = {}  # this rank's uncaught exception, once it raised


def note_raised(error: str, where: str, frames: List[str], text: str, plain: Optional[str] = None,
                peer: bool = False, digest: str = "") -> None:
    """This rank raised (the abort hook): its error line, the program's line and innermost frames,
    and the whole traceback; ``plain``: the words of a plain user error (a
    :class:`~hpcsync.core.errors.SetupError`), which the report shows instead of the traceback;
    ``peer``: it failed waiting on a peer (:func:`peer_gone`); ``digest``: a hash of the
    traceback (the same error at the same place, whatever the message's numbers)."""
    _raised.update(time=time.time(), error=error, where=where, frames=frames, traceback=text, plain=plain,
                   peer=peer, hash=digest)


def raised() -> Dict[str, Any]:
    """This rank's uncaught exception as :func:`note_raised` recorded it; empty when none."""
    return dict(_raised)


def raised_state() -> Dict[str, Any]:
    """:func:`raised` as a failure report gathers it from every rank: without the traceback (its
    hash stands for it; the printer asks one rank per distinct error for the text), its lines
    cut: a few hundred bytes a rank."""
    mine = raised()
    mine.pop("traceback", None)
    for key, most in (("error", 500), ("plain", 2000), ("where", 500)):
        if isinstance(mine.get(key), str):
            mine[key] = mine[key][:most]
    return mine


def job_id() -> str:
    """The job's id (Slurm's, Open MPI's), or this process's pid: part of every report's name."""
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("OMPI_MCA_orte_ess_jobid") or str(os.getpid())


def _me() -> Reporter:
    """This process's rank and node, from MPI when it runs, else the launcher's variables."""
    from ..core import mpi, nodemap

    rank: Optional[int] = None
    try:
        if mpi.already_initialized():
            rank = mpi.MPI().COMM_WORLD.Get_rank()
    except Exception:  # a record must never fail on its own
        rank = None
    if rank is None:
        value = os.environ.get("RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK")
        rank = int(value) if value and value.isdigit() else -1
    nodes = nodemap.current()
    return Reporter(rank, nodes.host(rank) if nodes is not None and rank >= 0 else socket.gethostname())


def _map() -> Optional[NodeMap]:
    from ..core import nodemap

    return nodemap.current()


def nodes_of(ranks: Iterable[int], nodes: Optional[NodeMap] = None) -> List[str]:
    """The nodes of ``ranks`` from ``nodes`` (default: the job's node map; empty when not known)."""
    nodes = nodes if nodes is not None else _map()
    return nodes.nodes(ranks) if nodes is not None else []


def build(cause: Cause, ranks: Iterable[int], nodes: Iterable[str], detail: str, reporter: Reporter,
          program_error: bool = False, blame_nodes: Optional[Iterable[str]] = None, **extra: Any) -> FailureRecord:
    """One record (see the module's text), stamped with the time and ``HPCSYNC_RUN_ATTEMPT``."""
    named = tuple(sorted(set(nodes)))
    return FailureRecord(cause=cause, reporter=reporter, detail=detail[:2000], program_error=bool(program_error),
                         ranks=tuple(sorted(set(ranks))), nodes=named,
                         blame_nodes=() if program_error else tuple(sorted(set(named if blame_nodes is None
                                                                                   else blame_nodes))),
                         time=time.time(), attempt=settings.text("HPCSYNC_RUN_ATTEMPT"), **extra)


def save(record: FailureRecord, folder: Optional[str] = None) -> Optional[str]:
    """Write ``record`` into ``folder`` (default :func:`report_dir`); its path, or None when it
    could not be written (or no folder is set)."""
    folder = folder or report_dir()
    if folder is None:
        return None
    me = record.reporter
    who = f"r{me.rank}" if me.rank >= 0 else f"{me.node}-pid{os.getpid()}"  # before MPI is up
    name = f"{PREFIX}{job_id()}-{who}-{record.cause.value}-{next(_written)}.json"  # a second record keeps the first
    path = os.path.join(folder, name)
    try:
        text = record.to_json()
        _replace(path, lambda f: f.write(text))
        return path
    except OSError as exc:
        log.warning("hpcsync: could not write the failure record %s: %s", path, exc)
        return None


def write(cause: Cause, ranks: Iterable[int], nodes: Iterable[str], detail: str, program_error: bool = False,
          blame_nodes: Optional[Iterable[str]] = None, folder: Optional[str] = None,
          reporter: Optional[Reporter] = None, **extra: Any) -> Optional[str]:
    """:func:`build` and :func:`save` one record; its path, or None when it could not be written."""
    me = reporter if reporter is not None else _me()
    return save(build(cause, ranks, nodes, detail, me, program_error, blame_nodes, **extra), folder)


def write_whole(path: str, record: Dict[str, Any]) -> None:
    """Write ``record`` to ``path`` as JSON whole or not at all (a temporary file, renamed; the
    temporary removed on failure). Raises OSError when it cannot."""
    _replace(path, lambda f: json.dump(record, f, indent=1, default=str))


def _replace(path: str, fill: Callable[[TextIO], Any]) -> None:
    """Write ``path`` whole through a new temporary file of its own (``mkstemp``: a name nobody
    can guess, created with ``O_EXCL``, so a link planted in a shared folder is never written
    through; the rename replaces a link at ``path`` itself, never its target)."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # what open(path, "w") would have given it
        with os.fdopen(fd, "w") as f:
            fill(f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def write_json(path: str, record: Dict[str, Any], what: str) -> Optional[str]:
    """:func:`write_whole`; its path, or None with a warning when it could not be written: a
    report never raises."""
    try:
        write_whole(path, record)
        return path
    except OSError as exc:
        log.warning("hpcsync: could not write the %s %s: %s", what, path, exc)
        return None


# Where torch.distributed raises a peer's failure as a plain RuntimeError (gloo's, DDP's reducer,
# a backward pass that waits on DDP's all_reduce): a frame of the traceback in one of these folders,
# and what the transport says when a peer died or its network went away. Both: a program's own
# error raised inside torch (DDP's "Expected to have finished reduction") stays the program's.
_DISTRIBUTED_DIRS = tuple(os.sep.join(["", "torch", *d, ""]) for d in (["distributed"], ["nn", "parallel"],
                                                                         ["autograd"]))
_PEER_GONE = ("connection closed", "closed by peer", "connection reset", "connection refused", "broken pipe",
              "remote process exited", "network error", "peer closed", "timed out", "timeout")
# A node's hardware failing under the program (an NVIDIA GPU's uncorrectable memory error, a GPU
# lost from the PCI bus, the driver's Xid events), as CUDA raises it: no exception type says it.
_HARDWARE = re.compile(r"(?i:uncorrectable ecc|fallen off the bus)|NVRM: Xid|\bXid \d+")  # Xid: as NVIDIA spells it


def peer_gone(exc: BaseException) -> bool:
    """Errors that come from another rank failing or staying away, by where they came from:
    hpcsync's bounded waits (:class:`~hpcsync.core.errors.CollectiveTimeout`), torch.distributed's
    own error types (NCCL's ``DistBackendError``, the store's), mpi4py's ``MPI.Exception`` (mpi4py
    sets ``MPI_ERRORS_RETURN``: a survivor's send to a dead peer, a lost connection; not an error
    class of the program's misuse, a wrong count, rank, type or tag), and a ``RuntimeError`` raised
    through torch.distributed, DDP, a backward pass or hpcsync's backend that says a peer went away
    (gloo's, the backend's "timed out"). The program's own errors stay the program's, "timed out"
    or not (a data loader's, a fetch's, a misuse of DDP, the backend's mismatch ``ValueError``)."""
    from ..core.errors import CollectiveTimeout

    if isinstance(exc, CollectiveTimeout):
        return True
    if type(exc).__name__ in ("DistBackendError", "DistNetworkError", "DistStoreError"):
        return True
    mpi_error = _mpi_error_class(exc)
    if mpi_error is not None:
        return mpi_error
    if not isinstance(exc, RuntimeError):
        return False
    through = any(any(d in f.filename for d in (*_DISTRIBUTED_DIRS, _BACKEND_DIR))
                  for f in traceback.extract_tb(exc.__traceback__))
    return through and any(w in str(exc).lower() for w in _PEER_GONE)


# MPI's error classes of a peer lost or the library failing under the call (ULFM's for a failed
# or aborted process, a revoked communicator; the generic ones a survivor gets from Open MPI and
# MPICH when a peer dies): every other class is a call the program got wrong (a receive too
# small, a bad request, a window or file misused, out of memory), which fails again on any node
_MPI_PEER_LOST = ("ERR_OTHER", "ERR_INTERN", "ERR_UNKNOWN", "ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING",
                  "ERR_PROC_ABORTED", "ERR_REVOKED")
_BACKEND_DIR = os.sep.join(["", "hpcsync", "backend", ""])


def _mpi_error_class(exc: BaseException) -> Optional[bool]:
    """For an ``MPI.Exception``: whether its error class is a peer's or the network's (True) or
    the program's misuse (False); None for any other exception (mpi4py not even loaded)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not isinstance(exc, mpi.Exception):
        return None
    try:
        cls = exc.Get_error_class()
    except Exception:  # a record must never fail on its own
        return True
    return cls in {getattr(mpi, name) for name in _MPI_PEER_LOST if hasattr(mpi, name)}


def hardware_fault(exc: BaseException) -> bool:
    """An error of this node's hardware that reached the program (a GPU's uncorrectable ECC error,
    a GPU fallen off the bus, an Xid), as CUDA raises it (a ``RuntimeError``): the node is at
    fault, not the program."""
    return isinstance(exc, RuntimeError) and bool(_HARDWARE.search(str(exc)))


def exception_record(exc: BaseException, reporter: Reporter, exit_code: int = 1) -> FailureRecord:
    """The record of ``exc``, uncaught on ``reporter``'s rank: a hardware fault blames its node, a
    peer gone (:func:`peer_gone`) blames nobody by itself (whoever sees the silent ranks does),
    anything else is the program's own error."""
    line = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
    me = reporter
    if hardware_fault(exc):  # this node is at fault: left out of a relaunch
        return build(Cause.HARDWARE, [me.rank], [me.node], line, me, blame_nodes=[me.node])
    if peer_gone(exc):  # the cause is elsewhere; whoever sees it (the hang report) blames nodes
        return build(Cause.TIMEOUT, [me.rank], [me.node], line, me, blame_nodes=[])
    return build(Cause.EXCEPTION, [me.rank], [me.node], line, me, program_error=True, exit_code=exit_code)


def note_exception(exc: BaseException, exit_code: int = 1) -> Optional[str]:
    """The record of an uncaught exception on this rank (the abort hook calls it; ``exit_code``: the
    code the job ends with). Only where ``HPCSYNC_REPORT_DIR`` is set (``hpcsync run`` sets it):
    the traceback on stderr says it all to a person, and a working directory is no place to litter."""
    if not settings.text("HPCSYNC_REPORT_DIR"):
        return None
    return save(exception_record(exc, _me(), exit_code))


def hang_record(report: Dict[str, Any], reached: Iterable[int], reporter: Reporter,
                nodes: Optional[NodeMap]) -> FailureRecord:
    """The record of a hang report (``no_reply``: silent ranks, ``never_entered``: ranks that
    answered elsewhere; of them, those in ``timed_out_ranks`` wait in another operation of their
    own), as :func:`note_hang` writes it, with the node map ``nodes``."""
    silent, never = list(report.get("no_reply", [])), list(report.get("never_entered", []))
    ranks = silent + never
    op = report.get("operation", {})
    detail = (f"{op.get('op')} #{op.get('seq')} in group {report.get('group')!r} did not complete within "
              f"{report.get('timeout_s')} s; no reply: {silent}; never entered: {never}")
    return build(Cause.HANG if silent else Cause.STALL, ranks, nodes_of(ranks, nodes), detail, reporter,
                 blame_nodes=nodes_of(silent, nodes), silent=tuple(sorted(set(silent))),
                 never_entered=tuple(sorted(set(never))), silent_at=_where(silent, nodes),
                 elsewhere=tuple(sorted(set(never) & set(report.get("stuck_ranks", report.get("timed_out_ranks", []))))), **_reach(reached, nodes))


def note_hang(report: Dict[str, Any], reached: Iterable[int] = ()) -> Optional[str]:
    """The record of a hang report: the ranks that did not answer (node lost, process dead or
    frozen) and those that never arrived (alive, stuck elsewhere) are implicated, with their
    nodes; only the silent ones' nodes are proposed for blame (a rank that answers runs on a node
    that works; ``hpcsync run`` blames a node only when none of its ranks answered).
    ``reached``: the ranks that answered this rank, itself included -- its side of a split, which
    ``hpcsync run`` weighs against the other side's record."""
    return save(hang_record(report, reached, _me(), _map()))


def silent_record(silent: Sequence[int], reached: Iterable[int], what: str, reporter: Reporter,
                  nodes: Optional[NodeMap]) -> FailureRecord:
    """The record :func:`note_silent` writes, with the node map ``nodes``."""
    quiet = sorted(set(silent))
    return build(Cause.HANG, quiet, nodes_of(quiet, nodes), f"{what}; no reply: {quiet}",
                 reporter, blame_nodes=nodes_of(quiet, nodes), silent=tuple(quiet), silent_at=_where(quiet, nodes),
                 **_reach(reached, nodes))


def note_silent(silent: Sequence[int], reached: Iterable[int], what: str) -> Optional[str]:
    """The record of a failure report whose rank's wait timed out (``what``: its error) while
    ``silent`` ranks answered nobody: their nodes are blamed, as a hang report's silent ranks'
    are, weighed by ``reached`` (the ranks that did answer). Only where ``HPCSYNC_REPORT_DIR`` is
    set, as for :func:`note_exception`."""
    if not settings.text("HPCSYNC_REPORT_DIR"):
        return None
    return save(silent_record(silent, reached, what, _me(), _map()))


def note_unreported(what: str, waited_s: float) -> Optional[str]:
    """The record of a rank that timed out in ``what`` and left the hang report to another rank,
    whose report did not come within ``waited_s``: nobody implicated, no node blamed, but the
    job's end is not without a record (``hpcsync run`` then asks its other evidence). Only where
    ``HPCSYNC_REPORT_DIR`` is set, as for :func:`note_exception`."""
    if not settings.text("HPCSYNC_REPORT_DIR"):
        return None
    me = _me()
    return save(build(Cause.TIMEOUT, [], [], f"{what} timed out on rank {me.rank}; the hang report it left to "
                      f"another rank did not come within {waited_s:g} s", me, blame_nodes=[],
                      **_reach([me.rank], _map())))


def _reach(reached: Iterable[int], nodes: Optional[NodeMap]) -> Dict[str, Any]:
    ranks = sorted(set(reached))
    return {"reached": tuple(ranks), "reached_nodes": tuple(nodes_of(ranks, nodes))}


def _where(ranks: Iterable[int], nodes: Optional[NodeMap]) -> Dict[int, str]:
    """Each rank's node, ``{3: "n1"}`` (empty when the job's node map is not known)."""
    return {r: nodes.host(r) for r in ranks} if nodes is not None else {}


def p2p_record(peer: Optional[int], answered: bool, what: str, reporter: Reporter,
               nodes: Optional[NodeMap]) -> FailureRecord:
    """The record :func:`note_p2p_hang` writes, with the node map ``nodes``."""
    ranks = [] if peer is None else [peer]
    return build(Cause.STALL if answered else Cause.HANG, ranks, nodes_of(ranks, nodes), what, reporter,
                 blame_nodes=[] if answered else nodes_of(ranks, nodes), silent=() if answered else tuple(ranks),
                 never_entered=tuple(ranks) if answered else (), silent_at={} if answered else _where(ranks, nodes),
                 **_reach([reporter.rank, *(ranks if answered else [])], nodes))


def note_p2p_hang(peer: Optional[int], answered: bool, what: str) -> Optional[str]:
    """The record of a send or receive past its timeout: its peer is implicated (blamed when it
    did not answer)."""
    return save(p2p_record(peer, answered, what, _me(), _map()))


def note_started() -> None:
    """Under ``hpcsync run``: every rank of this attempt is up (rank 0, once ``hpcsync.init`` has
    joined them all). The supervisor learns how long a start takes, and bounds the next ones."""
    folder = report_dir()
    if settings.text("HPCSYNC_RUN_ATTEMPT") and folder is not None:
        write_json(os.path.join(folder, STARTED), {"time": time.time()}, "note of the attempt's start")


def note_resume(step: int, path: str, saved_at: Optional[float]) -> None:
    """Under ``hpcsync run``: which checkpoint this attempt resumed from (rank 0, at load)."""
    folder = report_dir()
    if not settings.text("HPCSYNC_RUN_ATTEMPT") or folder is None:
        return
    write_json(os.path.join(folder, RESUMED), {"step": step, "path": path, "saved_at": saved_at,
                                                    "time": time.time()}, "note of the resumed checkpoint")


def read_json(folder: str, prefix: str, kind: str) -> List[Dict[str, Any]]:
    """Every readable ``<prefix>*.json`` record of ``kind`` in ``folder``, each with its ``path``
    (a torn or foreign file is skipped)."""
    out = []
    for path in glob.glob(os.path.join(folder, f"{prefix}*.json")):
        try:
            with open(path) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and rec.get("kind") == kind:
            rec["path"] = path
            out.append(rec)
    return out


def private_folder(path: str) -> str:
    """``path`` as a folder nobody but this user can write into: created ``0700`` (parents too)
    where missing; an existing one must be a folder, not a link, owned by this user and writable
    by nobody else. Its path; ``OSError`` saying why not."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    why = _not_private(path)
    if why is not None:
        raise OSError(f"{path}: {why}")
    return path


def _not_private(path: str) -> Optional[str]:
    try:
        st = os.lstat(path)
    except OSError as exc:
        return str(exc)
    if stat.S_ISLNK(st.st_mode):
        return "a link, not a folder of its own"
    if not stat.S_ISDIR(st.st_mode):
        return "not a folder"
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & 0o022:
        return f"writable by others (mode {st.st_mode & 0o777:o})"
    return None


def _own_text(path: str) -> str:
    """The text of ``path``, a regular file of this user's (not a link: ``O_NOFOLLOW``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RecordError("a link, not a record") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise RecordError("not a regular file")
        if st.st_uid != os.getuid():
            raise RecordError(f"owned by uid {st.st_uid}, not by the job's user (uid {os.getuid()})")
        return f.read(16 << 20).decode()


def read(folder: str) -> List[FailureRecord]:
    """Every failure record in ``folder``, the earliest first. A file that is not a record this
    code wrote (torn, another version, a key or a value it does not know), a link, a file another
    user owns, is skipped with a warning: never believed, never a crash of the reader. From a
    folder that is not private (a link, another user's, writable by others: anyone could have
    planted a record) nothing is read, with a warning."""
    why = _not_private(folder)
    if why is not None:
        log.warning("hpcsync: no failure record read from %s: %s", folder, why)
        return []
    out = []
    for path in glob.glob(os.path.join(folder, f"{PREFIX}*.json")):
        try:
            out.append(FailureRecord.from_json(_own_text(path), path))
        except (OSError, UnicodeDecodeError, RecordError, ValueError, TypeError, RecursionError) as exc:
            log.warning("hpcsync: skipped %s, not a failure record this hpcsync reads: %s", path, exc)
    return sorted(out, key=lambda r: r.time)
