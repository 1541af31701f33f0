"""Stage-in of small files: the listing shared by a node's ranks, modes given at creation, the
kernel copy's fallbacks, leftovers of a killed stage, and a kill amid small files then a resume."""
import hashlib
import json
import os
import shutil
import stat
import struct
import subprocess
import time
from pathlib import Path

import pytest

import hpcsync
from hpcsync.data.staging import destination, fileops, journal, listing, manifest, transfer
from launch import PY, Launcher, clean_env, openmpi, run
from test_staging import (OLD, _kill_when, _ranks_ok, _same_error_everywhere, expected, inodes,
                          journal_records, journaled, make_tree, no_temporaries, snapshot, temporary)

MODES = [0o600, 0o640, 0o644, 0o664, 0o666, 0o700, 0o755, 0o777, 0o444, 0o400, 0o000, 0o4755, 0o2750, 0o1644]


def test_every_mode_whatever_the_umask(tmp_path):
    """A copy is created with its mode when the umask leaves it whole, else given it after; both
    end with the source's mode, set-id and sticky bits included."""
    src = tmp_path / "src"
    src.mkdir()
    for m in MODES:
        p = src / f"m{m:04o}"
        p.write_bytes(os.urandom(100 + m))
        os.chmod(p, m)
    assert fileops.creation_mode(0o644, 0o022) == (0o644, False)
    assert fileops.creation_mode(0o664, 0o022) == (0o600, True)  # the umask would drop group write
    assert fileops.creation_mode(0o4755, 0) == (0o600, True)  # set-id bits are set after creation
    assert fileops.creation_mode(0o644, None) == (0o600, True)  # umask unknown: always set after
    old = os.umask(0o022)
    try:
        assert fileops.process_umask() == 0o022
        for umask in (0o022, 0o077, 0o000):
            os.umask(umask)
            dst = tmp_path / f"dst{umask:03o}"
            hpcsync.stage(src, dst)
            assert snapshot(dst) == snapshot(src), oct(umask)
    finally:
        os.umask(old)


def _default_acl(folder: Path, user: int, group: int, other: int) -> None:
    """A default POSIX ACL on ``folder`` (``setfacl -d -m u::..,g::..,o::..``), set through its
    extended attribute: the acl package (setfacl) is not installed here, the kernel's ACL is the same."""
    entries = ((0x01, user), (0x04, group), (0x20, other))  # ACL_USER_OBJ, ACL_GROUP_OBJ, ACL_OTHER
    os.setxattr(folder, "system.posix_acl_default",
                struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, 0xFFFFFFFF) for tag, perm in entries))


