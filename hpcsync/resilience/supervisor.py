"""``hpcsync run``: one job step that survives a failed node -- relaunched without it, resumed
from the program's latest checkpoint, no human involved.

::

    #SBATCH -N 5 --no-kill --requeue
    hpcsync run --spare-nodes 1 --max-restarts 3 -- python train.py --checkpoint-dir ckpt --checkpoint-every 200

- **Under Slurm** it starts ``srun`` on the allocation's nodes minus the spares and watches the
  step. When it fails, it reads what the ranks wrote (:mod:`hpcsync.observe.failure`: a hang report's
  silent or missing ranks, an exception) and what the launcher said (tasks killed by a signal), and
  relaunches the step without the nodes to blame, taking a spare (in a network split, a side
  holding more than half of the job's ranks is believed; otherwise nobody is left out on a guess: see
  :func:`~hpcsync.resilience.verdict.judge`; when no evidence names a node, each node is probed with a
  one-process step: :mod:`~hpcsync.resilience.probe`). A launcher that does not end once its step is failing is ended after
  :func:`launcher_grace`. With no spare left it requeues
  the job and excludes them from it (``scontrol requeue``, then ``update ExcNodeList`` while the
  job is pending), so the next start lands elsewhere. Bad nodes are kept in the state folder and printed at every start.
- **Under mpirun** (``--hosts`` or ``--hostfile``) the same over a list of hosts, with Open MPI's
  ``mpirun`` or MPICH's ``mpiexec``; without a spare the run ends with the list of attempts.
- **Ranks killed by the job's warning signal** (SIGUSR1 or SIGUSR2 before the program's
  preemption guard was installed, or after it was closed), or a warning that came between two
  attempts, blame no node: the signal went to every task on purpose (a node the launcher names
  as well joins the bad list, left out from the next start on). Under Slurm the job is requeued
  as the guard would have done (:func:`hpcsync.resilience.requeue.requeue_job`: ``HPCSYNC_MAX_RESTARTS``,
  never a job being ended), and resumes from the latest checkpoint; elsewhere the run ends with
  the step's exit code (128 + the signal between attempts). A program that finished should ignore
  the warning before it closes its guard (the example does), or it is requeued and resumes.
- **The program's own exception or crash is not retried** (the same code at the same step fails
  again): an exception, or a rank the launcher says ran out of memory, segfaulted or aborted, is
  one message with the rank and node, and the program's exit code; no node is blamed
  (``--retry-exceptions`` retries on the same nodes). So is a desync (every rank answered, some
  never entered the collective), and a rank killed by a signal twice in a row while its node ran
  on (the kernel's OOM killer: the first time it is relaunched on the same nodes, no spare
  spent). A node is blamed only when (nearly) all of its ranks are unreachable or the launcher
  or Slurm says it failed, and one failure leaves out no more nodes than there are spares
  without a second, independent sign. A GPU's hardware fault that reaches the
  program (ECC, fallen off the bus, Xid) blames its node. A step that ends without any record blaming a node --
  success, a preemption stop and requeue, ``scancel`` -- ends the run with the step's exit code.
- **A cap** (``--max-restarts``, relaunches and requeues together, across requeues): past it,
  the run ends with a message that lists every attempt. Each relaunch is logged with its cause,
  the nodes left out, the checkpoint resumed and the time lost.

Signals (USR1, USR2, TERM, INT) are forwarded to the launcher, which forwards them to the ranks:
the preemption path of :mod:`hpcsync.resilience.preemption` works inside ``hpcsync run`` unchanged.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, List, Optional, Sequence, TextIO, Tuple

import psutil

from ..core import settings
from ..observe import failure
from ..observe.record import FailureRecord, Reporter
from . import probe, requeue
from .verdict import PROCESS_KILLED, Action, Verdict, judge
from .launchers import (WARNING_SIGNALS, Launcher, LauncherWords, Srun,
                        mpi_launcher, parse_hosts)
from . import schedulers
from .schedulers import HostList, Scheduler, Slurm, detect

__all__ = [
    "EXIT_NO_NODES", "EXIT_SIGNALLED", "EXIT_RESTARTS_SPENT", "say", "Attempt", "State", "Supervisor",
    "LAUNCHER_SLACK_S", "launcher_grace", "START_MIN_S", "start_limit", "main", "add_parser"
]

EXIT_NO_NODES = schedulers.EXIT_NO_NODES  #: not enough healthy nodes, and no way to requeue (EX_NOINPUT)
EXIT_SIGNALLED = 128 + signal.SIGTERM  #: ended by a signal to the supervisor between two attempts
EXIT_RESTARTS_SPENT = requeue.EXIT_RESTARTS_SPENT  #: failures past ``--max-restarts``
_FORWARDED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)


def say(text: str) -> None:
    """The supervisor's words, on stderr (the job's log), one line each."""
    sys.stderr.write(f"[hpcsync run] {text}\n")
    sys.stderr.flush()


# -- state kept across relaunches and requeues ----------------------------------------------------
@dataclass
class Attempt:
    number: int
    nodes: List[str]
    started: float
    ended: float = 0.0
    exit_code: Optional[int] = None
    cause: str = ""
    blamed: List[str] = field(default_factory=list)
    detail: str = ""
    resumed_step: Optional[int] = None
    resumed_saved_at: Optional[float] = None
    resumed_at: Optional[float] = None
    first_record_at: Optional[float] = None
    failed: bool = False  # ended by a failure that was retried (counts against the cap)
    started_after: Optional[float] = None  # seconds until every rank was up (hpcsync.init's note)
    killed: List[str] = field(default_factory=list)  # "node/rank" the launcher says a signal killed ("node/?": rank unsaid)

    def line(self) -> str:
        took = f"{self.ended - self.started:.1f} s" if self.ended else "running"
        resumed = f", resumed step {self.resumed_step}" if self.resumed_step is not None else ""
        out = f"attempt {self.number} on {', '.join(self.nodes)}: {self.cause or '?'} (exit {self.exit_code}, {took}{resumed})"
        return out + (f"; blamed {', '.join(self.blamed)}" if self.blamed else "")


class State:
    """``state.json`` in the state folder: the attempts so far and the nodes left out."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.path = os.path.join(folder, "state.json")
        self.attempts: List[Attempt] = []
        self.bad_nodes: List[str] = []
        self.requeues = 0
        try:
            with open(self.path) as f:
                data = json.load(f)
            self.attempts = [Attempt(**a) for a in data.get("attempts", [])]
            self.bad_nodes = list(data.get("bad_nodes", []))
            self.requeues = int(data.get("requeues", 0))
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError) as exc:
            raise SystemExit(f"hpcsync run: cannot read {self.path}: {exc}") from None

    def restarts(self) -> int:
        """Relaunches and requeues after failures so far (not a preemption's requeue)."""
        return sum(a.failed for a in self.attempts)

    def save(self) -> None:
        _private(self.folder, "state folder")
        failure.write_whole(self.path, {"attempts": [asdict(a) for a in self.attempts], "bad_nodes": self.bad_nodes,
                                        "requeues": self.requeues})


