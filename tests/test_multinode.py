"""Multi-node, for real: namespace nodes with their own hostnames and networks, MPI across them.

See ``tests/netns_cluster.py`` for the nodes. Bridged and routed cluster networks, both with a
docker0 = 172.17.0.1 on every node and hostnames that resolve to 127.0.1.1; block and
round-robin placement; Open MPI (mpirun + rsh agent) and MPICH (hydra + ssh launcher).
"""
import subprocess
import time

import pytest

from launch import LONG, PY, clean_env, run
from multinode_checks import check_multinode_job
from netns_cluster import BRIDGED, DUAL_HOMED, ROUTED, Cluster


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    made = {}

    def get(network, nodes=2):
        if (network, nodes) not in made:
            made[network, nodes] = Cluster(tmp_path_factory.mktemp("nodes"), nodes, network).start()
        return made[network, nodes]

    yield get
    for c in made.values():
        c.stop()


def expected_nodes(placement, n, nodes):
    """node of each rank: block fills node 0 first, round-robin deals ranks out like cards."""
    per = n // nodes
    return [r // per if placement == "block" else r % nodes for r in range(n)]


CASES = [  # network, launcher, placement, backend, nodes, ranks
    (BRIDGED, "openmpi", "round-robin", "hpcsync", 2, 4),
    (ROUTED, "mpich", "block", "gloo", 2, 4),
    (ROUTED, "openmpi", "round-robin", "gloo", 3, 3),  # one rank a node: the 3-node case at its cheapest
] + ([(ROUTED, "openmpi", "block", "hpcsync", 2, 4), (BRIDGED, "mpich", "round-robin", "hpcsync", 2, 4)]
     if LONG else [])


@pytest.mark.parametrize("network,launcher,placement,backend,nodes,n", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_job_across_nodes(clusters, network, launcher, placement, backend, nodes, n, tmp_path):
    cluster = clusters(network, nodes)
    lau = getattr(cluster, launcher)([n // nodes] * nodes, placement)
    work = tmp_path / "work"
    work.mkdir()
    res = run(lau, n, "multinode.py", backend, str(work), cluster.node_local, tmp_path=tmp_path, timeout=300)
    check_multinode_job(res, cluster, expected_nodes(placement, n, nodes), backend, launcher == "openmpi", work,
                        tmp_path)


def _cli(cluster, lau, n, *args, env=None, timeout=180):
    full = clean_env({**lau.env, **(env or {})})
    cmd = [*lau.command(n, full), PY, "-m", "hpcsync", *args]
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("network", [BRIDGED])
def test_doctor_and_info_across_nodes(clusters, network):
    cluster = clusters(network)
    lau = cluster.openmpi([2, 2], "round-robin")
    p = _cli(cluster, lau, 4, "doctor")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "FAIL" not in p.stdout
    assert f"master address  {cluster.address(0)} (eth0)" in p.stdout, p.stdout
    assert "every rank connected to" in p.stdout
    assert "warn  lost node" in p.stdout and "oob_tcp_keepalive_time 5" in p.stdout  # plain mpirun, 2 nodes
    # hostnames resolve to 127.0.1.1 on these nodes: the doctor says so, and it does not matter
    assert "127.0.1.1 (loopback)" in p.stdout
    # the node-local bridge would be wrong: forcing it makes the doctor fail reachability
    p = _cli(cluster, lau, 4, "doctor", env={"HPCSYNC_MASTER_ADDR": "172.17.0.1"})
    assert p.returncode == 1 and "FAIL  reachability" in p.stdout, p.stdout + p.stderr


def test_ifname_override_on_routed_racks_skips_link_local(clusters):
    cluster = clusters(ROUTED)
    p = _cli(cluster, cluster.openmpi([1, 1]), 2, "info", env={"HPCSYNC_IFNAME": "eth0"})
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"# master address: {cluster.address(0)} " in p.stdout, p.stdout
    assert "fe80" not in p.stdout


def test_unreachable_candidates_are_one_clear_error(clusters, tmp_path):
    """ib0 shares a subnet on paper but is dead; docker0 is node-local. Forced onto either, every
    rank raises the same AddressError, within the connect timeout, instead of hanging in gloo."""
    cluster = clusters(BRIDGED)
    lau = cluster.openmpi([1, 1])
    for ifname, says in (("ib0", "no candidate master address was reachable from every node"),
                         ("docker0", "node-local bridges: 172.17.0.1")):
        res = run(lau, 2, "address.py", "gloo", tmp_path=tmp_path, env={"HPCSYNC_IFNAME": ifname})
        errors = [d.get("error", "") for d in res.ranks]
        assert errors[0] == errors[1] and errors[0].startswith("AddressError") and says in errors[0], errors
        assert cluster.names[1] in errors[0]  # the error lists every node's interfaces
        assert max(d["seconds"] for d in res.ranks) < 20
    # left to itself, init skips the dead ib0 and lands on eth0
    res = run(lau, 2, "address.py", "gloo", tmp_path=tmp_path)
    assert [d.get("master") for d in res.ranks] == [cluster.address(0)] * 2, res.ranks


@pytest.mark.parametrize("launcher", ["openmpi", "mpich"])
def test_rank_raising_on_second_node_ends_the_job(clusters, launcher, tmp_path):
    cluster = clusters(BRIDGED)
    lau = getattr(cluster, launcher)([1, 1])  # rank 1 is alone on the second node
    t0 = time.monotonic()
    res = run(lau, 2, "fail.py", tmp_path=tmp_path, expect_ok=False, timeout=120)
    assert res.returncode != 0
    assert time.monotonic() - t0 < 60
    assert "deliberate failure on rank 1" in res.stderr and "MPI_Abort" in res.stderr, res


@pytest.mark.parametrize("launcher", ["openmpi", "mpich"])
def test_stuck_rank_on_second_node_is_reported(clusters, launcher, tmp_path):
    """Rank 3 (second node) stops before its 3rd all_reduce: the job ends within timeout + 15 s
    and the report, gathered over MPI across the nodes, names rank 3, its node and its line."""
    cluster = clusters(ROUTED)
    timeout = 5
    t0 = time.monotonic()
    res = run(getattr(cluster, launcher)([2, 2]), 4, "stall.py", "hpcsync", "stuck", str(timeout),
              tmp_path=tmp_path, expect_ok=False, env={"HPCSYNC_REPORT_DIR": str(tmp_path)}, timeout=120)
    assert res.returncode != 0 and time.monotonic() - t0 < timeout + 15
    assert "never entered #3: rank(s) 3" in res.stderr, res
    assert f"rank 3 ({cluster.names[1]}): last operation all_reduce #2" in res.stderr
    assert "STUCK HERE" in res.stderr


def test_dual_homed_rank0_node_finds_an_address_every_node_reaches(clusters, tmp_path):
    """Rank 0's node on two networks, node 1 on the first, node 2 on the second, routes between:
    no subnet is shared by all, the kernel routes each node from another address; the connect
    proof finds one that all reach, and gloo starts on it."""
    cluster = clusters(DUAL_HOMED, 3)
    res = run(cluster.openmpi([1, 1, 1]), 3, "address.py", "gloo", tmp_path=tmp_path, timeout=120)
    assert all("error" not in d for d in res.ranks), res.ranks
    masters = {d["master"] for d in res.ranks}
    assert len(masters) == 1 and masters <= set(cluster.addresses(0)), masters
    assert "reached from every node" in res.ranks[0]["reason"] and "of 2 other node(s)" in res.ranks[0]["reason"]


def test_connect_proof_on_24_nodes_with_a_small_accept_queue(tmp_path):
    """24 namespace nodes, rank 0's node with net.core.somaxconn=16 (older kernels: 128): 23 node
    leaders connect at once; rank 0 accepts while the proof runs, so every node reaches the
    address instead of timing out in a full accept queue."""
    cluster = Cluster(tmp_path, 24, ROUTED).start()
    try:
        subprocess.run(["ip", "netns", "exec", cluster.names[0], "sysctl", "-qw", "net.core.somaxconn=16"], check=True)
        res = run(cluster.openmpi([1] * 24), 24, "proof.py", tmp_path=tmp_path, timeout=300)
        assert {d.get("master") for d in res.ranks} == {cluster.address(0)}, [d.get("error") for d in res.ranks][:3]
        assert {d["num_nodes"] for d in res.ranks} == {24}
        assert "reached from every node" in res.ranks[0]["reason"]
    finally:
        cluster.stop()
