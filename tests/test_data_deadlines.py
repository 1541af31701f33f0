"""Stage-in and file sync across namespace nodes when a rank stops making progress: a node's disk
that hangs in a write, a source that hangs in a read, a node leader frozen (SIGSTOP) mid-transfer,
a rank frozen mid-gather. Each ends within the timeout and 45 s, naming the node, the file and the
phase; a stage after a hung disk or source completes exactly; nothing half-written passes as
complete. Faults go in through ``tests/programs/stage.py``'s ``_fault`` (a call that never
returns, or a process that stops itself)."""
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from launch import run
from netns_cluster import ROUTED, Cluster
from test_staging import _same_error_everywhere, no_temporaries, node_dir

pytestmark = pytest.mark.alone  # wall-time bounds

TIMEOUT = 6.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("stage-deadline-nodes"), 2, ROUTED).start()
    yield c
    c.stop()


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"f{i:02d}.bin").write_bytes(os.urandom(200_000 + i))
    return src


def _exact(cluster, src: Path) -> None:
    for i in range(2):
        copy = node_dir(cluster, i, "dst")
        assert no_temporaries(copy), cluster.names[i]
        assert sorted(p.name for p in copy.glob("f*.bin")) == sorted(p.name for p in src.iterdir())
        for p in copy.glob("f*.bin"):
            assert p.read_bytes() == (src / p.name).read_bytes(), p


def _clean(cluster) -> None:
    for i in range(2):
        subprocess.run(["rm", "-rf", str(node_dir(cluster, i, "dst"))])


@pytest.mark.parametrize("where", ["disk", "source"])
def test_a_hung_disk_or_source_ends_the_stage_naming_node_file_and_phase(cluster, tmp_path, where):
    """Node 1's writer thread hangs in a write (a stuck local disk), or the root's reader hangs in
    a read (a stuck network filesystem under the source): every rank raises the same StageError
    naming the node, the file and whether it was reading or writing, within the timeout and 45 s
    (the node's own thread gets a quarter of the timeout, so its error comes before any round times out);
    nothing incomplete is at a final name; a second stage in the same job completes exactly."""
    src = _source(tmp_path)
    fault = {"disk": {"rank": 2, "patch": "hpcsync.data.staging.destination:Destination.write_round", "call": 2,
                      "do": "block"},
             "source": {"rank": 0, "patch": "hpcsync.data.staging.broadcast:Reader.fill", "call": 3,
                        "do": "block"}}[where]
    dst = Path(cluster.node_local, "dst")
    needles = {"disk": [f"rank 2: node {cluster.names[1]}: writing {dst}/f", "no progress for 1.5 s"],
               "source": [f"rank 0: node {cluster.names[0]}: reading {src}/f", "from the source",
                          "no progress for 1.5 s"]}[where]
    try:
        t0 = time.monotonic()
        res = run(cluster.openmpi([2, 1]), 3, "stage.py", str(src), str(dst), tmp_path=tmp_path, expect_ok=False,
                  timeout=120, env={"HPCSYNC_ABORT_ON_EXCEPTION": "0", "HPCSYNC_TEST_STAGE_OPTS": json.dumps(
                      {"chunk_bytes": 64 * 1024, "timeout": TIMEOUT, "names": False, "_again": True,
                       "_fault": [fault]})})
        took = time.monotonic() - t0
        _same_error_everywhere(res, 3, *needles)
        assert all(d["again"]["ok"] for d in res.ranks), [d["again"] for d in res.ranks]
        again = [d["again"]["result"] for d in res.ranks]
        assert again[0]["copied_files"] > 0, again
        assert all(a["copied_files"] == again[0]["copied_files"] and a["copied"] is None for a in again), again
        assert took < TIMEOUT + 45, took
        _exact(cluster, src)
    finally:
        _clean(cluster)


def test_a_frozen_node_leader_ends_the_stage_with_a_report_naming_it(cluster, tmp_path):
    """Node 1's leader freezes (SIGSTOP) amid the transfer, in a job that called hpcsync.init()
    and lets the error escape (the abort hook): the ranks that wait for it raise StageTimeout
    the failure report names
    the frozen rank and its node as silent (the others' errors say which broadcast round, with
    its files), and the job ends within the timeout and 45 s, where it
    used to wait for the job's time limit."""
    src = _source(tmp_path)
    dst = Path(cluster.node_local, "dst")
    fault = {"rank": 2, "patch": "hpcsync.data.staging.destination:Destination.write_round", "call": 2, "do": "stop"}
    try:
        t0 = time.monotonic()
        res = run(cluster.openmpi([2, 2]), 4, "stage.py", str(src), str(dst), tmp_path=tmp_path, expect_ok=False,
                  timeout=150, env={"HPCSYNC_TEST_STAGE_OPTS": json.dumps(
                      {"chunk_bytes": 64 * 1024, "timeout": TIMEOUT, "_init": True, "_uncaught": True,
                       "_fault": [fault]})})
        took = time.monotonic() - t0
        assert res.returncode != 0
        assert took < TIMEOUT + 45, (took, res)
        waited = [d for d in res.ranks if d is not None]
        assert waited and all(not d["ok"] and d["error"].startswith("StageTimeout: ") for d in waited), res.ranks
        # (Open MPI lets the stopped rank go on while it ends the job: it may report, too late)
        assert "broadcast round" in res.ranks[0]["error"] and "within 6 s" in res.ranks[0]["error"], res.ranks[0]
        report = res.stderr[res.stderr.index("[hpcsync] ====="):]
        assert silent_named(report, 2, cluster.names[1]), report
        assert no_temporaries(node_dir(cluster, 0, "dst"))
    finally:
        _clean(cluster)


