"""Master-address choice on synthetic clusters (pure logic), and on this machine."""
import pytest

from hpcsync.errors import AddressError
from hpcsync.network import Interface, NodeInterfaces, choose_master, hostname_addresses, local_interfaces


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


def test_bridge_and_link_local_only_as_last_resort():
    # eno1 not shared (other node is on another subnet) -> ib0 wins over docker0 / link-local
    nodes = cluster(2)
    nodes[1] = node("cn1", LO, ("eno1", "192.168.9.11", "255.255.255.0"), ("ib0", "10.20.0.11", "255.255.0.0"),
                    DOCKER, ("eno2", "169.254.3.2", "255.255.0.0"))
    assert choose_master(nodes).ifname == "ib0"
    # only docker0 and link-local are shared: the bridge beats link-local
    nodes = [node("a", LO, DOCKER, ("eno2", "169.254.3.1", "255.255.0.0")),
             node("b", LO, ("docker0", "172.17.0.2", "255.255.0.0"), ("eno2", "169.254.3.2", "255.255.0.0"))]
    assert choose_master(nodes).ifname == "docker0"


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
