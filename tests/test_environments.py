"""Launcher environments and Slurm spec parsing, on real variable sets each launcher exports."""
import pytest

from hpcsync.core.environments import detect_environment, expand_hostlist, parse_tasks_per_node
from hpcsync.core.errors import LaunchError
from hpcsync.core.topology import from_environment


def test_hostlist():
    assert expand_hostlist("node[01-03,07],gpu5") == ["node01", "node02", "node03", "node07", "gpu5"]
    assert expand_hostlist("a[8-10]-ib") == ["a8-ib", "a9-ib", "a10-ib"]
    assert expand_hostlist("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    with pytest.raises(ValueError):
        expand_hostlist("node[01-03")


def test_tasks_per_node():
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("4") == [4]
    with pytest.raises(ValueError):
        parse_tasks_per_node("2(x)")


SRUN = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "2", "SLURM_NTASKS": "8", "SLURM_NNODES": "4",
        "SLURM_STEP_ID": "0", "SLURM_TASKS_PER_NODE": "2(x4)", "SLURM_STEP_NODELIST": "cn[10-13]",
        "SLURM_JOB_ID": "1234"}
TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "x"}
OMPI = {"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_NODE_RANK": "1", "PMIX_RANK": "6"}


def test_srun_environment():
    t = from_environment(SRUN)
    assert (t.rank, t.world_size, t.local_rank, t.local_size, t.node_rank, t.num_nodes, t.launcher) == \
        (5, 8, 1, 2, 2, 4, "slurm")
    assert detect_environment(SRUN).master_addr() == "cn10"


def test_torchrun_environment():
    t = from_environment(TORCHRUN)
    assert (t.rank, t.world_size, t.local_rank, t.local_size, t.node_rank, t.num_nodes) == (3, 4, 1, 2, 1, 2)


def test_openmpi_inside_sbatch_wins():
    t = from_environment({**SRUN, "SLURM_PROCID": "0", **OMPI})
    assert (t.launcher, t.rank, t.local_rank, t.node_rank, t.num_nodes) == ("openmpi", 6, 2, 1, 2)


def test_hydra_without_mpi_refuses_to_guess_nodes():
    env = {"PMI_RANK": "3", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
    with pytest.raises(LaunchError, match="node rank"):
        from_environment(env)
    one_node = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "4"}
    assert from_environment(one_node).node_rank == 0


def test_pmix_alone_is_not_enough():
    with pytest.raises(LaunchError, match="does not export"):
        from_environment({"PMIX_RANK": "1"})


def test_bad_rank_rejected():
    with pytest.raises(LaunchError, match="outside"):
        from_environment({**TORCHRUN, "RANK": "9"})


def test_single_process_default():
    t = from_environment({})
    assert (t.rank, t.world_size, t.launcher) == (0, 1, "single")