def _private(folder: str, what: str) -> str:
    """``folder`` private to this user (:func:`hpcsync.observe.failure.private_folder`): the
    records read from it decide which nodes are left out; else a clear error."""
    try:
        return failure.private_folder(folder)
    except OSError as exc:
        raise SystemExit(f"hpcsync run: the {what} must be this user's alone (records planted there would decide "
                         f"the verdict): {exc}") from None


# -- the supervisor --------------------------------------------------------------------------------
def _pump(stream: TextIO, out: TextIO, words: LauncherWords, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        out.write(line)
        out.flush()
        with lock:
            words.feed(line)


class Supervisor:
    """Run ``program`` under ``launcher`` on ``hosts`` until it completes, a program error, or the
    cap. ``scheduler``: whose job it is (:mod:`~hpcsync.resilience.schedulers`: the nodes' names,
    their state, the requeue); default a :class:`~hpcsync.resilience.schedulers.HostList` of
    ``hosts``, no scheduler."""

    def __init__(self, launcher: Launcher, hosts: Sequence[str], per_node: int, spares: int, max_restarts: int,
                 state_dir: str, program: Sequence[str], retry_exceptions: bool = False,
                 scheduler: Optional[Scheduler] = None) -> None:
        self.launcher, self.per_node, self.spares = launcher, per_node, spares
        self.max_restarts, self.retry_exceptions = max_restarts, retry_exceptions
        self.scheduler = scheduler if scheduler is not None else HostList([(h, per_node) for h in hosts])
        self.all_hosts = list(hosts)
        self.program = list(program)
        self.state = State(state_dir)
        self.hosts = [h for h in hosts if h not in self.state.bad_nodes]
        self.width = len(hosts) - spares
        self._child: Optional[subprocess.Popen] = None
        self._signalled = False
        self._warning: Optional[int] = None  # a USR1 / USR2 that came while no step ran
        self._starts: List[float] = []  # seconds until the ranks were up, for each start of this run seen

    # signals: forwarded to the launcher (and so to the ranks)
    def _forward(self, signum: int, _frame: Any) -> None:
        if signum in (signal.SIGTERM, signal.SIGINT):
            self._signalled = True
        child = self._child
        if child is not None and child.poll() is None:
            try:
                child.send_signal(signum)
                return
            except OSError:
                pass
        if signum in WARNING_SIGNALS:  # no step to forward it to: kept for the run loop
            self._warning = signum

    def _step(self, attempt: Attempt) -> Tuple[int, LauncherWords]:
        folder = _private(os.path.join(self.state.folder, f"attempt-{attempt.number}"), "attempt folder")
        env = {**os.environ, "HPCSYNC_REPORT_DIR": folder, "HPCSYNC_RUN_ATTEMPT": str(attempt.number)}
        cmd = self.launcher.command(attempt.nodes, self.per_node, self.program)
        say(f"attempt {attempt.number}: {shlex.join(cmd)}")
        words, lock = LauncherWords(), threading.Lock()
        self._child = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1)
        if self._warning is not None:  # it came while the step was starting: passed on now
            warning, self._warning = self._warning, None
            self._forward(warning, None)
        pumps = [threading.Thread(target=_pump, args=(s, o, words, lock), daemon=True)
                 for s, o in ((self._child.stdout, sys.stdout), (self._child.stderr, sys.stderr))]
        for t in pumps:
            t.start()
        rc = self._wait_bounded(self._child, folder, words, lock, attempt)
        rc = rc if rc >= 0 else 128 - rc  # killed by a signal: the shell's convention
        drained = time.monotonic() + 2.0  # a process left on a lost node may hold the pipes open for good
        for t in pumps:
            t.join(timeout=max(0.0, drained - time.monotonic()))
        self._child = None
        return rc, words

    def _nodes_down(self, nodes: Sequence[str]) -> List[str]:
        return self.scheduler.down([self._host_name(n) for n in nodes])

    def _unreachable(self, nodes: Sequence[str]) -> List[str]:
        say(f"no evidence names a node: probing each of the step's {len(nodes)} node(s) with {self.launcher.name}")
        here = [] if self.launcher.through_controller else probe.own_names()
        return probe.unreachable(nodes, self.launcher.probe, here=here, stop=lambda: self._signalled,
                                 node_state=self.scheduler.node_states)

    def _named(self, record: FailureRecord) -> FailureRecord:
        """``record`` with every node by the scheduler's name (a record says ``gethostname()``)."""
        name = self._host_name
        return dataclasses.replace(
            record, reporter=Reporter(record.reporter.rank, name(record.reporter.node)),
            nodes=tuple(name(n) for n in record.nodes), blame_nodes=tuple(name(n) for n in record.blame_nodes),
            silent_at={rank: name(n) for rank, n in record.silent_at.items()},
            reached_nodes=tuple(name(n) for n in record.reached_nodes))

    def _wait_bounded(self, child: subprocess.Popen, folder: str, words: LauncherWords, lock: threading.Lock,
                      attempt: Attempt) -> int:
        """The launcher's exit code. Once the launcher's own words say the step is failing (a
        task's death, a lost daemon, an abort), it has :func:`launcher_grace` seconds to end; past
        them it and what it started here are ended (TERM, then KILL) and ``words.hung`` says so: a
        launcher that lost a node can wait for it for good (Open MPI's mpirun after a link cut,
        ranks already gone), and a silent hang of the supervisor is the one thing it must never
        do. (A hang report alone starts no clock: a program may catch its timeout and go on.)
        Once a start of this run was seen (``hpcsync.init``'s note), a later start that takes more
        than :func:`start_limit` is ended the same way (a launcher waiting for a node it cannot
        reach); a start after a requeue, on other nodes, is not bounded by this run's."""
        grace, begun = launcher_grace(), time.monotonic()
        limit = start_limit(self._starts)
        since: Optional[float] = None
        why = f"{grace:.0f} s after the step began to fail"
        while True:
            try:
                rc = child.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                rc = None
            now = time.monotonic()
            if attempt.started_after is None and os.path.exists(os.path.join(folder, failure.STARTED)):
                attempt.started_after = round(now - begun, 1)
                self._starts.append(attempt.started_after)
            if rc is not None:
                return rc
            with lock:
                since = words.trouble_at
            if since is not None and now - since > grace:
                break
            if limit is not None and attempt.started_after is None and now - begun > limit:
                why = f"{limit:.0f} s after it began, and its ranks are not all up (this run's earlier starts took " \
                      f"at most {max(self._starts):.0f} s)"
                with lock:
                    words.never_started = True
                break
        say(f"the launcher is still running {why}: ending it (TERM, then KILL)")
        with lock:
            words.hung = True
        return _end(child)

    def _observe(self, attempt: Attempt, rc: int, records: List[FailureRecord], verdict: Verdict) -> None:
        attempt.ended, attempt.exit_code = time.time(), rc
        attempt.cause, attempt.blamed, attempt.detail = verdict.cause, verdict.blamed, verdict.detail
        attempt.first_record_at = records[0].time if records else None
        try:
            with open(os.path.join(self.state.folder, f"attempt-{attempt.number}", failure.RESUMED)) as f:
                resumed = json.load(f)
            attempt.resumed_step, attempt.resumed_saved_at = resumed["step"], resumed.get("saved_at")
            attempt.resumed_at = resumed["time"]
        except (OSError, ValueError, KeyError):
            pass

    def _lost(self, failed: Attempt, next_: Attempt) -> str:
        """Time lost to ``failed``: the work since the checkpoint resumed, detection, relaunch, restore."""
        parts = []
        if next_.resumed_saved_at and failed.ended:
            parts.append(f"work since the checkpoint {max(0.0, failed.ended - next_.resumed_saved_at):.1f} s "
                         "(detection included)")
        parts.append(f"relaunch {next_.started - failed.ended:.1f} s")
        if next_.resumed_at:
            parts.append(f"restore {next_.resumed_at - next_.started:.1f} s")
        return ", ".join(parts)

    def run(self) -> int:
        for s in _FORWARDED:
            signal.signal(s, self._forward)
        if self.width < 1:
            say(f"{len(self.hosts) + len(self.state.bad_nodes)} node(s) and {self.spares} spare(s): no node left to run on")
            return EXIT_NO_NODES
        if self.state.bad_nodes:
            say(f"nodes left out after earlier failures: {', '.join(self.state.bad_nodes)}")
        say(f"{self.width} node(s) x {self.per_node} rank(s) with {self.launcher.name}; spares: "
            f"{', '.join(self.hosts[self.width:]) or 'none'}; at most {self.max_restarts} restart(s)")
        while True:
            if self._signalled:  # a TERM / INT that came between two attempts ends the run too
                say("signalled between attempts: not relaunched")
                return EXIT_SIGNALLED
            if self._warning is not None:  # the next step's guard would never see it
                name = WARNING_SIGNALS[self._warning]
                say(f"{name}, the job's warning signal, came between two attempts")
                return self._warned(128 + self._warning, name)
            if len(self.hosts) < self.width:
                return self._no_spare()
            previous = self.state.attempts[-1] if self.state.attempts and self.state.attempts[-1].failed else None
            attempt = Attempt(len(self.state.attempts) + 1, self.hosts[:self.width], time.time())
            self.state.attempts.append(attempt)
            self.state.save()
            rc, words = self._step(attempt)
            records = [self._named(r) for r in failure.read(os.path.join(self.state.folder, f"attempt-{attempt.number}"))]
            verdict = judge(rc, records, words, self._signalled, self._nodes_down,
                            ranks=len(attempt.nodes) * self.per_node, nodes=attempt.nodes,
                            probe=self._unreachable if self.state.restarts() < self.max_restarts else None,
                            spares=len(self.hosts) - self.width)
            before = self.state.attempts[-2] if len(self.state.attempts) > 1 else None
            attempt.killed = sorted({f"{n}/{r}" for n, ranks in words.deaths.items() for r in (ranks or {"?"})})
            again = sorted(set(attempt.killed) & set(before.killed)) if before is not None else []
            if verdict.cause == PROCESS_KILLED and before is not None and before.cause == PROCESS_KILLED and again \
                    and before.nodes == attempt.nodes:
                verdict = Verdict(Action.STOP_PROGRAM, PROCESS_KILLED, [], f"{verdict.detail}; the second time in a row "
                                  f"({', '.join(again)}) on nodes that run on: the program's (a memory limit's kill "
                                  "comes back)")
            if verdict.action is Action.STOP_PROGRAM and self.retry_exceptions:
                verdict = Verdict(Action.RELAUNCH, f"{verdict.cause} (retried: --retry-exceptions)", [], verdict.detail)
            self._observe(attempt, rc, records, verdict)
            self.state.save()
            if previous is not None:
                say(f"attempt {attempt.number - 1}'s failure cost {self._lost(previous, attempt)}")
            if verdict.action is Action.DONE:
                say(f"{attempt.line()}" + (f": {verdict.detail}" if verdict.detail else ""))
                return rc
            if verdict.action is Action.REQUEUE:
                say(f"{attempt.line()}: {verdict.detail}")
                if verdict.blamed:  # the next start leaves them out (a spare, or the job moves elsewhere)
                    self._mark_bad(verdict.blamed)
                    self.state.save()
                return self._warned(rc, verdict.cause)
            if verdict.action is Action.STOP_PROGRAM:
                code = next((r.exit_code for r in records if r.program_error and r.exit_code), rc)
                say(f"the program failed: {verdict.detail}; not relaunched (the same code fails again at the "
                    f"same step; --retry-exceptions retries it). Exit code {code}")
                return code
            say(f"attempt {attempt.number} failed ({verdict.cause}): {verdict.detail}")
            if self.state.restarts() >= self.max_restarts:
                return self._give_up()
            attempt.failed = True
            verdict.blamed = self._mark_bad(verdict.blamed)
            self.hosts = [h for h in self.hosts if h not in verdict.blamed]
            self.state.save()
            if verdict.blamed:
                say(f"leaving out {', '.join(verdict.blamed)}; healthy nodes: {', '.join(self.hosts) or 'none'}")

    def _mark_bad(self, nodes: Sequence[str]) -> List[str]:
        """Add ``nodes`` (by the launcher's names) to the bad list, once each; their launcher names."""
        names = [self._host_name(n) for n in nodes]
        for node in names:
            if node not in self.state.bad_nodes:
                self.state.bad_nodes.append(node)
        return names

    def _host_name(self, node: str) -> str:
        """The scheduler's name of ``node`` (a record says what the node's hostname is: maybe the
        fully qualified form of a Slurm node name, or another name altogether:
        :meth:`~hpcsync.resilience.schedulers.Scheduler.node_name`)."""
        return self.scheduler.node_name(node, self.all_hosts)

    def _warned(self, rc: int, cause: str) -> int:
        """What the program's guard would have done with the warning: under a scheduler, requeue the
        job (:meth:`~hpcsync.resilience.schedulers.Scheduler.requeue`; Slurm's:
        ``HPCSYNC_MAX_RESTARTS``, never a job being ended; it resumes from the latest checkpoint);
        elsewhere (``--hosts``), end with ``rc``."""
        if not self.scheduler.can_requeue:
            say(f"{cause}: not run by a scheduler, nothing to requeue; not relaunched. Exit code {rc}")
            return rc
        outcome = self.scheduler.requeue(self.state.bad_nodes, "SIGTERM" if self._signalled else None)
        say(outcome.message)
        return outcome.exit_code

    def _give_up(self) -> int:
        lines = "\n".join(f"  {a.line()}" for a in self.state.attempts)
        say(f"giving up after {len(self.state.attempts)} attempt(s), the cap is {self.max_restarts} restart(s):\n{lines}")
        return EXIT_RESTARTS_SPENT

    def _no_spare(self) -> int:
        bad = ", ".join(self.state.bad_nodes)
        if not self.scheduler.can_requeue:
            say(f"no spare node left ({self.width} needed, healthy: {', '.join(self.hosts) or 'none'}; left out: {bad})")
            return EXIT_NO_NODES
        if self.state.requeues >= self.max_restarts:  # each failure requeues once at most: this is a loop
            say(f"no spare node left and the job was requeued {self.state.requeues} time(s) already (the cap is "
                f"{self.max_restarts}): it keeps landing on {bad}; not requeued again")
            return self._give_up()
        if self._signalled:
            say("no spare node left; the run was signalled: not requeued")
            return EXIT_SIGNALLED
        outcome = self.scheduler.requeue_excluding(self.state.bad_nodes, lambda: self._signalled, self._count_requeue)
        say(outcome.message)
        return outcome.exit_code

    def _count_requeue(self) -> None:
        """One requeue more against the cap, saved before the scheduler is asked (a requeued
        job's script may be ended at once)."""
        self.state.requeues += 1
        self.state.save()


