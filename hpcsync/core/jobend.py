"""End a broken job for sure: ``MPI_Abort``, then make sure the launcher does not wait forever.

``MPI_Abort`` asks the launcher to kill every rank, and the launcher then waits until every
node's daemon confirms. A node that dropped off the network never confirms: Open MPI's
``mpirun`` waits for its out-of-band keepalive (300 s idle + 9 x 20 s probes by default), so the
job outlives its report by many minutes and burns the allocation. Before aborting, a rank that
runs under its launcher (``mpirun``/``mpiexec`` is an ancestor: the ranks on the launcher's node)
leaves a detached watcher: if that launcher is still alive ``HPCSYNC_ABORT_GRACE`` seconds
(default 10) later, the watcher sends it SIGTERM (it kills what it can reach and exits; Open MPI 4.1's
``mpirun`` may crash on its way out, which ends the job all the same), and SIGKILL after as
long again. A rank whose own ``MPI_Abort`` has not ended it within the grace ends itself
(:func:`end_within`: no Python thread, which a blocked ``MPI_Abort`` holding the GIL would stop).
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable, List, NoReturn, Optional, Tuple

from . import mpi, settings

__all__ = [
    "LAUNCHERS", "before_abort", "BEFORE_ABORT_S", "run_before_abort", "EXIT_STAGES", "at_exit", "set_abort_on_error",
    "abort_on_error", "set_hook_installed", "exception_ends_job", "grace_s", "end_within", "stacks_on_crash", "launcher_pid", "watch_launcher", "abort"
]

log = logging.getLogger(__name__)

# Process names (``/proc/PID/comm``, at most 15 characters) of launchers that wait for their nodes.
LAUNCHERS = ("mpirun", "mpiexec", "orterun", "prterun", "mpirun.openmpi", "mpiexec.openmpi", "mpiexec.hydra",
             "mpiexec.mpich", "mpirun.mpich")


_abort_on_error = True  # init(abort_on_exception=...) sets it for the job
_hook_installed = False  # hpcsync's sys.excepthook (hpcsync.start.bootstrap.install_abort_hook)
_before_abort: List[Callable[[], None]] = []  # what must reach the user before MPI_Abort (held-back logs)


def before_abort(fn: Callable[[], None]) -> None:
    """Run ``fn`` (quick) just before this process calls ``MPI_Abort``, or when another rank is
    about to (it asks this one through :func:`hpcsync.observe.watchdog.flush_before_abort`)."""
    _before_abort.append(fn)


BEFORE_ABORT_S = 2.0  # how long the functions of before_abort may take, together


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # the abort matters more
        pass


def run_before_abort(wait_s: float = BEFORE_ABORT_S) -> None:
    """Run the functions of :func:`before_abort`, side by side, for at most ``wait_s`` seconds in
    all: one still running then (a flush to a disk that stopped answering) is left behind, in a
    daemon thread that ends with the process; the abort matters more, and one stuck flush does
    not hold back the others (the held-back warnings, the other files)."""
    threads = []
    for fn in list(_before_abort):
        t = threading.Thread(target=_quietly, args=(fn,), name="hpcsync-before-abort", daemon=True)
        try:
            t.start()
        except RuntimeError:  # (no thread starts at interpreter shutdown: then inline)
            _quietly(fn)
            continue
        threads.append(t)
    deadline = time.monotonic() + wait_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))

# The one ordered exit, before MPI_Finalize (mpi4py finalizes after every Python atexit handler):
# torch's process group first (gloo threads must be joined while the interpreter is whole), then
# hpcsync's own MPI users (the store's server thread), then the backend's bounded exit barrier
# and watchdog, which may end a broken job with MPI_Abort.
EXIT_STAGES = ("torch", "store", "backend")
_exit_steps: List[Tuple[int, int, Callable[[], None]]] = []


def at_exit(stage: str, fn: Callable[[], None]) -> None:
    """Run ``fn`` at interpreter exit, in :data:`EXIT_STAGES` order (then in registration order).

    The one handler is re-registered on every call, so it runs before any Python exit handler
    registered earlier (as the last ``atexit.register`` would): torch's group is destroyed first.
    """
    import atexit

    _exit_steps.append((EXIT_STAGES.index(stage), len(_exit_steps), fn))
    atexit.unregister(_run_exit)
    atexit.register(_run_exit)


def _run_exit() -> None:
    for _, _, fn in sorted(_exit_steps, key=lambda s: s[:2]):
        try:
            fn()
        except Exception as exc:  # one step failing must not skip the ones that end the job cleanly
            log.warning("hpcsync: exit step %s failed: %s", getattr(fn, "__qualname__", fn), exc)
    _exit_steps.clear()


def set_abort_on_error(on: bool) -> None:
    """Whether an uncaught error or a timed-out collective ends the job (``MPI_Abort``) or raises."""
    global _abort_on_error
    _abort_on_error = bool(on)


def abort_on_error() -> bool:
    """The policy: ``init(abort_on_exception=)``, and ``HPCSYNC_ABORT_ON_EXCEPTION=0`` turns it off."""
    return _abort_on_error and settings.flag("HPCSYNC_ABORT_ON_EXCEPTION")


def set_hook_installed(on: bool) -> None:
    """Whether hpcsync's hook for uncaught exceptions is in place (:func:`hpcsync.init` installs it)."""
    global _hook_installed
    _hook_installed = bool(on)


