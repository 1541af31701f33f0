"""What ``hpcsync run`` asks of the scheduler that gave it its nodes, one small class per
scheduler behind :class:`Scheduler` (in the manner of Lightning's ``ClusterEnvironment``): the
job's nodes and ranks per node, its id and end, the nodes the scheduler calls down, a requeue
that leaves nodes out, whether the job still runs, and the scheduler's name for a rank's host.

- :class:`Slurm`: ``SLURM_*`` in the environment, ``scontrol`` for the rest.
- :class:`PBS`: ``PBS_JOBID`` and ``PBS_NODEFILE``; ``pbsnodes``, ``qstat`` and ``qrerun``.
- :class:`HostList`: ``mpirun`` over a list of hosts (``--hosts``, ``--hostfile``), no scheduler:
  nothing to requeue, no node state.

:func:`detect` picks one from the environment. A record names its node by ``gethostname()``; the
scheduler may call the node otherwise (Slurm's ``NodeName`` apart from its ``NodeHostName``):
every node ``hpcsync run`` leaves out, probes or excludes goes by :meth:`Scheduler.node_name`.
Every call to a scheduler's command is bounded by :data:`COMMAND_TIMEOUT_S`; a command that is
missing or does not answer says nothing (an empty answer), never a guess.

Another scheduler is one more subclass here, with :meth:`Scheduler.detect`, added to
:data:`SCHEDULERS` (most specific first)."""
from __future__ import annotations

import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from abc import ABC, abstractmethod
from collections import Counter
from enum import Enum
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Type

from ..core.environments import expand_hostlist, parse_tasks_per_node
from . import requeue
from .requeue import Requeue

__all__ = ["COMMAND_TIMEOUT_S", "EXIT_NO_NODES", "NodeState", "Scheduler", "Slurm", "PBS", "HostList", "SCHEDULERS",
           "detect", "short_name", "slurm_node_states", "slurm_host_names", "pbs_node_states"]

COMMAND_TIMEOUT_S = requeue.SCONTROL_TIMEOUT_S  #: one scheduler command's bound (scontrol, qstat, ...)
EXIT_NO_NODES = 66  #: not enough healthy nodes, and no way to requeue (EX_NOINPUT)


class NodeState(str, Enum):
    """What the scheduler says of a node."""

    UP = "up"  #: usable: idle, allocated, mixed, free, busy
    DOWN = "down"  #: down, drained or draining, failing, not responding, offline
    UNKNOWN = "unknown"  #: no answer (no command, a timeout, a node it does not know)


Run = Callable[[Sequence[str]], Tuple[bool, str]]


