"""Stage-in (hpcsync.stage): exact copies on every node, one read of the source, resumable, clear errors.

In-process tests cover the schedule and a one-process stage; the rest run real MPI jobs on one
node (Open MPI, MPICH) and across namespace nodes (source only on rank 0's node, or seen by all).
"""
import hashlib
import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

import hpcsync
from hpcsync.data.staging import destination, journal, listing, manifest
from hpcsync.data.staging.rounds import _writers
from launch import PY, Launcher, clean_env, long_run, mpich, openmpi, run
from netns_cluster import ROUTED, Cluster

OLD = 1_600_000_000_123_456_789  # an mtime in the past, with nanoseconds


def make_tree(root: Path, files: int = 40, seed: int = 0) -> None:
    """Nested directories, empty files and directories, odd modes, old mtimes, a link, a FIFO."""
    rng = np.random.default_rng(seed)
    for i in range(files):
        p = root / f"d{i % 3}" / f"e{i % 5}" / f"f{i:03d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rng.integers(0, 256, int(rng.integers(0, 70_000)), dtype=np.uint8).tobytes())
        os.utime(p, ns=(OLD, OLD + i))
    (root / "empty.txt").write_bytes(b"")
    (root / "empty_dir" / "inner_empty").mkdir(parents=True)
    (root / "script.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(root / "script.sh", 0o751)
    (root / "readonly.txt").write_text("do not touch\n")
    os.chmod(root / "readonly.txt", 0o444)
    (root / "locked").mkdir()
    (root / "locked" / "inside.txt").write_text("in a read-only directory\n")
    os.symlink("d0/e0", root / "link_to_dir")
    os.mkfifo(root / "a_fifo")
    for d in [p for p in root.rglob("*") if p.is_dir() and not p.is_symlink()] + [root]:
        os.utime(d, ns=(OLD, OLD + 7))
    os.chmod(root / "locked", 0o555)


def snapshot(root: Path) -> dict:
    """rel -> (kind, mode, mtime, size, content hash or link target); stage's own files left out."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in [*dirs, *files, ""]:
            if name in (manifest.MANIFEST, journal.JOURNAL):
                continue
            p = os.path.join(folder, name) if name else folder
            if name == "" and folder != str(root):
                continue
            s = os.lstat(p)
            rel = os.path.relpath(p, root)
            if stat.S_ISLNK(s.st_mode):
                out[rel] = ("l", os.readlink(p))
            elif stat.S_ISDIR(s.st_mode):
                out[rel] = ("d", stat.S_IMODE(s.st_mode), s.st_mtime_ns)
            elif stat.S_ISREG(s.st_mode):
                out[rel] = ("f", stat.S_IMODE(s.st_mode), s.st_mtime_ns, s.st_size, _digest(p))
    return out


def _digest(path: str) -> str:
    h = hashlib.sha1()
    with open(path, "rb") as f:
        while block := f.read(16 * 2**20):
            h.update(block)
    return h.hexdigest()


def expected(src: Path) -> dict:
    snap = snapshot(src)
    return {k: v for k, v in snap.items() if k != "a_fifo"}


def inodes(root: Path) -> dict:
    return {p: (os.lstat(p).st_ino, os.lstat(p).st_mtime_ns) for p in map(str, root.rglob("*"))
            if os.path.isfile(p) and not os.path.basename(p).startswith((manifest.MANIFEST, journal.JOURNAL))}


def temporary(folder: Path, name: str) -> bool:
    """Whether some node's temporary file for ``name`` exists in ``folder``."""
    return any(folder.glob(f".{name}.*{destination.TMP_SUFFIX}"))


def no_temporaries(root: Path) -> bool:
    return not [p for p in root.rglob("*") if p.name.endswith(destination.TMP_SUFFIX)]


# -- in process: the schedule and a one-process stage ----------------------------------------------

def test_chunks_cover_every_byte_once_within_bounds():
    files = [(0, 0), (1, 5), (2, 3 * 2**31 + 7), (3, 0), (4, 100)] + [(5 + i, 1) for i in range(50)]
    rounds = list(listing.chunks(files, chunk_bytes=2**30, max_pieces=8))
    seen = {}
    for r in rounds:
        assert sum(n for _, _, n in r) <= 2**30 and len(r) <= 8
        for idx, off, n in r:
            assert off == seen.get(idx, 0)  # in order, no gap, no overlap
            seen[idx] = off + n
    assert seen == {idx: size for idx, size in files}
    # six full GiB rounds, then the big file's 12-byte tail and 52 more pieces, 8 per round
    assert len(rounds) == 6 + 7 and all(sum(n for _, _, n in r) == 2**30 for r in rounds[:6])
    # ten thousand small files: a handful of broadcasts, not ten thousand
    small = [(i, 10240) for i in range(10_000)]
    assert len(list(listing.chunks(small, 16 * 2**20))) == 7


def test_one_process_stage_is_exact_idempotent_and_repairs(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_tree(src)
    r = hpcsync.stage(src, dst, names=True)
    assert snapshot(dst) == expected(src)
    assert r.ignored == ("a_fifo",) and r.files == len(r.copied) == 44 and r.skipped == ()
    assert r.source_reads == r.copied_bytes == r.bytes and r.nodes == 1 and r.broadcasts == 0
    before, mtime = inodes(dst), os.stat(dst / manifest.MANIFEST).st_mtime_ns
    r2 = hpcsync.stage(src, dst, names=True)  # nothing to do: nothing rewritten
    assert r2.copied == () and len(r2.skipped) == 44 and r2.source_reads == 0
    summary = hpcsync.stage(src, dst)  # by default a summary: counts, no names
    assert summary.copied is None and summary.skipped is None and (summary.copied_files, summary.skipped_files) == (0, 44)
    assert inodes(dst) == before and os.stat(dst / manifest.MANIFEST).st_mtime_ns == mtime
    # repair: changed at the source, truncated, deleted, rewritten in place at the destination
    changed, truncated, deleted, touched = "d0/e0/f000.bin", "d1/e1/f001.bin", "d2/e2/f002.bin", "empty.txt"
    (src / changed).write_bytes(b"new content")
    os.truncate(dst / truncated, 1)
    os.unlink(dst / deleted)
    (dst / touched).write_bytes(b"")  # same size, same content: only its ctime/mtime tell
    r3 = hpcsync.stage(src, dst, names=True)
    assert sorted(r3.copied) == sorted([changed, truncated, deleted, touched])
    assert snapshot(dst) == expected(src)
    after = inodes(dst)
    untouched = [p for p in before if not any(p.endswith(x) for x in (changed, truncated, deleted, touched))]
    assert all(after[p] == before[p] for p in untouched)


def test_single_file_source_and_interrupted_leftovers(tmp_path):
    src = tmp_path / "one.bin"
    src.write_bytes(os.urandom(100_000))
    dst = tmp_path / "dst"
    dst.mkdir()
    # what a killed stage leaves: a journal and a temporary file
    (dst / journal.JOURNAL).write_text(json.dumps({"source": str(src)}) + "\n")
    tag = hashlib.sha1(os.uname().nodename.encode()).hexdigest()[:8]
    (dst / f".one.bin.{tag}{destination.TMP_SUFFIX}").write_bytes(b"partial")
    r = hpcsync.stage(src, dst, names=True)
    assert r.copied == ("one.bin",) and (dst / "one.bin").read_bytes() == src.read_bytes()
    assert no_temporaries(dst) and not (dst / journal.JOURNAL).exists()


def test_one_process_errors_name_the_path(tmp_path):
    with pytest.raises(hpcsync.StageError, match="does not exist"):
        hpcsync.stage(tmp_path / "missing", tmp_path / "dst")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "src").mkdir()
    with pytest.raises(hpcsync.StageError, match="cannot create destination .*afile"):
        hpcsync.stage(tmp_path / "src", tmp_path / "afile")
    with pytest.raises(ValueError):
        hpcsync.stage(tmp_path / "src", tmp_path / "dst", chunk_bytes=0)


# -- one node, real MPI ---------------------------------------------------------------------------

def _ranks_ok(res, n):
    results = [d["result"] for d in res.ranks]
    assert all(d["ok"] for d in res.ranks), res
    stripped = [{k: v for k, v in r.items() if k not in ("seconds", "received_bytes")} for r in results]
    assert all(s == stripped[0] for s in stripped), "ranks got different results"
    return results[0]


@pytest.mark.parametrize("launcher,n", [("openmpi", 3), ("mpich", 2)])
def test_one_node_several_ranks_one_copy(launcher, n, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_tree(src)
    lau = openmpi() if launcher == "openmpi" else mpich()
    res = run(lau, n, "stage.py", str(src), str(dst), json.dumps({"progress": True}), tmp_path=tmp_path)
    r = _ranks_ok(res, n)
    assert snapshot(dst) == expected(src)
    assert r["nodes"] == 1 and r["broadcasts"] == 0 and len(r["written"]) == 1
    assert r["source_reads"] == r["bytes"] == r["written"][0][2] and r["written"][0][1] == r["files"]
    assert res.stderr.count("staging src") >= 1 and "100.0%" in res.stderr  # the bar, from rank 0 only
    before = inodes(dst)
    res = run(lau, n, "stage.py", str(src), str(dst), tmp_path=tmp_path)
    r = _ranks_ok(res, n)
    assert r["copied"] == [] and r["source_reads"] == 0 and inodes(dst) == before


def test_cli_under_mpirun(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_tree(src, files=5)
    lau = openmpi()
    env = clean_env(lau.env)
    p = subprocess.run([*lau.command(2), PY, "-m", "hpcsync", "stage", str(src), str(dst)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("staged ") == 1 and "copied 9 " in p.stdout, p.stdout
    assert snapshot(dst) == expected(src)


def _same_error_everywhere(res, n, *needles, kind="StageError"):
    """Every rank reported, and reported the same ``kind`` of error holding each of ``needles``."""
    assert res.returncode != 0
    assert all(d is not None for d in res.ranks), res.stderr[-3000:]
    errors = {d["error"] for d in res.ranks}
    assert len(errors) == 1 and all(not d["ok"] for d in res.ranks), res.ranks
    (error,) = errors
    assert error.startswith(f"{kind}: ") and all(s in error for s in needles), error
    return error


def test_errors_are_the_same_on_every_rank(tmp_path, mount_tmpfs):
    host = os.uname().nodename
    src = tmp_path / "src"
    make_tree(src, files=30)  # ~1 MB
    lau = openmpi()

    def stage(s, d, opts=None, launcher=lau):
        t0 = time.monotonic()
        res = run(launcher, 2, "stage.py", str(s), str(d), json.dumps(opts or {}), tmp_path=tmp_path,
                  expect_ok=False, timeout=120)
        assert time.monotonic() - t0 < 60
        return res

    _same_error_everywhere(stage(tmp_path / "nope", tmp_path / "d1"), 2, f"node {host}", "nope", "does not exist")
    assert not (tmp_path / "d1").exists()  # a stage that fails on its source leaves no destination behind
    (tmp_path / "afile").write_text("x")
    _same_error_everywhere(stage(src, tmp_path / "afile"), 2, f"node {host}", "afile")
    ro = mount_tmpfs(tmp_path / "ro", "ro,size=1m")
    _same_error_everywhere(stage(src, ro / "dst"), 2, f"node {host}", str(ro / "dst"), "Read-only file system")
    small = mount_tmpfs(tmp_path / "small", "size=256k")
    _same_error_everywhere(stage(src, small / "dst"), 2, f"node {host}", "not enough space", str(small / "dst"))
    assert not [p for p in (small / "dst").rglob("*") if p.is_file()]  # nothing was written
    _same_error_everywhere(stage(src, tmp_path / "d2", {"_rank1": {"dst": str(tmp_path / "d3")}}), 2,
                           "different arguments", "rank(s) [1]")
    # unreadable: root without the capability to bypass file permissions, as an ordinary user
    os.chmod(src / "d1" / "e1" / "f001.bin", 0)
    unprivileged = Launcher("openmpi", ["setpriv", "--bounding-set", "-dac_override,-dac_read_search",
                                        *lau.argv], lau.env)
    existing = tmp_path / "d4"  # a destination that exists stays untouched
    existing.mkdir(mode=0o750)
    (existing / "mine.txt").write_text("not the stage's\n")
    os.utime(existing, ns=(OLD, OLD))
    before = snapshot(existing)
    _same_error_everywhere(stage(src, existing, launcher=unprivileged), 2, f"node {host}",
                           "f001.bin", "not readable")
    assert snapshot(existing) == before and os.listdir(existing) == ["mine.txt"]


def test_an_unexpected_error_on_the_root_before_the_copy_is_one_error_on_every_rank(tmp_path):
    """One node: the root raises an error no check expects after the ranks agreed that the copy
    can start and before the ranks share it out (here: while it starts the journal and the
    links), with HPCSYNC_ABORT_ON_EXCEPTION=0 and the error caught: every rank raises the same
    StageError naming the root and its node, within seconds."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_tree(src, files=10)
    fault = {"rank": 0, "patch": "hpcsync.data.staging.destination:Destination.start"}
    t0 = time.monotonic()
    res = run(openmpi(), 2, "stage.py", str(src), str(dst), json.dumps({"_fault": [fault]}), tmp_path=tmp_path,
              expect_ok=False, timeout=60, env={"HPCSYNC_ABORT_ON_EXCEPTION": "0"})
    assert time.monotonic() - t0 < 30
    _same_error_everywhere(res, 2, f"rank 0: node {os.uname().nodename}: RuntimeError: fault injected into "
                           "Destination.start")
    assert no_temporaries(dst) and not (dst / manifest.MANIFEST).exists()


def test_killed_mid_stage_then_restaged(tmp_path):
    """SIGKILL while a big file is being copied: every file at its final name is complete, and the
    next call copies only what was unfinished."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    _kill_dataset(src)
    lau = openmpi()
    out = tmp_path / "out"
    out.mkdir()
    env = clean_env({**lau.env, "HPCSYNC_TEST_OUT": str(out)})
    proc = subprocess.Popen([*lau.command(2), PY, str(Path(__file__).parent / "programs" / "stage.py"), str(src),
                             str(dst)], env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    # the big file is being copied (in one byte range per rank), the small ones are done and journaled
    _kill_when(lambda: temporary(dst / "zz", "big.bin") and journaled(dst) == 200, proc)
    _check_after_kill(src, dst)
    before = inodes(dst)
    r = _ranks_ok(run(lau, 2, "stage.py", str(src), str(dst), tmp_path=tmp_path), 2)
    assert r["copied"] == ["zz/big.bin"], r["copied"]
    assert snapshot(dst) == expected(src) and no_temporaries(dst)
    assert all(inodes(dst)[p] == v for p, v in before.items() if "big.bin" not in p)


def journaled(dst: Path) -> int:
    """Files recorded in the journals of a running stage (one per rank that copies)."""
    return len(journal_records(dst))


def journal_records(dst: Path) -> set:
    """The files recorded in the journals of a running stage: a line per checkpoint, complete
    lines only."""
    done = set()
    for j in dst.glob(journal.JOURNAL + "*"):
        try:
            lines = j.read_text().split("\n")[1:-1]  # the last piece: a torn line, or empty
        except OSError:
            continue
        for line in lines:
            done |= {rel for rel, _ in json.loads(line)}
    return done


def _kill_dataset(src: Path) -> None:
    for i in range(200):
        p = src / "a" / f"s{i:03d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(10240))
    (src / "zz").mkdir()
    with open(src / "zz" / "big.bin", "wb") as f:
        for _ in range(24):
            f.write(os.urandom(32 * 2**20))  # 768 MiB: copied in well under a second, but not at once


def _kill_when(ready, proc, timeout=120):
    """SIGKILL the launcher and every process under it (Open MPI puts ranks in their own process
    groups, so a signal to the launcher's group alone would leave them running)."""
    t0 = time.monotonic()
    while not ready():
        assert proc.poll() is None, "the stage ended before it could be killed"
        assert time.monotonic() - t0 < timeout
        time.sleep(0.002)
    tree = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
    psutil.wait_procs([p for p in map(_proc, tree) if p is not None], timeout=30)


def _proc(pid):
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _check_after_kill(src: Path, dst: Path) -> None:
    """What a reader sees after the kill: only complete files under their final names."""
    assert any(dst.glob(journal.JOURNAL + "*"))
    for p in dst.rglob("*"):
        if p.is_file() and not p.name.startswith("."):
            assert _digest(str(p)) == _digest(str(src / p.relative_to(dst))), f"{p} is incomplete"
    assert not (dst / "zz" / "big.bin").exists()


# -- across namespace nodes -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("stage-nodes"), 2, ROUTED).start()
    yield c
    c.stop()


def node_dir(cluster, i, *rel) -> Path:
    return Path(cluster.dir, "nodes", cluster.names[i], *rel)


@pytest.mark.parametrize("where,launcher", [("rank0-node", "openmpi"), ("shared", "openmpi"), ("rank0-node", "mpich")])
def test_across_nodes(cluster, where, launcher, tmp_path):
    """Source on rank 0's node only (nodelocal/src exists there alone), or on a path every node sees."""
    if where == "shared":
        src, src_on_host = tmp_path / "src", tmp_path / "src"
    else:
        src, src_on_host = Path(cluster.node_local, "src"), node_dir(cluster, 0, "src")
    src_on_host.mkdir(parents=True)
    try:
        make_tree(src_on_host)
        for i in range(200):  # many small files: batched into few broadcasts
            p = src_on_host / "many" / f"m{i:04d}"
            p.parent.mkdir(exist_ok=True)
            p.write_bytes(os.urandom(1000 + i))
        dst = Path(cluster.node_local, "dst")
        lau = getattr(cluster, launcher)([2, 2])
        res = run(lau, 4, "stage.py", str(src), str(dst), tmp_path=tmp_path, timeout=300,
                  env={"HPCSYNC_TEST_STAGE_OPTS": json.dumps({"chunk_bytes": 256 * 1024})})
        r = _ranks_ok(res, 4)
        assert [d["hostname"] for d in res.ranks] == [cluster.names[0]] * 2 + [cluster.names[1]] * 2
        for i in range(2):
            assert snapshot(node_dir(cluster, i, "dst")) == expected(src_on_host), cluster.names[i]
        assert r["nodes"] == 2 and sorted(w[0] for w in r["written"]) == sorted(cluster.names)
        assert all(w[2] == r["bytes"] for w in r["written"])
        assert r["source_reads"] == r["bytes"]  # read once, whatever the number of nodes
        assert r["broadcasts"] <= r["bytes"] // (256 * 1024) + 2 + r["files"] // listing.MAX_PIECES
        # node 1 lost a file: only it is sent again, and only node 1 writes it
        os.unlink(node_dir(cluster, 1, "dst", "d0", "e0", "f000.bin"))
        r = _ranks_ok(run(lau, 4, "stage.py", str(src), str(dst), tmp_path=tmp_path, timeout=300), 4)
        assert r["copied"] == ["d0/e0/f000.bin"]
        assert {w[0]: w[1] for w in r["written"]} == {cluster.names[0]: 0, cluster.names[1]: 1}
        assert snapshot(node_dir(cluster, 1, "dst")) == expected(src_on_host)
    finally:
        for i in range(2):
            subprocess.run(["rm", "-rf", str(node_dir(cluster, i, "dst")), str(node_dir(cluster, i, "src"))])


def test_ten_thousand_small_files_across_nodes(cluster, tmp_path):
    src = tmp_path / "src"
    for i in range(10_000):
        p = src / f"c{i // 1000}" / f"s{i:05d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(i.to_bytes(4, "little") * 2560)  # 10 KiB, different in every file
    dst = Path(cluster.node_local, "dst")
    try:
        r = _ranks_ok(run(cluster.openmpi([1, 1]), 2, "stage.py", str(src), str(dst), tmp_path=tmp_path,
                          timeout=300), 2)
        assert r["files"] == 10_000 and r["bytes"] == 10_000 * 10240
        assert r["broadcasts"] == 7  # 100 MB in rounds of 16 MiB: seven collectives, not ten thousand
        for i in range(2):
            assert snapshot(node_dir(cluster, i, "dst")) == snapshot(src)
    finally:
        for i in range(2):
            subprocess.run(["rm", "-rf", str(node_dir(cluster, i, "dst"))])


@long_run
def test_file_over_2gib_across_nodes(cluster, tmp_path):
    """2 GiB + 1 MiB + 3 bytes; every 8-byte word holds its own offset, so a misplaced chunk shows."""
    src = tmp_path / "big"
    src.mkdir()
    size = 2**31 + 2**20 + 3
    block = 64 * 2**20
    with open(src / "huge.bin", "wb") as f:
        for off in range(0, size, block):
            words = np.arange(off // 8, (off + block) // 8, dtype=np.int64).tobytes()
            f.write(words[: min(block, size - off)])
    dst = Path(cluster.node_local, "dst")
    try:
        r = _ranks_ok(run(cluster.openmpi([1, 1]), 2, "stage.py", str(src), str(dst), tmp_path=tmp_path,
                          timeout=400), 2)
        assert r["bytes"] == size == r["source_reads"], r
        assert r["broadcasts"] == -(-size // listing.DEFAULT_CHUNK_BYTES), r
        want = _digest(str(src / "huge.bin"))
        for i in range(2):
            got = node_dir(cluster, i, "dst", "huge.bin")
            assert got.stat().st_size == size, (cluster.names[i], got.stat().st_size)
            assert _digest(str(got)) == want, (cluster.names[i], _first_difference(src / "huge.bin", got))
    finally:
        os.unlink(src / "huge.bin")
        for i in range(2):
            subprocess.run(["rm", "-rf", str(node_dir(cluster, i, "dst"))])


def _first_difference(a: Path, b: Path):
    """(offset, expected word, got word) of the first differing 8-byte word, for a failure message."""
    with open(a, "rb") as fa, open(b, "rb") as fb:
        off = 0
        while True:
            x, y = fa.read(16 * 2**20), fb.read(16 * 2**20)
            if x != y:
                k = next(i for i in range(min(len(x), len(y)) + 1) if i == min(len(x), len(y)) or x[i] != y[i])
                return off + k, x[k - k % 8: k - k % 8 + 8].hex(), y[k - k % 8: k - k % 8 + 8].hex()
            if not x:
                return None
            off += len(x)


def test_full_disk_on_one_node_is_one_error(cluster, tmp_path):
    """Node 1's local disk is too small: every rank raises the same error naming node 1, and no
    node receives anything."""
    src = tmp_path / "src"
    make_tree(src, files=30)
    full = node_dir(cluster, 1)  # the agent bind-mounts this folder (not its submounts) as nodelocal
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(full)], check=True)
    try:
        res = run(cluster.openmpi([2, 1]), 3, "stage.py", str(src), str(Path(cluster.node_local, "dst")),
                  tmp_path=tmp_path, expect_ok=False, timeout=120)
        _same_error_everywhere(res, 3, f"node {cluster.names[1]}", "not enough space", "nodelocal/dst")
        assert not [p for p in node_dir(cluster, 0, "dst").rglob("*") if p.is_file()]
    finally:
        subprocess.run(["umount", "-l", str(full)])
        subprocess.run(["rm", "-rf", str(node_dir(cluster, 0, "dst"))])


def kill_across_nodes_at_big_file(cluster, lau, src: Path, dst: Path, tmp_path: Path, env=None) -> None:
    """Stage ``_kill_dataset``'s ``src`` across the cluster's two nodes and SIGKILL every process of
    the job, on every node, once both nodes write ``zz/big.bin`` under its temporary name."""
    out = tmp_path / "out"
    out.mkdir()
    full = clean_env({**lau.env, "HPCSYNC_TEST_OUT": str(out), **(env or {})})
    proc = subprocess.Popen([*lau.command(2, full), PY, str(Path(__file__).parent / "programs" / "stage.py"),
                             str(src), str(dst)], env=full, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _kill_when(lambda: all(temporary(node_dir(cluster, i, "dst", "zz"), "big.bin") for i in range(2)), proc)
    for name in cluster.names:  # every process of the job, on every node
        for pid in subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    time.sleep(0.5)


@long_run  # its kin in every run: test_staging_rounds.py, killed in the last of 13 rounds
def test_killed_mid_stage_across_nodes_then_restaged(cluster, tmp_path):
    src = tmp_path / "src"
    _kill_dataset(src)
    dst = Path(cluster.node_local, "dst")
    lau = cluster.openmpi([1, 1])
    try:
        kill_across_nodes_at_big_file(cluster, lau, src, dst, tmp_path)
        for i in range(2):
            _check_after_kill(src, node_dir(cluster, i, "dst"))
        r = _ranks_ok(run(lau, 2, "stage.py", str(src), str(dst), tmp_path=tmp_path, timeout=300), 2)
        assert r["copied"] == ["zz/big.bin"], r["copied"]
        for i in range(2):
            assert snapshot(node_dir(cluster, i, "dst")) == snapshot(src) and no_temporaries(node_dir(cluster, i, "dst"))
    finally:
        for i in range(2):
            subprocess.run(["rm", "-rf", str(node_dir(cluster, i, "dst"))])


def test_destination_shared_by_the_nodes_is_written_once(cluster, tmp_path):
    """A shared filesystem given as ``dst``: the nodes see each other's probe, one writes."""
    src, dst = tmp_path / "src", tmp_path / "shared-dst"
    make_tree(src)
    r = _ranks_ok(run(cluster.openmpi([1, 1]), 2, "stage.py", str(src), str(dst), tmp_path=tmp_path,
                      timeout=300), 2)
    assert {w[0]: w[1] for w in r["written"]} == {cluster.names[0]: r["files"], cluster.names[1]: 0}
    assert snapshot(dst) == expected(src) and no_temporaries(dst)
    r = _ranks_ok(run(cluster.openmpi([1, 1]), 2, "stage.py", str(src), str(dst), tmp_path=tmp_path, timeout=300), 2)
    assert r["copied"] == []


def test_writer_choice_for_shared_destinations():
    # (sees leader 0's probe, sees the previous leader's probe) per leader
    assert _writers([(False, False)] * 3) == [0, 1, 2]  # node-local everywhere
    assert _writers([(False, False), (True, False), (True, True)]) == [0, 0, 0]  # one shared dst
    assert _writers([(False, False), (False, False), (False, True), (False, False)]) == [0, 1, 1, 3]


def test_blocks_keep_folders_whole_and_bound_the_rest():
    e = [listing.Entry(f"f{i}", "f", 0o644, 0, 0, 1000 * (i == 5) + 1) for i in range(12)]
    units = {100: [2, 3, 4]}  # a folder copied whole: one block, never cut
    assert listing.blocks(e, list(range(12)), units, most_files=2, most_bytes=500) == [
        (-1, [0, 1]), (100, [2, 3, 4]), (-1, [5]), (-1, [6, 7]), (-1, [8, 9]), (-1, [10, 11])]
    assert listing.blocks(e, [0, 2, 3, 7], units, most_files=2) == [(-1, [0, 2]), (-1, [3, 7])]  # folder incomplete
    assert listing.blocks(e, [], units) == []
