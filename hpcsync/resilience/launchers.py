"""What ``hpcsync run`` starts a step with, and what it reads back from the launcher: the
launchers (srun, Open MPI's mpirun, MPICH's hydra) and their words about ranks that died, nodes
that dropped out, and ranks that crashed by themselves: one output parser per launcher
(:class:`OutputParser`), all of them fed each line by :class:`LauncherWords` into one
:class:`Evidence`, which the verdict reads."""
from __future__ import annotations

import re
import signal
import subprocess
import time
from abc import ABC, abstractmethod
from typing import Dict, List, Optional, Sequence, Set, Tuple, Type

__all__ = ["WARNING_SIGNALS", "Evidence", "OutputParser", "SrunOutput", "OpenMPIOutput", "HydraOutput",
           "WatchdogOutput", "LauncherWords", "Launcher", "Srun", "OpenMPI", "Hydra", "mpi_launcher", "parse_hosts"]


# -- what the launcher said ---------------------------------------------------------------------
# the warning signals a job is sent on purpose, on every task (Slurm's --signal, scancel --signal):
# a rank they killed (its program had no handler yet, or no longer) says nothing about its node
WARNING_SIGNALS = {int(signal.SIGUSR1): "SIGUSR1", int(signal.SIGUSR2): "SIGUSR2"}
# a rank's own crash (a segfault, an abort, a division by zero), whichever launcher says so: the
# program's doing, the same step crashes again; its node works -- when it is the first death the
# launcher reports (a survivor that aborts after a peer is lost, as NCCL's watchdog does, comes
# after). SIGKILL without a word of memory, SIGBUS (a machine check, a full /dev/shm) and SIGILL
# (a node without an instruction set) stay the node's.
_CRASH_SIGNALS = {int(s) for s in (signal.SIGSEGV, signal.SIGABRT, signal.SIGFPE)}


class Evidence:
    """What a step's output said, whichever launcher's parser read it: the nodes it says lost
    ranks to a signal or dropped out; ``warning``: the warning signal (SIGUSR1, SIGUSR2) that
    killed ranks, if one did (no node blamed); ``crashes``: the lines that say a rank crashed by
    itself (out of memory, a segfault, an abort: the program's, no node blamed); ``crash_first``:
    whether such a line came before any line that blames a node (a crash after a node's failure
    is its consequence); ``trouble_at``: when (``time.monotonic()``) a line first said the step is
    failing; ``launch_failed``: the launcher said it could not start its daemons (the step never
    ran: not the program's exit); ``teardown``: NCCL's watchdog ended a rank because a peer failed
    (the aborts after it are not crashes).

    ``nodes`` holds three kinds of evidence, kept apart too: ``failed``, the nodes the launcher
    itself calls failed (srun's "Node failure", a failed task launch: slurmctld's word);
    ``lost``, the nodes whose daemon Open MPI lost (its own node's link as likely as theirs); and
    ``deaths``, the ranks (by rank, where the line says it) each node lost to a signal -- a death
    its node's own daemon reported, so its node was up. ``alive``: the nodes where a rank lived
    until the launcher's cleanup (ended by SIGTERM, or exited by itself): their node ran on.
    ``lines``: the line that first blamed each node of ``nodes``. ``hung`` and ``never_started``
    are the supervisor's: it had to end the launcher (because its ranks were not all up in time)."""

    def __init__(self) -> None:
        self.nodes: List[str] = []
        self.lines: List[str] = []
        self.failed: List[str] = []
        self.lost: List[str] = []
        self.deaths: Dict[str, Set[str]] = {}
        self.alive: Set[str] = set()
        self.crashes: List[str] = []
        self.crash_first = False
        self.teardown = False
        self.warning: Optional[str] = None
        self.trouble_at: Optional[float] = None
        self.hung = False  # the supervisor had to end the launcher
        self.never_started = False  # ... because its ranks were not all up in time
        self.launch_failed = False  # the launcher could not start its daemons

    def trouble(self) -> None:
        """The step is failing: from now on the launcher has a bounded time to end."""
        if self.trouble_at is None:
            self.trouble_at = time.monotonic()

    def crash(self, line: str) -> None:
        if self.teardown:  # a survivor ended by its watchdog: the cause is a peer's
            return
        if not self.crashes and not self.nodes:
            self.crash_first = True
        self.crashes.append(line.strip())

    def warn(self, name: str) -> None:
        self.warning = self.warning or name  # the first one the launcher reports

    def blame(self, node: str, line: str) -> None:
        node = node.rstrip(".,:")
        if node not in self.nodes:
            self.nodes.append(node)
            self.lines.append(line.strip())

    def node_failed(self, node: str, line: str) -> None:
        self.blame(node, line)
        node = node.rstrip(".,:")
        if node not in self.failed:
            self.failed.append(node)

    def daemon_lost(self, node: str, line: str) -> None:
        self.blame(node, line)
        node = node.rstrip(".,:")
        if node not in self.lost:
            self.lost.append(node)

    def died(self, node: str, ranks: Sequence[str], line: str) -> None:
        self.blame(node, line)
        self.deaths.setdefault(node.rstrip(".,:"), set()).update(ranks)

    def lived(self, node: Optional[str]) -> None:
        if node:
            self.alive.add(node.rstrip(".,:"))


