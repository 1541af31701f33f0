"""A node-local disk that stops answering while node-local copies move
(``Checkpoints(root, local_dir=...)``): real 2-rank MPI jobs on this host, each rank a node of its
own (``programs/ckpt_runs.py``), rank 1's first ``open`` of a copy's file never returning -- on
save (the copy of rank 0's files it receives) and on load (its own node's copy it reads). Every
rank ends within the timeout and 45 s with the same CheckpointError naming rank 1, its node, the
file and the phase; none hangs."""
import time

import pytest

from launch import openmpi, run

TIMEOUT = 8


@pytest.mark.parametrize("phase", ["save", "load"])
def test_a_stuck_node_local_disk_ends_every_rank_naming_the_rank_node_file_and_phase(tmp_path, phase):
    root, local = tmp_path / "root", tmp_path / "local"
    if phase == "load":
        run(openmpi(), 2, "ckpt_runs.py", str(root), str(local), "local:5=a", tmp_path=tmp_path, timeout=180)
    t0 = time.monotonic()
    res = run(openmpi(), 2, "ckpt_runs.py", str(root), str(local), "local:7=b" if phase == "save" else "load",
              tmp_path=tmp_path, timeout=TIMEOUT + 120, expect_ok=False,
              env={"HPCSYNC_TEST_STUCK": "xb" if phase == "save" else "rb", "HPCSYNC_TEST_CKPT_TIMEOUT": str(TIMEOUT)})
    took = time.monotonic() - t0
    assert all(d is not None for d in res.ranks), f"a rank did not report (hung, or killed): {res}"
    errors = {(d["results"][0] or {}).get("error") for d in res.ranks}
    assert len(errors) == 1, errors
    [error] = errors
    what = "step 7 not saved" if phase == "save" else "cannot load"
    assert error and f"hpcsync.checkpoint: {what}: rank 1: " in error, error
    for needle in ("its node-local disk stopped answering: rank 1 on fake1: ", f"({phase}): no progress for",
                   str(local / "fake1" / "hpcsync-root-")):
        assert needle in error, (needle, error)
    assert all(d["seconds"][0] < TIMEOUT + 45 for d in res.ranks), [d["seconds"] for d in res.ranks]
    assert res.returncode == 0 and took < TIMEOUT + 90, (res.returncode, took)