def _run(argv: Sequence[str]) -> Tuple[bool, str]:
    """``(exited 0, stdout or the error)`` of ``argv`` within :data:`COMMAND_TIMEOUT_S`."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    return proc.returncode == 0, proc.stdout if proc.returncode == 0 else (proc.stderr or proc.stdout).strip()


def short_name(name: str) -> str:
    """A host's short name (``n1`` of ``n1.cluster``); an address stays whole (``10.0.0.5`` is
    not ``10``, which every address of that network would share)."""
    try:
        ipaddress.ip_address(name)
        return name
    except ValueError:
        return name.split(".")[0]


class Scheduler(ABC):
    """One scheduler's answers for ``hpcsync run`` (``env``: the job's environment)."""

    name = "scheduler"
    can_requeue = False  #: whether :meth:`requeue_excluding` can bring the job back

    def __init__(self, env: Optional[Mapping[str, str]] = None, run: Run = _run) -> None:
        self.env: Dict[str, str] = dict(os.environ if env is None else env)
        self.run = run  #: how a command of the scheduler's is run (default: bounded)
        self._host_cache: Dict[Tuple[str, ...], Tuple[float, Dict[str, str]]] = {}

    @staticmethod
    @abstractmethod
    def detect(env: Mapping[str, str]) -> bool:
        """Whether ``env`` is this scheduler's job."""

    @abstractmethod
    def nodes(self) -> List[str]:
        """The job's nodes, by the scheduler's names, in its order."""

    @abstractmethod
    def tasks_per_node(self) -> int:
        """Ranks each node runs (the same on every node: a relaunch a node fewer keeps it)."""

    def job_id(self) -> Optional[str]:
        """The id the scheduler's commands take; None without a scheduler."""
        return None

    def end_time(self) -> Optional[float]:
        """The job's end, epoch seconds; None when not known."""
        return None

    def node_states(self, nodes: Sequence[str]) -> Dict[str, NodeState]:
        """What the scheduler says of each of ``nodes`` (by its names)."""
        return {n: NodeState.UNKNOWN for n in nodes}

    def down(self, nodes: Sequence[str]) -> List[str]:
        """The ``nodes`` the scheduler calls down, in their order."""
        states = self.node_states(nodes)
        return [n for n in nodes if states.get(n) is NodeState.DOWN]

    def running(self) -> Optional[bool]:
        """Whether the job still runs (not being ended); None when it cannot tell."""
        return None

    def requeue_excluding(self, nodes: Sequence[str], signalled: Callable[[], bool] = lambda: False,
                          asking: Callable[[], None] = lambda: None) -> Requeue:
        """Requeue the job, its next start leaving ``nodes`` out; never a job being ended.
        ``asking()`` runs right before the scheduler is asked to requeue, never when it is not
        (where the caller counts its requeues)."""
        return Requeue(False, EXIT_NO_NODES, f"no spare node left and {self.name} cannot requeue the job")

    def requeue(self, bad: Sequence[str], ending: Optional[str] = None) -> Requeue:
        """What the program's preemption guard would do with the job's warning signal: requeue the
        job (its next start leaving ``bad`` out where the scheduler can), never after an
        ``ending`` signal (e.g. ``"SIGTERM"``)."""
        if ending:
            return Requeue(False, requeue.EXIT_ENDING_BASE + int(getattr(signal, ending, signal.SIGTERM)),
                                   f"stopped on {ending}, which ends a job: not requeued", self.job_id())
        return self.requeue_excluding(bad)

    def host_names(self, nodes: Sequence[str]) -> Dict[str, str]:
        """Other names of ``nodes`` (host name, address) -> the scheduler's name; none by default."""
        return {}

    def node_name(self, host: str, among: Sequence[str] = ()) -> str:
        """The scheduler's name of the node whose host name (a record's ``gethostname()``) is
        ``host``: itself when it is one of ``among`` (default: the job's nodes), or the one whose
        short name is the same; else the scheduler's own mapping (:meth:`host_names`); else
        ``host`` unchanged."""
        known = list(among) or self.nodes()
        if host in known:
            return host
        short = next((n for n in known if short_name(n) == short_name(host)), None)
        if short is not None:
            return short
        names = self._names(known)
        return names.get(host) or names.get(short_name(host)) or host

    def _names(self, known: Sequence[str]) -> Dict[str, str]:
        """:meth:`host_names` of ``known``, asked once (no answer: once a :data:`COMMAND_TIMEOUT_S`
        at most, so that a verdict over many records waits on a slow controller once)."""
        key, now = tuple(known), time.monotonic()
        asked = self._host_cache.get(key)
        if asked is None or (not asked[1] and now - asked[0] > COMMAND_TIMEOUT_S):
            names = self.host_names(known)
            asked = self._host_cache[key] = (time.monotonic(), names)
        return asked[1]


class HostList(Scheduler):
    """``mpirun`` over hosts (``[(host, slots)]``), no scheduler: the hosts as given."""

    name = "host list"

    def __init__(self, hosts: Sequence[Tuple[str, int]], env: Optional[Mapping[str, str]] = None) -> None:
        super().__init__(env)
        self.hosts = list(hosts)

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return False  # given by the command line, never by the environment

    def nodes(self) -> List[str]:
        return [h for h, _ in self.hosts]

    def tasks_per_node(self) -> int:
        return self.hosts[0][1] if self.hosts else 1


# -- Slurm ---------------------------------------------------------------------------------------
_SLURM_DOWN = {"DOWN", "DRAIN", "DRAINED", "DRAINING", "NOT_RESPONDING", "NO_RESPOND", "FAIL", "FAILING",
               "POWER_DOWN", "POWERED_DOWN", "POWERING_DOWN"}


