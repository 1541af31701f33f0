"""Preemption on a real one-node Slurm, through the job scripts in jobs/: the example is signalled,
stops at one step on every rank, checkpoints, rank 0 requeues the job, and the job comes back and
resumes to the same weights, bit for bit, as a run that was never stopped. Also: a finished job is
not requeued, an array job requeues only the signalled task, the restart cap, and a missing
``scontrol``, and Lightning's Trainer. The four jobs run side by side (one fixture), each test
checks one of them."""
import os
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import slurm_cluster
from launch import PROGRAMS, PY, ROOT, VENV_BIN, clean_env

pytestmark = pytest.mark.slurm

# 480 steps of at least 50 ms: 24 s of training at the least, however fast the machine, against the
# seconds a signal takes to arrive on a loaded one (150 unpaced epochs ran in 0.9 s and missed it)
TRAIN = "--epochs 60 --samples 1200 --seed 11 --backend hpcsync --step-time 0.05"
OPENMPI = {"MPI4PY_MPIABI": "openmpi", "OMPI_MCA_btl": "self,vader"}
MPIRUN = {**OPENMPI, "MPIRUN": "mpirun.openmpi", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def submit(env, script, out, *opts):
    proc = subprocess.run(["sbatch", "--parsable", "--ntasks-per-node=2", f"--output={out}", *opts,
                           str(ROOT / "jobs" / script)], env=env, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def read(path):
    return path.read_text(errors="replace") if path.exists() else ""


def signal_while_training(env, job, log, runs_before, batch=False):
    """Once the run after ``runs_before`` earlier ones started training: SIGUSR1 to the job's
    steps (every srun task) or, with ``batch``, to the batch shell only."""
    def training():  # the guard is installed before the program says "training on"
        return read(log).count("training on ") > runs_before

    slurm_cluster.wait_for(f"job {job} to train ({log.name})", training, timeout=180,
                           explain=lambda: f"the end of {log}:\n{read(log)[-4000:]}")
    subprocess.run(["scancel", *(["--batch"] if batch else []), "--signal=USR1", job], env=env, check=True)


def finish(env, job):
    """Every task's fields once the job (an array: all its tasks) left the queue."""
    slurm_cluster.wait_job(job, env, timeout=300)
    return slurm_cluster.jobs(job, env)


def array_job(slurm, tmp):
    """Array of 2 (jobs/slurm_pmix.sbatch): task 0 runs through, task 1 is signalled once."""
    env = clean_env({**slurm, **OPENMPI, "PYTHON": PY, "TRAIN_ARGS": TRAIN})
    job = submit(env, "slurm_pmix.sbatch", tmp / "array-%A_%a.out", "--array=0-1")
    log1 = tmp / f"array-{job}_1.out"
    signal_while_training(env, f"{job}_1", log1, 0)
    slurm_cluster.start_requeued_now(f"{job}_1", env, 1, log=log1)
    tasks = {int(t["ArrayTaskId"]): t for t in finish(env, job)}
    return {"job": job, "tasks": tasks, "logs": [read(tmp / f"array-{job}_{i}.out") for i in (0, 1)]}


def capped_job(slurm, tmp):
    """HPCSYNC_MAX_RESTARTS=1, jobs/slurm_mpirun.sbatch, signalled twice through the batch shell."""
    env = clean_env({**slurm, **MPIRUN, "PYTHON": PY, "TRAIN_ARGS": TRAIN, "HPCSYNC_MAX_RESTARTS": "1"})
    log = tmp / "capped.out"
    job = submit(env, "slurm_mpirun.sbatch", log)
    signal_while_training(env, job, log, 0, batch=True)
    slurm_cluster.start_requeued_now(job, env, 1, log=log)
    signal_while_training(env, job, log, 1, batch=True)
    return {"job": job, "info": finish(env, job)[0], "log": read(log)}


def no_scontrol_job(slurm, tmp):
    """jobs/slurm_pmi2.sbatch (MPICH) with a PATH that has srun but no scontrol, signalled once."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    os.symlink(subprocess.run(["which", "srun"], capture_output=True, text=True, check=True).stdout.strip(),
               bin_dir / "srun")
    env = clean_env({**slurm, "PYTHON": PY, "TRAIN_ARGS": TRAIN})
    log = tmp / "no-scontrol.out"
    job = submit(env, "slurm_pmi2.sbatch", log, f"--export=ALL,PATH={bin_dir}:{VENV_BIN}")
    return {"job": job, "log": log}


def lightning_job(slurm, tmp):
    """lightning.Trainer(**hpcsync.resilience.lightning.trainer_kwargs()) under srun in a --requeue batch job."""
    root = tmp / "lightning"
    root.mkdir()
    script = tmp / "lightning.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --requeue\n#SBATCH --open-mode=append\n"
                      f"srun --mpi=pmix {PY} {PROGRAMS / 'lightning_preempt.py'} {root}\n")
    env = clean_env({**slurm, **OPENMPI})
    log = tmp / "lightning.out"
    proc = subprocess.run(["sbatch", "--parsable", "--ntasks=2", f"--output={log}", str(script)], env=env,
                          cwd=tmp, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    signal_while_training(env, job, log, 0)
    slurm_cluster.start_requeued_now(job, env, 1, log=log)
    return {"job": job, "info": finish(env, job)[0], "log": read(log), "starts": read(root / "starts.txt"),
            "root": root}


def cancelled_job(slurm, tmp):
    """jobs/slurm_pmix.sbatch, plain `scancel` (SIGTERM to every task) while it trains."""
    env = clean_env({**slurm, **OPENMPI, "PYTHON": PY, "TRAIN_ARGS": TRAIN})
    log = tmp / "cancelled.out"
    job = submit(env, "slurm_pmix.sbatch", log)
    slurm_cluster.wait_for(f"job {job} to train", lambda: "training on " in read(log), timeout=180)
    subprocess.run(["scancel", job], env=env, check=True)
    slurm_cluster.wait_job(job, env, timeout=120)
    time.sleep(30)  # a requeue would have made it PENDING again by now
    state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True).stdout
    return {"job": job, "info": slurm_cluster.jobs(job, env)[0], "queued_after_30s": state.strip(), "log": read(log)}


def requeued_by_slurm_job(slurm, tmp):
    """jobs/slurm_pmix.sbatch requeued from outside while it trains (`scontrol requeue`, what
    PreemptMode=REQUEUE does): Slurm's SIGTERM stops it, and Slurm brings it back by itself."""
    env = clean_env({**slurm, **OPENMPI, "PYTHON": PY, "TRAIN_ARGS": TRAIN})
    log = tmp / "slurm-requeued.out"
    job = submit(env, "slurm_pmix.sbatch", log)
    slurm_cluster.wait_for(f"job {job} to train", lambda: "training on " in read(log), timeout=180)
    subprocess.run(["scontrol", "requeue", job], env=env, check=True)
    slurm_cluster.start_requeued_now(job, env, 1, log=log)
    return {"job": job, "info": finish(env, job)[0], "log": read(log)}


def shared_root_array(slurm, tmp):
    """An array of 2 given one CHECKPOINT_DIR, each task training far longer than the test waits:
    the task that claims the root first still runs when the other starts, which must be refused.
    (The node's 16 CPUs are not enough for every job of this module at once, so the second task
    may start only when another job ends.) The first is cancelled once the second has failed."""
    root = tmp / "one-root"
    env = clean_env({**slurm, **OPENMPI, "PYTHON": PY, "CHECKPOINT_DIR": str(root),
                     "TRAIN_ARGS": "--epochs 1000000 --samples 1200 --seed 11 --backend hpcsync --step-time 0.05"})
    job = submit(env, "slurm_pmix.sbatch", tmp / "shared-%A_%a.out", "--array=0-1")
    logs = [tmp / f"shared-{job}_{i}.out" for i in (0, 1)]

    def states():  # by task; the tasks still pending together share one record ("0-1"): left out
        return {int(t["ArrayTaskId"]): t["JobState"] for t in slurm_cluster.jobs(job, env)
                if t.get("ArrayTaskId", "").isdigit()}

    def one_failed():
        now = states()
        return now if "FAILED" in now.values() else None

    try:
        now = slurm_cluster.wait_for(f"a task of array {job} to fail", one_failed, timeout=300,
                                     explain=lambda: f"{states()}\n" + "\n".join(read(p)[-2000:] for p in logs))
    finally:
        subprocess.run(["scancel", job], env=env)
    tasks = {int(t["ArrayTaskId"]): t for t in finish(env, job)}
    return {"job": job, "tasks": tasks, "when_refused": now, "logs": [read(p) for p in logs]}


@pytest.fixture(scope="module")
def jobs(slurm, tmp_path_factory):
    """Every job of the module, side by side. Whatever happens, the runs/slurm-<id> folders the job
    scripts made go at the end, and a failure here cancels what still runs (the cluster serves the
    next modules)."""
    tmp = tmp_path_factory.mktemp("requeue")
    runs = ROOT / "runs"
    before = set(os.listdir(runs)) if runs.exists() else set()
    env = clean_env(slurm)
    done = False
    try:
        c = no_scontrol_job(slurm, tmp)  # submitted first: the others wait on it below, in threads
        with ThreadPoolExecutor(6) as pool:
            futures = {"array": pool.submit(array_job, slurm, tmp), "capped": pool.submit(capped_job, slurm, tmp),
                       "lightning": pool.submit(lightning_job, slurm, tmp),
                       "cancelled": pool.submit(cancelled_job, slurm, tmp),
                       "by_slurm": pool.submit(requeued_by_slurm_job, slurm, tmp),
                       "shared_root": pool.submit(shared_root_array, slurm, tmp)}
            signal_while_training(env, c["job"], c["log"], 0)
            c.update(info=finish(env, c["job"])[0], log=read(c["log"]))
            results = {name: f.result() for name, f in futures.items()}
        results["no_scontrol"] = c
        done = True
        yield results
    finally:
        if not done:  # and gone from the queue before their folders go (KillWait: up to 5 s)
            subprocess.run(["scancel", "--user=root"], env=env)
            slurm_cluster.wait_for("the module's jobs to leave the queue", lambda: not subprocess.run(
                ["squeue", "-h", "--user=root"], env=env, capture_output=True, text=True).stdout.strip(), 120)
        for name in (set(os.listdir(runs)) if runs.exists() else set()) - before:
            if name.startswith("slurm-"):
                subprocess.run(["rm", "-rf", str(runs / name)])


def stop_steps(log, sig="SIGUSR1"):
    return [int(s) for s in re.findall(rf"stopped at step (\d+) \(signal {sig}\)", log)]


def test_signalled_task_is_requeued_and_resumes_bitwise(jobs):
    import torch

    a = jobs["array"]
    task, log = a["tasks"][1], a["logs"][1]
    assert task["JobState"] == "COMPLETED" and task["ExitCode"] == "0:0" and task["Restarts"] == "1", f"{task}\n{log}"
    [step] = stop_steps(log)
    assert f"requeued Slurm job {a['job']}_1 (restart 1 of at most 8)" in log, log
    assert re.search(rf"resuming at epoch \d+, batch \d+ \(step {step}\) .*Slurm restart 1", log), log
    ref, resumed = (ROOT / "runs" / f"slurm-{a['tasks'][i]['JobId']}" for i in (0, 1))
    w0, w1 = (torch.load(d / "model.pt")["model"] for d in (ref, resumed))
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0), "weights differ from the reference"
    assert (ref / "metrics.csv").read_bytes() == (resumed / "metrics.csv").read_bytes()


def test_finished_task_is_not_requeued(jobs):
    task, log = jobs["array"]["tasks"][0], jobs["array"]["logs"][0]
    assert task["JobState"] == "COMPLETED" and task["ExitCode"] == "0:0" and task["Restarts"] == "0", task
    assert "stopped at step" not in log and "requeue" not in log and log.count("training on ") == 1, log


def test_restart_cap_ends_the_job_with_a_clear_message(jobs):
    info, log = jobs["capped"]["info"], jobs["capped"]["log"]
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "75:0" and info["Restarts"] == "1", f"{info}\n{log}"
    first, second = stop_steps(log)  # the batch shell forwarded USR1 to mpirun, mpirun to every rank
    assert second > first and re.search(rf"resuming at epoch \d+, batch \d+ \(step {first}\)", log), log
    assert log.count("not requeued: it has restarted 1 time(s), the cap (HPCSYNC_MAX_RESTARTS) is 1") == 1, log


def test_missing_scontrol_is_one_clear_error_and_its_exit_code(jobs):
    info, log = jobs["no_scontrol"]["info"], jobs["no_scontrol"]["log"]
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "69:0" and info["Restarts"] == "0", f"{info}\n{log}"
    assert log.count("scontrol is not on PATH") == 1 and len(stop_steps(log)) == 1, log
    ckpt = ROOT / "runs" / f"slurm-{jobs['no_scontrol']['job']}" / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["OWNER", f"step-{stop_steps(log)[0]:08d}"]


def test_lightning_trainer_is_requeued_and_resumes_from_its_checkpoint(jobs):
    j = jobs["lightning"]
    info, log, starts = j["info"], j["log"], j["starts"].splitlines()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "1", f"{info}\n{log}"
    [stopped] = re.findall(r"every rank stopped at global step (\d+) \(signal SIGUSR1\)", log)
    assert f"requeued Slurm job {j['job']} (restart 1" in log, log
    first = sorted(line for line in starts if " start 0 " in line)
    again = sorted(line for line in starts if " start 1 " in line)
    assert first == ["0 start 0 - 0", "1 start 0 - 0"], starts  # a fresh start, from step 0
    assert again == [f"{r} start 1 hpc_ckpt_1.ckpt {stopped}" for r in (0, 1)], starts  # resumed where it stopped
    assert sorted(line for line in starts if " done " in line) == [f"{r} done {100 * 8}" for r in (0, 1)], starts
    assert [p.name for p in j["root"].glob("*.ckpt")] == ["hpc_ckpt_1.ckpt"]  # nothing left incomplete


def test_scancel_ends_the_job_for_good(jobs):
    """scancel is SIGTERM: every rank stops and checkpoints, nobody requeues; 30 s later the job is
    still gone (Slurm accepts a requeue from inside a job being cancelled: it must not be asked)."""
    j = jobs["cancelled"]
    info, log = j["info"], j["log"]
    assert info["JobState"] in ("CANCELLED", "COMPLETED") and info["Restarts"] == "0", f"{info}\n{log}"
    assert j["queued_after_30s"] == "", j
    [step] = stop_steps(log, "SIGTERM")
    assert f"job {j['job']} stopped on SIGTERM, which ends a job" in log and "requeued Slurm job" not in log, log
    ckpt = ROOT / "runs" / f"slurm-{j['job']}" / "checkpoints"
    assert (ckpt / f"step-{step:08d}" / "COMPLETE").exists(), sorted(p.name for p in ckpt.iterdir())


def test_a_job_slurm_requeued_itself_is_said_so_and_resumes(jobs):
    j = jobs["by_slurm"]
    info, log = j["info"], j["log"]
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "1", f"{info}\n{log}"
    [step] = stop_steps(log, "SIGTERM")
    assert f"Slurm has already requeued job {j['job']} (restart 1)" in log and "ERROR" not in log, log
    assert re.search(rf"resuming at epoch \d+, batch \d+ \(step {step}\) .*Slurm restart 1", log), log


def test_two_array_tasks_on_one_checkpoint_root_one_is_refused(jobs):
    j = jobs["shared_root"]
    refused = next(i for i, state in j["when_refused"].items() if state == "FAILED")
    other = 1 - refused
    assert j["when_refused"][other] == "RUNNING", (j["when_refused"], j["logs"])
    assert j["tasks"][refused]["JobState"] == "FAILED", (j["tasks"], j["logs"])
    assert j["tasks"][other]["JobState"] == "CANCELLED", (j["tasks"], j["logs"])  # ended by the test, not refused
    owner = j["tasks"][other]["JobId"]
    assert f"is in use by Slurm job {owner}, which is still running" in j["logs"][refused], j["logs"][refused]
    assert "training on " not in j["logs"][refused], j["logs"][refused]
