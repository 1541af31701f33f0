"""Choosing a master address that every node can reach.

Hostnames on compute nodes often resolve to 127.0.1.1 or to a management network the job cannot
use, so hpcsync never trusts the hostname: every node reports its interfaces (address + netmask)
and every address of rank 0's node that another node could connect to is a candidate, best
first: one that shares a subnet with every other node, then, on routed networks, the source
address rank 0's kernel uses to reach them, then the rest (a dual-homed rank 0 whose other nodes
each sit on one of its networks, with routes between). Addresses seen on several nodes (docker0 =
172.17.0.1 everywhere) are node-local bridges and never candidates. The ranking is a pure function
of those tables (and a routing function) so it can be tested on synthetic clusters;
:func:`hpcsync.start.bootstrap.master_address` then proves the candidates with a TCP connect from every
node, and the first that every node reached wins.
"""
from __future__ import annotations

import ipaddress
import os
import re
import selectors
import socket
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from ..core.errors import AddressError

__all__ = [
    "Interface", "NodeInterfaces", "MasterChoice", "local_interfaces", "hostname_addresses", "usable",
    "duplicated_addresses", "RouteFn", "kernel_route_source", "ifname_matches", "master_candidates",
    "choose_master", "describe_nodes", "open_listener", "Acceptor", "reach_all", "try_connect"
]

# Virtual / container interfaces: usable only when nothing better exists.
_VIRTUAL = re.compile(r"^(docker|br-|virbr|veth|cni|flannel|cali|vxlan|weave|lxc|lxd|podman|tun|tap|kube|cilium)")


@dataclass(frozen=True)
class Interface:
    """One address of one network interface."""

    name: str
    address: str
    netmask: Optional[str] = None
    up: bool = True

    @property
    def ip(self) -> "ipaddress.IPv4Address | ipaddress.IPv6Address":
        return ipaddress.ip_address(self.address.split("%")[0])

    @property
    def network(self) -> "ipaddress.IPv4Network | ipaddress.IPv6Network":
        mask = self.netmask or ("255.255.255.255" if self.ip.version == 4 else "128")
        if self.ip.version == 6 and ":" in mask:  # psutil gives v6 masks as ffff:ffff::
            mask = str(bin(int(ipaddress.IPv6Address(mask))).count("1"))
        return ipaddress.ip_interface(f"{self.address.split('%')[0]}/{mask}").network

    @property
    def is_loopback(self) -> bool:
        return self.ip.is_loopback

    @property
    def is_link_local(self) -> bool:
        return self.ip.is_link_local

    @property
    def is_virtual(self) -> bool:
        return bool(_VIRTUAL.match(self.name))

    def __str__(self) -> str:
        mask = f"/{self.network.prefixlen}" if self.netmask else ""
        return f"{self.name}={self.address}{mask}{'' if self.up else '(down)'}"


@dataclass(frozen=True)
class NodeInterfaces:
    """The interfaces of one node, as its node leader reported them."""

    hostname: str
    interfaces: Tuple[Interface, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class MasterChoice:
    address: str
    ifname: Optional[str]
    reason: str


def local_interfaces() -> Tuple[Interface, ...]:
    """IPv4 and IPv6 addresses of this host's interfaces (via psutil)."""
    import psutil

    stats = psutil.net_if_stats()
    out: List[Interface] = []
    for name, addrs in psutil.net_if_addrs().items():
        up = stats[name].isup if name in stats else True
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6) and a.address:
                out.append(Interface(name, a.address, a.netmask, up))
    return tuple(out)


