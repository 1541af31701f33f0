"""Master-address choice on synthetic clusters (pure logic), and on this machine."""
import pytest

from hpcsync.core.errors import AddressError
from hpcsync.start.network import (Interface, NodeInterfaces, choose_master, hostname_addresses, kernel_route_source,
                             local_interfaces, master_candidates)


def node(host, *ifaces):
    return NodeInterfaces(host, tuple(Interface(*i) for i in ifaces))


LO = ("lo", "127.0.0.1", "255.0.0.0")
DOCKER = ("docker0", "172.17.0.1", "255.255.0.0")


def cluster(n=3):
    return [node(f"cn{i}", LO, ("eno1", f"192.168.5.{10 + i}", "255.255.255.0"),
                 ("ib0", f"10.20.0.{10 + i}", "255.255.0.0"), DOCKER,
                 ("eno2", f"169.254.3.{i + 1}", "255.255.0.0")) for i in range(n)]


def test_single_node_uses_loopback():
    c = choose_master(cluster(1))
    assert (c.address, c.ifname) == ("127.0.0.1", "lo")


def test_multi_node_takes_first_shared_physical_subnet():
    c = choose_master(cluster(3))
    assert (c.address, c.ifname) == ("192.168.5.10", "eno1")


def test_hostname_resolving_to_127_0_1_1_is_ignored():
    """Debian maps the hostname to 127.0.1.1: the choice comes from interfaces, never the hostname."""
    nodes = [node("cn0", LO, ("lo", "127.0.1.1", "255.0.0.0"), ("eth0", "10.1.2.3", "255.255.255.0")),
             node("cn1", LO, ("eth0", "10.1.2.4", "255.255.255.0"))]
    assert choose_master(nodes).address == "10.1.2.3"


def test_bridge_only_as_last_resort_link_local_never():
    # eno1 not shared (other node is on another subnet) -> ib0 wins over docker0 / link-local
    nodes = cluster(2)
    nodes[1] = node("cn1", LO, ("eno1", "192.168.9.11", "255.255.255.0"), ("ib0", "10.20.0.11", "255.255.0.0"),
                    DOCKER, ("eno2", "169.254.3.2", "255.255.0.0"))
    assert choose_master(nodes).ifname == "ib0"
    # a real bridge spanning nodes (distinct addresses) is usable when nothing else is shared
    nodes = [node("a", LO, DOCKER, ("eno2", "169.254.3.1", "255.255.0.0")),
             node("b", LO, ("docker0", "172.17.0.2", "255.255.0.0"), ("eno2", "169.254.3.2", "255.255.0.0"))]
    assert choose_master(nodes).ifname == "docker0"
    # link-local is never chosen, even when it is all that is shared
    nodes = [node("a", LO, ("eno2", "169.254.3.1", "255.255.0.0"), ("eth0", "fe80::1", "ffff:ffff:ffff:ffff::")),
             node("b", LO, ("eno2", "169.254.3.2", "255.255.0.0"), ("eth0", "fe80::2", "ffff:ffff:ffff:ffff::"))]
    with pytest.raises(AddressError):
        choose_master(nodes)


def racks(docker=True):
    """Two routed racks (10.81/24, 10.82/24), docker0 = 172.17.0.1 and hostname -> 127.0.1.1 on every node."""
    def rack_node(i):
        ifaces = [LO, ("lo", "127.0.1.1", "255.0.0.0"), (f"eth{i}", f"10.8{i + 1}.0.2", "255.255.255.0"),
                  (f"eth{i}", f"fe80::{i + 1}%eth{i}", "ffff:ffff:ffff:ffff::")]
        return node(f"n{i}", *ifaces, *([DOCKER] if docker else []))
    return [rack_node(0), rack_node(1)]


def kernel_of_n0(dest):
    """What rank 0's kernel answers for `ip route get dest`: everything off-box goes out of eth0."""
    return {"10.82.0.2": "10.81.0.2", "172.17.0.1": "172.17.0.1"}.get(dest.split("%")[0])


