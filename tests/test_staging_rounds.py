"""Stage-in across nodes takes the listing in rounds: the manifest is read forward and written
round by round, in the listing's order; a node that cannot take a later round ends the stage
with the earlier rounds kept.

On paper: the order of the manifest is the order of the walk, and its forward reader passes over
names that left the source and finds those that remain. Across namespace nodes (netns): real MPI
jobs with rounds of a few entries."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from hpcsync.data.staging import journal, manifest
from hpcsync.data.staging.listing import Entry, walk_names
from hpcsync.data.staging.manifest import Lines, LinesWriter, load, order_key, recorded_bytes
from hpcsync.data.staging.rounds import NodeInRounds
from launch import run
from netns_cluster import ROUTED, Cluster
from test_staging import (_check_after_kill, _kill_dataset, _ranks_ok, _same_error_everywhere, expected, journal_records,
                          kill_across_nodes_at_big_file, make_tree, no_temporaries, node_dir, snapshot)


def test_the_manifests_order_is_the_walks(tmp_path):
    """Names that sort differently as paths and as folders ("a" / "a.txt" / "a/b" / "a-b")."""
    for rel in ["a/x", "a/y/z", "a/y.txt", "a.txt", "a-b/c", "a b", "A", "é/f", "b", "a/y/zz/q", "a0"]:
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(rel)
    names, _, err = walk_names(str(tmp_path))
    assert err is None and len(names) > 15
    assert names == sorted(names, key=order_key)


def test_the_forward_reader_passes_over_names_that_left(tmp_path):
    out = LinesWriter(str(tmp_path), str(tmp_path / ".tmp"), "/src")
    rec = [1, 2, 0o644, None, 3, 4]
    out.add([("a", rec), ("b", rec), ("d/x", rec)])
    out.add([("d/y", rec), ("d/z", rec), ("e/w", rec)])
    out.commit(durable=False)
    assert load(str(tmp_path), "/other-src", "h") == {}  # another source's manifest is none
    lines = load(str(tmp_path), "/src", "h")
    assert isinstance(lines, Lines)
    assert set(lines.take(["a", "c", "d"])) == {"a"}  # "b" left the source; "c", "d" are new
    assert lines.passed == 1
    assert set(lines.take(["d/x", "d/z"])) == {"d/x", "d/z"} and lines.passed == 2  # "d/y" left
    assert lines.rest() == 1 and lines.passed == 3  # "e/w" too
    (tmp_path / manifest.MANIFEST).write_text('{"version":2,"source":"/src"}\n[["a",[1,2,3,null,4,5]]]\n[["b"')
    lines = load(str(tmp_path), "/src", "h")
    assert set(lines.take(["a", "b"])) == {"a"}  # a torn line ends it: "b" is copied again
    for bad in ('[["b"]]', '[1,2]', '[["b",[1,2]]]', '{"b":[1,2,3,null,4,5]}'):  # valid JSON, not records
        (tmp_path / manifest.MANIFEST).write_text('{"version":2,"source":"/src"}\n[["a",[1,2,3,null,4,5]]]\n'
                                                 f'{bad}\n[["c",[1,2,3,null,4,5]]]\n')
        lines = load(str(tmp_path), "/src", "h")
        assert set(lines.take(["a", "b", "c"])) == {"a"}, bad  # ends there too, never raises
    (tmp_path / manifest.MANIFEST).write_text('{"version": 1, "source": "/src",\n "files": {"a": [1,2,3,null,4,5]}}\n')
    assert load(str(tmp_path), "/src", "h") == {"a": [1, 2, 3, None, 4, 5]}  # version 1 on several lines
    path = str(tmp_path / manifest.MANIFEST)
    assert recorded_bytes({"a": [7, 2, 3, None, 4, 5], "b": [5, 0, 0, None, 0, 0]}, path) == 12
    for damaged in ({"a": None}, {"a": [1, 2]}, {"a": ["x", 2, 3, None, 4, 5]}, {"a": {}}):
        assert recorded_bytes(damaged, path) is None  # nothing can be said: the rounds' own checks decide
    (tmp_path / manifest.MANIFEST).write_bytes(b'{"version":2,"source":"/src"}\n[["a",[1,2,3,null,4,5]]]\n\xff\xfe\n')
    assert load(str(tmp_path), "/src", "h") == {}  # bytes that are not text: ignored, with a warning


def test_a_rounds_copies_are_journaled_when_it_ends(tmp_path):
    """In one process: a file recorded in round one is in the journal once the round ends, before
    any other file opens (a kill from then on keeps it), and nothing is journaled on a node that
    copied nothing."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "a").write_bytes(b"abc")
    entries = [Entry("", "d", 0o755, 0, 0, 0), Entry("a", "f", 0o644, 0, os.stat(src / "a").st_mtime_ns, 3)]
    node = NodeInRounds(str(dst), str(src), [], False, "h", call="abc")
    assert node.open_destination("token", 0) is None
    node.close_probe()
    assert node.open_rounds(3) is None and node.begin_round(entries) is None
    assert list(node.need) == [0, 1]
    node.start()
    shutil.copy2(src / "a", dst / "a")  # (as stage's own copy: the source's mode and mtime)
    node.record(1, os.stat(dst / "a"), None)
    node.end_round()
    assert journal_records(dst) == {"a"}
    assert node.finish() is None and journal_records(dst) == set()  # the manifest took over
    assert [rel for rel in load(str(dst), str(src), "h").take(["a"])] == ["a"]
    node.close_rounds()
    again = NodeInRounds(str(dst), str(src), [], False, "h", call="def")  # nothing to copy: no journal
    assert again.open_destination("token", 0) is None
    again.close_probe()
    assert again.open_rounds(3) is None and again.begin_round(entries) is None and not again.need.any()
    again.start()
    again.end_round()
    assert not list(dst.glob(journal.JOURNAL + "*"))
    assert again.finish() is None
    again.close_rounds()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("rounds-nodes"), 2, ROUTED).start()
    yield c
    c.stop()


