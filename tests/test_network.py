"""Master-address choice on synthetic clusters (pure logic), and on this machine."""
import pytest

from hpcsync.errors import AddressError
from hpcsync.network import (Interface, NodeInterfaces, choose_master, hostname_addresses, kernel_route_source,
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
    # without routing information nothing qualifies, and the error names the duplicated bridge
    with pytest.raises(AddressError, match="172.17.0.1"):
        choose_master(racks())


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
    # only the bridge is shared: an error, not 172.17.0.1
    only_bridge = [node(f"n{i}", LO, DOCKER, ("eth0", f"10.9{i}.0.2", "255.255.255.0")) for i in range(2)]
    with pytest.raises(AddressError, match="node-local bridges: 172.17.0.1"):
        choose_master(only_bridge)


def test_route_source_must_be_a_unique_own_address():
    # the kernel would use docker0 (a duplicate) or an address of another node: not a candidate
    with pytest.raises(AddressError):
        choose_master(racks(), route=lambda d: "172.17.0.1")
    with pytest.raises(AddressError):
        choose_master(racks(), route=lambda d: "10.82.0.2")


def test_kernel_route_source_on_this_machine():
    assert kernel_route_source("127.0.0.1") == "127.0.0.1"


def test_down_interfaces_and_ipv6():
    nodes = [node("a", LO, ("eth0", "10.0.0.1", "255.255.255.0", False), ("eth1", "fd00::1", "ffff:ffff:ffff:ffff::")),
             node("b", LO, ("eth0", "10.0.0.2", "255.255.255.0"), ("eth1", "fd00::2", "ffff:ffff:ffff:ffff::"))]
    c = choose_master(nodes)
    assert (c.address, c.ifname) == ("fd00::1", "eth1")


def test_no_shared_subnet_lists_every_node():
    nodes = [node("a", LO, ("eth0", "10.0.0.1", "255.255.255.0")), node("b", LO, ("eth0", "10.9.0.1", "255.255.255.0"))]
    with pytest.raises(AddressError) as err:
        choose_master(nodes)
    msg = str(err.value)
    assert "a: lo=127.0.0.1/8, eth0=10.0.0.1/24" in msg and "b: lo=127.0.0.1/8, eth0=10.9.0.1/24" in msg
    assert "HPCSYNC_MASTER_ADDR" in msg


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