class OutputParser(ABC):
    """One launcher's output, read line by line into ``evidence`` (which the parsers of a step
    share): a parser knows its own launcher's lines and keeps what it must remember between them;
    a line of another launcher's, or of the program's, changes nothing."""

    def __init__(self, evidence: Evidence) -> None:
        self.evidence = evidence

    @abstractmethod
    def feed(self, line: str) -> None:
        """Read one line of the step's output (stdout or stderr)."""


class SrunOutput(OutputParser):
    """Slurm's ``srun`` (and ``slurmstepd``'s words it passes on): a task's death, exit or crash
    by node and task, a node's failure, and the step's end, after which srun's deaths are its own
    doing."""

    _TASK = re.compile(r"srun: error: (\S+): tasks? ([0-9,\-]+): (.+)$")
    _NODE = re.compile(r"srun: error: (?:Node failure on|Task launch for .+? failed on node) (\S+?)(?:[:\s]|$)")
    _WARNING_WORDS = {"User defined signal 1": "SIGUSR1", "User defined signal 2": "SIGUSR2"}
    _NOT_A_DEATH = ("Terminated", "Exited with exit code")  # ended by srun, or by itself: it ran till then
    _CRASH_WORDS = ("Out Of Memory", "Segmentation fault", "Aborted", "Floating point exception")  # a rank's own
    # srun ending the step: every death it reports from here on is its own doing, not a cause
    _ENDING = ("_step_signal: Terminating", "Job step aborted", "CANCELLED AT", "Force Terminated")

    def __init__(self, evidence: Evidence) -> None:
        super().__init__(evidence)
        self._ending = False

    def feed(self, line: str) -> None:
        words = self.evidence
        task, node = self._TASK.search(line), self._NODE.search(line)
        if task or node:  # not srun's other errors (a tty, a plugin)
            words.trouble()
        if any(w in line for w in self._ENDING):
            self._ending = True
        said = task.group(3).strip() if task else ""
        if task and said in self._WARNING_WORDS:
            words.warn(self._WARNING_WORDS[said])
        elif task and said.startswith(self._NOT_A_DEATH):
            words.lived(task.group(1))
        elif task and not self._ending and said.startswith(self._CRASH_WORDS):
            words.crash(line)
        elif task and not self._ending:
            words.died(task.group(1), _task_ranks(task.group(2)), line)
        elif node:
            words.node_failed(node.group(1), line)


