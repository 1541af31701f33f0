"""What ``hpcsync run`` starts a step with, and what it reads back from the launcher: the
launchers (srun, Open MPI's mpirun, MPICH's hydra) and their words about ranks that died, nodes
that dropped out, and ranks that crashed by themselves."""
from __future__ import annotations

import re
import signal
import subprocess
import time
from typing import Dict, List, Optional, Sequence, Set, Tuple

__all__ = ["WARNING_SIGNALS", "LauncherWords", "Launcher", "Srun", "OpenMPI", "Hydra", "mpi_launcher", "parse_hosts"]


# -- what the launcher said ---------------------------------------------------------------------
_SRUN_TASK = re.compile(r"srun: error: (\S+): tasks? ([0-9,\-]+): (.+)$")
_SRUN_NODE = re.compile(r"srun: error: (?:Node failure on|Task launch for .+? failed on node) (\S+?)(?:[:\s]|$)")
_OMPI_SIGNAL = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)")
_OMPI_DAEMON = re.compile(r"Remote daemon:.*? on node (\S+)")  # not "HNP daemon": mpirun's own node
_HYDRA_AT = re.compile(r"(?:RANK (\d+) )?PID \d+ RUNNING AT (\S+)|RUNNING AT (\S+)")
_HYDRA_STATUS = re.compile(r"=\s+EXIT STATUS: (\d+)")  # MPICH 3-4: a rank that ended by itself (alive till then)
_HYDRA_SIGNAL = re.compile(r"KILLED BY SIGNAL: (\d+)")  # MPICH 3-4, one line per dead rank
# MPICH 5: a banner per process it ended, the first one the process that died first: its EXIT
# CODE is the raw status (a signal's number in the low bits). "EXIT STRING" ORs every process's
# status together, and the later banners are hydra's own cleanup: neither says anything.
_HYDRA_BANNER = "BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES"
_HYDRA_EXIT_CODE = re.compile(r"=\s+EXIT CODE: (\d+)")
_NOT_A_DEATH = ("Terminated", "Exited with exit code")
# the warning signals a job is sent on purpose, on every task (Slurm's --signal, scancel --signal):
# a rank they killed (its program had no handler yet, or no longer) says nothing about its node
WARNING_SIGNALS = {int(signal.SIGUSR1): "SIGUSR1", int(signal.SIGUSR2): "SIGUSR2"}
_WARNING_WORDS = {"User defined signal 1": "SIGUSR1", "User defined signal 2": "SIGUSR2"}
# srun ending the step: every death it reports from here on is its own doing, not a cause
_SRUN_ENDING = ("_step_signal: Terminating", "Job step aborted", "CANCELLED AT", "Force Terminated")
# a rank's own crash (out of memory, a segfault, an abort, a division by zero): the program's
# doing, the same step crashes again; its node works -- when it is the first death the launcher
# reports (a survivor that aborts after a peer is lost, as NCCL's watchdog does, comes after).
# SIGKILL without a word of memory, SIGBUS (a machine check, a full /dev/shm) and SIGILL (a node
# without an instruction set) stay the node's.
_CRASH_WORDS = ("Out Of Memory", "Segmentation fault", "Aborted", "Floating point exception")
_CRASH_SIGNALS = {int(s) for s in (signal.SIGSEGV, signal.SIGABRT, signal.SIGFPE)}
# NCCL's watchdog ending a rank (SIGABRT) because a peer failed: the aborts after it are not crashes
_TEARDOWN = ("taking the entire process down", "Process group watchdog thread terminated")
# the step is failing, whoever says so: from the first of these the launcher has a bounded time to end
_TROUBLE = ("ORTE was unable", "ORTE has lost communication", "PRTE has lost communication", "BAD TERMINATION",
            "MPI_ABORT was invoked", "mpirun noticed", "prterun noticed")  # and srun's task and node lines
# the launcher could not start its daemons (on a node it does not name): the step never ran
_LAUNCH_FAILED = ("was unable to reliably start one or more daemons",  # Open MPI's ORTE and PRTE
                  "None of the TCP networks specified to be included for out-of-band",  # its node's link down
                  "It looks like orte_init failed")


