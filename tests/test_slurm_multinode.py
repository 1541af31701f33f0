"""Slurm across namespace nodes: one slurmctld, a slurmd in every node with its own hostname and
address (``tests/netns_cluster.py``), ``srun`` and ``sbatch`` from the first node, as users run them."""
import json
import re
import subprocess
import time

import pytest

import slurm_cluster
from launch import PY, ROOT, clean_env, openmpi, run
from multinode_checks import check_multinode_job
from netns_cluster import with_slurm

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = with_slurm(tmp_path_factory.mktemp("slurm-nodes"), 2)
    yield c
    c.stop()


CASES = [  # srun --mpi, backend, tasks per node
    ("pmix", "hpcsync", [2, 2]),  # Open MPI
    ("pmi2", "gloo", [2, 2]),  # MPICH
]


# A step whose MPI start is refused by slurmstepd's pmi2 plugin hangs in MPI_Init: it is ended
# within WATCH_GRACE seconds of the message (netns_cluster.py says why MPICH runs over OFI here).
PMI2_ERROR = "error: mpi/pmi2:"


@pytest.mark.parametrize("mpi,backend,per_node", CASES, ids=[f"{m}-{b}-{'+'.join(map(str, p))}" for m, b, p in CASES])
def test_srun_job_across_nodes(cluster, mpi, backend, per_node, tmp_path):
    """Topology from the step, the proven master address, init, DDP, sync_file and HDF5, rank by rank."""
    work = tmp_path / "work"
    work.mkdir()
    n = sum(per_node)
    srun = cluster.srun(per_node, mpi, "--kill-on-bad-exit=1")
    def cancel():  # the step's job (this module's cluster runs one job at a time), within a bound
        done = subprocess.run(cluster.on_node(0, "scancel", "--user=root"), env=clean_env(srun.env),
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr

    res = run(srun, n, "multinode.py", backend, str(work), cluster.node_local, tmp_path=tmp_path, timeout=300,
              expect_ok=False, watch=(PMI2_ERROR, cancel) if mpi == "pmi2" else None)
    assert res.returncode == 0 and all(d is not None and d["world_size"] == n for d in res.ranks), str(res)
    where = [node for node, k in enumerate(per_node) for _ in range(k)]  # srun's block distribution
    check_multinode_job(res, cluster, where, backend, mpi == "pmix", work, tmp_path)
    assert {d["topology"]["launcher"] for d in res.ranks} == {"slurm"}


def test_srun_uneven_tasks_topology(cluster, tmp_path):
    """3 tasks on 2 nodes: node and local ranks from the step as MPI sees it, not from even division."""
    res = run(cluster.srun([2, 1]), 3, "topo.py", tmp_path=tmp_path, timeout=120)
    want = [(0, 0, 2), (0, 1, 2), (1, 0, 1)]  # node, local rank, local size
    for r, d in enumerate(res.ranks):
        assert (d["rank"], d["num_nodes"], d["launcher"]) == (r, 2, "slurm"), d
        assert (d["node_rank"], d["local_rank"], d["local_size"]) == want[r], d
        assert d["hostname"] == cluster.names[want[r][0]] and d["env_slurm_procid"] == str(r)


def test_srun_hang_report_names_the_rank_and_its_node(cluster, tmp_path):
    timeout = 5
    t0 = time.monotonic()
    res = run(cluster.srun([2, 2]), 4, "stall.py", "hpcsync", "stuck", str(timeout), tmp_path=tmp_path,
              expect_ok=False, env={"HPCSYNC_REPORT_DIR": str(tmp_path)}, timeout=120)
    assert res.returncode != 0 and time.monotonic() - t0 < timeout + 25, res
    assert f"never entered #3: rank(s) 3 on {cluster.names[1]}" in res.stderr, res
    assert f"inside #3: rank(s) 0-2 on {cluster.names[0]}, {cluster.names[1]}" in res.stderr, res
    assert f"rank 3 ({cluster.names[1]}): last operation all_reduce #2" in res.stderr and "STUCK HERE" in res.stderr


def test_srun_raising_rank_ends_the_job(cluster, tmp_path):
    t0 = time.monotonic()
    res = run(cluster.srun([1, 1]), 2, "fail.py", tmp_path=tmp_path, expect_ok=False, timeout=120)
    assert res.returncode != 0 and time.monotonic() - t0 < 60, res
    assert "deliberate failure on rank 1" in res.stderr and "MPI_Abort" in res.stderr, res


def test_srun_wrong_mpi_plugin_is_caught_as_silent_singletons(cluster, tmp_path):
    """MPICH tasks under ``srun --mpi=none`` each see a world of one: every task stops, none runs
    as a fake rank 0."""
    res = run(cluster.srun([2, 2], "none"), 4, "topo.py", tmp_path=tmp_path, expect_ok=False, timeout=120)
    assert res.returncode != 0 and res.ranks == [None] * 4, res
    assert res.stderr.count("silent singletons") == 4 and "srun --mpi=pmi2" in res.stderr, res


def test_sbatch_two_nodes_signalled_requeued_resumed(cluster, tmp_path):
    """``sbatch -N 2 --requeue jobs/slurm_pmix.sbatch``: the batch script on the first node, srun
    across both; SIGUSR1 to the step stops both ranks at one step, rank 0 requeues the job, and it
    comes back and ends with the weights of an uninterrupted run, bit for bit."""
    import torch

    train = "--epochs 40 --samples 1200 --seed 11 --backend hpcsync --step-time 0.03"  # 18 s at the least
    env = clean_env({**cluster.srun([1, 1]).env, "PYTHON": PY, "TRAIN_ARGS": train})
    on = lambda *argv: cluster.on_node(0, *argv)  # noqa: E731
    log = tmp_path / "job.out"
    sub = subprocess.run(on("sbatch", "--parsable", "-N", "2", "--ntasks-per-node=1", f"--output={log}",
                            str(ROOT / "jobs" / "slurm_pmix.sbatch")), env=env, cwd=ROOT, capture_output=True, text=True)
    assert sub.returncode == 0, sub.stderr
    jid = sub.stdout.strip().split(";")[0]
    ref = tmp_path / "reference"  # the same training, never stopped, on this machine (2 ranks under mpirun)
    reference = subprocess.Popen([*openmpi().command(2), PY, str(ROOT / "examples" / "train.py"), *train.split(),
                                  "--out", str(ref)], env=clean_env(openmpi().env), cwd=tmp_path,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = ROOT / "runs" / f"slurm-{jid}"
    try:
        def explain():  # what the job, Slurm and the job's processes said, for a wait that timed out
            ask = lambda *argv: subprocess.run(on(*argv), env=env, capture_output=True, text=True).stdout  # noqa: E731
            ps = [line for line in ask("ps", "-eo", "pid,ppid,etimes,stat,args", "--sort=pid").splitlines()
                  if any(word in line for word in ("srun", "slurmstepd", "train.py"))]
            return "\n".join([f"--- job log\n{log.read_text(errors='replace')[-4000:] if log.exists() else '(none)'}",
                               f"--- scontrol\n{ask('scontrol', 'show', 'job', jid)}", f"--- squeue -s\n{ask('squeue', '-s')}",
                               "--- the job's processes", *ps, cluster.slurm_logs(2500)])

        slurm_cluster.wait_for("the job to train", lambda: log.exists() and "training on " in log.read_text(), 240,
                               explain=explain)
        subprocess.run(on("scancel", "--signal=USR1", jid), env=env, check=True)
        slurm_cluster.start_requeued_now(jid, env, 1, on=on)
        info = slurm_cluster.wait_job(jid, env, timeout=300, on=on)
        text = log.read_text(errors="replace")
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "1", \
            f"{info}\n{text[-3000:]}"
        assert info["NodeList"] == f"{cluster.names[0][:-1]}[0-1]", info
        [step] = re.findall(r"stopped at step (\d+) \(signal SIGUSR1\)", text)
        assert f"requeued Slurm job {jid} (restart 1" in text and f"(step {step})" in text, text[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["nodes"] == 2, summary
        assert reference.wait(timeout=120) == 0, reference.stdout.read()
        w0, w1 = (torch.load(d / "model.pt")["model"] for d in (ref, out))
        assert all(torch.equal(w0[k], w1[k]) for k in w0), "the resumed job's weights differ from the reference's"
        assert (ref / "metrics.csv").read_bytes() == (out / "metrics.csv").read_bytes()
        assert (out / "predictions.h5").exists()
    finally:
        reference.kill()
        subprocess.run(["rm", "-rf", str(out)])
