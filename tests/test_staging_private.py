"""Stage-in never writes where another user can reach: a destination that is a symbolic link, a
directory of another user, another user's link on the way, or (while the destination is missing)
another user's folder in a place where anyone may create names (``/tmp/hpcsync-<job>`` made first)
is refused on every rank before anything is written; what stage creates in such a place is private."""
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
    """Theirs at the destination (their files would join the copy), and theirs, made first in a
    folder anyone may create names in, as the nearest existing folder of a missing destination
    (they could swap what stage creates in it). A group's project folder of another user is fine."""
    src = tmp_path / "src"
    make_source(src)
    shared_tmp = tmp_path / "tmp"
    shared_tmp.mkdir()
    os.chmod(shared_tmp, 0o1777)
    theirs = shared_tmp / "hpcsync-42"
    theirs.mkdir()
    (theirs / "planted.txt").write_text("not the dataset\n")
    os.chown(theirs, OTHER, OTHER)
    with pytest.raises(hpcsync.StageError, match=rf"hpcsync-42 is a directory of another user \(uid {OTHER}\)"):
        hpcsync.stage(src, theirs)
    with pytest.raises(hpcsync.StageError, match=rf"hpcsync-42 is a directory of another user \(uid {OTHER}\) where"):
        hpcsync.stage(src, theirs / "data")
    assert os.listdir(theirs) == ["planted.txt"]
    project = tmp_path / "project"  # the group's, its PI's: not a place anyone may create names in
    project.mkdir(mode=0o2775)
    os.chown(project, OTHER, OTHER)
    hpcsync.stage(src, project / "me" / "data")
    assert (project / "me" / "data" / "a.txt").read_text() == "a\n"
    link = tmp_path / "linked"  # their link to a directory of ours, on the way to the destination
    os.symlink(tmp_path / "ours", link)
    (tmp_path / "ours").mkdir()
    os.lchown(link, OTHER, OTHER)
    with pytest.raises(hpcsync.StageError, match=rf"linked is a symbolic link of another user \(uid {OTHER}\)"):
        hpcsync.stage(src, link / "data")
    assert os.listdir(tmp_path / "ours") == []


def test_what_stage_creates_where_anyone_may_create_names_is_private(tmp_path):
    """/tmp/hpcsync-<job>, made by stage: 0700; a folder made in an ordinary one follows the umask."""
    src = tmp_path / "src"
    make_source(src)
    shared_tmp = tmp_path / "tmp"
    shared_tmp.mkdir()
    os.chmod(shared_tmp, 0o1777)
    dst = shared_tmp / "hpcsync-42" / "data"
    hpcsync.stage(src, dst)
    assert (dst / "sub" / "b.txt").read_text() == "b\n"
    assert stat.S_IMODE(os.stat(shared_tmp / "hpcsync-42").st_mode) == 0o700
    umask = os.umask(0o022)
    os.umask(umask)
    hpcsync.stage(src, tmp_path / "plain" / "data")
    assert stat.S_IMODE(os.stat(tmp_path / "plain").st_mode) == 0o777 & ~umask


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
