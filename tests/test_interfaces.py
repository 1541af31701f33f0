"""Nodes whose interfaces are named differently: each rank gives gloo its own interface, every
pair of nodes is proven before gloo starts, and an unreachable pair is one clear error.

``split-names`` (``tests/netns_cluster.py``): node 0 on two networks (``eth0``, ``eth1``), node 1
on the first only (``eth0``), node 2 on the second only (``eth1``), routes between, no subnet
shared by all, docker0 everywhere; ``ib0-node``: one bridged network where the last node's only
link is ``ib0``. With rank 0's interface name exported everywhere, gloo on such nodes waited
until the store timed out (``DistStoreError: wait timeout``).
"""
import subprocess
import time

import pytest

from launch import PY, clean_env, run
from netns_cluster import BRIDGED, IB0_NODE, SPLIT_NAMES, Cluster


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    made = {}

    def get(network, nodes=3, slurm=False):
        if network not in made:
            made[network] = Cluster(tmp_path_factory.mktemp("ifnodes"), nodes, network).start()
        c = made[network]
        if slurm and not c.slurm_env:
            try:
                c.start_slurm()
            except RuntimeError as exc:
                pytest.fail(f"could not start Slurm on the namespace nodes: {exc}")
        return c

    yield get
    for c in made.values():
        c.stop()


def check_pairs(res, cluster, backend):
    """Every rank on its own node's interface; all_reduce and all_to_all across every pair right."""
    n = len(res.ranks)
    for r, d in enumerate(res.ranks):
        assert "error" not in d, d
        node = cluster.names.index(d["hostname"])
        if backend == "gloo":
            if node == 0:  # the interface that holds the master address
                want = "eth0" if d["master"] == cluster.address(0) else cluster.links(0)[1]
            else:
                want = cluster.links(node)[0]
            assert d["gloo_ifname"] == want and d["nccl_ifname"] == f"={want}", (r, d)  # NCCL: exact
        else:
            assert d["gloo_ifname"] is None and d["master"] is None, d  # the MPI backend needs no address
        assert d["allreduce"] == n * (n + 1) / 2
        assert d["all_to_all"] == [100.0 * j + r for j in range(n)], d


LAUNCHES = [("openmpi", "gloo"), ("mpich", "gloo"), ("srun", "gloo"), ("openmpi", "hpcsync")]


@pytest.mark.parametrize("launcher,backend", LAUNCHES, ids=[f"{lau}-{b}" for lau, b in LAUNCHES])
def test_each_node_gives_gloo_its_own_interface(clusters, launcher, backend, tmp_path):
    cluster = clusters(SPLIT_NAMES, slurm=launcher == "srun")
    lau = cluster.srun([1, 1, 1], "pmix") if launcher == "srun" else getattr(cluster, launcher)([1, 1, 1])
    res = run(lau, 3, "interfaces.py", backend, tmp_path=tmp_path, timeout=180)
    check_pairs(res, cluster, backend)
    assert {cluster.links(1)[0], cluster.links(2)[0]} == {"eth0", "eth1"}  # the layout differs, as meant


def test_a_node_whose_only_link_is_ib0(clusters, tmp_path):
    cluster = clusters(IB0_NODE)
    res = run(cluster.openmpi([1, 1, 1]), 3, "interfaces.py", "gloo", tmp_path=tmp_path, timeout=180)
    check_pairs(res, cluster, "gloo")
    assert res.ranks[2]["gloo_ifname"] == "ib0" and res.ranks[0]["gloo_ifname"] == "eth0"