def _stage(cluster, src, tmp_path, n=3, expect_ok=True, **opts):
    opts = {"_round_entries": 16, **opts}
    res = run(cluster.openmpi([2, 1]), n, "stage.py", str(src), str(Path(cluster.node_local, "dst")),
              tmp_path=tmp_path, timeout=300, expect_ok=expect_ok, env={"HPCSYNC_TEST_STAGE_OPTS": json.dumps(opts)})
    return res if not expect_ok else _ranks_ok(res, n)


def _records(dst: Path) -> list:
    lines = (dst / manifest.MANIFEST).read_text().splitlines()
    assert json.loads(lines[0])["version"] == 2
    return [rel for line in lines[1:] for rel, _ in json.loads(line)]


def _many(src: Path, n: int = 120) -> None:
    for i in range(n):
        p = src / f"k{i % 4}" / f"m{i:04d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(100 + 37 * i))


def test_rounds_across_nodes_exact_then_only_what_changed(cluster, tmp_path):
    """Some 180 entries in rounds of 16 on two nodes: exact copies and a manifest of the listing's
    files in its order; a second stage copies nothing and leaves the manifest as it was; a changed,
    a new and a deleted file: only the first two are sent, the third leaves the manifest."""
    src = tmp_path / "src"
    make_tree(src)
    _many(src)
    try:
        r = _stage(cluster, src, tmp_path)
        assert r["copied_files"] == r["files"] > 150
        dsts = [node_dir(cluster, i, "dst") for i in range(2)]
        for d in dsts:
            assert snapshot(d) == expected(src) and no_temporaries(d)
            names = _records(d)
            assert names == sorted(names, key=order_key) and len(names) == r["files"]
            assert len((d / manifest.MANIFEST).read_text().splitlines()) > 8  # written round by round
        before = [os.stat(d / manifest.MANIFEST) for d in dsts]
        r = _stage(cluster, src, tmp_path)
        assert r["copied"] == [] and r["skipped_files"] == r["files"]
        assert [(s.st_ino, s.st_mtime_ns) for s in before] == \
            [(os.stat(d / manifest.MANIFEST).st_ino, os.stat(d / manifest.MANIFEST).st_mtime_ns) for d in dsts]
        (src / "k1" / "m0001.bin").write_bytes(b"changed")
        (src / "k2" / "m0050b.bin").write_bytes(b"new, in the middle of a folder")
        os.unlink(src / "k3" / "m0007.bin")
        r = _stage(cluster, src, tmp_path)
        assert sorted(r["copied"]) == ["k1/m0001.bin", "k2/m0050b.bin"]
        for d in dsts:
            snap = snapshot(d)
            assert snap.pop("k3/m0007.bin")[0] == "f"  # stage leaves what the source lacks; the manifest drops it
            assert snap == expected(src)
            assert sorted(_records(d)) == sorted(p.relative_to(src).as_posix() for p in src.rglob("*")
                                                 if p.is_file() and not p.is_symlink())
    finally:
        for i in range(2):
            subprocess.run(["rm", "-rf", str(node_dir(cluster, i, "dst"))])


