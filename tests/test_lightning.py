"""Lightning's Trainer on hpcsync under mpirun (the `lightning` extra is installed by tests/run.sh)."""
import json
import os
import signal
import subprocess
import time

import pytest

from launch import PROGRAMS, PY, clean_env, openmpi, run


@pytest.mark.parametrize("backend", ["hpcsync", "gloo"])
def test_lightning_trainer_under_mpirun(backend, tmp_path):
    res = run(openmpi(), 2, "lightning_train.py", backend, tmp_path=tmp_path, timeout=300)
    assert [d["rank"] for d in res.ranks] == [0, 1]
    assert [d["rank_zero_before_fit"] for d in res.ranks] == [0, 1], "rank_zero_only knew the rank before fit"
    for d in res.ranks:
        assert d["backend"] == backend and d["world_size"] == 2
        assert d["last"] < 0.5 * d["first"], d
        assert d["samples_seen"] == 4 * 8, "DistributedSampler gave each rank half of the 16 batches"
    assert res.ranks[0]["weights"] == res.ranks[1]["weights"], "DDP kept the replicas identical"


@pytest.mark.parametrize("backend", ["hpcsync", "gloo"])
def test_lightning_fabric_under_mpirun(backend, tmp_path):
    res = run(openmpi(), 2, "fabric_train.py", backend, tmp_path=tmp_path, timeout=300)
    assert [d["rank"] for d in res.ranks] == [0, 1]
    for d in res.ranks:
        assert d["backend"] == backend and d["world_size"] == 2
        assert d["last"] < 0.5 * d["first"], d
        assert d["steps"] == 4 * 8 and d["steps_all_ranks"] == 2 * 4 * 8  # each rank: half of 16 batches
    assert res.ranks[0]["weights"] == res.ranks[1]["weights"], "DDP kept the replicas identical"


@pytest.mark.parametrize("form", ["ddp", "sharded"])
def test_a_stop_wins_over_min_epochs_and_skips_validation(tmp_path, form):
    """Trainer(min_epochs=max_epochs=60) with validation, 2 ranks, SIGUSR1 to one of them while it
    trains: both stop after the same batch (Lightning would go on until min_epochs), no validation
    batch runs after the stop, one complete hpc_ckpt_1.ckpt is left, and the job exits 0 (not a
    Slurm job: nothing to requeue). ``sharded``: FSDP2 under ModelParallelStrategy, whose
    checkpoint is a directory of every rank's shard: it is made whole and renamed the same way."""
    root = tmp_path / "root"
    root.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    lau = openmpi()
    env = clean_env({**lau.env, "HPCSYNC_TEST_OUT": str(out)})
    extra = ["sharded"] if form == "sharded" else []
    proc = subprocess.Popen([*lau.command(2, env), PY, str(PROGRAMS / "lightning_stop.py"), str(root), *extra], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (root / "pid1").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    time.sleep(1.0)
    os.kill(int((root / "pid1").read_text()), signal.SIGUSR1)
    stdout, stderr = proc.communicate(timeout=180)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert proc.returncode == 0, stderr[-3000:]
    assert ranks[0]["stopped_at"] == ranks[1]["stopped_at"] is not None, ranks
    for d in ranks:
        assert d["global_step"] == d["stopped_at"] and d["epochs"] < 60 and d["val_after_stop"] == 0, d
        assert [n for n in d["listing"] if n.endswith(".ckpt")] == ["hpc_ckpt_1.ckpt"], d
    if form == "sharded":  # every rank's shard and Lightning's metadata, under the final name
        saved = sorted(p.name for p in (root / "hpc_ckpt_1.ckpt").iterdir())
        assert "meta.pt" in saved and sum(n.endswith(".distcp") for n in saved) == 2, saved
    assert "not a Slurm job, nothing to requeue" in stdout + stderr
