"""Asking each node whether the launcher can still run a process on it: the last evidence
``hpcsync run`` takes before relaunching a failed step on the same nodes. When nothing else names
a node (records nobody can believe, a launcher that could not start its daemons and did not say
where, a launcher that hung), a one-process step on each node (``true``), started the way the
relaunch would start, tells the nodes it cannot use from the ones it can."""
from __future__ import annotations

import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence

PROBE_TIMEOUT_S = 30.0  #: one probe's bound: a launcher waiting on a node it cannot reach
PROBES_AT_ONCE = 32  #: probes in flight together (each one a launcher process on this node)


def _ends_well(cmd: Sequence[str], timeout: float, env: Optional[Dict[str, str]]) -> bool:
    """Whether ``cmd`` exits 0 within ``timeout``; a probe past it is ended with everything it
    started here (its own session)."""
    try:
        proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    except OSError:
        return False
    try:
        return proc.wait(timeout=timeout) == 0
    except subprocess.TimeoutExpired:
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
        return False


def unreachable(nodes: Sequence[str], command: Callable[[str], List[str]], timeout: float = PROBE_TIMEOUT_S,
                env: Optional[Dict[str, str]] = None) -> List[str]:
    """The ``nodes`` on which ``command(node)`` (a one-process step) fails twice, each try within
    ``timeout`` seconds, :data:`PROBES_AT_ONCE` at a time -- but only when it works on at least one
    node: when it works nowhere, the launcher or this node is at fault, not the nodes, and none is
    named. Wall time: about ``ceil(len(nodes) / PROBES_AT_ONCE)`` starts of the launcher, twice
    ``timeout`` at most for each round."""
    nodes = list(dict.fromkeys(nodes))
    if not nodes:
        return []

    def works(node: str) -> bool:
        return _ends_well(command(node), timeout, env) or _ends_well(command(node), timeout, env)

    with ThreadPoolExecutor(max_workers=min(PROBES_AT_ONCE, len(nodes)), thread_name_prefix="hpcsync-probe") as pool:
        answers = dict(zip(nodes, pool.map(works, nodes)))
    failing = [n for n in nodes if not answers[n]]
    return failing if len(failing) < len(nodes) else []
