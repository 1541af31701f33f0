"""hpcsync.preemption under real launchers: a signal to one rank at random moments, to the
launcher, and with DataLoader workers: every rank stops at the same step, the checkpoint holds
it, and the job exits 0."""
import collections
import json
import random
import signal
import subprocess
import time

import psutil
import pytest

from launch import LAUNCHERS, PROGRAMS, PY, clean_env


def start(launcher, n, tmp_path, *args):
    out = tmp_path / "out"
    out.mkdir(parents=True)
    lau = LAUNCHERS[launcher]()
    env = clean_env({**lau.env, "HPCSYNC_TEST_OUT": str(out)})
    python = [] if launcher == "torchrun" else [PY]  # torchrun runs the program with its own
    proc = subprocess.Popen([*lau.command(n, env), *python, str(PROGRAMS / "preempt.py"), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not all((out / f"pid{r}").exists() for r in range(n)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the ranks did not start: {proc.communicate()}")
        time.sleep(0.02)
    return proc, out, [int((out / f"pid{r}").read_text()) for r in range(n)]


def finish(proc, out, n, sig=signal.SIGUSR1):
    """One stop step on every rank, the checkpoint holds it, and the exit code says why: 0 after
    SIGUSR1 (nothing to requeue outside Slurm), 128 + 15 after SIGTERM (an ending signal: never
    requeued); SIGTERM stays ignored after ``close()`` once ``requeue()`` has run."""
    try:
        stdout, stderr = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the job did not stop: {proc.communicate()}")
    code = 0 if sig == signal.SIGUSR1 else 128 + sig
    assert proc.returncode == code, stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]
    steps = {d["stop_step"] for d in ranks}
    assert len(steps) == 1 and None not in steps, ranks
    assert json.loads((out / "ckpt.json").read_text()) == {"step": steps.pop()}, ranks
    assert {d["reason"] for d in ranks} == {f"signal {signal.Signals(sig).name}"}, ranks
    assert {(d["exit_code"], d["requeued"], d["sigterm_after_close"]) for d in ranks} == {(code, False, "SIG_IGN")}
    if sig == signal.SIGTERM:
        assert all("stopped on SIGTERM, which ends a job" in d["message"] for d in ranks), ranks
    return ranks


@pytest.mark.parametrize("launcher", ["openmpi", "mpich"])
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(launcher, tmp_path):
    """10 jobs per MPI library, 4 ranks: SIGUSR1 to one random rank at a random moment (inside
    the 32 MiB Allreduce, sync_file, a sleep, should_stop itself)."""
    rng = random.Random(launcher)
    where = collections.Counter()
    for k in range(10):
        proc, out, pids = start(launcher, 4, tmp_path / str(k), "400")
        victim = rng.randrange(4)
        time.sleep(rng.uniform(0.05, 1.0))
        psutil.Process(pids[victim]).send_signal(signal.SIGUSR1)
        ranks = finish(proc, out, 4)
        assert ranks[victim]["received"] == signal.SIGUSR1 and all(
            d["received"] is None for r, d in enumerate(ranks) if r != victim), ranks
        where.update(ranks[victim]["landed"])
    print(f"\n{launcher}: where the signal landed: {dict(where)}")


@pytest.mark.parametrize("launcher", ["openmpi", "mpich"])
def test_a_signal_to_the_launcher_reaches_every_rank_and_stops_them_together(launcher, tmp_path):
    """mpirun and hydra's mpiexec forward SIGUSR1 to every rank: one stop step all the same."""
    proc, out, _ = start(launcher, 4, tmp_path, "400")
    time.sleep(0.5)
    proc.send_signal(signal.SIGUSR1)
    ranks = finish(proc, out, 4)
    assert all(d["received"] == signal.SIGUSR1 for d in ranks), ranks


@pytest.mark.parametrize("launcher", ["openmpi", "mpich"])
def test_sigterm_to_one_rank_stops_every_rank_and_never_requeues(launcher, tmp_path):
    """SIGTERM (scancel, the end) to one rank: every rank stops at the same step with the
    checkpoint, and the outcome is "not requeued", exit 143, on every rank."""
    proc, out, pids = start(launcher, 3, tmp_path, "400")
    time.sleep(0.5)
    psutil.Process(pids[2]).send_signal(signal.SIGTERM)
    ranks = finish(proc, out, 3, signal.SIGTERM)
    assert ranks[2]["received"] == signal.SIGTERM and ranks[0]["received"] is None, ranks


def test_dataloader_workers_ignore_the_signal(tmp_path):
    """The signal goes to one rank and its two DataLoader workers: the workers live on (the guard's
    worker_init_fn), the ranks stop together."""
    proc, out, pids = start("openmpi", 2, tmp_path, "400", "--loader")
    time.sleep(0.5)
    rank = psutil.Process(pids[1])
    workers = rank.children()
    assert len(workers) == 2, workers
    for p in [rank, *workers]:
        p.send_signal(signal.SIGUSR1)
    finish(proc, out, 2)


def test_without_mpi_the_guard_agrees_over_torch_distributed(tmp_path):
    """torchrun, 2 ranks, gloo: the agreement is a blocking all-gather over torch.distributed; a
    signal to one rank still stops both at the same step."""
    proc, out, pids = start("torchrun", 2, tmp_path, "400")
    time.sleep(0.5)
    psutil.Process(pids[0]).send_signal(signal.SIGUSR1)
    ranks = finish(proc, out, 2)
    assert ranks[0]["received"] == signal.SIGUSR1 and ranks[1]["received"] is None, ranks


@pytest.mark.solo  # close() within 0.5 s
@pytest.mark.parametrize("launcher,args", [("openmpi", ()), ("mpich", ("group",)), ("torchrun", ())],
                         ids=["openmpi", "mpich-torch-group", "torchrun"])
def test_a_rank_that_stops_calling_is_a_timeout_at_the_guards_bound(launcher, args, tmp_path):
    """Rank 1 stops calling should_stop(): rank 0 raises TimeoutError about 2 s (the guard's
    timeout) after the last call they shared -- also without MPI, where the wait was torch's own
    60 s -- and close() afterwards does not wait a second time. A torch group is a valid group=
    under MPI."""
    from launch import run

    res = run(LAUNCHERS[launcher](), 2, "guard_timeout.py", *args, tmp_path=tmp_path, timeout=120, expect_ok=False,
              env={"HPCSYNC_ABORT_GRACE": "2"})
    d = res.ranks[0]
    assert d is not None and res.ranks[1] == {"rank": 1, "world_size": 2, "calls": 3}, res
    assert d["error"].startswith("CollectiveTimeout: hpcsync.preemption: should_stop() #"), d
    assert 1.9 < d["after_s"] < 2 + 1.5 and d["close_s"] < 0.5, d


def test_a_guard_never_made_on_a_rank_is_a_timeout_and_the_job_still_ends(tmp_path):
    """Rank 1 never makes a guard: rank 0's is a CollectiveTimeout at the guard's bound while it
    is being made, and the job ends (MPI_Abort, saying why) instead of waiting forever in
    MPI_Finalize on the duplicate that never completed."""
    from launch import run

    t0 = time.monotonic()
    res = run(LAUNCHERS["openmpi"](), 2, "guard_timeout.py", "never", tmp_path=tmp_path, timeout=120,
              expect_ok=False, env={"HPCSYNC_ABORT_GRACE": "2"})
    took = time.monotonic() - t0
    d = res.ranks[0]
    assert d is not None and d["error"].startswith("CollectiveTimeout: "), res
    assert "hpcsync.preemption: duplicating the communicator timed out" in res.stderr, res.stderr
    assert res.returncode != 0 and took < 60, (took, res)
