"""Asking each node whether the launcher can still run a process on it: the last evidence
``hpcsync run`` takes before relaunching a failed step on the same nodes. When nothing else names
a node (records nobody can believe, a launcher that could not start its daemons and did not say
where, a launcher that hung), a one-process step on each node (``true``), started the way the
relaunch would start, tells the nodes the launcher cannot use from the ones it can. It tests the
launcher's own way to the nodes (ssh, slurmd), not the MPI fabric: a node whose fabric alone
failed passes it (the ranks' records and the launcher's words are the evidence for that)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import psutil

from .schedulers import NodeState, short_name

__all__ = ["PROBE_TIMEOUT_S", "PROBES_AT_ONCE", "RETRY_TIMEOUT_S", "RETRY_BUDGET_S", "Outcome", "own_names", "unreachable"]

PROBE_TIMEOUT_S = 30.0  #: one probe's bound: a launcher waiting on a node it cannot reach
PROBES_AT_ONCE = 32  #: probes in flight together (each one a launcher process on this node)
RETRY_TIMEOUT_S = 90.0  #: the bound of a probe that timed out, tried again alone
RETRY_BUDGET_S = 300.0  #: all the retries alone together: a node not retried within it is not blamed


class Outcome(str, Enum):
    """One probe's end."""

    PASSED = "passed"
    FAILED = "failed"  #: it exited with an error
    TIMED_OUT = "timed out"  #: it did not end within its bound (ended with what it started)


def _ends_well(cmd: Sequence[str], timeout: float, env: Optional[Dict[str, str]],
               stop: Callable[[], bool]) -> Outcome:
    """How ``cmd`` ends within ``timeout`` (and before ``stop()`` says to give up); a probe past it
    is ended with everything it started here (its own session): TERM, 5 s, KILL."""
    try:
        proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    except OSError:
        return Outcome.FAILED
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop():
        try:
            return Outcome.PASSED if proc.wait(timeout=0.2) == 0 else Outcome.FAILED
        except subprocess.TimeoutExpired:
            continue
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            pass
        try:
            proc.wait(timeout=5.0)
            break
        except subprocess.TimeoutExpired:
            continue
    return Outcome.TIMED_OUT


def own_names() -> List[str]:
    """This node's names and addresses (for ``here``): a launcher that needs no network to start a
    process here (mpirun) proves nothing by a probe that passed on any of them, however the host
    list names this node."""
    names = [socket.gethostname(), socket.getfqdn(), "localhost"]
    try:
        names += [a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
                  if a.family in (socket.AF_INET, socket.AF_INET6)]
    except (OSError, psutil.Error):
        pass
    return list(dict.fromkeys(names))


def unreachable(nodes: Sequence[str], command: Callable[[str], List[str]], timeout: float = PROBE_TIMEOUT_S,
                env: Optional[Dict[str, str]] = None, here: Sequence[str] = (),
                stop: Callable[[], bool] = lambda: False,
                node_state: Optional[Callable[[Sequence[str]], Mapping[str, NodeState]]] = None,
                retry_timeout: float = RETRY_TIMEOUT_S, retry_budget: float = RETRY_BUDGET_S) -> List[str]:
    """The ``nodes`` on which ``command(node)`` (a one-process step) fails, :data:`PROBES_AT_ONCE`
    at a time, each try within ``timeout`` seconds: one that exits with an error is tried twice;
    one that times out (a launcher waiting on a slow controller as much as on a lost node) is
    checked against the scheduler (``node_state``): a node it calls down has failed, any other
    is tried again alone, within ``retry_timeout`` (all the retries together within
    ``retry_budget``: a node left over is not blamed) -- it has failed if that retry exits with an
    error, or times out on a node the scheduler does not call up (a node it calls up whose lone
    retry only timed out is the controller's slowness, not the node's). Timeouts on more than half
    of the nodes at once are the controller's or the launcher's: only the nodes the scheduler
    calls down among them have failed.

    Nodes are named only when the command worked on at least one node that proves the network
    works: not one of ``here`` (this node's names and addresses, where a launcher like mpirun
    starts its process without the network; pass none for a launcher that goes through a
    controller, as srun does). When it works on no such node, this node or the launcher is at
    fault (a supervisor on the node that was cut off reaches only itself), and none is named.
    ``stop()``: give up at once (the supervisor was signalled), naming none."""
    nodes = list(dict.fromkeys(nodes))
    if not nodes:
        return []

    def tried(node: str) -> Outcome:
        first = _ends_well(command(node), timeout, env, stop)
        if first is not Outcome.FAILED or stop():
            return first
        return _ends_well(command(node), timeout, env, stop)

    with ThreadPoolExecutor(max_workers=min(PROBES_AT_ONCE, len(nodes)), thread_name_prefix="hpcsync-probe") as pool:
        answers = dict(zip(nodes, pool.map(tried, nodes)))
    late = [n for n in nodes if answers[n] is Outcome.TIMED_OUT]
    states: Mapping[str, NodeState] = node_state(late) if late and node_state is not None and not stop() else {}
    failed = {n for n in nodes if answers[n] is Outcome.FAILED}
    failed |= {n for n in late if states.get(n) is NodeState.DOWN}
    if 2 * len(late) <= len(nodes):
        budget = time.monotonic() + retry_budget
        for node in late:
            if node in failed:
                continue
            left = budget - time.monotonic()
            if stop() or left <= 0:
                break
            again = _ends_well(command(node), min(retry_timeout, left), env, stop)
            answers[node] = again
            if again is Outcome.FAILED or (again is Outcome.TIMED_OUT and states.get(node) is not NodeState.UP):
                failed.add(node)
    local = {short_name(h) for h in here} | set(here)
    proven = any(ok is Outcome.PASSED for n, ok in answers.items() if n not in local and short_name(n) not in local)
    return [n for n in nodes if n in failed] if proven and not stop() else []