def test_routed_racks_use_the_kernel_route_never_the_shared_bridge():
    c = choose_master(racks(), route=kernel_of_n0)
    assert (c.address, c.ifname) == ("10.81.0.2", "eth0")
    assert c.reason.startswith("routed")
    # without routing information the rack address is still the one candidate, left to the connect
    # proof; the duplicated bridge never is one
    cands = master_candidates(racks())
    assert [c.address for c in cands] == ["10.81.0.2"] and "connect proof" in cands[0].reason


def test_ifname_skips_ipv6_link_local():
    c = choose_master(racks(), ifname="eth0", route=kernel_of_n0)
    assert c.address == "10.81.0.2"
    assert all("fe80" not in m.address for m in master_candidates(racks(), ifname="eth0", route=kernel_of_n0))


def test_duplicate_addresses_are_never_candidates():
    # docker0 = 172.17.0.1/16 on every node looks "shared" by subnet but is node-local
    nodes = cluster(3)
    assert all(m.ifname != "docker0" for m in master_candidates(nodes, route=lambda d: "172.17.0.1"))
    # the same duplicate on a bridged cluster network still leaves the real subnet first
    assert [m.ifname for m in master_candidates(nodes)] == ["eno1", "ib0"]
    # only the bridge is shared: never 172.17.0.1; the unshared eth0 is left to the connect proof
    only_bridge = [node(f"n{i}", LO, DOCKER, ("eth0", f"10.9{i}.0.2", "255.255.255.0")) for i in range(2)]
    assert [m.address for m in master_candidates(only_bridge)] == ["10.90.0.2"]
    # nothing but the bridge on rank 0's node: an error that names it
    bridge_only = [node(f"n{i}", LO, DOCKER) for i in range(2)]
    with pytest.raises(AddressError, match="node-local bridges: 172.17.0.1"):
        choose_master(bridge_only)


def test_route_source_must_be_a_unique_own_address():
    # the kernel would use docker0 (a duplicate) or an address of another node: neither becomes a
    # candidate nor makes the rack address "routed"
    for route in (lambda d: "172.17.0.1", lambda d: "10.82.0.2"):
        cands = master_candidates(racks(), route=route)
        assert [c.address for c in cands] == ["10.81.0.2"] and not cands[0].reason.startswith("routed")


def test_kernel_route_source_on_this_machine():
    assert kernel_route_source("127.0.0.1") == "127.0.0.1"


def test_down_interfaces_and_ipv6():
    nodes = [node("a", LO, ("eth0", "10.0.0.1", "255.255.255.0", False), ("eth1", "fd00::1", "ffff:ffff:ffff:ffff::")),
             node("b", LO, ("eth0", "10.0.0.2", "255.255.255.0"), ("eth1", "fd00::2", "ffff:ffff:ffff:ffff::"))]
    c = choose_master(nodes)
    assert (c.address, c.ifname) == ("fd00::1", "eth1")


def test_no_candidate_lists_every_node():
    nodes = [node("a", LO, ("eth0", "fe80::1", "ffff:ffff:ffff:ffff::")), node("b", LO, ("eth0", "10.9.0.1", "255.255.255.0"))]
    with pytest.raises(AddressError) as err:
        choose_master(nodes)
    msg = str(err.value)
    assert "a: lo=127.0.0.1/8, eth0=fe80::1/64" in msg and "b: lo=127.0.0.1/8, eth0=10.9.0.1/24" in msg
    assert "HPCSYNC_MASTER_ADDR" in msg
    # no shared subnet, no route: still a candidate, which the connect proof accepts or refuses
    nodes = [node("a", LO, ("eth0", "10.0.0.1", "255.255.255.0")), node("b", LO, ("eth0", "10.9.0.1", "255.255.255.0"))]
    assert [c.address for c in master_candidates(nodes)] == ["10.0.0.1"]