def hostname_addresses(hostname: Optional[str] = None) -> List[str]:
    """What the hostname resolves to here (often 127.0.1.1 on Debian: not routable)."""
    try:
        infos = socket.getaddrinfo(hostname or socket.gethostname(), None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return []
    return sorted({i[4][0] for i in infos})


def usable(iface: Interface) -> bool:
    """Up, not loopback, not link-local: an address another node could connect to."""
    return iface.up and not iface.is_loopback and not iface.is_link_local


def duplicated_addresses(nodes: Sequence[NodeInterfaces]) -> Set[str]:
    """Addresses found on more than one node: node-local bridges such as docker0 = 172.17.0.1."""
    seen: Dict[str, int] = {}
    for n, node in enumerate(nodes):
        for i in node.interfaces:
            if i.is_loopback or i.is_link_local:
                continue
            addr = i.address.split("%")[0]
            if seen.setdefault(addr, n) != n:
                seen[addr] = -1
    return {a for a, n in seen.items() if n == -1}


def _reaches(cand: Interface, other: Interface) -> bool:
    if cand.ip.version != other.ip.version:
        return False
    return other.ip in cand.network and cand.ip in other.network


def _rank(iface: Interface) -> Tuple[int, int]:
    return (1 if iface.is_virtual else 0, 0 if iface.ip.version == 4 else 1)


RouteFn = Callable[[str], Optional[str]]


def kernel_route_source(dest: str) -> Optional[str]:
    """The source address this host's kernel would use to reach ``dest`` (``ip route get``).

    A UDP ``connect`` only consults the routing table: no packet is sent.
    """
    family = socket.AF_INET6 if ":" in dest else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((dest.split("%")[0], 9))
            return str(s.getsockname()[0]).split("%")[0]
    except OSError:
        return None


def ifname_matches(spec: str, name: str) -> bool:
    """Whether interface ``name`` matches ``spec``, by NCCL_SOCKET_IFNAME's rules: a comma-separated
    list of name prefixes; ``=`` first: exact names; ``^`` first: every interface but those
    (``^docker,lo``). ``eth,ib`` names a different interface on differently wired nodes."""
    spec = spec.strip()
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    items = [s.strip() for s in (spec[1:] if exact else spec).split(",") if s.strip()]
    hit = any(name == s if exact else name.startswith(s) for s in items)
    return not hit if exclude else hit


def master_candidates(
    nodes: Sequence[NodeInterfaces],
    ifname: Optional[str] = None,
    route: Optional[RouteFn] = None,
) -> List[MasterChoice]:
    """Every address of rank 0's node another node could connect to, best first (``nodes[0]`` is
    rank 0's node); the connect proof decides among them.

    Never an address that appears on several nodes (a node-local bridge), loopback, link-local
    or down. First the addresses on a subnet shared with every other node (physical before
    virtual, IPv4 before IPv6); then, for routed networks, the source address that rank 0's
    kernel (``route``, run on rank 0's node) uses to reach every other node's usable addresses;
    then the rest, those that reach most nodes by subnet or route first. ``ifname``
    (HPCSYNC_IFNAME, see :func:`ifname_matches`) limits the choice to those interfaces of rank 0. One node: loopback (or the
    named interface). Raises :class:`AddressError` listing every node's interfaces when rank 0's
    node has no candidate at all.
    """
    if not nodes:
        raise ValueError("need at least rank 0's node")
    own = [i for i in nodes[0].interfaces if i.up]
    if ifname:
        own = [i for i in own if ifname_matches(ifname, i.name)]
        if not own:
            raise AddressError(f"HPCSYNC_IFNAME={ifname!r}: rank 0's node {nodes[0].hostname} has no "
                               f"such interface that is up; it has: {_describe(nodes[0])}")
    if len(nodes) == 1:
        if ifname:
            best = sorted(own, key=lambda i: (i.is_link_local, i.ip.version))[0]
            return [MasterChoice(best.address, best.name, f"HPCSYNC_IFNAME={ifname}")]
        loop = sorted((i for i in own if i.is_loopback), key=lambda i: i.ip.version)
        if loop:
            return [MasterChoice(loop[0].address, loop[0].name, "single node: loopback")]
        return [MasterChoice("127.0.0.1", None, "single node: loopback")]
    dup = duplicated_addresses(nodes)

    def unique(i: Interface) -> bool:
        return usable(i) and i.address.split("%")[0] not in dup

    own = [i for i in own if unique(i)]
    others = [[i for i in node.interfaces if unique(i)] for node in nodes[1:]]
    names = ", ".join(n.hostname for n in nodes[1:4]) + (" ..." if len(nodes) > 4 else "")
    if not own:
        why = f" (addresses found on several nodes, i.e. node-local bridges: {', '.join(sorted(dup))})" if dup else ""
        raise AddressError(
            f"rank 0's node {nodes[0].hostname} has no address another node could connect to (only loopback, "
            f"link-local, down or duplicated ones{why}); set HPCSYNC_MASTER_ADDR (a routable address of rank 0's node) or "
            f"HPCSYNC_IFNAME. Interfaces per node:\n{describe_nodes(nodes)}"
        )
    # per candidate: the other nodes it shares a subnet with, and those rank 0's kernel reaches from it
    by_subnet = [{n for n, node in enumerate(others) if any(_reaches(c, o) for o in node)} for c in own]
    by_route: List[Set[int]] = [set() for _ in own]
    if route is not None:
        index = {c.address.split("%")[0]: k for k, c in enumerate(own)}
        for n, node in enumerate(others):
            for o in node:
                k = index.get(route(o.address) or "")
                if k is not None:
                    by_route[k].add(n)
    everyone = set(range(len(others)))
    out: List[Tuple[Tuple[int, int, Tuple[int, int]], MasterChoice]] = []
    for k, c in enumerate(own):
        if by_subnet[k] == everyone:
            key, reason = (0, 0), f"{c.network} is shared with {names}"
        elif by_route[k] == everyone:
            key, reason = (1, 0), f"routed: rank 0's kernel reaches {names} from {c.name}"
        else:
            reached = len(by_subnet[k] | by_route[k])
            key, reason = (2, -reached), (f"reaches {reached} of {len(others)} other node(s) by subnet or route; "
                                          "left to the connect proof")
        out.append(((key[0], key[1], _rank(c)), MasterChoice(c.address, c.name, reason)))
    return [choice for _, choice in sorted(out, key=lambda item: item[0])]


def choose_master(
    nodes: Sequence[NodeInterfaces],
    ifname: Optional[str] = None,
    address: Optional[str] = None,
    route: Optional[RouteFn] = None,
) -> MasterChoice:
    """The best of :func:`master_candidates`; ``address`` (HPCSYNC_MASTER_ADDR) is taken as given."""
    if address:
        if not nodes:
            raise ValueError("need at least rank 0's node")
        match = next((i.name for i in nodes[0].interfaces if i.address.split("%")[0] == address), None)
        return MasterChoice(address, match, "HPCSYNC_MASTER_ADDR")
    return master_candidates(nodes, ifname, route)[0]


def describe_nodes(nodes: Sequence[NodeInterfaces]) -> str:
    return "\n".join(f"  node {n}: {node.hostname}: {_describe(node)}" for n, node in enumerate(nodes))


def _describe(node: NodeInterfaces) -> str:
    return ", ".join(str(i) for i in node.interfaces) or "(no interfaces)"


def open_listener(address: str, backlog: int = 128) -> Tuple[Optional[socket.socket], int, Optional[str]]:
    """Listen on ``address`` (any free port) for a reachability test: (socket, port, error).

    Nobody accepts: the kernel completes connections up to ``backlog``, which is all a test needs.
    """
    sock = None
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((address.split("%")[0], 0))
        sock.listen(backlog)
        return sock, sock.getsockname()[1], None
    except OSError as exc:
        if sock is not None:
            sock.close()
        return None, 0, f"cannot listen on {address}: {exc}"


class Acceptor:
    """Accepts and closes every connection to ``listeners`` on a thread until :meth:`close`.

    Without it the kernel's accept queue alone holds the connect proof's connections, and that
    queue is capped by ``net.core.somaxconn`` (128 before Linux 5.4): on a job of a few hundred
    nodes the connections past the cap are dropped and time out although the address works.
    """

    def __init__(self, listeners: Sequence[socket.socket]) -> None:
        self._selector = selectors.DefaultSelector()
        for sock in listeners:
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ)
        self._stop = threading.Event()
        self.accepted = 0
        self._thread = threading.Thread(target=self._run, name="hpcsync-accept", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.05):
                while True:
                    try:
                        conn, _ = key.fileobj.accept()  # type: ignore[union-attr]
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError:  # the listener was closed under us
                        break
                    conn.close()
                    self.accepted += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._selector.close()