class OpenMPIOutput(OutputParser):
    """Open MPI's ``mpirun`` (ORTE, PRTE): a rank's death by signal and node, a remote daemon lost,
    daemons it could not start."""

    _SIGNAL = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)")
    _DAEMON = re.compile(r"Remote daemon:.*? on node (\S+)")  # not "HNP daemon": mpirun's own node
    _TROUBLE = ("ORTE was unable", "ORTE has lost communication", "PRTE has lost communication",
                "MPI_ABORT was invoked", "mpirun noticed", "prterun noticed")
    # it could not start its daemons (on a node it does not name): the step never ran
    _LAUNCH_FAILED = ("was unable to reliably start one or more daemons",  # ORTE's and PRTE's
                      "None of the TCP networks specified to be included for out-of-band",  # its node's link down
                      "It looks like orte_init failed")

    def feed(self, line: str) -> None:
        words = self.evidence
        if any(w in line for w in self._TROUBLE):
            words.trouble()
        if any(w in line for w in self._LAUNCH_FAILED):
            words.launch_failed = True
        m = self._DAEMON.search(line)
        if m:  # the link between mpirun's node and that one failed: either end's
            words.daemon_lost(m.group(1), line)
            return
        m = self._SIGNAL.search(line)
        if not m:
            return
        number = int(m.group(3))
        if number in WARNING_SIGNALS:
            words.warn(WARNING_SIGNALS[number])
        elif number in _CRASH_SIGNALS:
            words.crash(line)
        elif number == signal.SIGTERM:
            words.lived(m.group(2))
        else:
            words.died(m.group(2), [m.group(1)], line)


class HydraOutput(OutputParser):
    """MPICH's hydra ``mpiexec``: the node a rank ran at, then its signal or exit status.

    MPICH 3-4 prints one ``KILLED BY SIGNAL`` per dead rank and an ``EXIT STATUS`` for a rank that
    ended by itself (alive till then). MPICH 5 prints a banner per process it ended, the first one
    the process that died first: its ``EXIT CODE`` is the raw status (a signal's number in the low
    bits). Its "EXIT STRING" ORs every process's status together, and the later banners are
    hydra's own cleanup: neither says anything."""

    _AT = re.compile(r"(?:RANK (\d+) )?PID \d+ RUNNING AT (\S+)|RUNNING AT (\S+)")
    _STATUS = re.compile(r"=\s+EXIT STATUS: (\d+)")
    _SIGNAL = re.compile(r"KILLED BY SIGNAL: (\d+)")
    _BANNER = "BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES"
    _EXIT_CODE = re.compile(r"=\s+EXIT CODE: (\d+)")
    _TROUBLE = "BAD TERMINATION"

    def __init__(self, evidence: Evidence) -> None:
        super().__init__(evidence)
        self._banners = 0
        self._code_seen = False
        self._at: Optional[str] = None  # the node (and rank) of the banner read last
        self._rank: Optional[str] = None

    def feed(self, line: str) -> None:
        words = self.evidence
        if self._TROUBLE in line:
            words.trouble()
        if self._BANNER in line:
            self._banners += 1
        m = self._AT.search(line)
        if m and self._banners <= 1:  # (the later banners are hydra's own cleanup)
            self._at, self._rank = m.group(2) or m.group(3), m.group(1)
        if self._STATUS.search(line) and self._banners == 0:
            words.lived(self._at)
        m = self._SIGNAL.search(line)
        number = int(m.group(1)) if m else None
        m = self._EXIT_CODE.search(line)
        if m and self._banners == 1 and not self._code_seen:
            self._code_seen = True
            number = int(m.group(1)) & 0x7F
        if number in WARNING_SIGNALS:
            words.warn(WARNING_SIGNALS[number])
        elif number in _CRASH_SIGNALS:
            words.crash(f"{self._at or '?'}: {line.strip()}")
        elif number == signal.SIGTERM:
            words.lived(self._at)
        elif number is not None and self._at:
            words.died(self._at, [self._rank or f"? {line.strip()}"], line)


class WatchdogOutput(OutputParser):
    """No launcher's: PyTorch's NCCL watchdog ending a rank (SIGABRT) because a peer failed, in the
    ranks' own output whoever started them. The aborts any launcher reports after it are not
    crashes."""

    _TEARDOWN = ("taking the entire process down", "Process group watchdog thread terminated")

    def feed(self, line: str) -> None:
        if any(w in line for w in self._TEARDOWN):
            self.evidence.teardown = True


