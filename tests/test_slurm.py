"""On a real single-node Slurm that this test session starts: srun with PMIx / PMI-2, the job
scripts in jobs/ submitted with sbatch, silent singletons, and a failing job."""
import json
import subprocess
from pathlib import Path

import pytest

import slurm_cluster
from launch import PROGRAMS, PY, ROOT, clean_env

pytestmark = pytest.mark.slurm


OPENMPI_ENV = {"MPI4PY_MPIABI": "openmpi", "OMPI_MCA_btl": "self,vader"}


def srun(slurm, args, tmp_path, extra_env=None, expect_ok=True, timeout=180):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    env = clean_env({**slurm, "HPCSYNC_TEST_OUT": str(out), **(extra_env or {})})
    proc = subprocess.run(["srun", *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    if expect_ok:
        assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = sorted(out.glob("rank*.json"))
    return proc, [json.loads(p.read_text()) for p in ranks]


def test_srun_pmix_topology(slurm, tmp_path):
    _, ranks = srun(slurm, ["--mpi=pmix", "-n", "4", PY, str(PROGRAMS / "topo.py")], tmp_path, OPENMPI_ENV)
    assert [d["rank"] for d in ranks] == [0, 1, 2, 3]
    assert all(d["launcher"] == "slurm" and d["world_size"] == 4 and d["local_size"] == 4 for d in ranks)
    assert all(d["mpi_library"].startswith("Open MPI") for d in ranks)


@pytest.mark.parametrize("backend", ["gloo", "hpcsync"])
def test_srun_pmix_init(slurm, tmp_path, backend):
    _, ranks = srun(slurm, ["--mpi=pmix", "-n", "4", PY, str(PROGRAMS / "init.py"), backend], tmp_path, OPENMPI_ENV)
    assert len(ranks) == 4
    assert all(d["backend"] == backend and d["allreduce"] == 10.0 for d in ranks)


def test_srun_pmix_file_sync(slurm, tmp_path):
    target = tmp_path / "metrics.csv"
    args = json.dumps({"_mode": "synced_file", "strip_header": True})
    _, ranks = srun(slurm, ["--mpi=pmix", "-n", "4", PY, str(PROGRAMS / "sync.py"), str(target), args], tmp_path,
                    OPENMPI_ENV)
    lines = target.read_text(encoding="utf-8").splitlines()
    assert lines == ["rank,i,text"] + [f"{r},{i},rång {r}·{i}" for r in range(4) for i in range(r + 1)]


def test_srun_pmi2_with_mpich(slurm, tmp_path):
    _, ranks = srun(slurm, ["--mpi=pmi2", "-n", "3", PY, str(PROGRAMS / "topo.py")], tmp_path)
    assert [d["rank"] for d in ranks] == [0, 1, 2]
    assert all(d["mpi_library"].startswith("MPICH") for d in ranks)


def test_srun_without_plugin_is_silent_singletons(slurm, tmp_path):
    """MPICH under plain srun: every task sees a 1-rank world. hpcsync must stop every task."""
    proc, ranks = srun(slurm, ["-n", "2", PY, str(PROGRAMS / "topo.py")], tmp_path, expect_ok=False)
    assert proc.returncode != 0
    assert ranks == [], "no task may run on as a fake rank 0"
    assert proc.stderr.count("silent singletons") == 2 and "srun --mpi=pmi2" in proc.stderr


def test_srun_pmix_with_mpich_fails_loudly(slurm, tmp_path):
    """The PyPI MPICH refuses PMIx itself (measured); whatever happens, no task runs as rank 0 of 1."""
    proc, ranks = srun(slurm, ["--mpi=pmix", "-n", "2", PY, str(PROGRAMS / "topo.py")], tmp_path, expect_ok=False)
    assert proc.returncode != 0 and ranks == []


def sbatch(slurm, script, tmp_path, env):
    full = clean_env({**slurm, "PYTHON": PY, "TRAIN_ARGS": "--epochs 3 --samples 1500", **env})
    jid = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/slurm-%j.out", str(script)], env=full,
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    info = slurm_cluster.wait_job(jid, full, timeout=400)
    log = (tmp_path / f"slurm-{jid}.out").read_text(errors="replace")
    return jid, info, log


@pytest.mark.parametrize("script,env", [  # (slurm_pmi2.sbatch: under test_requeue.py, signalled)
    ("slurm_mpirun.sbatch", {"MPIRUN": "mpirun.openmpi", "OMPI_ALLOW_RUN_AS_ROOT": "1",
                             "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_btl": "self,vader"}),
])
def test_sbatch_job_scripts_train(slurm, tmp_path, script, env):
    jid, info, log = sbatch(slurm, ROOT / "jobs" / script, tmp_path, env)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{log[-3000:]}"
    out = ROOT / "runs" / f"slurm-{jid}"
    try:
        summary = json.loads((out / "summary.json").read_text())
        assert summary["world_size"] == 4 and summary["loss_last"] < summary["loss_first"]
        rows = (out / "metrics.csv").read_text().splitlines()
        assert rows[0] == "rank,epoch,step,loss" and {r.split(",")[0] for r in rows[1:]} == {"0", "1", "2", "3"}
        assert (out / "predictions.h5").exists() and (out / "model.pt").exists()
    finally:
        subprocess.run(["rm", "-rf", str(out)])


def test_sbatch_stages_the_dataset_before_training(slurm, tmp_path):
    """DATA=... sbatch jobs/slurm_pmix.sbatch: `hpcsync stage` under srun into a fresh private
    folder whose name nobody can guess (no $SLURM_TMPDIR here), then training reads the copy."""
    import numpy as np

    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3000, 2)).astype(np.float32)
    np.savez(data / "spirals.npz", x=x, y=(x[:, 0] > 0).astype(np.int64))
    jid, info, log = sbatch(slurm, ROOT / "jobs" / "slurm_pmix.sbatch", tmp_path, {"DATA": str(data)})
    out = ROOT / "runs" / f"slurm-{jid}"
    name = out / "stage-name"  # the fresh folder's name, drawn by the job script
    local = Path(f"/tmp/hpcsync-{jid}-{name.read_text().strip() if name.exists() else 'missing'}/data")
    try:
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{log[-3000:]}"
        assert log.count("staged ") == 1 and "copied 1 " in log, log[-3000:]
        assert len(name.read_text().strip()) == 16 and (name.stat().st_mode & 0o777) == 0o600
        assert (local.parent.stat().st_mode & 0o777) == 0o700  # made private by stage
        assert (local / "spirals.npz").read_bytes() == (data / "spirals.npz").read_bytes()
        summary = json.loads((out / "summary.json").read_text())
        assert summary["world_size"] == 4 and summary["loss_last"] < summary["loss_first"]
    finally:
        subprocess.run(["rm", "-rf", str(out), str(local.parent)])