def _fields(line: str) -> Dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S*)", line))


def slurm_node_states(show: str) -> Dict[str, NodeState]:
    """``scontrol show node -o``'s lines as each NodeName's state: DOWN, DRAIN, FAIL,
    NOT_RESPONDING (``-o`` prints ``IDLE*`` as ``IDLE+NOT_RESPONDING``, some versions keep the
    ``*``) and the like are down; IDLE, ALLOCATED, MIXED (with flags such as REBOOT_REQUESTED) up."""
    out: Dict[str, NodeState] = {}
    for line in show.splitlines():
        f = _fields(line)
        name, state = f.get("NodeName"), f.get("State")
        if not name or not state:
            continue
        flags = set(state.upper().rstrip("*$~#!%@^-").split("+"))
        out[name] = NodeState.DOWN if state.endswith("*") or flags & _SLURM_DOWN else NodeState.UP
    return out


def slurm_host_names(show: str) -> Dict[str, str]:
    """``scontrol show node -o``'s lines as ``{NodeHostName, NodeAddr, their short forms -> NodeName}``."""
    out: Dict[str, str] = {}
    for line in show.splitlines():
        f = _fields(line)
        name = f.get("NodeName")
        if not name:
            continue
        for other in (f.get("NodeHostName"), f.get("NodeAddr")):
            if other and other != "(null)":
                out.setdefault(other, name)
                out.setdefault(short_name(other), name)
    return out