class LauncherWords(Evidence):
    """The :class:`Evidence` of one step's output, each line read by every parser: the
    supervisor's launcher is not the only one that speaks (mpirun and mpiexec inside a Slurm
    allocation start their daemons with srun, whose errors come out between theirs), and the
    ranks' own watchdog speaks under any of them. Each parser acts on its own launcher's lines."""

    # the watchdog first, as before: its word on a line decides whether that line's abort is a crash
    PARSERS: Tuple[Type[OutputParser], ...] = (WatchdogOutput, SrunOutput, OpenMPIOutput, HydraOutput)

    def __init__(self) -> None:
        super().__init__()
        self.parsers = [parser(self) for parser in self.PARSERS]

    def feed(self, line: str) -> None:
        for parser in self.parsers:
            parser.feed(line)


def _task_ranks(spec: str) -> List[str]:
    """srun's ``0,3-5`` as ``["0", "3", "4", "5"]``."""
    out: List[str] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (hi.isdigit() or not hi):
            out += [str(r) for r in range(int(lo), int(hi or lo) + 1)]
    return out


# -- launchers ---------------------------------------------------------------------------------
class Launcher:
    """How to start the step on ``nodes`` with ``per_node`` ranks each."""

    name = "launcher"
    through_controller = False  #: a step on this node also goes through the network (srun: slurmctld)

    def __init__(self, exe: str, extra: Sequence[str]) -> None:
        self.exe, self.extra = exe, list(extra)

    def command(self, nodes: Sequence[str], per_node: int, program: Sequence[str]) -> List[str]:
        raise NotImplementedError

    def probe(self, node: str) -> List[str]:
        """One process (``true``) on ``node``, started as a step would be: can the launcher use it?"""
        return self.command([node], 1, ["true"])


class Srun(Launcher):
    """``srun`` inside the allocation. ``--overlap``: a step that lost a node stays "completing"
    until Slurm hears from that node (minutes, for a node cut off), and holds its CPUs on the
    healthy nodes meanwhile; without it the relaunch waits for them ("Requested nodes are busy")."""

    name = "srun"
    through_controller = True

    def command(self, nodes: Sequence[str], per_node: int, program: Sequence[str]) -> List[str]:
        return [self.exe, f"--nodelist={','.join(nodes)}", "-N", str(len(nodes)), "-n", str(len(nodes) * per_node),
                f"--ntasks-per-node={per_node}", "--kill-on-bad-exit=1", "--overlap", *self.extra, *program]


class OpenMPI(Launcher):
    name = "mpirun (Open MPI)"

    def command(self, nodes: Sequence[str], per_node: int, program: Sequence[str]) -> List[str]:
        hosts = ",".join(f"{n}:{per_node}" for n in nodes)
        return [self.exe, "--host", hosts, "-n", str(len(nodes) * per_node), "-x", "HPCSYNC_REPORT_DIR",
                "-x", "HPCSYNC_RUN_ATTEMPT", *self.extra, *program]


class Hydra(Launcher):
    name = "mpiexec (MPICH)"

    def command(self, nodes: Sequence[str], per_node: int, program: Sequence[str]) -> List[str]:
        hosts = ",".join(f"{n}:{per_node}" for n in nodes)
        return [self.exe, "-hosts", hosts, "-n", str(len(nodes) * per_node), *self.extra, *program]


def mpi_launcher(exe: str, extra: Sequence[str]) -> Launcher:
    """Open MPI's ``mpirun`` or MPICH's ``mpiexec``, told apart by ``--version``."""
    try:
        version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SystemExit(f"hpcsync run: cannot run {exe}: {exc}") from None
    return OpenMPI(exe, extra) if re.search(r"Open MPI|OpenRTE|Open RTE", version) else Hydra(exe, extra)


def parse_hosts(spec: str) -> List[Tuple[str, int]]:
    """``a:2,b:2`` or a hostfile's lines (``a slots=2``, ``a:2``, ``a``) as ``[(host, slots)]``."""
    out: List[Tuple[str, int]] = []
    for item in re.split(r"[,\n]", spec):
        item = item.split("#", 1)[0].strip()
        if not item:
            continue
        m = re.match(r"^(\S+?)(?::(\d+))?(?:\s+slots=(\d+))?\s*$", item)
        if not m:
            raise SystemExit(f"hpcsync run: cannot read the host {item!r}")
        out.append((m.group(1), int(m.group(2) or m.group(3) or 1)))
    return out