def test_an_unreachable_pair_of_nodes_is_one_clear_error(clusters, tmp_path):
    """The last node's ranks set GLOO_SOCKET_IFNAME=ib0 themselves: the dead fabric. The master
    is reachable; the pairs with that node are not. Every rank raises the same AddressError
    naming the node, its interface and what failed, within the proof's bound -- not a store timeout."""
    cluster = clusters(BRIDGED)
    last = cluster.names[2]
    res = run(cluster.openmpi([1, 1, 1]), 3, "interfaces.py", "gloo", f"{last}=ib0", tmp_path=tmp_path,
              env={"HPCSYNC_CONNECT_TIMEOUT": "2"}, timeout=180)
    errors = {d["error"] for d in res.ranks}
    assert len(errors) == 1, errors
    (err,) = errors
    assert err.startswith("AddressError: gloo connects every pair of ranks, but 2 node pair(s) could not connect"), err
    assert (f"node 0 ({cluster.names[0]}, eth0 {cluster.address(0)}) -> node 2 ({last}, ib0 10.70.0.4): "
            "cannot connect to 10.70.0.4:") in err, err
    assert f"node 1 ({cluster.names[1]}, eth0 {cluster.address(1)}) -> node 2" in err, err
    assert f"node 2 {last}: ib0 10.70.0.4 (GLOO_SOCKET_IFNAME=ib0, set by the user)" in err, err
    assert all(d["seconds"] < 2 + 10 for d in res.ranks), [d["seconds"] for d in res.ranks]


def test_doctor_shows_each_nodes_interface(clusters, tmp_path):
    cluster = clusters(SPLIT_NAMES)
    lau = cluster.openmpi([1, 1, 1])
    full = clean_env(lau.env)
    p = subprocess.run([*lau.command(3, full), PY, "-m", "hpcsync", "doctor"], env=full, capture_output=True,
                       text=True, timeout=180)
    out = p.stdout
    for i, name in enumerate(cluster.names[1:], start=1):
        assert f"node {i} {name}: {cluster.links(i)[0]} {cluster.address(i)}" in out, out
    assert "interface names differ between nodes" in out and "eth1 on node(s) " in out, out
    assert p.returncode == 0, out + p.stderr


def test_a_rank_failing_inside_the_proof_ends_every_rank_within_the_timeout(clusters, tmp_path):
    """HPCSYNC_ABORT_ON_EXCEPTION=0, rank 0 alone raises in the proof of every pair of nodes,
    before its first exchange: ranks 1 and 2 raise one CollectiveTimeout at init's 5 s timeout
    instead of waiting forever, and the job ends."""
    cluster = clusters(BRIDGED)
    t0 = time.monotonic()
    res = run(cluster.openmpi([1, 1, 1]), 3, "interfaces.py", "gloo", "fault=raise", "timeout=5", tmp_path=tmp_path,
              env={"HPCSYNC_ABORT_ON_EXCEPTION": "0", "HPCSYNC_ABORT_GRACE": "2"}, timeout=120, expect_ok=False)
    assert res.returncode != 0 and time.monotonic() - t0 < 5 + 40, res
    assert res.ranks[0]["error"] == "RuntimeError: injected on rank 0", res
    for d in res.ranks[1:]:
        assert d["error"].startswith("CollectiveTimeout: hpcsync.init: proving every pair of nodes"), d
        assert 4.9 < d["seconds"] < 5 + 10, d


def test_a_node_out_of_file_descriptors_is_an_error_of_its_pairs(clusters, tmp_path):
    """Node 0 runs out of file descriptors in its connection test (EMFILE at socket()): every rank raises the same
    AddressError that names the pairs and the reason, within the bound; nobody waits."""
    cluster = clusters(BRIDGED)
    res = run(cluster.openmpi([1, 1, 1]), 3, "interfaces.py", "gloo", "fault=emfile", "timeout=20", tmp_path=tmp_path,
              env={"HPCSYNC_ABORT_ON_EXCEPTION": "0"}, timeout=120, expect_ok=False)
    errors = {d["error"] for d in res.ranks}
    assert len(errors) == 1, errors
    (err,) = errors
    assert err.startswith("AddressError: gloo connects every pair of ranks, but "), err
    assert "Too many open files" in err and f"node 0 ({cluster.names[0]}" in err, err
    assert all(d["seconds"] < 15 for d in res.ranks), res