def test_dual_homed_rank0_offers_both_networks():
    """Rank 0 on two cluster networks, every other node on one of them, routes between: no address
    is shared with all or routed to all, yet both are candidates (the proof then finds one)."""
    nodes = [node("n0", LO, ("eth0", "10.91.0.2", "255.255.255.0"), ("eth1", "10.92.0.2", "255.255.255.0"), DOCKER),
             node("n1", LO, ("eth0", "10.91.0.3", "255.255.255.0"), DOCKER),
             node("n2", LO, ("eth0", "10.92.0.3", "255.255.255.0"), DOCKER),
             node("n3", LO, ("eth0", "10.92.0.4", "255.255.255.0"), DOCKER)]
    route = {"10.91.0.3": "10.91.0.2", "10.92.0.3": "10.92.0.2", "10.92.0.4": "10.92.0.2"}.get
    cands = master_candidates(nodes, route=route)
    assert [c.address for c in cands] == ["10.92.0.2", "10.91.0.2"]  # the one reaching more nodes first
    assert all("of 3 other node(s)" in c.reason for c in cands)


def test_overrides():
    nodes = cluster(3)
    assert choose_master(nodes, ifname="ib0").address == "10.20.0.10"
    c = choose_master(nodes, address="10.20.0.10")
    assert (c.address, c.ifname, c.reason) == ("10.20.0.10", "ib0", "HPCSYNC_MASTER_ADDR")
    with pytest.raises(AddressError, match="no such interface"):
        choose_master(nodes, ifname="hsn0")
    assert choose_master(cluster(1), ifname="ib0").address == "10.20.0.10"


def test_this_machine_has_loopback():
    ifaces = local_interfaces()
    assert any(i.is_loopback and i.address == "127.0.0.1" for i in ifaces)
    assert isinstance(hostname_addresses(), list)


def test_connect_proof_survives_a_small_accept_queue():
    """net.core.somaxconn caps the accept queue (128 before Linux 5.4). In a namespace capped at 16,
    200 leaders connecting at once: without accepting, the connections past the cap time out;
    with the proof's acceptor thread, every one is reached within the bound."""
    import json
    import os
    import subprocess
    import uuid

    from launch import PROGRAMS, PY

    if os.geteuid() != 0:
        pytest.fail("needs root (a network namespace), as CI has")
    ns = f"hq{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.core.somaxconn=16"], check=True)

        def reached(mode):
            p = subprocess.run(["ip", "netns", "exec", ns, PY, str(PROGRAMS / "accept_queue.py"), "200", mode, "3"],
                               capture_output=True, text=True, timeout=60)
            assert p.returncode == 0, p.stderr
            return json.loads(p.stdout)["reached"]

        assert reached("noaccept") < 100  # the failure is real here
        assert reached("accept") == 200
    finally:
        subprocess.run(["ip", "netns", "del", ns])


# -- each node's own interface (hpcsync.start.interfaces), on synthetic nodes -------------------------

def test_interface_specs_follow_nccls_rules():
    from hpcsync.start.network import ifname_matches

    assert ifname_matches("eth", "eth1") and ifname_matches("eth,ib", "ib0") and not ifname_matches("eth", "ib0")
    assert ifname_matches("=eth0", "eth0") and not ifname_matches("=eth0", "eth01")
    assert not ifname_matches("^docker,lo", "docker0") and ifname_matches("^docker,lo", "enp1s0")
    assert not ifname_matches("^=eth0", "eth0") and ifname_matches("^=eth0", "eth01")


SPLIT = {  # the kernel of each node: the source address of its route to the master 10.93.0.10
    "head": ((LO, ("eth0", "10.93.0.10", "255.255.255.0"), ("eth1", "10.94.0.10", "255.255.255.0"), DOCKER), "10.93.0.10"),
    "cn1": ((LO, ("eth0", "10.93.0.11", "255.255.255.0"), DOCKER), "10.93.0.11"),
    "cn2": ((LO, ("eth1", "10.94.0.12", "255.255.255.0"), DOCKER), "10.94.0.12"),
}


def link_of(host, env=None, backend="gloo"):
    from hpcsync.start.interfaces import own_link

    ifaces, src = SPLIT[host]
    return own_link("10.93.0.10", backend, tuple(Interface(*i) for i in ifaces), route=lambda _dest: src,
                    env=env or {}, hostname=host)