def _end(child: subprocess.Popen) -> int:
    """End a launcher that would not end, and what it started on this node (its daemons, local
    ranks: they would meet the next attempt; a rank's preemption guard catches TERM): TERM to
    all, 10 s, then KILL to every one of them still there. The launcher's exit code."""
    try:
        family = [psutil.Process(child.pid)]
        family += family[0].children(recursive=True)
    except psutil.Error:
        family = []
    for proc in family:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    try:
        rc: Optional[int] = child.wait(timeout=10.0)
    except subprocess.TimeoutExpired:
        rc = None
    for proc in family:  # psutil checks each is still the process it was (no pid reused)
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                proc.kill()
        except psutil.Error:
            pass
    if rc is None:
        try:
            rc = child.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            rc = 128 + signal.SIGKILL
    return rc


LAUNCHER_SLACK_S = 45.0


def launcher_grace() -> float:
    """Seconds a launcher has to end once its step is failing: the ranks' timeout (at most 300 s:
    what a rank still waiting would need to report), the aborts' grace twice, and
    :data:`LAUNCHER_SLACK_S`."""
    return min(settings.number("HPCSYNC_TIMEOUT"), 300.0) + 2 * settings.number("HPCSYNC_ABORT_GRACE") + LAUNCHER_SLACK_S