def test_default_acl_on_the_destination_does_not_change_modes(tmp_path):
    """A default ACL on the destination replaces the umask at creation: a copy created with its
    mode (the umask leaves it whole) gets the ACL's instead, so the copy's own mode is checked;
    a copy that an earlier stage left with the ACL's mode and recorded is staged again."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_tree(src, files=12)
    (src / "many").mkdir()
    for i, m in enumerate((0o644, 0o755, 0o664, 0o600, 0o444, 0o640)):  # a folder copied whole
        (src / "many" / f"m{i}").write_bytes(os.urandom(300 + i))
        os.chmod(src / "many" / f"m{i}", m)
    os.chmod(src / "d0" / "e0" / "f000.bin", 0o755)  # a file copied on its own
    dst.mkdir()
    _default_acl(dst, 6, 0, 0)  # what a file created with 0o644 gets: rw-------
    old = os.umask(0o022)
    try:
        probe = os.open(dst / "probe", os.O_WRONLY | os.O_CREAT, 0o644)
        assert stat.S_IMODE(os.fstat(probe).st_mode) == 0o600  # the ACL applies, not the umask
        os.close(probe)
        os.unlink(dst / "probe")
        hpcsync.stage(src, dst)
        assert snapshot(dst) == expected(src)
        # a copy with the ACL's mode, recorded with its ctime: what the stage used to leave
        doc = json.loads((dst / manifest.MANIFEST).read_text())
        for rel in ("many/m0", "d0/e0/f000.bin"):
            os.chmod(dst / rel, 0o600)
            doc["files"][rel][5] = os.lstat(dst / rel).st_ctime_ns
        (dst / manifest.MANIFEST).write_text(json.dumps(doc))
        r = hpcsync.stage(src, dst, names=True)
        assert sorted(r.copied) == ["d0/e0/f000.bin", "many/m0"] and snapshot(dst) == expected(src)
    finally:
        os.umask(old)


def test_copier_fallbacks_copy_every_byte(tmp_path):
    """copy_file_range, then sendfile, then read/write: each copies the same bytes at any offset,
    and a short source answers fewer bytes."""
    data = os.urandom(3 * 2**20 + 17)
    (tmp_path / "a").write_bytes(data)
    for range_copy, sendfile in ((True, True), (False, True), (False, False)):
        c = fileops.Copier()
        c.range_copy, c.sendfile = range_copy, sendfile
        out = tmp_path / f"out-{range_copy}-{sendfile}"
        sfd, dfd = os.open(tmp_path / "a", os.O_RDONLY), os.open(out, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            assert c.copy(sfd, dfd, 1000) == 1000
            assert c.copy(sfd, dfd, len(data) - 1000, 1000) == len(data) - 1000
            assert c.copy(sfd, dfd, 50, len(data) - 10) == 10  # the source ends first
        finally:
            os.close(sfd)
            os.close(dfd)
        assert out.read_bytes() == data


def test_a_kernel_copy_that_answers_zero_is_not_the_end_of_the_file(tmp_path, monkeypatch):
    """Some kernels and filesystems answer 0 from copy_file_range (or sendfile) at offset 0 of a
    file that is not empty; cp then reads and writes. Simulated here (this kernel refuses
    procfs with EXDEV instead): the copy goes on with the next way, exact, and only a plain
    read's 0 is the end of the file."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_tree(src, files=12)
    (src / "many").mkdir()
    for i in range(6):  # a folder copied whole
        (src / "many" / f"m{i}").write_bytes(os.urandom(3000 + i))
    (src / "big.bin").write_bytes(os.urandom(17 * 2**20))  # a file of its own, in its own call
    monkeypatch.setattr(os, "copy_file_range", lambda *a: 0)
    r = hpcsync.stage(src, dst / "a")
    assert snapshot(dst / "a") == expected(src) and r.source_reads == r.bytes
    monkeypatch.setattr(os, "sendfile", lambda *a: 0)
    r = hpcsync.stage(src, dst / "b")
    assert snapshot(dst / "b") == expected(src) and r.source_reads == r.bytes
    c = fileops.Copier()
    sfd, dfd = os.open(src / "many" / "m0", os.O_RDONLY), os.open(tmp_path / "short", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        assert c.copy(sfd, dfd, 5000) == 3000  # the source ends first: the plain read says so
    finally:
        os.close(sfd)
        os.close(dfd)


def test_source_on_another_filesystem(tmp_path):
    """A source on another filesystem than the destination (here: disk to RAM), as a shared
    filesystem is to node-local disk: copy_file_range refuses (EXDEV on most kernels), the copy
    goes on with sendfile, exact."""
    src = tmp_path / "src"
    make_tree(src, files=20)
    (src / "many").mkdir()
    for i in range(20):  # a folder copied whole
        (src / "many" / f"m{i:02d}").write_bytes(os.urandom(5000 + i))
    dst = Path("/dev/shm") / f"hpcsync-test-{os.getpid()}-{tmp_path.name}"
    try:
        r = hpcsync.stage(src, dst)
        assert snapshot(dst) == expected(src) and r.source_reads == r.bytes
    finally:
        shutil.rmtree(dst, ignore_errors=True)


def test_leftover_temporary_without_journal_is_never_taken_for_data(tmp_path):
    """A temporary file with no journal beside it (no stage leaves one: each starts its journal
    before its first temporary name; an older version's, or a copy's): the next call creates the
    copy afresh under its own temporary name (its mode from creation, not the leftover's) and
    leaves the stray one alone."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "f.bin").write_bytes(os.urandom(5000))
    os.chmod(src / "f.bin", 0o644)
    dst.mkdir()
    tag = hashlib.sha1(os.uname().nodename.encode()).hexdigest()[:8]
    leftover = dst / f".f.bin.{tag}{destination.TMP_SUFFIX}"
    leftover.write_bytes(b"partial")
    os.chmod(leftover, 0o600)
    hpcsync.stage(src, dst)
    assert leftover.read_bytes() == b"partial"
    assert (dst / "f.bin").read_bytes() == (src / "f.bin").read_bytes()
    assert os.stat(dst / "f.bin").st_mode & 0o777 == 0o644
    assert [p.name for p in dst.iterdir() if p.name.endswith(destination.TMP_SUFFIX)] == [leftover.name]


def test_killed_before_its_first_checkpoint_leaves_no_temporary_behind(tmp_path):
    """A stage killed while it copies its first file, before any checkpoint: its temporary file
    must not outlive it, even when the next call no longer copies that file (here: gone from the
    source), since loaders that walk the tree see hidden names too."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "z_small.txt").write_text("copied after the big file\n")
    with open(src / "a_big.bin", "wb") as f:  # sparse: made at once, copied in about half a second
        f.truncate(128 * 2**20)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen([PY, str(Path(__file__).parent / "programs" / "stage.py"), str(src), str(dst)],
                            env=clean_env({"HPCSYNC_TEST_OUT": str(out)}), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _kill_when(lambda: temporary(dst, "a_big.bin"), proc)
    assert not journal_records(dst)  # killed before its first checkpoint
    os.unlink(src / "a_big.bin")
    r = hpcsync.stage(src, dst, names=True)
    assert no_temporaries(dst) and snapshot(dst) == snapshot(src) and r.copied == ("z_small.txt",)


def test_the_collector_is_paused_only_inside_and_restored_whatever_happens():
    """The listing and the copies run with Python's cyclic garbage collector off (a tree of small
    files would start full collections of the whole heap); it is on again afterwards, after an
    error too, and a collector the program turned off stays off."""
    import gc

    seen = []
    paused = listing.collector_paused()(lambda fail: seen.append(gc.isenabled()) or (fail and 1 / 0))
    assert gc.isenabled()
    paused(False)
    with pytest.raises(ZeroDivisionError):
        paused(True)
    assert seen == [False, False] and gc.isenabled()
    gc.disable()
    try:
        paused(False)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_listing_in_shares_matches_one_walk(tmp_path):
    """The names walked once and stat'ed in any split give the listing of a single scan; a name
    whose kind changed since the walk is an error, not a wrong listing."""
    src = tmp_path / "src"
    make_tree(src, files=30)
    whole, ignored, err = listing.scan(str(src))
    assert err is None and ignored == ["a_fifo"]
    names, dirs, err = listing.walk_names(str(src))
    for parts in (2, 3, 7):
        stats = []
        for k in range(parts):
            part, err = listing.stat_names(str(src), names, dirs, len(names) * k // parts, len(names) * (k + 1) // parts)
            assert err is None
            stats += part
        entries, left_out = listing.assemble(names, stats)
        assert [e._replace(atime_ns=0) for e in entries] == [e._replace(atime_ns=0) for e in whole]  # a walk reads folders
        assert left_out == ignored
    i = names.index("d0/e0/f000.bin")
    dirs[i] = 1  # walked as a directory, a file when stat'ed
    assert "changed while the source was listed" in listing.stat_names(str(src), names, dirs, 0, len(names))[1]


def test_unreadable_file_in_a_helpers_share_fails_on_every_rank(tmp_path):
    """The last file of the listing is stat'ed by the last rank: its error still reaches every
    rank, naming the file, before anything is copied."""
    src = tmp_path / "src"
    make_tree(src, files=30)
    last = src / "zz" / "zz_last.bin"
    last.parent.mkdir()
    last.write_bytes(b"x" * 100)
    os.chmod(last, 0)
    lau = openmpi()
    unprivileged = Launcher("openmpi", ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *lau.argv],
                            lau.env)
    res = run(unprivileged, 3, "stage.py", str(src), str(tmp_path / "dst"), tmp_path=tmp_path, expect_ok=False,
              timeout=120)
    _same_error_everywhere(res, 3, "zz_last.bin", "not readable")
    assert not (tmp_path / "dst").exists()  # not even created


@pytest.mark.parametrize("rank", [0, 1])
def test_a_journal_that_cannot_be_written_is_one_error_on_every_rank(rank, tmp_path):
    """One rank's journal cannot be written (a directory holds its path): every rank raises the
    same StageError naming that rank, its node and its journal, within seconds, when the job
    neither aborts on an exception nor lets one escape (HPCSYNC_ABORT_ON_EXCEPTION=0, the error
    caught): no rank is left waiting. The root starts its journal before any copy; rank 1 writes
    its own once it has copied a block, before its byte range of a file over SPLIT_BYTES (here
    the root claims no block, as a root slowed by other jobs may not: rank 1 copies them all)."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    for i in range(40):  # files only: no link for the stage to replace while it prepares
        (src / f"d{i % 4}").mkdir(parents=True, exist_ok=True)
        (src / f"d{i % 4}" / f"f{i:02d}").write_bytes(os.urandom(2000 + i))
    opts = {}
    if rank:
        with open(src / "split.bin", "wb") as f:  # sparse: made at once
            f.truncate(transfer.SPLIT_BYTES + 1)
        opts["_fault"] = [{"rank": 0, "patch": "hpcsync.data.staging.transfer:copy_blocks", "do": "return", "value": []}]
    journal_name = journal.JOURNAL + (f".{rank}" if rank else "")
    (dst / journal_name).mkdir(parents=True)
    t0 = time.monotonic()
    res = run(openmpi(), 2, "stage.py", str(src), str(dst), json.dumps(opts), tmp_path=tmp_path, expect_ok=False,
              timeout=60, env={"HPCSYNC_ABORT_ON_EXCEPTION": "0"})
    assert time.monotonic() - t0 < 30
    _same_error_everywhere(res, 2, f"rank {rank}: node {os.uname().nodename}: cannot write the stage journal "
                           f"{dst / journal_name}: Is a directory")
    assert no_temporaries(dst)


def _small_and_big(src: Path) -> None:
    """Eight folders: four of 200 small files (each copied whole), four of one 17 MiB file (a
    rank journals what it finished before such a file)."""
    for k in range(8):
        folder = src / f"a{k}"
        folder.mkdir(parents=True)
        if k % 2:
            (folder / "z.big").write_bytes(os.urandom(17 * 2**20))
            continue
        for i in range(200):
            (folder / f"s{i:04d}").write_bytes(os.urandom(1024 + i))


def test_killed_amid_small_files_then_restaged(tmp_path):
    """SIGKILL once a folder of small files is journaled, while the ranks copy the others: only
    complete files at final names (a folder being filled is hidden), and the next call copies
    exactly what the journals lack."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    _small_and_big(src)
    lau = openmpi()
    out = tmp_path / "out"
    out.mkdir()
    env = clean_env({**lau.env, "HPCSYNC_TEST_OUT": str(out)})
    # each big file starts 5 s late (a slow disk), so a folder journaled is seen before the stage
    # ends, however fast the machine copies
    slow = [{"rank": r, "patch": "hpcsync.data.staging.transfer:copy_file", "call": [1, 2, 3, 4], "do": "sleep",
             "seconds": 5} for r in (0, 1)]
    proc = subprocess.Popen([*lau.command(2), PY, str(Path(__file__).parent / "programs" / "stage.py"), str(src),
                             str(dst), json.dumps({"_fault": slow})], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _kill_when(lambda: journaled(dst) >= 200, proc)
    done = journal_records(dst)
    assert len(done) >= 200
    for p in dst.rglob("*"):  # what a reader sees: complete files only (hidden names are not data)
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(dst).parts):
            assert p.read_bytes() == (src / p.relative_to(dst)).read_bytes(), p
    before = inodes(dst)
    r = _ranks_ok(run(lau, 2, "stage.py", str(src), str(dst), tmp_path=tmp_path), 2)
    assert set(r["copied"]) == {str(p.relative_to(src)) for p in src.rglob("*") if p.is_file()} - done
    assert snapshot(dst) == snapshot(src) and no_temporaries(dst)
    after = inodes(dst)
    assert all(after[p] == before[p] for p in before if os.path.relpath(p, dst) in done)


def test_killed_twice_still_skips_what_the_first_run_finished(tmp_path):
    """Kill, resume, kill again, resume: the second run's journal carries what the first run's
    journals recorded, so the third run copies neither what the first nor what the second
    finished. The first and last runs are one process, the second two ranks (a journal per rank;
    the root's is the one the first run left, which the second starts afresh)."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    every = set()
    for k in range(10):
        folder = src / f"a{k}"
        folder.mkdir(parents=True)
        if k % 2:  # sparse: made at once; a rank journals what it finished before such a file
            with open(folder / "z.big", "wb") as f:
                f.truncate(17 * 2**20)
            every.add(f"a{k}/z.big")
            continue
        for i in range(200):
            (folder / f"s{i:04d}").write_bytes(os.urandom(1024 + i))
            every.add(f"a{k}/s{i:04d}")
    lau = openmpi()
    prog = str(Path(__file__).parent / "programs" / "stage.py")
    out = tmp_path / "out"
    out.mkdir()
    env = clean_env({"HPCSYNC_TEST_OUT": str(out)})

    def start(cmd, e):
        return subprocess.Popen(cmd, env=e, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    _kill_when(lambda: journaled(dst) >= 200, start([PY, prog, str(src), str(dst)], env))
    first = journal_records(dst)
    assert first and not (dst / manifest.MANIFEST).exists()
    _kill_when(lambda: bool(journal_records(dst) - first),
               start([*lau.command(2), PY, prog, str(src), str(dst)], {**env, **lau.env}))
    second = journal_records(dst)
    assert second > first, sorted(first - second)[:5]  # nothing the first run finished is forgotten
    r = _ranks_ok(run(None, 1, "stage.py", str(src), str(dst), tmp_path=tmp_path), 1)
    assert set(r["copied"]) == every - second
    assert snapshot(dst) == snapshot(src) and no_temporaries(dst)


def test_folders_of_small_files_are_copied_whole(tmp_path, monkeypatch):
    """A folder of small files is filled under a hidden name and renamed into place: the same
    tree (contents, modes, mtimes), a folder with links or subfolders copied file by file."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_tree(src)
    for i, m in enumerate(MODES):
        p = src / "many" / f"m{i:02d}"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(os.urandom(i * 100))
        os.chmod(p, m)
        os.utime(p, ns=(OLD, OLD + i))
    filled = []
    real = transfer.fill_folder
    monkeypatch.setattr(transfer, "fill_folder", lambda *a: filled.append(a[4]) or real(*a))
    r = hpcsync.stage(src, dst, names=True)
    assert snapshot(dst) == expected(src) and no_temporaries(dst) and len(r.copied) == r.files
    assert sorted(os.path.relpath(f, src) for f in filled) == ["many"]  # the other folders hold 2 or 3 files
    doc = json.loads((dst / manifest.MANIFEST).read_text())
    assert all(doc["files"][f"many/m{i:02d}"][4] == os.lstat(dst / "many" / f"m{i:02d}").st_ino for i in range(len(MODES)))
    r = hpcsync.stage(src, dst, names=True)
    assert r.copied == () and len(filled) == 1


def test_a_folder_whose_copy_failed_is_not_put_in_place(tmp_path, mount_tmpfs):
    """A folder of small files is filled under a hidden name; when a file of it cannot be
    written (here: the destination runs out of inodes, which the free-space check does not
    count), the stage fails and the folder stays empty: readers never see part of it."""
    src = tmp_path / "src"
    (src / "many").mkdir(parents=True)
    for i in range(12):
        (src / "many" / f"m{i:02d}").write_bytes(os.urandom(1000 + i))
    dst = mount_tmpfs(tmp_path / "small", "size=1m,nr_inodes=10") / "dst"
    with pytest.raises(hpcsync.StageError, match="No space left on device"):
        hpcsync.stage(src, dst)
    assert os.listdir(dst / "many") == [] and no_temporaries(dst)
    assert not (dst / manifest.MANIFEST).exists()


@pytest.mark.parametrize("ranks", [1, 2])
def test_same_tree_from_one_or_more_ranks(ranks, tmp_path):
    """The one-node path gives the same tree whatever the ranks: contents, modes, mtimes, links,
    empty folders, the manifest's records for every file."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_tree(src)
    r = _ranks_ok(run(openmpi(), ranks, "stage.py", str(src), str(dst), tmp_path=tmp_path), ranks)
    assert snapshot(dst) == expected(src) and no_temporaries(dst)
    doc = json.loads((dst / manifest.MANIFEST).read_text())
    assert sorted(doc["files"]) == sorted(r["copied"]) and len(r["copied"]) == r["files"]
    for rel, (size, mtime, mode, _crc, ino, ctime) in doc["files"].items():
        s = os.lstat(dst / rel)
        assert (s.st_size, s.st_mtime_ns, stat.S_IMODE(s.st_mode), s.st_ino, s.st_ctime_ns) == (size, mtime, mode,
                                                                                              ino, ctime), rel


def stage_with_rank1_bind(tmp_path, src, dst, folder, over):
    """stage(src, dst) on 2 ranks of one node, rank 1 in a mount namespace where ``folder`` is
    bind-mounted over the path ``over``; each rank's report."""
    lau = openmpi()
    out = tmp_path / "out"
    out.mkdir()
    prog = str(Path(__file__).parent / "programs" / "stage.py")
    env = clean_env({**lau.env, "HPCSYNC_TEST_OUT": str(out)})
    cmd = [*lau.argv, "-n", "1", PY, prog, str(src), str(dst), ":", "-n", "1", "unshare", "--mount", "sh", "-c",
           f"mount --bind {folder} {over} && exec {PY} {prog} {src} {dst}"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_rank_that_sees_another_source_leaves_its_share_to_the_root(tmp_path):
    """Rank 1 runs in a mount namespace where the source path holds something else: it neither
    stats nor copies anything (its share of both goes to the root), and the copy is exact."""
    src, dst, decoy = tmp_path / "src", tmp_path / "dst", tmp_path / "decoy"
    make_tree(src)
    for i in range(40):
        (src / "many" / f"m{i:03d}").parent.mkdir(exist_ok=True)
        (src / "many" / f"m{i:03d}").write_bytes(os.urandom(3000 + i))
    make_tree(decoy, files=5, seed=1)
    ranks = stage_with_rank1_bind(tmp_path, src, dst, decoy, src)
    assert all(d["ok"] for d in ranks) and ranks[0]["result"]["copied"] == ranks[1]["result"]["copied"]
    assert snapshot(dst) == expected(src) and no_temporaries(dst)
    assert not list(dst.glob(journal.JOURNAL + "*"))


def test_a_rank_that_sees_another_destination_gets_its_own_copy(tmp_path):
    """Rank 1 runs in a mount namespace where the destination path is another directory (as a
    private /tmp per rank in a container): the same path, another folder. Each rank returns
    with the dataset in the destination it sees: rank 1 counts as a node of its own."""
    src, dst, private = tmp_path / "src", tmp_path / "dst", tmp_path / "private"
    make_tree(src)
    for i in range(40):
        (src / "many" / f"m{i:03d}").parent.mkdir(exist_ok=True)
        (src / "many" / f"m{i:03d}").write_bytes(os.urandom(3000 + i))
    dst.mkdir()
    private.mkdir()
    ranks = stage_with_rank1_bind(tmp_path, src, dst, private, dst)
    assert all(d["ok"] for d in ranks), ranks
    r = ranks[0]["result"]
    assert r == {**ranks[1]["result"], "seconds": r["seconds"], "received_bytes": r["received_bytes"]} and r["nodes"] == 2
    assert [w[1:] for w in r["written"]] == [[r["files"], r["bytes"]]] * 2
    for folder in (dst, private):
        assert snapshot(folder) == expected(src) and no_temporaries(folder), folder


def test_journal_lines_old_and_new_are_both_read(tmp_path):
    """A killed stage's journal: a line per checkpoint ([[rel, record], ...]), or, from an older
    version, a line per file ([rel, record]); either way the next call skips what they record,
    and a torn last line is ignored."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_tree(src, files=6)
    hpcsync.stage(src, dst)
    records = json.loads((dst / manifest.MANIFEST).read_text())["files"]
    os.unlink(dst / manifest.MANIFEST)
    rels = sorted(records)
    old, batch, torn = rels[:2], rels[2:5], rels[5]
    head = json.dumps({"source": str(src)}) + "\n"
    (dst / journal.JOURNAL).write_text(head + "".join(json.dumps([r, records[r]]) + "\n" for r in old)
                                       + json.dumps([[r, records[r]] for r in batch]) + "\n"
                                       + json.dumps([[torn, records[torn]]]))
    r = hpcsync.stage(src, dst, names=True)
    assert sorted(r.copied) == sorted(set(rels) - set(old) - set(batch))
    assert snapshot(dst) == expected(src) and not (dst / journal.JOURNAL).exists()


def test_a_kill_amid_the_rewrite_of_a_resumed_journal_loses_nothing(tmp_path):
    """A resumed stage rewrites the journal it found, carrying its records over: killed amid
    that rewrite, before any of it reached the file, the journal still holds every record of
    the killed stage (the rewrite goes to a temporary file that replaces the journal once
    written), and the next call still skips those files."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_tree(src, files=6)
    hpcsync.stage(src, dst)
    records = json.loads((dst / manifest.MANIFEST).read_text())["files"]
    os.unlink(dst / manifest.MANIFEST)
    done = sorted(records)[:4]
    (dst / journal.JOURNAL).write_text(json.dumps({"source": str(src)}) + "\n"
                                       + json.dumps([[r, records[r]] for r in done]) + "\n")
    kill = {"rank": 0, "patch": "hpcsync.data.staging.journal:Journal._flush", "do": "exit"}  # its first flush
    res = run(None, 1, "stage.py", str(src), str(dst), json.dumps({"_fault": [kill]}), tmp_path=tmp_path,
              expect_ok=False)
    assert res.returncode == 9 and res.ranks == [None], res
    assert journal_records(dst) == set(done)
    r = hpcsync.stage(src, dst, names=True)
    assert sorted(r.copied) == sorted(set(records) - set(done))
    assert snapshot(dst) == expected(src) and no_temporaries(dst)
