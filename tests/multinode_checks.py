"""What a multi-node job of ``tests/programs/multinode.py`` must show, whatever launched it."""
import csv

import h5py
import numpy as np

from launch import openmpi, run
from netns_cluster import ROUTED

_reference = {}


def one_node_weights(backend, n, tmp_path):
    """The same program on one node (no namespaces): the weights a multi-node run must reproduce."""
    if (backend, n) not in _reference:
        work = tmp_path / f"ref-{backend}"
        (work / "local").mkdir(parents=True)
        res = run(openmpi(), n, "multinode.py", backend, str(work), str(work / "local"), tmp_path=work)
        _reference[backend, n] = res.ranks[0]["weights"]
    return _reference[backend, n]



def check_multinode_job(res, cluster, where, backend, parallel_h5, work, tmp_path):
    """Everything ``multinode.py`` reports, rank by rank; ``where[r]``: the node of rank ``r``."""
    n, nodes = len(where), len(set(where))
    for r, d in enumerate(res.ranks):
        t = d["topology"]
        # topology: real nodes, from MPI
        assert (t["rank"], t["node_rank"], t["num_nodes"]) == (r, where[r], nodes), d
        assert t["local_size"] == where.count(where[r]) and t["local_rank"] == where[:r].count(where[r])
        assert d["hostname"] == t["hostname"] == cluster.names[where[r]]
        # address: the cluster network, never docker0 / loopback / link-local, reachable from all nodes
        rank0_node = 0
        assert d["master"]["address"] == cluster.address(rank0_node), d["master"]
        assert d["master"]["ifname"] == "eth0"
        assert ("routed" in d["master"]["reason"]) == (cluster.network == ROUTED)
        assert "reached from every node" in d["master"]["reason"]
        assert d["backend"] == backend and d["allreduce"] == n * (n + 1) / 2
        assert d["env_master"] == (None if backend == "hpcsync" else cluster.address(0))
        assert d["gathered_hosts"] == [cluster.names[k] for k in where]
        assert d["local_group_ranks"] == [k for k in range(n) if where[k] == where[r]]
        assert d["sync_gather"] == "gather" and d["sync_mpiio"] == "mpiio" and d["sync_copy"] == "copy"
        # shared folder, small merge: the root copies; node-local parts (same path, another file on
        # each node): the root must not copy its own files for the other nodes' -> gather
        assert d["sync_auto"] == "copy" and d["sync_nodelocal"] == "gather"
        # node-local parts: each node's folder holds only its own ranks' parts
        mine = sorted(f"rank{k:05d}.csv" for k in range(n) if where[k] == where[r])
        assert d["nodelocal_visible_here"] == mine
        assert d["h5_parallel"] == parallel_h5  # MPICH job: h5py links Open MPI -> fallback
    # DDP: identical on every rank and equal to a one-node run with the same ranks
    weights = np.array(res.ranks[0]["weights"])
    assert all(np.array_equal(weights, np.array(d["weights"])) for d in res.ranks)
    np.testing.assert_allclose(weights, one_node_weights(backend, n, tmp_path), rtol=1e-5, atol=1e-6)
    # merged outputs: every rank's rows in rank order, one header, whatever the method
    want = [["rank", "i", "host"]] + [[str(r), str(i), cluster.names[where[r]]] for r in range(n) for i in range(r + 1)]
    for name in ("copy", "gather", "mpiio", "auto", "nodelocal"):
        with open(work / f"metrics-{name}.csv", newline="") as f:
            assert list(csv.reader(f)) == want, name
    with h5py.File(work / "rows.h5") as f:
        assert f["x"][:, 0].tolist() == [r for r in range(n) for _ in range(r + 1)]
