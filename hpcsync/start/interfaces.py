"""Each rank's own interface for gloo and NCCL, and the proof that every node reaches every other.

Interface names differ between nodes on real clusters (``eno1`` and ``ib0`` on a head node,
``enp65s0f0`` and ``enp1s0`` on two generations of compute nodes), so rank 0's interface name
means nothing on another node. Each rank asks its own kernel for the route to the proven master
address and takes the interface that holds the source address of that route
(:func:`own_link`); ``HPCSYNC_IFNAME`` (NCCL's syntax: prefixes, ``=exact``, ``^exclude``) limits
the choice per node, and a ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` the user set still wins.

Gloo and NCCL connect every pair of ranks, not only rank 0 to the rest. :func:`prove_peers`
checks what they will use before handing over: one rank per node listens on its node's address
and connects to every other node's (non-blocking, at most 256 connections in flight per node,
``HPCSYNC_CONNECT_TIMEOUT`` each), and an unreachable pair is the same :class:`AddressError` on
every rank, naming both nodes, their interfaces and the error, instead of a store timeout.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..core import settings
from ..core.errors import AddressError
from .network import (Acceptor, Interface, RouteFn, ifname_matches, kernel_route_source, local_interfaces,
                      open_listener, reach_all, usable)

__all__ = ["BACKEND_VARS", "NodeLink", "own_link", "export", "prove_peers", "names_differ"]

# The variable each backend reads, and which of them hpcsync sets for a rank.
BACKEND_VARS = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}


@dataclass(frozen=True)
class NodeLink:
    """The interface and address one node's ranks give gloo / NCCL, and why that one."""

    node: int
    hostname: str
    ifname: Optional[str]
    address: Optional[str]
    reason: str

    def __str__(self) -> str:
        return f"{self.ifname or '?'} {self.address or '(no address)'} ({self.reason})"


def _first_address(ifaces: Sequence[Interface], name: str, family: int) -> Optional[str]:
    """The address gloo binds for interface ``name``: its first one of the master's family."""
    for i in ifaces:
        if i.name == name and i.ip.version == family:
            return i.address
    return None


def own_link(master: str, backend: str = "gloo", ifaces: Optional[Sequence[Interface]] = None,
             route: RouteFn = kernel_route_source, env: Optional[Dict[str, str]] = None,
             node: int = 0, hostname: str = "") -> NodeLink:
    """This rank's interface for ``backend``, toward the proven ``master`` address.

    In order: the backend's own variable, set by the user (``GLOO_SOCKET_IFNAME`` /
    ``NCCL_SOCKET_IFNAME``: that interface, or an error naming what this node has); the interface
    holding the source address of this kernel's route to ``master``, if ``HPCSYNC_IFNAME``
    allows it; the first usable interface ``HPCSYNC_IFNAME`` matches. Raises
    :class:`AddressError` when ``HPCSYNC_IFNAME`` matches nothing here.
    """
    env = os.environ if env is None else env
    ifaces = local_interfaces() if ifaces is None else ifaces
    family = 6 if ":" in master else 4
    up = [i for i in ifaces if i.up]
    have = ", ".join(sorted({i.name for i in up})) or "none"
    var = BACKEND_VARS.get(backend, "GLOO_SOCKET_IFNAME")
    user = env.get(var)
    if user:
        if var == "GLOO_SOCKET_IFNAME":  # gloo: exact names, comma-separated, every one must exist
            wanted = [n.strip() for n in user.split(",") if n.strip()]
            missing = [n for n in wanted if n not in {i.name for i in up}]
            names = [] if missing else wanted
        else:  # NCCL: its own rules (prefixes, =exact, ^exclude)
            names = [i.name for i in up if ifname_matches(user, i.name)]
        if not names:
            raise AddressError(f"{var}={user!r} (set by the user) matches no interface that is up on node "
                               f"{node} ({hostname}); it has: {have}"
                               + (" (gloo takes exact names, not NCCL's prefixes)" if var.startswith("GLOO") else ""))
        return NodeLink(node, hostname, names[0], _first_address(up, names[0], family), f"{var}={user}, set by the user")
    spec = settings.text("HPCSYNC_IFNAME") if env is os.environ else env.get("HPCSYNC_IFNAME")
    src = route(master)
    via = next((i for i in up if src and i.address.split("%")[0] == src), None)
    if via is not None and (not spec or ifname_matches(spec, via.name)):
        return NodeLink(node, hostname, via.name, _first_address(up, via.name, family) or via.address,
                        "this node's route to the master" + (f", HPCSYNC_IFNAME={spec}" if spec else ""))
    if spec:
        usable_here = [i for i in up if usable(i) and i.ip.version == family and ifname_matches(spec, i.name)]
        if not usable_here:
            raise AddressError(f"HPCSYNC_IFNAME={spec!r} matches no usable interface on node {node} ({hostname}); "
                               f"it has: {have}")
        best = sorted(usable_here, key=lambda i: i.is_virtual)[0]
        return NodeLink(node, hostname, best.name, best.address, f"HPCSYNC_IFNAME={spec}")
    if via is None:
        raise AddressError(f"node {node} ({hostname}) has no route to the master address {master} (source "
                           f"{src or 'none'}); set HPCSYNC_IFNAME; it has: {have}")
    return NodeLink(node, hostname, via.name, via.address, "this node's route to the master")