# -- file sync ------------------------------------------------------------------------------------

def _sync_parts(cluster, tmp_path, per_node):
    """Random parts of 300 kB for each rank, in its own node's local folder; the target on a
    folder every node sees. Returns (target, parts_dir, parts)."""
    from hpcsync.data.filesync import part_path

    target, parts_dir = tmp_path / "merged.bin", os.path.join(cluster.node_local, "parts")
    parts, rank = [], 0
    for node, n in enumerate(per_node):
        for _ in range(n):
            data = os.urandom(300_000 + rank)
            rel = os.path.relpath(part_path(str(target), rank, parts_dir), cluster.node_local)
            p = node_dir(cluster, node, rel)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
            parts.append(p)
            rank += 1
    return target, parts_dir, parts


@pytest.mark.parametrize("where", ["disk", "part"])
def test_a_hung_write_or_part_read_ends_the_sync_naming_node_file_and_phase(cluster, tmp_path, where):
    """The root's writer hangs in a write (its disk), or rank 2's read of its part hangs (its
    node's disk): every rank raises the same SyncError naming the node, the file and whether it
    was reading or writing, within the timeout and 45 s; no target appears and every part is kept."""
    target, parts_dir, parts = _sync_parts(cluster, tmp_path, [2, 1])
    fault = {"disk": {"rank": 0, "patch": "hpcsync.data.transports:_pwrite_all", "call": 2, "do": "block"},
             "part": {"rank": 2, "patch": "hpcsync.data.transports:Source.fill", "call": 2, "do": "block"}}[where]
    needles = {"disk": [f"rank 0: node {cluster.names[0]}: writing {tmp_path}/", "no progress for 1.5 s"],
               "part": [f"rank 2: node {cluster.names[1]}: reading {cluster.node_local}/parts/",
                        "no progress for 1.5 s"]
               }[where]
    t0 = time.monotonic()
    res = run(cluster.openmpi([2, 1]), 3, "sync.py", str(target), tmp_path=tmp_path, expect_ok=False, timeout=120,
              env={"HPCSYNC_ABORT_ON_EXCEPTION": "0", "HPCSYNC_TEST_SYNC_OPTS": json.dumps(
                  {"text": False, "method": "gather", "round_bytes": 100_000, "parts_dir": parts_dir,
                   "timeout": TIMEOUT, "_fault": [fault]})})
    took = time.monotonic() - t0
    _same_error_everywhere(res, 3, *needles, kind="SyncError")
    assert took < TIMEOUT + 45, took
    assert not target.exists() and all(p.exists() for p in parts)


def test_a_rank_frozen_mid_gather_ends_the_sync_with_a_report_naming_it(cluster, tmp_path):
    """Rank 2 freezes (SIGSTOP) while it reads its part for the second gather round, in a job
    that called hpcsync.init() and lets the error escape: the ranks waiting for it raise
    SyncTimeout within the timeout, the failure report names rank 2 and its node as silent, and
    the job ends within the timeout and 45 s; no target appears."""
    target, parts_dir, parts = _sync_parts(cluster, tmp_path, [2, 1])
    fault = {"rank": 2, "patch": "hpcsync.data.transports:Source.fill", "call": 2, "do": "stop"}
    t0 = time.monotonic()
    res = run(cluster.openmpi([2, 1]), 3, "sync.py", str(target), tmp_path=tmp_path, expect_ok=False, timeout=150,
              env={"HPCSYNC_TEST_SYNC_OPTS": json.dumps(
                  {"text": False, "method": "gather", "round_bytes": 100_000, "parts_dir": parts_dir,
                   "timeout": TIMEOUT, "_init": True, "_uncaught": True, "_fault": [fault]})})
    took = time.monotonic() - t0
    assert res.returncode != 0 and took < TIMEOUT + 45, (took, res)
    assert res.ranks[0] is not None and res.ranks[0]["error"].startswith("SyncTimeout: "), res.ranks[0]
    assert "within 6 s" in res.ranks[0]["error"], res.ranks[0]
    report = res.stderr[res.stderr.index("[hpcsync] ====="):]
    assert silent_named(report, 2, cluster.names[1]), report
    assert not target.exists() and all(p.exists() for p in parts)


def silent_named(report, rank, node):
    """The report names ``rank`` and its node as giving no answer: at its head when the others
    failed waiting on it, else among the other ranks."""
    return f"rank {rank} ({node}) gave no answer" in report or f"rank {rank} on {node}: no answer" in report