class LauncherWords:
    """The nodes a launcher's output says lost ranks to a signal or dropped out, read line by line;
    ``warning``: the warning signal (SIGUSR1, SIGUSR2) that killed ranks, if one did (no node
    blamed); ``crashes``: the lines that say a rank crashed by itself (out of memory, a segfault, an
    abort: the program's, no node blamed); ``crash_first``: whether such a line came before any
    line that blames a node (a crash after a node's failure is its consequence); ``trouble_at``:
    when (``time.monotonic()``) a line first said the step is failing; ``launch_failed``: the
    launcher said it could not start its daemons (the step never ran: not the program's exit).

    ``nodes`` holds three kinds of evidence, kept apart too: ``failed``, the nodes the launcher
    itself calls failed (srun's "Node failure", a failed task launch: slurmctld's word);
    ``lost``, the nodes whose daemon Open MPI lost (its own node's link as likely as theirs); and
    ``deaths``, the ranks (by rank, where the line says it) each node lost to a signal -- a death
    its node's own daemon reported, so its node was up. ``alive``: the nodes where a rank lived
    until the launcher's cleanup (ended by SIGTERM, or exited by itself): their node ran on."""

    def __init__(self) -> None:
        self.nodes: List[str] = []
        self.lines: List[str] = []
        self.failed: List[str] = []
        self.lost: List[str] = []
        self.deaths: Dict[str, Set[str]] = {}
        self.alive: Set[str] = set()
        self.crashes: List[str] = []
        self.crash_first = False
        self._teardown = False
        self._hydra_banners = 0
        self._hydra_code_seen = False
        self.warning: Optional[str] = None
        self._hydra_at: Optional[str] = None
        self._hydra_rank: Optional[str] = None
        self._srun_ending = False
        self.trouble_at: Optional[float] = None
        self.hung = False  # the supervisor had to end the launcher
        self.never_started = False  # ... because its ranks were not all up in time
        self.launch_failed = False  # the launcher could not start its daemons

    def _crash(self, line: str) -> None:
        if self._teardown:  # a survivor ended by its watchdog: the cause is a peer's
            return
        if not self.crashes and not self.nodes:
            self.crash_first = True
        self.crashes.append(line.strip())

    def _warn(self, name: str) -> None:
        self.warning = self.warning or name  # the first one the launcher reports

    def _blame(self, node: str, line: str) -> None:
        node = node.rstrip(".,:")
        if node not in self.nodes:
            self.nodes.append(node)
            self.lines.append(line.strip())

    def _node_failed(self, node: str, line: str) -> None:
        self._blame(node, line)
        node = node.rstrip(".,:")
        if node not in self.failed:
            self.failed.append(node)

    def _died(self, node: str, ranks: Sequence[str], line: str) -> None:
        self._blame(node, line)
        self.deaths.setdefault(node.rstrip(".,:"), set()).update(ranks)

    def _lived(self, node: Optional[str]) -> None:
        if node:
            self.alive.add(node.rstrip(".,:"))

    def feed(self, line: str) -> None:
        if self.trouble_at is None and (any(w in line for w in _TROUBLE) or _SRUN_TASK.search(line)
                                        or _SRUN_NODE.search(line)):  # not srun's other errors (a tty, a plugin)
            self.trouble_at = time.monotonic()
        if any(w in line for w in _LAUNCH_FAILED):
            self.launch_failed = True
        if any(w in line for w in _TEARDOWN):
            self._teardown = True
        if any(w in line for w in _SRUN_ENDING):
            self._srun_ending = True
        m = _SRUN_TASK.search(line)
        said = m.group(3).strip() if m else ""
        if m and said in _WARNING_WORDS:
            self._warn(_WARNING_WORDS[said])
            return
        if m and said.startswith(_NOT_A_DEATH):  # ended by srun, or by itself: it ran till then
            self._lived(m.group(1))
            return
        if m and not self._srun_ending and said.startswith(_CRASH_WORDS):
            self._crash(line)
            return
        if m and not self._srun_ending:
            self._died(m.group(1), _task_ranks(m.group(2)), line)
            return
        m = _SRUN_NODE.search(line)
        if m:
            self._node_failed(m.group(1), line)
            return
        m = _OMPI_DAEMON.search(line)
        if m:  # the link between mpirun's node and that one failed: either end's
            self._blame(m.group(1), line)
            if m.group(1).rstrip(".,:") not in self.lost:
                self.lost.append(m.group(1).rstrip(".,:"))
            return
        m = _OMPI_SIGNAL.search(line)
        number = int(m.group(3)) if m else None
        if m and number in WARNING_SIGNALS:
            self._warn(WARNING_SIGNALS[int(m.group(3))])
            return
        if m and number in _CRASH_SIGNALS:
            self._crash(line)
            return
        if m and number == signal.SIGTERM:
            self._lived(m.group(2))
            return
        if m:
            self._died(m.group(2), [m.group(1)], line)
            return
        if _HYDRA_BANNER in line:
            self._hydra_banners += 1
        m = _HYDRA_AT.search(line)
        if m and self._hydra_banners <= 1:  # (the later banners are hydra's own cleanup)
            self._hydra_at, self._hydra_rank = m.group(2) or m.group(3), m.group(1)
        m = _HYDRA_STATUS.search(line)
        if m and self._hydra_banners == 0:
            self._lived(self._hydra_at)
        m = _HYDRA_SIGNAL.search(line)
        number = int(m.group(1)) if m else None
        m = _HYDRA_EXIT_CODE.search(line)
        if m and self._hydra_banners == 1 and not self._hydra_code_seen:
            self._hydra_code_seen = True
            number = int(m.group(1)) & 0x7F
        if number in WARNING_SIGNALS:
            self._warn(WARNING_SIGNALS[number])
        elif number in _CRASH_SIGNALS:
            self._crash(f"{self._hydra_at or '?'}: {line.strip()}")
        elif number == signal.SIGTERM:
            self._lived(self._hydra_at)
        elif number is not None and self._hydra_at:
            self._died(self._hydra_at, [self._hydra_rank or f"? {line.strip()}"], line)


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