def exception_ends_job(exc_type: Any) -> bool:
    """Whether an exception of ``exc_type`` now leaving a ``with`` block will end the job: an
    :class:`Exception` (not ``SystemExit`` or ``KeyboardInterrupt``), hpcsync's hook in place
    and the policy on, more than one rank. A context manager's ``__exit__`` then does only its
    local part -- flush, keep its files -- and enters no collective: the other ranks are elsewhere
    (in the program's next collective), so that collective would wait out its timeout on this
    rank alone while the job should end in seconds, this rank's traceback first."""
    if exc_type is None or not issubclass(exc_type, Exception) or not (_hook_installed and abort_on_error()):
        return False
    if threading.current_thread() is not threading.main_thread():  # (no hook of ours ends a thread's error)
        return False
    return mpi.use_mpi() and mpi.MPI().COMM_WORLD.Get_size() > 1


def grace_s() -> float:
    """``HPCSYNC_ABORT_GRACE``; its default when malformed or not positive (an abort must never
    wait on a typo: :func:`hpcsync.core.settings.validate` rejects it at ``init``)."""
    try:
        grace = settings.number("HPCSYNC_ABORT_GRACE")
    except ValueError:
        grace = 0.0
    return grace if 0 < grace < float("inf") else float(settings.SETTINGS["HPCSYNC_ABORT_GRACE"].default)


def end_within(seconds: float) -> None:
    """End this process ``seconds`` from now whatever it is doing then: faulthandler's watchdog is
    a C thread that needs no GIL (mpi4py's ``Abort`` and a stuck report may hold it), writes every
    thread's stack to stderr, then calls ``_exit(1)``. A later call replaces the deadline."""
    import faulthandler

    faulthandler.dump_traceback_later(max(seconds, 0.1), exit=True)


def stacks_on_crash() -> None:
    """On a fatal signal (a segmentation fault, a bus error, an abort) print every Python thread's
    stack first: the MPI library's own handler, which ``MPI_Init`` installed and which runs next,
    prints only C frames, so a crash inside MPI would not say which of the program's threads was
    where. Left alone when the program enabled :mod:`faulthandler` itself, or where stderr has no
    file descriptor."""
    import faulthandler

    if faulthandler.is_enabled():
        return
    try:
        faulthandler.enable(all_threads=True)
    except (AttributeError, ValueError, OSError, RuntimeError):  # (io.UnsupportedOperation is an OSError)
        pass


def _stat(pid: int) -> Tuple[str, int]:
    """(comm, parent pid) of ``pid`` from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    comm = text[text.index("(") + 1:text.rindex(")")]
    return comm, int(text[text.rindex(")") + 2:].split()[1])


def launcher_pid(pid: Optional[int] = None) -> Optional[Tuple[int, str]]:
    """The nearest ancestor of ``pid`` (default: this process) that is an MPI launcher, or None
    (ranks on other nodes descend from a per-node daemon; under srun, from slurmstepd)."""
    try:
        pid = _stat(pid or os.getpid())[1]
        for _ in range(64):
            if pid <= 1:
                return None
            comm, parent = _stat(pid)
            if comm in LAUNCHERS:
                return pid, comm
            pid = parent
    except (OSError, ValueError, IndexError):
        return None
    return None


def watch_launcher(pid: int, comm: str, grace: float) -> None:
    """Start the detached watcher (its own session and no open pipes, so it neither dies with this
    rank nor keeps the launcher's output forwarding open)."""
    check = f'[ "$(cat /proc/{pid}/comm 2>/dev/null)" = "{comm}" ]'
    script = f"sleep {grace}; {check} || exit 0; kill -TERM {pid}; sleep {grace}; {check} && kill -KILL {pid}"
    subprocess.Popen(["/bin/sh", "-c", script], start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)


def abort(code: int = 1) -> NoReturn:
    """``MPI_Abort(COMM_WORLD)``, bounded as the module docstring says. Never returns."""
    run_before_abort()
    grace = grace_s()
    rank = mpi.MPI().COMM_WORLD.Get_rank()
    launcher = launcher_pid()
    if launcher is not None:
        try:
            watch_launcher(*launcher, grace)
            sys.stderr.write(f"[hpcsync] rank {rank}: if {launcher[1]} (pid {launcher[0]}) still waits {grace:g} s "
                             "after this abort (a lost node), hpcsync sends it SIGTERM\n")
            sys.stderr.flush()
        except OSError as exc:
            log.warning("hpcsync: cannot watch the launcher: %s", exc)
    end_within(grace)  # if MPI_Abort has not ended this rank by then
    mpi.MPI().COMM_WORLD.Abort(code)
    os._exit(code)
