"""File sync on real MPI jobs: byte-exact merges, failures that lose nothing, > 2 GiB, the CLI."""
import hashlib
import json
import os
import subprocess

import pytest

from hpcsync.data.filesync import part_path
from launch import LAUNCHERS, PY, clean_env, long_run, mpich, openmpi, run


def write_parts(target, parts, parts_dir=None):
    """parts[r] = bytes for rank r, or None for no part at all."""
    for r, data in enumerate(parts):
        p = part_path(str(target), r, parts_dir)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        if data is not None:
            with open(p, "wb") as f:
                f.write(data)


def expected_merge(parts, strip_header=False, text=True):
    """Reference semantics, written independently of hpcsync: rank order, one header, no glued lines."""
    chunks = [p for p in parts if p]
    out, first = [], True
    for data in chunks:
        if strip_header and not first:
            nl = data.find(b"\n")
            data = data[nl + 1:] if nl >= 0 else b""
        first = False
        if data:
            out.append(data)
    if text:
        out = [c if c.endswith(b"\n") or i == len(out) - 1 else c + b"\n" for i, c in enumerate(out)]
    return b"".join(out)


def csv_parts(n):
    parts = []
    for r in range(n):
        rows = "".join(f"{r},{i},naïve ☃ {r}\n" for i in range(r % 3 + 1))
        data = ("rank,i,text\n" + rows).encode()
        if r == 1:
            data = data.rstrip(b"\n")  # no trailing newline
        if r == 2:
            data = b""  # empty part
        parts.append(data)
    return parts


def sync(launcher, n, target, tmp_path, expect_ok=True, **opts):
    res = run(launcher, n, "sync.py", str(target), json.dumps(opts), tmp_path=tmp_path, expect_ok=expect_ok)
    return res


@pytest.mark.parametrize("launcher,n", [(None, 1), ("openmpi", 2), ("mpich", 4), ("openmpi", 16)])
@pytest.mark.parametrize("method", ["copy", "gather", "mpiio"])
def test_csv_with_headers(launcher, n, method, tmp_path):
    target = tmp_path / "merged.csv"
    parts = csv_parts(n)
    write_parts(target, parts)
    res = sync(LAUNCHERS[launcher]() if launcher else None, n, target, tmp_path, strip_header=True, method=method)
    assert target.read_bytes() == expected_merge(parts, strip_header=True)
    assert target.read_bytes().count(b"rank,i,text") == 1
    assert all(d["result"]["method"] == (method if n > 1 or method == "copy" else "gather") for d in res.ranks)
    assert not any(os.path.exists(part_path(str(target), r)) for r in range(n)), "parts deleted after success"
    assert not os.path.exists(os.path.dirname(part_path(str(target), 0))), "empty parts folder removed"


@pytest.mark.parametrize("method", ["copy", "gather", "mpiio"])
def test_binary_parts_byte_exact(method, tmp_path):
    target = tmp_path / "blob.bin"
    parts = [os.urandom(r * 7919 % 50000) for r in range(5)] + [b"", os.urandom(3)]
    write_parts(target, parts, parts_dir=tmp_path / "node-local")
    sync(openmpi(), len(parts), target, tmp_path, text=False, method=method, round_bytes=10000,
         parts_dir=str(tmp_path / "node-local"))
    assert target.read_bytes() == b"".join(parts)


@pytest.mark.parametrize("method,used", [("auto", "copy"), ("gather", "gather")])
def test_torchrun_without_mpi(method, used, tmp_path):
    """torchrun, no MPI: SyncedFile joins over torch.distributed once hpcsync.init() ran (auto: the
    root copies the parts it sees; gather: the bytes travel over torch.distributed)..."""
    target = tmp_path / "metrics.csv"
    res = run(LAUNCHERS["torchrun"](), 3, "sync.py", str(target),
              json.dumps({"_mode": "synced_file", "strip_header": True, "_init": True, "method": method}),
              tmp_path=tmp_path)
    assert {d["result"]["method"] for d in res.ranks} == {used}
    lines = target.read_text(encoding="utf-8").splitlines()
    assert lines == ["rank,i,text"] + [f"{r},{i},rång {r}·{i}" for r in range(3) for i in range(r + 1)]


def test_torchrun_without_any_transport_is_an_error(tmp_path):
    """...and refuses to run as N independent one-rank jobs when nothing connects the ranks."""
    target = tmp_path / "metrics.csv"
    res = run(LAUNCHERS["torchrun"](), 2, "sync.py", str(target), json.dumps({"_mode": "synced_file"}),
              tmp_path=tmp_path, expect_ok=False)
    assert res.returncode != 0 and not target.exists()
    assert "neither MPI (mpi4py) nor torch.distributed" in res.stderr