def export(link: NodeLink, backend: str, env: Optional[Dict[str, str]] = None) -> Optional[str]:
    """Set this rank's ``GLOO_SOCKET_IFNAME`` (``eth1``) / ``NCCL_SOCKET_IFNAME`` (``=eth1``: NCCL
    reads a bare name as a prefix) to its own interface unless the user set it; returns the
    variable set, or None."""
    env = os.environ if env is None else env
    set_var = None
    for var in BACKEND_VARS.values():
        if link.ifname and var not in env:
            # NCCL reads a bare name as a prefix (eth1 would match eth10 too): "=" makes it exact
            env[var] = f"={link.ifname}" if var == "NCCL_SOCKET_IFNAME" else link.ifname
            set_var = set_var or var
    return set_var


def prove_peers(comm: Any, topo: Any, link: NodeLink, backend: str, timeout: Optional[float] = None) -> List[NodeLink]:
    """Collective: every node's ``link`` reached from every other node, or the same
    :class:`AddressError` on every rank. Returns every node's link (index: node rank). ``comm``:
    a bounded one (:func:`hpcsync.core.bounded.control`), so a rank that fails before an exchange
    leaves the others a timeout, not a hang."""
    timeout = settings.number("HPCSYNC_CONNECT_TIMEOUT") if timeout is None else timeout
    leader = topo.local_rank == 0
    listener, port, err = (None, 0, None)
    acceptor = None
    if leader and link.address:
        listener, port, err = open_listener(link.address, backlog=min(4096, max(128, topo.num_nodes + 16)))
        if listener is not None:
            acceptor = Acceptor([listener])
    elif leader:
        err = "no address on that interface"
    table = comm.allgather((link, port, err) if leader else None)
    nodes: Dict[int, Tuple[NodeLink, int, Optional[str]]] = {t[0].node: t for t in table if t is not None}
    errors: List[Tuple[int, int, str]] = []
    try:
        if leader:
            others = [n for n in sorted(nodes) if n != topo.node_rank]
            targets = [(nodes[n][0].address or "", nodes[n][1]) for n in others]
            try:
                reached = reach_all(targets, timeout)
            except Exception as exc:  # this node's failure is an error of its pairs, never a missing rank
                reached = [f"the connection test failed on this node: {type(exc).__name__}: {exc}"] * len(targets)
            for n, res in zip(others, reached):
                if res is not None:
                    errors.append((topo.node_rank, n, nodes[n][2] or res))
        every = comm.allgather(errors if leader else [])
    finally:
        if acceptor is not None:
            acceptor.close()
        if listener is not None:
            listener.close()
    failed = sorted(e for errs in every for e in errs)
    links = [nodes[n][0] for n in sorted(nodes)]
    if failed:
        raise AddressError(_peer_message(failed, links, backend, timeout))
    return links


def _peer_message(failed: List[Tuple[int, int, str]], links: List[NodeLink], backend: str, timeout: float) -> str:
    """One text for every rank: the pairs that failed (the first 12), then every node's link."""
    by_node = {lk.node: lk for lk in links}

    def name(n: int) -> str:
        lk = by_node[n]
        return f"node {n} ({lk.hostname}, {lk.ifname or '?'} {lk.address or '?'})"

    lines = [f"{backend} connects every pair of ranks, but {len(failed)} node pair(s) could not connect to the "
             f"address the other advertises (TCP, {timeout:g} s each):"]
    lines += [f"  {name(a)} -> {name(b)}: {why}" for a, b, why in failed[:12]]
    if len(failed) > 12:
        lines.append(f"  ... and {len(failed) - 12} more")
    lines.append("Each node's interface:")
    lines += [f"  node {lk.node} {lk.hostname}: {lk}" for lk in links]
    lines.append("Fix the routes or firewall between those nodes, name the right interface per node with "
                 "HPCSYNC_IFNAME (NCCL's syntax: eth,ib or ^docker), or use backend='hpcsync' (needs no address).")
    return "\n".join(lines)


def names_differ(links: Sequence[NodeLink]) -> Optional[str]:
    """``eth0 on node(s) 0-1; eth1 on node(s) 2`` when the nodes use differently named interfaces."""
    groups: Dict[str, List[int]] = {}
    for lk in links:
        groups.setdefault(lk.ifname or "?", []).append(lk.node)
    if len(groups) < 2:
        return None
    from ..core.nodemap import ranges

    return "; ".join(f"{n} on node(s) {ranges(ns)}" for n, ns in sorted(groups.items(), key=lambda kv: kv[1][0]))