class Slurm(Scheduler):
    """A Slurm job: ``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``, ``SLURM_TASKS_PER_NODE``,
    ``SLURM_JOB_END_TIME``; ``scontrol`` for node states, the job's state and the requeue.
    ``run``: how a command is run (default: bounded by :data:`COMMAND_TIMEOUT_S`)."""

    name = "Slurm"
    can_requeue = True

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return bool(env.get("SLURM_JOB_ID"))

    def nodes(self) -> List[str]:
        return expand_hostlist(self.env.get("SLURM_JOB_NODELIST") or self.env.get("SLURM_NODELIST", ""))

    def tasks_per_node(self) -> int:
        """``SLURM_NTASKS_PER_NODE`` (set only with ``--ntasks-per-node``), else
        ``SLURM_TASKS_PER_NODE`` (set for every job: ``-N 2 -n 8`` gives ``4(x2)``); 1 when
        neither is set. Uneven counts (``3,2``) cannot be kept by a relaunch with a node fewer: a
        clear error asking for ``--ntasks-per-node``."""
        env = self.env
        if env.get("SLURM_NTASKS_PER_NODE"):
            return int(env["SLURM_NTASKS_PER_NODE"].split("(")[0])
        try:
            counts = set(parse_tasks_per_node(env.get("SLURM_TASKS_PER_NODE", "")))
        except ValueError as exc:
            raise SystemExit(f"hpcsync run: {exc}; give --ntasks-per-node, the ranks each node runs") from None
        if len(counts) > 1:
            raise SystemExit(f"hpcsync run: the allocation has uneven ranks per node (SLURM_TASKS_PER_NODE="
                             f"{env['SLURM_TASKS_PER_NODE']}); give --ntasks-per-node, the ranks each node runs")
        return counts.pop() if counts else 1

    def job_id(self) -> Optional[str]:
        return requeue.slurm_job_id(self.env)

    def end_time(self) -> Optional[float]:
        value = self.env.get("SLURM_JOB_END_TIME", "").strip()
        return float(value) if re.fullmatch(r"\d+(\.\d*)?", value) else None

    def _scontrol(self, *args: str) -> Tuple[bool, str]:
        scontrol = shutil.which("scontrol", path=self.env.get("PATH"))
        if scontrol is None:
            return False, "scontrol is not on PATH"
        return self.run([scontrol, *args])

    def _show_nodes(self, nodes: Sequence[str]) -> str:
        if not nodes:
            return ""
        ok, out = self._scontrol("show", "node", "-o", ",".join(nodes))
        return out if ok else ""

    def node_states(self, nodes: Sequence[str]) -> Dict[str, NodeState]:
        said = slurm_node_states(self._show_nodes(nodes))
        return {n: said.get(n, NodeState.UNKNOWN) for n in nodes}

    def host_names(self, nodes: Sequence[str]) -> Dict[str, str]:
        names = slurm_host_names(self._show_nodes(nodes))
        here = self.env.get("SLURMD_NODENAME")  # this node's, when run inside the job
        if here and here in nodes:
            for host in (socket.gethostname(), socket.getfqdn()):
                names.setdefault(host, here)
                names.setdefault(short_name(host), here)
        return names

    def _job(self) -> Tuple[bool, Dict[str, str], str]:
        job = self.job_id()
        if job is None:
            return False, {}, "not a Slurm job"
        ok, out = self._scontrol("show", "job", "-o", job)
        return ok, _fields(out) if ok else {}, out

    def running(self) -> Optional[bool]:
        ok, job, _ = self._job()
        return job.get("JobState") == "RUNNING" if ok and job.get("JobState") else None

    def requeue(self, bad: Sequence[str], ending: Optional[str] = None) -> Requeue:
        """As the program's guard does (:func:`hpcsync.resilience.requeue.requeue_job`:
        ``HPCSYNC_MAX_RESTARTS``, never a job being ended, one Slurm already requeued); ``bad``
        stays in the state folder, which the next start leaves out of the step."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # Slurm ends a requeued job's batch script with it
        return requeue.requeue_job(ending=ending)

    def requeue_excluding(self, nodes: Sequence[str], signalled: Callable[[], bool] = lambda: False,
                          asking: Callable[[], None] = lambda: None) -> Requeue:
        """``scontrol requeue``, then ``nodes`` added to the job's ExcNodeList. A requeued job is
        pending (a running one's ExcNodeList cannot change) and cannot start again while this
        batch script still runs, so the update lands first; the job is never held, so a
        supervisor killed between the two calls leaves a job that comes back, not one held for
        good. A job being ended (no longer RUNNING, or ``signalled()``) is never requeued. SIGTERM,
        which Slurm sends the batch script once the job is requeued, is ignored from here on."""
        job = self.job_id()
        if shutil.which("scontrol", path=self.env.get("PATH")) is None:
            return Requeue(False, requeue.EXIT_NO_SCONTROL, "no spare node left and scontrol is not on "
                                   "PATH: cannot requeue", job)
        ok, show, said = self._job()
        state = show.get("JobState")
        if signalled() or not ok or state != "RUNNING":
            return Requeue(False, requeue.EXIT_ENDING_BASE + signal.SIGTERM, f"no spare node left; job {job} "
                                   f"is being ended ({state or said or 'signalled'}): not requeued", job)
        listed = show.get("ExcNodeList", "(null)")
        excluded = [] if listed in ("", "(null)") else expand_hostlist(listed)
        excluded += [n for n in nodes if n not in excluded]
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        asking()
        ok, why = self._scontrol("requeue", str(job))
        if not ok:
            return Requeue(False, requeue.EXIT_REQUEUE_FAILED, f"`scontrol requeue {job}` failed: {why}", job)
        ok, why = self._scontrol("update", f"JobId={job}", f"ExcNodeList={','.join(excluded)}")
        if not ok:
            return Requeue(False, requeue.EXIT_REQUEUE_FAILED, f"`scontrol update JobId={job} ExcNodeList=...` "
                                   f"failed: {why}; requeued without excluding {', '.join(excluded)} (its next start "
                                   "leaves them out of the step)", job)
        return Requeue(True, requeue.EXIT_REQUEUED, f"no spare node left: requeued Slurm job {job} without "
                               f"{', '.join(excluded)}; it resumes from its checkpoint when it starts again", job)


# -- PBS (OpenPBS, PBS Pro, Torque) --------------------------------------------------------------
_PBS_DOWN = {"down", "offline", "unknown", "stale", "state-unknown"}


def pbs_node_states(text: str) -> Dict[str, NodeState]:
    """``pbsnodes NODE...``'s blocks (a node's name, then indented ``state = free``) as states."""
    out: Dict[str, NodeState] = {}
    node: Optional[str] = None
    for line in text.splitlines():
        if line and not line[0].isspace():
            node = line.strip()
            continue
        m = re.match(r"\s+state\s*=\s*(\S+)", line)
        if node and m:
            words = set(m.group(1).lower().split(","))
            out[node] = NodeState.DOWN if words & _PBS_DOWN else NodeState.UP
    return out


class PBS(Scheduler):
    """A PBS job: ``PBS_JOBID``, ``PBS_NODEFILE`` (a host per rank); ``pbsnodes`` for node states,
    ``qstat -f`` for the job's state, ``qrerun`` to requeue. PBS has no way to leave nodes out of
    a rerun job: it is rerun as it is, and its next start leaves the bad nodes out of the step
    (they are in the state folder)."""

    name = "PBS"
    can_requeue = True

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return bool(env.get("PBS_JOBID") and env.get("PBS_NODEFILE"))

    def _slots(self) -> List[Tuple[str, int]]:
        path = self.env.get("PBS_NODEFILE", "")
        try:
            with open(path) as f:
                hosts = [line.strip() for line in f if line.strip() and not line.startswith("#")]
        except OSError as exc:
            raise SystemExit(f"hpcsync run: cannot read PBS_NODEFILE={path!r}: {exc}") from None
        counts = Counter(hosts)
        return [(h, counts[h]) for h in dict.fromkeys(hosts)]

    def nodes(self) -> List[str]:
        return [h for h, _ in self._slots()]

    def tasks_per_node(self) -> int:
        slots = self._slots()
        counts = {n for _, n in slots}
        if len(counts) > 1:
            raise SystemExit("hpcsync run: PBS_NODEFILE gives uneven ranks per node "
                             f"({', '.join(f'{h}: {n}' for h, n in slots)}); give --ntasks-per-node")
        return counts.pop() if counts else 1

    def job_id(self) -> Optional[str]:
        return self.env.get("PBS_JOBID") or None

    def _command(self, *argv: str) -> Tuple[bool, str]:
        exe = shutil.which(argv[0], path=self.env.get("PATH"))
        return (False, f"{argv[0]} is not on PATH") if exe is None else self.run([exe, *argv[1:]])

    def node_states(self, nodes: Sequence[str]) -> Dict[str, NodeState]:
        ok, out = self._command("pbsnodes", *nodes) if nodes else (False, "")
        said = pbs_node_states(out) if ok else {}
        return {n: said.get(n, NodeState.UNKNOWN) for n in nodes}

    def running(self) -> Optional[bool]:
        job = self.job_id()
        ok, out = self._command("qstat", "-f", job) if job else (False, "")
        m = re.search(r"\bjob_state\s*=\s*(\S+)", out) if ok else None
        return m.group(1) == "R" if m else None

    def requeue_excluding(self, nodes: Sequence[str], signalled: Callable[[], bool] = lambda: False,
                          asking: Callable[[], None] = lambda: None) -> Requeue:
        job = self.job_id()
        if signalled() or self.running() is False:
            return Requeue(False, requeue.EXIT_ENDING_BASE + signal.SIGTERM, f"no spare node left; job {job} "
                                   "is being ended: not requeued", job)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        asking()
        ok, why = self._command("qrerun", str(job))
        if not ok:
            return Requeue(False, requeue.EXIT_REQUEUE_FAILED, f"`qrerun {job}` failed: {why}", job)
        return Requeue(True, requeue.EXIT_REQUEUED, f"no spare node left: reran PBS job {job} (PBS cannot leave "
                               f"{', '.join(nodes)} out: its next start leaves them out of the step)", job)


SCHEDULERS: Tuple[Type[Scheduler], ...] = (Slurm, PBS)  #: asked in this order by :func:`detect`


def detect(env: Optional[Mapping[str, str]] = None) -> Optional[Scheduler]:
    """The scheduler whose job ``env`` (default: this process's) is, or None (no scheduler: give
    the hosts, :class:`HostList`)."""
    env = dict(os.environ if env is None else env)
    for kind in SCHEDULERS:
        if kind.detect(env):
            return kind(env)
    return None