def test_missing_rank_part_allowed_and_keep_parts(tmp_path):
    target = tmp_path / "m.txt"
    parts = [b"a\n", None, b"c"]
    write_parts(target, parts)
    res = sync(mpich(), 3, target, tmp_path, allow_missing=True, keep_parts=True, root=2)
    assert target.read_bytes() == b"a\nc"
    assert res.ranks[0]["result"]["parts_deleted"] is False
    assert os.path.exists(part_path(str(target), 0)) and os.path.exists(part_path(str(target), 2))


def check_failed(res, target, parts, words, old=None):
    assert res.returncode != 0
    errors = {d["error"] for d in res.ranks}
    assert len(errors) == 1, f"every rank must raise the same error: {errors}"
    msg = errors.pop()
    assert all(w in msg for w in words), msg
    if old is None:
        assert not target.exists()
    else:
        assert target.read_bytes() == old, "a failed sync must leave the old target intact"
    for r, data in enumerate(parts):
        p = part_path(str(target), r)
        if data is not None and os.path.isfile(p):
            assert open(p, "rb").read() == data, "parts must be kept on failure"
    leftovers = [f for f in os.listdir(target.parent) if ".hpcsync-" in f]
    assert leftovers == [], leftovers


def test_missing_part_is_an_error_on_every_rank(tmp_path):
    target = tmp_path / "t.csv"
    parts = [b"h\n1\n", b"h\n2\n", None, b"h\n4\n"]
    write_parts(target, parts)
    target.write_bytes(b"old content\n")
    res = sync(openmpi(), 4, target, tmp_path, expect_ok=False, strip_header=True)
    check_failed(res, target, parts, ["rank 2", "does not exist", "nothing deleted"], old=b"old content\n")


def test_unreadable_part(tmp_path):
    target = tmp_path / "t.csv"
    parts = [b"h\n1\n", b"h\n2\n"]
    write_parts(target, parts)
    os.unlink(part_path(str(target), 1))
    os.mkdir(part_path(str(target), 1))  # a directory where the part should be (root can read any file)
    res = sync(openmpi(), 2, target, tmp_path, expect_ok=False)
    check_failed(res, target, parts[:1], ["rank 1", "not a regular file"])


def test_unequal_headers(tmp_path):
    target = tmp_path / "t.csv"
    parts = [b"a,b\n1,2\n", b"a,c\n3,4\n", b"a,b\n5,6\n", b"a,c\n"]
    write_parts(target, parts)
    res = sync(mpich(), 4, target, tmp_path, expect_ok=False, strip_header=True)
    check_failed(res, target, parts, ["headers differ", "[1, 3]"])
    # and merged anyway when asked
    sync(mpich(), 4, target, tmp_path, strip_header=True, check_headers=False)
    assert target.read_bytes() == b"a,b\n1,2\n3,4\n5,6\n"


def test_bad_target_directory(tmp_path):
    target = tmp_path / "no" / "such" / "dir.csv"
    parts = [b"1\n", b"2\n"]
    write_parts(target, parts, parts_dir=tmp_path)
    res = run(openmpi(), 2, "sync.py", str(target), json.dumps({"parts_dir": str(tmp_path)}), tmp_path=tmp_path,
              expect_ok=False)
    assert res.returncode != 0
    assert {d["error"] for d in res.ranks} == {res.ranks[0]["error"]}
    assert "target directory" in res.ranks[0]["error"] and "does not exist" in res.ranks[0]["error"]
    assert all(open(part_path(str(target), r, tmp_path), "rb").read() == parts[r] for r in range(2))