def test_a_node_that_cannot_take_a_later_round_keeps_the_earlier_ones(cluster, tmp_path):
    """Node 1 has a folder where a file of a late round belongs: every rank raises the same error
    naming node 1 and the path, no byte of that round moves, and a file changed in the first
    round, copied before the error, is not sent again once the folder is gone."""
    src = tmp_path / "src"
    _many(src)
    dsts = [node_dir(cluster, i, "dst") for i in range(2)]
    try:
        _stage(cluster, src, tmp_path)
        first, late = "k0/m0000.bin", "k3/m0115.bin"
        (src / first).write_bytes(b"changed in round one")
        (src / "k3" / "m0119.bin").write_bytes(b"changed in the last round")
        (dsts[1] / late).unlink()
        (dsts[1] / late).mkdir()
        res = _stage(cluster, src, tmp_path, expect_ok=False)
        _same_error_everywhere(res, 3, f"node {cluster.names[1]}", "is a directory", late)
        assert (dsts[0] / first).read_bytes() == (dsts[1] / first).read_bytes() == b"changed in round one"
        assert (dsts[0] / "k3" / "m0119.bin").read_bytes() != b"changed in the last round"  # that round never ran
        (dsts[1] / late).rmdir()
        r = _stage(cluster, src, tmp_path)
        assert sorted(r["copied"]) == [late, "k3/m0119.bin"], r["copied"]  # round one's file was kept
        assert {w[0]: w[1] for w in r["written"]} == {cluster.names[0]: 1, cluster.names[1]: 2}
        for d in dsts:
            assert snapshot(d) == snapshot(src) and no_temporaries(d)
    finally:
        for i in range(2):
            shutil.rmtree(node_dir(cluster, i, "dst"), ignore_errors=True)


def test_killed_in_a_late_round_then_restaged(cluster, tmp_path):
    """SIGKILL on both nodes while the last of 13 rounds copies its big file: every file under its
    final name is complete, and the next stage copies only that file (the earlier rounds' are in
    the journals)."""
    src = tmp_path / "src"
    _kill_dataset(src)  # 200 small files in a/, then zz/big.bin (768 MiB)
    dst = Path(cluster.node_local, "dst")
    lau = cluster.openmpi([1, 1])
    opts = json.dumps({"_round_entries": 16})
    try:
        kill_across_nodes_at_big_file(cluster, lau, src, dst, tmp_path, {"HPCSYNC_TEST_STAGE_OPTS": opts})
        for i in range(2):
            _check_after_kill(src, node_dir(cluster, i, "dst"))
        r = _ranks_ok(run(lau, 2, "stage.py", str(src), str(dst), tmp_path=tmp_path, timeout=300,
                          env={"HPCSYNC_TEST_STAGE_OPTS": opts}), 2)
        assert r["copied"] == ["zz/big.bin"], r["copied"]
        for i in range(2):
            d = node_dir(cluster, i, "dst")
            assert snapshot(d) == snapshot(src) and no_temporaries(d)
            assert len(_records(d)) == 201
    finally:
        for i in range(2):
            subprocess.run(["rm", "-rf", str(node_dir(cluster, i, "dst"))])


def test_a_source_grown_past_a_nodes_room_is_refused_before_any_byte_moves(cluster, tmp_path):
    """Node 1's disk holds the first stage; then the source grows by more than it has free: every
    rank raises the same error naming node 1 before anything moves (a file changed in the first
    round is not updated on either node), although no single early round would overflow."""
    src = tmp_path / "src"
    _many(src, 40)
    full = node_dir(cluster, 1)  # the agent bind-mounts this folder (not its submounts) as nodelocal
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(full)], check=True)
    try:
        _stage(cluster, src, tmp_path)
        (src / "k0" / "m0000.bin").write_bytes(b"changed in round one")
        with open(src / "k3" / "zz.bin", "wb") as f:  # the last folder's last name: in the last round
            f.write(os.urandom(2 * 2**20))
        res = _stage(cluster, src, tmp_path, expect_ok=False)
        _same_error_everywhere(res, 3, f"node {cluster.names[1]}", "not enough space", "nodelocal/dst")
        for i in range(2):
            assert (node_dir(cluster, i, "dst", "k0", "m0000.bin")).read_bytes() != b"changed in round one"
            assert not (node_dir(cluster, i, "dst", "k3", "zz.bin")).exists()
    finally:
        subprocess.run(["umount", "-l", str(full)], check=True)
        shutil.rmtree(node_dir(cluster, 0, "dst"), ignore_errors=True)

