"""Lightning's Trainer on hpcsync under mpirun (the `lightning` extra is installed by tests/run.sh)."""
import pytest

from launch import openmpi, run


@pytest.mark.parametrize("backend", ["hpcsync", "gloo"])
def test_lightning_trainer_under_mpirun(backend, tmp_path):
    res = run(openmpi(), 2, "lightning_train.py", backend, tmp_path=tmp_path, timeout=300)
    assert [d["rank"] for d in res.ranks] == [0, 1]
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
