"""Topology from real MPI jobs (Open MPI mpirun, MPICH mpiexec) and from launcher environments."""
import subprocess

import pytest

from launch import PY, LAUNCHERS, clean_env, mpich, openmpi, run


@pytest.mark.parametrize("launcher", ["openmpi", "mpich"])
@pytest.mark.parametrize("n", [4, 16])
def test_topology_under_mpi(launcher, n, tmp_path):
    res = run(LAUNCHERS[launcher](), n, "topo.py", tmp_path=tmp_path)
    for r, d in enumerate(res.ranks):
        assert (d["rank"], d["world_size"]) == (r, n)
        # one machine: one node, every rank local
        assert (d["local_rank"], d["local_size"], d["node_rank"], d["num_nodes"]) == (r, n, 0, 1)
        assert d["launcher"] == {"openmpi": "openmpi", "mpich": "hydra"}[launcher]
        assert d["mpi_library"].startswith({"openmpi": "Open MPI", "mpich": "MPICH"}[launcher])
        assert d["imported_torch"] is False
        # block placement: nodes {0,1}, {2,3}, ...
        assert d["block"] == {"node_rank": r // 2, "num_nodes": n // 2, "local_rank": r % 2, "local_size": 2}
        # round-robin placement over n/2 nodes: rank r on node r % (n/2)
        nodes = n // 2
        assert d["roundrobin"] == {"node_rank": r % nodes, "num_nodes": nodes, "local_rank": r // nodes,
                                   "local_size": 2}


def test_mpi_wins_over_slurm_variables(tmp_path):
    """mpirun inside sbatch leaves SLURM_PROCID=0 on every rank: MPI's answer must win."""
    slurm = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0",
             "SLURM_NODEID": "0", "SLURM_JOB_ID": "77", "SLURM_NNODES": "1", "SLURM_TASKS_PER_NODE": "4"}
    res = run(openmpi(), 4, "topo.py", tmp_path=tmp_path, env=slurm)
    assert [d["rank"] for d in res.ranks] == [0, 1, 2, 3]
    assert all(d["env_slurm_procid"] == "0" for d in res.ranks)
    assert all(d["launcher"] == "openmpi" for d in res.ranks)


def test_silent_singletons_are_an_error(tmp_path):
    """MPICH's mpiexec starting processes whose mpi4py loaded Open MPI: each sees a 1-rank world."""
    res = run(mpich(), 2, "topo.py", tmp_path=tmp_path, env={"MPI4PY_MPIABI": "openmpi"}, expect_ok=False)
    assert res.returncode != 0
    assert res.ranks == [None, None], "no rank may run on as a singleton"
    assert res.stderr.count("silent singletons") == 2, res
    assert "MPI4PY_MPIABI" in res.stderr


def test_single_process_without_launcher(tmp_path):
    res = run(None, 1, "topo.py", tmp_path=tmp_path)
    d = res.ranks[0]
    assert (d["rank"], d["world_size"], d["local_size"], d["num_nodes"], d["launcher"], d["mpi_library"]) == \
        (0, 1, 1, 1, "single", None)


def test_import_initialises_nothing():
    code = ("import sys, hpcsync; assert hpcsync.__version__;"
            "print(sorted(m for m in ('mpi4py.MPI', 'torch', 'h5py', 'numpy') if m in sys.modules))")
    out = subprocess.run([PY, "-c", code], env=clean_env({"OMPI_COMM_WORLD_SIZE": "4"}), capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"


def test_cli_info_prints_every_rank_in_order():
    lau = openmpi()
    p = subprocess.run([*lau.command(4), PY, "-m", "hpcsync.cli", "info"], env=clean_env(lau.env),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert lines[0] == "# master address: 127.0.0.1 (single node: loopback)"
    assert [ln.split()[0] for ln in lines[1:]] == [f"rank={r}/4" for r in range(4)]
    assert all("local=" in ln and "ifname=lo" in ln and "mpi=Open MPI" in ln and "hpcsync" in ln for ln in lines[1:])