@pytest.fixture
def tiny_fs(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_disk_full(tiny_fs, tmp_path):
    target = tiny_fs / "big.bin"
    target.write_bytes(b"previous")
    parts = [os.urandom(60000), os.urandom(60000)]
    write_parts(target, parts, parts_dir=tmp_path)
    res = run(openmpi(), 2, "sync.py", str(target), json.dumps({"parts_dir": str(tmp_path), "text": False}),
              tmp_path=tmp_path, expect_ok=False)
    assert {d["error"] for d in res.ranks} == {res.ranks[0]["error"]}
    assert "not enough space" in res.ranks[0]["error"]
    assert target.read_bytes() == b"previous"
    assert all(open(part_path(str(target), r, tmp_path), "rb").read() == parts[r] for r in range(2))


def test_synced_file_with_csv_writer(tmp_path):
    target = tmp_path / "metrics.csv"
    res = run(openmpi(), 4, "sync.py", str(target), json.dumps({"_mode": "synced_file", "strip_header": True}),
              tmp_path=tmp_path)
    lines = target.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "rank,i,text"
    assert lines[1:] == [f"{r},{i},rång {r}·{i}" for r in range(4) for i in range(r + 1)]
    assert all(d["result"]["bytes"] == target.stat().st_size for d in res.ranks)


def test_synced_file_exception_on_one_rank_merges_nothing(tmp_path):
    target = tmp_path / "metrics.csv"
    res = run(openmpi(), 4, "sync.py", str(target),
              json.dumps({"_mode": "synced_file", "strip_header": True, "_fail_rank": 2}),
              tmp_path=tmp_path, expect_ok=False)
    assert not target.exists()
    errs = [d["error"] for d in res.ranks]
    assert errs[2].startswith("KeyError")
    assert all(e.startswith("SyncError") and "rank 2: KeyError" in e for r, e in enumerate(errs) if r != 2)
    assert all(os.path.getsize(d["part"]) > 0 for d in res.ranks), "parts kept"


def test_cli_merge(tmp_path):
    parts = [tmp_path / f"p{i}.csv" for i in range(5)]
    data = [f"x,y\n{i},{i * i}".encode() for i in range(5)]
    for p, d in zip(parts, data):
        p.write_bytes(d)
    want = expected_merge(data, strip_header=True)
    one = tmp_path / "one.csv"
    subprocess.run([PY, "-m", "hpcsync.cli", "merge", str(one), *map(str, parts), "--strip-header"],
                   env=clean_env(), check=True)
    assert one.read_bytes() == want
    two = tmp_path / "two.csv"
    cmd = [*openmpi().command(2), PY, "-m", "hpcsync.cli", "merge", str(two), *map(str, parts), "--strip-header",
           "--delete-parts"]
    proc = subprocess.run(cmd, env=clean_env(openmpi().env), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert two.read_bytes() == want
    assert "merged 5 part(s) from 2 rank(s)" in proc.stdout
    assert not any(p.exists() for p in parts)


@pytest.mark.bigmem
def test_merge_past_2gib_with_bounded_root_memory(tmp_path):
    sizes = [300 * 2**20, 2**31 + 4099]  # total and one single part past 2 GiB
    target = tmp_path / "huge.bin"
    h = hashlib.sha256()
    for r, n in enumerate(sizes):
        p = part_path(str(target), r)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        block = bytes([r + 1]) * (1 << 20)
        with open(p, "wb") as f:
            left = n
            while left:
                k = min(left, len(block))
                f.write(block[:k])
                h.update(block[:k])
                left -= k
    res = run(openmpi(), 2, "sync.py", str(target), json.dumps({"text": False, "method": "gather"}),
              tmp_path=tmp_path, timeout=600)
    assert target.stat().st_size == sum(sizes)
    g = hashlib.sha256()
    with open(target, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            g.update(chunk)
    assert g.hexdigest() == h.hexdigest()
    root_peak = res.ranks[0]["maxrss_kib"] * 1024
    assert root_peak < 1.0 * 2**30, f"root peak RSS {root_peak / 2**20:.0f} MiB for a {sum(sizes) / 2**30:.1f} GiB merge"


@pytest.mark.parametrize("n", [pytest.param(2, marks=long_run), 4])  # (2 ranks: a long run; 4 stays)
def test_repeated_sync_of_one_target_is_race_free(n, tmp_path):
    """1000 back-to-back SyncedFile syncs of one target (a rank's rmdir of the parts folder once
    raced another rank's next part), then two same-named targets sharing one parts_dir."""
    for attempt in range(2):
        work = tmp_path / f"w{attempt}"
        work.mkdir()
        res = run(openmpi(), n, "repeat_sync.py", str(work), "1000", tmp_path=tmp_path, timeout=600)
        assert all(d["bad"] is None for d in res.ranks), res.ranks[0]["bad"]
        assert res.ranks[0]["left"] == ["a", "b", "f.csv", "parts"]  # no stray parts folder
        assert os.listdir(work / "parts") == []


@pytest.mark.parametrize("how,words", [
    ({"_rank1": {"strip_header": False}}, ["different arguments (desync)", "strip_header", "rank(s) [1] False"]),
    ({"_target_per_rank": True}, ["different arguments (desync)", "target", "t.1.csv"]),
    ({"_rank1": {"method": "mpiio"}}, ["different arguments (desync)", "method"]),
])
def test_ranks_that_diverge_get_the_same_error(how, words, tmp_path):
    """A rank calling sync_file with other arguments (or another target) than the rest: before,
    the root's target silently won; now every rank raises the same SyncError, nothing is touched."""
    target = tmp_path / "t.csv"
    parts = [b"h\n1\n", b"h\n2\n", b"h\n3\n"]
    write_parts(target, parts)
    res = sync(openmpi(), 3, target, tmp_path, expect_ok=False, strip_header=True, **how)
    check_failed(res, target, parts, words)
    assert all(open(part_path(str(target), r), "rb").read() == p for r, p in enumerate(parts))


def test_auto_copies_in_the_kernel_when_the_root_sees_every_part(tmp_path):
    """One node: the root concatenates the parts itself (copy_file_range), headers and newlines kept right."""
    target = tmp_path / "merged.csv"
    parts = csv_parts(5)
    write_parts(target, parts)
    res = sync(mpich(), 5, target, tmp_path, strip_header=True)
    assert {d["result"]["method"] for d in res.ranks} == {"copy"}
    assert target.read_bytes() == expected_merge(parts, strip_header=True)


def test_root_that_sees_other_files_at_the_same_path_does_not_copy(tmp_path):
    """Same path, another file on the root (node-local storage): auto gathers; copy is refused on every rank.
    "/proc/self/cwd/part.csv" with a cwd per rank names a different file in each process."""
    target = tmp_path / "m.csv"
    parts = [f"h\n{r}\n".encode() for r in range(3)]
    for r, data in enumerate(parts):
        (tmp_path / f"cwd{r}").mkdir()
        (tmp_path / f"cwd{r}" / "part.csv").write_bytes(data)
    common = {"part": "/proc/self/cwd/part.csv", "strip_header": True, "keep_parts": True, "_chdir_per_rank": True}
    res = run(openmpi(), 3, "sync.py", str(target), json.dumps({**common, "_mode": "sync_part"}), tmp_path=tmp_path)
    assert {d["result"]["method"] for d in res.ranks} == {"gather"}
    assert target.read_bytes() == b"h\n0\n1\n2\n"
    target.unlink()
    res = run(openmpi(), 3, "sync.py", str(target), json.dumps({**common, "_mode": "sync_part", "method": "copy"}),
              tmp_path=tmp_path, expect_ok=False)
    errors = {d["error"] for d in res.ranks}
    assert len(errors) == 1 and "method='copy' needs the root to open every rank's part" in errors.pop(), errors
    assert "another file on the root" in res.ranks[0]["error"] and not target.exists()


@pytest.mark.parametrize("where", ["under a file", "read-only filesystem"])
def test_synced_file_where_no_part_can_be_made_is_a_sync_error(tmp_path, where):
    """The docs promise SyncError for a bad target folder: SyncedFile raised a raw OSError
    (PermissionError for a new user's read-only folder; root here, so a read-only mount)."""
    from hpcsync import SyncedFile, SyncError

    if where == "under a file":
        (tmp_path / "file").write_text("x")
        target = tmp_path / "file" / "metrics.csv"
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)], check=True)
        target = ro / "metrics.csv"
    try:
        with pytest.raises(SyncError, match=r"cannot create this rank's part .*metrics\.csv"):
            SyncedFile(target)
    finally:
        if where != "under a file":
            subprocess.run(["umount", str(tmp_path / "ro")], check=True)


def test_append_names_what_differs_and_refuses_to_join_kept_parts_twice(tmp_path):
    """One process: the joined file's header against a part's that differs is said as it is (it
    read "rank(s) [0] have b'x,y' but rank 0 has b'x,y'"); ``keep_parts=True`` with ``append=True``
    in a block would join the rows a mid-run ``sync()`` kept a second time: refused up front."""
    from hpcsync import SyncError, SyncedFile, sync_file

    target = tmp_path / "m.csv"
    target.write_text("x,y\n1,2\n")
    part = tmp_path / "p.csv"
    part.write_text("a,b\n3,4\n")
    with pytest.raises(SyncError) as err:
        sync_file(str(target), part=str(part), strip_header=True, append=True)
    assert "the joined file starts b'x,y\\n'" in str(err.value) and "start b'a,b\\n'" in str(err.value), err.value
    assert target.read_text() == "x,y\n1,2\n"
    with pytest.raises(ValueError, match="twice"):
        SyncedFile(str(target), append=True, keep_parts=True)
