"""hpcsync.Checkpoints on 3 real MPI ranks that each see a different folder, and the requeue
decision (which id, the cap, a missing or refusing scontrol). The requeue itself, on a real
Slurm, is in test_requeue.py."""
import os
import stat

import pytest

from hpcsync import requeue
from launch import openmpi, run


def test_checkpoints_are_written_and_chosen_by_rank_0_only(tmp_path):
    res = run(openmpi(), 3, "checkpoints.py", tmp_path=tmp_path, timeout=180)
    for r, d in enumerate(res.ranks):
        assert d["empty"] and d["latest_empty"] is None, d
        # rank 0's shared state, this rank's own local state, though ranks 1 and 2 have no folder
        assert d["loaded"] == {"step": 12, "shared_w": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], "note": "from rank 0",
                               "local_rank": r, "local_step": 12, "rng_equal": True}, d
        assert d["latest"] == 12 and d["older"] == 7
        assert d["past_leftovers"] == 12, "a temporary, unmarked or cut-short checkpoint was chosen"
        assert d["bad_local"] is not None and "rank 2: cannot serialise its local state" in d["bad_local"], d
        assert d["after_bad_local"] == 12
    assert res.ranks[0]["kept"] == ["OWNER", "step-00000007", "step-00000012"]  # keep=2, and which job uses it
    assert res.ranks[1]["kept"] is False and res.ranks[2]["kept"] is False  # nothing written off rank 0
    assert res.ranks[0]["wrong_world"] == res.ranks[1]["wrong_world"]
    assert "was written by 3 ranks, this job has 2" in res.ranks[0]["wrong_world"]
    assert "wrong_world" not in res.ranks[2]
    assert "skipping" in res.stderr and "differ in size from its marker" in res.stderr


def test_requeue_id_of_an_array_task_and_of_a_job():
    assert requeue.slurm_job_id({"SLURM_JOB_ID": "41", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "1"}) == "40_1"
    assert requeue.slurm_job_id({"SLURM_JOB_ID": "41"}) == "41"
    assert requeue.slurm_job_id({}) is None


def fake_scontrol(tmp_path, rc, says=""):
    """A stand-in for scontrol that records its arguments and answers ``rc`` (the real one runs in
    test_requeue.py)."""
    exe = tmp_path / "scontrol"
    exe.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/args\necho '{says}' >&2\nexit {rc}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe)


@pytest.mark.parametrize("env,cap,scontrol_rc,code,requeued,words", [
    ({}, 8, 0, requeue.EXIT_REQUEUED, False, "not a Slurm job"),
    ({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "2"}, 2, 0, requeue.EXIT_RESTARTS_SPENT, False,
     "restarted 2 time(s), the cap (HPCSYNC_MAX_RESTARTS) is 2"),
    ({"SLURM_JOB_ID": "7"}, 8, None, requeue.EXIT_NO_SCONTROL, False, "scontrol is not on PATH"),
    ({"SLURM_JOB_ID": "7"}, 8, 1, requeue.EXIT_REQUEUE_FAILED, False, "Requested operation is presently disabled"),
    ({"SLURM_JOB_ID": "9", "SLURM_ARRAY_JOB_ID": "8", "SLURM_ARRAY_TASK_ID": "3", "SLURM_RESTART_COUNT": "1"}, 8, 0,
     requeue.EXIT_REQUEUED, True, "requeued Slurm job 8_3 (restart 2 of at most 8)"),
])
def test_requeue_decision(tmp_path, env, cap, scontrol_rc, code, requeued, words):
    exe = None if scontrol_rc is None else fake_scontrol(tmp_path, scontrol_rc, "Requested operation is presently disabled")
    got = requeue._decide(cap, env, exe)
    assert (got.exit_code, got.requeued) == (code, requeued) and words in got.message, got
    assert len({requeue.EXIT_REQUEUE_FAILED, requeue.EXIT_NO_SCONTROL, requeue.EXIT_RESTARTS_SPENT, 0}) == 4
    if requeued:
        assert (tmp_path / "args").read_text().split() == ["requeue", "8_3"]


def test_restart_cap_setting(monkeypatch):
    monkeypatch.setenv("HPCSYNC_MAX_RESTARTS", "3")
    assert requeue.restart_cap() == 3
    monkeypatch.setenv("HPCSYNC_MAX_RESTARTS", "three")
    with pytest.raises(ValueError, match="HPCSYNC_MAX_RESTARTS='three'"):
        requeue.restart_cap()
    monkeypatch.delenv("HPCSYNC_MAX_RESTARTS")
    assert requeue.restart_cap() == 8 and os.environ.get("HPCSYNC_MAX_RESTARTS") is None
