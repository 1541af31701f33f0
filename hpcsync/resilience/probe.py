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
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence

__all__ = ["PROBE_TIMEOUT_S", "PROBES_AT_ONCE", "unreachable"]

PROBE_TIMEOUT_S = 30.0  #: one probe's bound: a launcher waiting on a node it cannot reach
PROBES_AT_ONCE = 32  #: probes in flight together (each one a launcher process on this node)


def _ends_well(cmd: Sequence[str], timeout: float, env: Optional[Dict[str, str]],
               stop: Callable[[], bool]) -> bool:
    """Whether ``cmd`` exits 0 within ``timeout`` (and before ``stop()`` says to give up); a probe
    past it is ended with everything it started here (its own session): TERM, 5 s, KILL."""
    try:
        proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    except OSError:
        return False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop():
        try:
            return proc.wait(timeout=0.2) == 0
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
    return False


def unreachable(nodes: Sequence[str], command: Callable[[str], List[str]], timeout: float = PROBE_TIMEOUT_S,
                env: Optional[Dict[str, str]] = None, here: Sequence[str] = (),
                stop: Callable[[], bool] = lambda: False) -> List[str]:
    """The ``nodes`` on which ``command(node)`` (a one-process step) fails twice, each try within
    ``timeout`` seconds, :data:`PROBES_AT_ONCE` at a time -- but only when it works on at least one
    node that proves the network works: not one of ``here`` (this node's names, where a launcher
    like mpirun starts its process without the network; pass none for a launcher that goes
    through a controller, as srun does). When it works on no such node, this node or the launcher
    is at fault (a supervisor on the node that was cut off reaches only itself), and none is
    named. ``stop()``: give up at once (the supervisor was signalled), naming none. Wall time:
    about ``ceil(len(nodes) / PROBES_AT_ONCE)`` rounds, each at most twice ``timeout`` + 10 s."""
    nodes = list(dict.fromkeys(nodes))
    if not nodes:
        return []

    def works(node: str) -> bool:
        return _ends_well(command(node), timeout, env, stop) or (not stop() and _ends_well(command(node), timeout, env, stop))

    with ThreadPoolExecutor(max_workers=min(PROBES_AT_ONCE, len(nodes)), thread_name_prefix="hpcsync-probe") as pool:
        answers = dict(zip(nodes, pool.map(works, nodes)))
    local = {h.split(".")[0] for h in here}
    proven = any(ok for n, ok in answers.items() if n.split(".")[0] not in local)
    return [n for n in nodes if not answers[n]] if proven and not stop() else []
