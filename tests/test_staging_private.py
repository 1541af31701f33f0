"""Stage-in never writes where another user can reach: a destination that is a symbolic link, or
a directory of another user (the destination, or while it is missing its nearest existing
ancestor), is refused on every rank before anything is written; what stage creates is private."""
import json
import os
import stat

import pytest

import hpcsync
from launch import openmpi, run

OTHER = 65534  # nobody: a user other than the one running the tests


def make_source(root):
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("a\n")
    (root / "sub" / "b.txt").write_text("b\n")


def test_a_symbolic_link_at_the_destination_is_refused_and_nothing_goes_through_it(tmp_path):
    src, theirs, dst = tmp_path / "src", tmp_path / "theirs", tmp_path / "dst"
    make_source(src)
    theirs.mkdir()
    os.symlink(theirs, dst)
    with pytest.raises(hpcsync.StageError, match="dst is a symbolic link"):
        hpcsync.stage(src, dst)
    assert os.listdir(theirs) == [] and os.path.islink(dst)


def test_a_directory_of_another_user_is_refused(tmp_path):
    """Theirs at the destination (their files would join the copy), and theirs as the nearest
    existing ancestor of a missing destination (they could swap what stage creates in it)."""
    src = tmp_path / "src"
    make_source(src)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "planted.txt").write_text("not the dataset\n")
    os.chown(theirs, OTHER, OTHER)
    with pytest.raises(hpcsync.StageError, match=rf"theirs is a directory of another user \(uid {OTHER}\)"):
        hpcsync.stage(src, theirs)
    with pytest.raises(hpcsync.StageError, match=rf"theirs is a directory of another user \(uid {OTHER}\)"):
        hpcsync.stage(src, theirs / "job" / "data")
    assert os.listdir(theirs) == ["planted.txt"]
    link = tmp_path / "linked"  # their link to a directory of ours, on the way to the destination
    os.symlink(tmp_path / "ours", link)
    (tmp_path / "ours").mkdir()
    os.lchown(link, OTHER, OTHER)
    with pytest.raises(hpcsync.StageError, match=rf"linked is a symbolic link of another user \(uid {OTHER}\)"):
        hpcsync.stage(src, link / "data")
    assert os.listdir(tmp_path / "ours") == []


def test_the_folders_stage_creates_are_private(tmp_path):
    src = tmp_path / "src"
    make_source(src)
    dst = tmp_path / "job" / "node" / "data"
    hpcsync.stage(src, dst)
    assert (dst / "sub" / "b.txt").read_text() == "b\n"
    for made in (tmp_path / "job", tmp_path / "job" / "node"):
        assert stat.S_IMODE(os.stat(made).st_mode) == 0o700, oct(os.stat(made).st_mode)


def test_every_rank_refuses_the_same_link(tmp_path):
    """Open MPI, 3 ranks on one node: the same StageError on every rank, nothing written."""
    src, theirs, dst = tmp_path / "src", tmp_path / "theirs", tmp_path / "dst"
    make_source(src)
    theirs.mkdir()
    os.symlink(theirs, dst)
    res = run(openmpi(), 3, "stage.py", str(src), str(dst), json.dumps({}), tmp_path=tmp_path, expect_ok=False,
              timeout=120)
    errors = {d["error"] for d in res.ranks if d is not None}
    assert res.returncode != 0 and len(errors) == 1 and None not in res.ranks, res
    (error,) = errors
    assert error.startswith("StageError: ") and "is a symbolic link" in error and os.uname().nodename in error, error
    assert os.listdir(theirs) == []