def reach_all(targets: Sequence[Tuple[str, int]], timeout: float, window: int = 256) -> List[Optional[str]]:
    """Connect to every ``(address, port)``, at most ``window`` connections in flight at once (non-
    blocking, one selector, no thread per target); per target None (reached) or the error. Takes
    at most ``timeout`` per ``window`` targets, whatever the network does."""
    import errno
    import time

    results: List[Optional[str]] = ["not tried"] * len(targets)
    pending = list(range(len(targets)))[::-1]
    sel = selectors.DefaultSelector()
    try:
        while pending or sel.get_map():
            while pending and len(sel.get_map()) < window:
                k = pending.pop()
                addr, port = targets[k]
                if not port:
                    results[k] = "not listening"
                    continue
                try:  # socket() fails with EMFILE past the open-files limit; an address may not parse
                    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
                except OSError as exc:
                    results[k] = f"cannot open a socket to try {addr}:{port}: {exc.strerror or exc}"
                    continue
                try:
                    sock.setblocking(False)
                    code = sock.connect_ex((addr.split("%")[0], port))
                except OSError as exc:
                    code = exc.errno or errno.EINVAL
                if code not in (0, errno.EINPROGRESS):
                    results[k] = f"cannot connect to {addr}:{port}: {os.strerror(code)}"
                    sock.close()
                    continue
                sel.register(sock, selectors.EVENT_WRITE, (k, time.monotonic() + timeout))
            now = time.monotonic()
            for key, _ in sel.select(timeout=0.05):
                k, _until = key.data
                code = key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)  # type: ignore[union-attr]
                addr, port = targets[k]
                results[k] = None if code == 0 else f"cannot connect to {addr}:{port}: {os.strerror(code)}"
                sel.unregister(key.fileobj)
                key.fileobj.close()  # type: ignore[union-attr]
            for key in list(sel.get_map().values()):
                k, until = key.data
                if now > until:
                    addr, port = targets[k]
                    results[k] = f"cannot connect to {addr}:{port} within {timeout:g}s (no answer: filtered or unrouted)"
                    sel.unregister(key.fileobj)
                    key.fileobj.close()  # type: ignore[union-attr]
    finally:
        for key in list(sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        sel.close()
    return results


def try_connect(targets: Sequence[Tuple[str, int]], timeout: float) -> List[Optional[str]]:
    """Connect to every ``(address, port)`` at once; per target None (reached) or the error."""
    from concurrent.futures import ThreadPoolExecutor

    def one(target: Tuple[str, int]) -> Optional[str]:
        addr, port = target
        if not port:
            return "not listening"
        try:
            socket.create_connection((addr.split("%")[0], port), timeout=timeout).close()
            return None
        except OSError as exc:
            return f"cannot connect to {addr}:{port} within {timeout:g}s: {exc}"

    if not targets:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
        return list(pool.map(one, targets))
