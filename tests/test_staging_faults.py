"""Stage-in across namespace nodes when something fails that no check expects (an error raised
in the listing or amid the broadcast, injected through ``tests/programs/stage.py``'s ``_fault``):
one StageError on every rank, in seconds, nothing half-written left behind."""
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from launch import openmpi, run
from netns_cluster import ROUTED, Cluster
from test_staging import _same_error_everywhere, make_tree, no_temporaries, node_dir


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("stage-fault-nodes"), 2, ROUTED).start()
    yield c
    c.stop()


@pytest.mark.parametrize("where", ["writer", "root-writer", "reader", "buffers"])
def test_an_unexpected_error_amid_the_broadcast_is_one_error_on_every_rank(cluster, where, tmp_path):
    """An error no check expects, raised amid the broadcast (node 1's writer thread: a write or
    close answering EIO, as a network filesystem may; the root's reader thread; node 1's buffers,
    which it cannot allocate; the root's writer too, which takes each piece's checksum from the
    round without computing it: its third round is the middle of the first file), with the job
    neither aborting on an exception nor letting one escape (HPCSYNC_ABORT_ON_EXCEPTION=0, the
    error caught): every rank raises the same StageError naming the rank and node, within
    seconds; no rank is left waiting in a broadcast, no temporary file stays, and whatever is at
    a final name is complete."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"f{i:02d}.bin").write_bytes(os.urandom(200_000 + i))
    fault = {"writer": {"rank": 2, "patch": "hpcsync.data.staging.destination:Destination.write_round", "call": 4,
                        "error": "EIO"},
             "root-writer": {"rank": 0, "patch": "hpcsync.data.staging.destination:Destination.write_round", "call": 3,
                             "error": "EIO"},
             "reader": {"rank": 0, "patch": "hpcsync.data.staging.broadcast:Reader.fill", "call": 4},
             "buffers": {"rank": 2, "patch": "hpcsync.data.staging.broadcast:_Pipeline.buffer", "call": 1}}[where]
    needle = {"writer": f"rank 2: node {cluster.names[1]}: Input/output error",
              "root-writer": f"rank 0: node {cluster.names[0]}: Input/output error",
              "reader": f"rank 0: node {cluster.names[0]}: RuntimeError: fault injected into Reader.fill",
              "buffers": f"rank 2: node {cluster.names[1]}: cannot allocate the broadcast's buffers"}[where]
    dst = Path(cluster.node_local, "dst")
    try:
        t0 = time.monotonic()
        res = run(cluster.openmpi([2, 1]), 3, "stage.py", str(src), str(dst), tmp_path=tmp_path, expect_ok=False,
                  timeout=60, env={"HPCSYNC_ABORT_ON_EXCEPTION": "0", "HPCSYNC_TEST_STAGE_OPTS": json.dumps(
                      {"chunk_bytes": 64 * 1024, "_fault": [fault]})})
        assert time.monotonic() - t0 < 30
        _same_error_everywhere(res, 3, needle)
        for i in range(2):
            copy = node_dir(cluster, i, "dst")
            assert no_temporaries(copy), cluster.names[i]
            for p in copy.glob("f*.bin"):
                assert p.read_bytes() == (src / p.name).read_bytes(), p
    finally:
        for i in range(2):
            subprocess.run(["rm", "-rf", str(node_dir(cluster, i, "dst"))])


@pytest.mark.parametrize("where, nodes, rank, on", [
    ("scan", [1, 2], 0, ""), ("walk_names", [2, 1], 0, ""), ("stat_names", [2, 1], 1, " (on rank 1)"),
    ("assemble", [2, 1], 0, " (on rank 0)"), ("stat_names", None, 1, " (on rank 1)"),
    ("assemble", None, 1, " (on rank 1)")], ids=["scan", "walk", "stat", "assemble", "stat-one-node",
                                                  "assemble-one-node"])
def test_an_unexpected_error_in_the_listing_is_one_error_on_every_rank(cluster, tmp_path, where, nodes, rank, on):
    """An error no check expects while the source is listed (on the root alone, or on a rank that
    lists a share of it, across nodes or on one; ``nodes`` None: one node), with the job neither
    aborting on an exception nor letting one escape: every rank raises the same StageError naming
    the node and the rank where it happened, within seconds, and no destination is made."""
    src = tmp_path / "src"
    make_tree(src, files=20)
    dst, n = Path(cluster.node_local if nodes else tmp_path, "dst"), 3 if nodes else 2
    env = {"HPCSYNC_ABORT_ON_EXCEPTION": "0", "HPCSYNC_TEST_STAGE_OPTS": json.dumps(
        {"_fault": [{"rank": rank, "patch": f"hpcsync.data.staging:{where}"}]})}
    host = cluster.names[0] if nodes else os.uname().nodename
    copies = [node_dir(cluster, i, "dst") for i in range(2)] if nodes else [dst]
    try:
        t0 = time.monotonic()
        res = run(cluster.openmpi(nodes) if nodes else openmpi(), n, "stage.py", str(src), str(dst),
                  tmp_path=tmp_path, expect_ok=False, timeout=60, env=env)
        assert time.monotonic() - t0 < 30 and len(res.ranks) == n
        _same_error_everywhere(res, n, f"rank 0: node {host}: RuntimeError: fault injected into {where}{on}")
        assert not [d for d in copies if d.exists()]
    finally:
        for d in copies:
            subprocess.run(["rm", "-rf", str(d)])