def test_failing_job_ends_failed(slurm, tmp_path):
    script = tmp_path / "fail.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --ntasks=4\nsrun --mpi=pmix {PY} {PROGRAMS / 'fail.py'}\n")
    jid, info, log = sbatch(slurm, script, tmp_path, OPENMPI_ENV)
    assert info["JobState"] == "FAILED", info
    assert info["ExitCode"] != "0:0"
    assert "deliberate failure on rank 1" in log


def test_warning_before_the_guard_requeues_the_job_and_blames_no_node(slurm, tmp_path):
    """`scancel --signal=USR1` while the program under `hpcsync run` has no preemption guard yet
    (still importing, say): the signal kills every rank. That says nothing about the node: the job
    is requeued as it is (no ExcNodeList), as the guard would have done, not requeued without the node."""
    script = tmp_path / "warned.sbatch"
    program = "import time; print('rank' + ' up', flush=True); time.sleep(300)"  # 'rank up' only once it runs
    script.write_text(f"#!/bin/bash\n#SBATCH --requeue\n#SBATCH --open-mode=append\n"
                      f"{PY} -m hpcsync run --state-dir {tmp_path / 'state'} -- {PY} -c \"{program}\"\n")
    env = clean_env(slurm)
    log = tmp_path / "warned.out"
    jid = subprocess.run(["sbatch", "--parsable", "--ntasks-per-node=2", f"--output={log}", str(script)], env=env,
                         cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    text = lambda: log.read_text(errors="replace") if log.exists() else ""  # noqa: E731
    try:
        slurm_cluster.wait_for(f"job {jid} to start its program", lambda: text().count("rank up") == 2, 120,
                               explain=text)
        subprocess.run(["scancel", "--signal=USR1", jid], env=env, check=True)

        def requeued():  # Slurm's state, and the supervisor's words once scontrol answered it
            info = slurm_cluster.jobs(jid, env)[0]
            said = f"requeued Slurm job {jid} (restart 1" in text()
            return info if info["JobState"] == "PENDING" and info.get("Restarts") == "1" and said else None

        info = slurm_cluster.wait_for(f"job {jid} to be requeued", requeued, 120,
                                      explain=lambda: f"{slurm_cluster.jobs(jid, env)[0]}\n{text()}")
        assert info["ExcNodeList"] == "(null)", f"{info}\n{text()}"
        assert "killed by SIGUSR1" in text() and "no node is blamed" in text(), text()
        assert f"requeued Slurm job {jid} (restart 1 of at most 8)" in text() and "leaving out" not in text(), text()
    finally:
        subprocess.run(["scancel", jid], env=env)