def test_each_node_takes_the_interface_of_its_own_route_to_the_master():
    """The layout that made gloo wait for its store: rank 0's eth0 exported everywhere, node 2
    has only eth1. Each node names its own."""
    assert [(link_of(h).ifname, link_of(h).address) for h in SPLIT] == [
        ("eth0", "10.93.0.10"), ("eth0", "10.93.0.11"), ("eth1", "10.94.0.12")]
    assert "route to the master" in link_of("cn2").reason


def test_the_users_interface_variables_win_and_fail_clearly():
    link = link_of("cn1", env={"GLOO_SOCKET_IFNAME": "docker0"})
    assert (link.ifname, link.address) == ("docker0", "172.17.0.1") and "set by the user" in link.reason
    assert link_of("cn1", env={"NCCL_SOCKET_IFNAME": "eth"}, backend="nccl").ifname == "eth0"
    with pytest.raises(AddressError, match=r"GLOO_SOCKET_IFNAME='ib0' \(set by the user\) matches no interface"
                                           r" that is up on node 0 \(cn2\); it has: docker0, eth1, lo"):
        link_of("cn2", env={"GLOO_SOCKET_IFNAME": "ib0"})


def test_gloo_takes_exact_names_and_nccl_gets_an_exact_spec():
    """gloo reads GLOO_SOCKET_IFNAME as exact names (NCCL's prefix "eth" names nothing to gloo);
    hpcsync exports NCCL_SOCKET_IFNAME=eth1 as "=eth1" (a bare eth1 would match eth10 too)."""
    from hpcsync.start.interfaces import NodeLink, export

    with pytest.raises(AddressError, match=r"GLOO_SOCKET_IFNAME='eth' .*gloo takes exact names"):
        link_of("cn1", env={"GLOO_SOCKET_IFNAME": "eth"})
    with pytest.raises(AddressError, match=r"GLOO_SOCKET_IFNAME='eth0,ib0'"):
        link_of("cn1", env={"GLOO_SOCKET_IFNAME": "eth0,ib0"})  # every listed one must exist
    assert link_of("head", env={"GLOO_SOCKET_IFNAME": "eth1,eth0"}).ifname == "eth1"
    env = {}
    export(NodeLink(0, "cn", "eth1", "10.0.0.1", "test"), "gloo", env)
    assert env == {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "=eth1"}


def test_hpcsync_ifname_names_an_interface_per_node():
    """HPCSYNC_IFNAME=eth1,eth0 (a list): node 1 has only eth0, node 2 only eth1: each its own."""
    assert [link_of(h, env={"HPCSYNC_IFNAME": "eth1,eth0"}).ifname for h in SPLIT] == ["eth0", "eth0", "eth1"]
    # a spec that excludes the route's interface: the first usable one it allows
    assert link_of("head", env={"HPCSYNC_IFNAME": "=eth1"}).ifname == "eth1"
    with pytest.raises(AddressError, match=r"HPCSYNC_IFNAME='ib' matches no usable interface on node 0 \(cn1\)"):
        link_of("cn1", env={"HPCSYNC_IFNAME": "ib"})


def test_names_that_differ_between_nodes_are_named():
    from dataclasses import replace

    from hpcsync.start.interfaces import names_differ

    links = [replace(link_of(h), node=k) for k, h in enumerate(SPLIT)]
    assert names_differ(links) == "eth0 on node(s) 0-1; eth1 on node(s) 2"
    assert names_differ(links[:2]) is None


@pytest.mark.alone  # a bound of wall time
def test_reach_all_answers_for_every_target_within_its_bound():
    import socket
    import time

    from hpcsync.start.network import reach_all

    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen(8)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: refused
    targets = [("127.0.0.1", listening.getsockname()[1]), ("127.0.0.1", closed.getsockname()[1]), ("127.0.0.1", 0)]
    t0 = time.monotonic()
    got = reach_all(targets * 3, timeout=2.0, window=2)  # more targets than the window
    assert time.monotonic() - t0 < 2.0
    assert got[0::3] == [None] * 3 and all("refused" in g for g in got[1::3]) and got[2::3] == ["not listening"] * 3
    listening.close()
    closed.close()
