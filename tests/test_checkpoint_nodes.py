"""hpcsync.Checkpoints across namespace nodes, each node with a disk of its own at the same path
(``cluster.node_local``), as on a cluster's node-local scratch."""
import pytest

from launch import run
from netns_cluster import ROUTED, Cluster
from test_staging import node_dir


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("checkpoint-nodes"), 2, ROUTED).start()
    yield c
    c.stop()


def test_a_sharded_root_the_nodes_do_not_share_is_refused_on_every_rank(cluster, tmp_path):
    """A sharded save into a node-local root: rank 1 (on node 1) cannot see the directory rank 0
    made on node 0, so the ranks cannot write one checkpoint: every rank raises the same error,
    which says why, and nothing is marked complete on either node."""
    root = f"{cluster.node_local}/ckpt"
    res = run(cluster.openmpi([1, 1]), 2, "sharded_ckpt.py", "gloo", root, "5", "5", "sync", tmp_path=tmp_path,
              timeout=180)
    errors = {d["error"] for d in res.ranks}
    assert len(errors) == 1, errors
    [error] = errors
    assert error.startswith("hpcsync.checkpoint: step 5 not saved: rank 1: does not see "), error
    assert "a sharded checkpoint's root must be a directory every rank sees (a shared filesystem)" in error
    for node in range(2):
        assert not list(node_dir(cluster, node, "ckpt").glob("step-*")), "a checkpoint was marked complete"
