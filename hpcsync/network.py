"""Choosing a master address that every node can reach.

Hostnames on compute nodes often resolve to 127.0.1.1 or to a management network the job cannot
use, so hpcsync never trusts the hostname: every node reports its interfaces (address + netmask)
and rank 0 picks one of its own addresses that shares a subnet with every other node. The choice
logic is a pure function of those tables so it can be tested on synthetic clusters.
"""
from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from .errors import AddressError

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


def _reaches(cand: Interface, other: Interface) -> bool:
    if cand.ip.version != other.ip.version or not other.up or other.is_loopback:
        return False
    return other.ip in cand.network and cand.ip in other.network


def _rank(iface: Interface) -> Tuple[int, int]:
    kind = 2 if iface.is_link_local else 1 if iface.is_virtual else 0
    return (kind, 0 if iface.ip.version == 4 else 1)


def choose_master(
    nodes: Sequence[NodeInterfaces],
    ifname: Optional[str] = None,
    address: Optional[str] = None,
) -> MasterChoice:
    """Pick rank 0's address that every node can reach. ``nodes[0]`` is rank 0's node.

    ``address`` (HPCSYNC_MASTER_ADDR) is taken as given; ``ifname`` (HPCSYNC_IFNAME) limits
    the choice to that interface of rank 0. One node: loopback (or the named interface).
    """
    if not nodes:
        raise ValueError("need at least rank 0's node")
    own = [i for i in nodes[0].interfaces if i.up]
    if address:
        match = next((i.name for i in own if i.address.split("%")[0] == address), None)
        return MasterChoice(address, match, "HPCSYNC_MASTER_ADDR")
    if ifname:
        own = [i for i in own if i.name == ifname]
        if not own:
            raise AddressError(f"HPCSYNC_IFNAME={ifname!r}: rank 0's node {nodes[0].hostname} has no "
                               f"such interface that is up; it has: {_describe(nodes[0])}")
    if len(nodes) == 1:
        if ifname:
            best = min(own, key=_rank)
            return MasterChoice(best.address, best.name, f"HPCSYNC_IFNAME={ifname}")
        loop = sorted((i for i in own if i.is_loopback), key=lambda i: i.ip.version)
        if loop:
            return MasterChoice(loop[0].address, loop[0].name, "single node: loopback")
        return MasterChoice("127.0.0.1", None, "single node: loopback")
    candidates = []
    for order, cand in enumerate(own):
        if cand.is_loopback:
            continue
        if all(any(_reaches(cand, o) for o in node.interfaces) for node in nodes[1:]):
            candidates.append((_rank(cand), order, cand))
    if not candidates:
        lines = "\n".join(f"  node {n}: {node.hostname}: {_describe(node)}" for n, node in enumerate(nodes))
        raise AddressError(
            "no address of rank 0's node shares a subnet with every other node; set "
            "HPCSYNC_MASTER_ADDR (a routable address of rank 0's node) or HPCSYNC_IFNAME. "
            f"Interfaces per node:\n{lines}"
        )
    best = min(candidates, key=lambda c: (c[0], c[1]))[2]
    others = ", ".join(n.hostname for n in nodes[1:4]) + (" ..." if len(nodes) > 4 else "")
    return MasterChoice(best.address, best.name, f"{best.network} is shared with {others}")


def _describe(node: NodeInterfaces) -> str:
    return ", ".join(str(i) for i in node.interfaces) or "(no interfaces)"