START_MIN_S = 120.0


def start_limit(earlier: Sequence[float]) -> Optional[float]:
    """Seconds a start may take before its launcher is ended: four times the slowest earlier start
    of this run, at least :data:`START_MIN_S`; None (no bound) before any start was seen."""
    return max(START_MIN_S, 4 * max(earlier)) if earlier else None


def main(args: Any) -> int:
    """``hpcsync run`` (see :mod:`hpcsync.cli`)."""
    program = list(args.program[1:] if args.program[:1] == ["--"] else args.program)
    if not program:
        raise SystemExit("hpcsync run: give the program after --")
    extra = shlex.split(args.launcher_args or "")
    found = detect()
    if args.hosts or args.hostfile:
        spec = args.hosts or open(args.hostfile).read()
        scheduler: Scheduler = HostList(parse_hosts(spec))
        launcher: Launcher = mpi_launcher(args.mpirun or shutil.which("mpirun") or "mpirun", extra)
        default_dir = os.path.join("hpcsync-run", f"local-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    elif found is not None:
        scheduler = found
        launcher = Srun(shutil.which("srun") or "srun", extra) if isinstance(found, Slurm) else \
            mpi_launcher(args.mpirun or shutil.which("mpirun") or "mpirun", extra)
        default_dir = os.path.join("hpcsync-run", str(found.job_id()))
    else:
        raise SystemExit("hpcsync run: not inside a scheduler's job (Slurm, PBS): give --hosts or --hostfile "
                         "(and --mpirun)")
    hosts = scheduler.nodes()
    per_node = args.ntasks_per_node or scheduler.tasks_per_node()
    if args.spare_nodes < 0 or args.max_restarts < 0 or per_node < 1:
        raise SystemExit("hpcsync run: --spare-nodes and --max-restarts must be 0 or more, --ntasks-per-node 1 or more")
    sup = Supervisor(launcher, hosts, per_node, args.spare_nodes, args.max_restarts,
                     os.path.abspath(args.state_dir or default_dir), program, args.retry_exceptions, scheduler)
    return sup.run()


def add_parser(sub: Any) -> None:
    run = sub.add_parser("run", help="run a job step, relaunched without a failed node (Slurm, or mpirun over hosts)",
                         description=__doc__.split("\n\n")[0])
    run.add_argument("--spare-nodes", type=int, default=0, metavar="N", help="nodes held back to replace failed ones")
    run.add_argument("--max-restarts", type=int, default=3, metavar="N", help="relaunches and requeues, in all (default 3)")
    run.add_argument("--retry-exceptions", action="store_true", help="relaunch after the program's own exception, crash or desync too (on the same nodes)")
    run.add_argument("--ntasks-per-node", type=int, metavar="N", help="ranks per node (Slurm: the allocation's, SLURM_TASKS_PER_NODE; "
                     "mpirun: the first host's slots)")
    run.add_argument("--hosts", help="mpirun mode: hosts and slots, e.g. n0:2,n1:2,n2:2")
    run.add_argument("--hostfile", metavar="FILE", help="mpirun mode: a hostfile (host slots=N, or host:N, a line each)")
    run.add_argument("--mpirun", metavar="PATH", help="mpirun mode: the launcher (default: mpirun on PATH)")
    run.add_argument("--launcher-args", metavar="ARGS", help="more arguments for srun / mpirun, one string (e.g. '--mpi=pmix')")
    run.add_argument("--state-dir", metavar="DIR", help="attempts, failure records and bad nodes (shared by every node; default "
                     "hpcsync-run/<Slurm job id>)")
    run.add_argument("program", nargs="...", help="-- PROGRAM ARGS...")
    run.set_defaults(func=main)
