"""examples/train.py trains (loss falls) under every local launcher; srun/sbatch: test_slurm.py."""
import json
import re
import signal
import subprocess
import time

import h5py
import numpy as np
import psutil
import pytest

from launch import LAUNCHERS, PY, ROOT, clean_env, long_run


EXAMPLE = str(ROOT / "examples" / "train.py")


def check_outputs(out, n):
    s = json.loads((out / "summary.json").read_text())
    assert s["world_size"] == n
    assert s["loss_last"] < 0.7 * s["loss_first"], s
    assert s["val_accuracy"] > 0.5
    rows = (out / "metrics.csv").read_text().splitlines()
    assert rows[0] == "rank,epoch,step,loss" and rows.count("rank,epoch,step,loss") == 1
    assert {int(r.split(",")[0]) for r in rows[1:]} == set(range(n))
    with h5py.File(out / "predictions.h5") as f:
        assert f["pred"].shape == f["label"].shape and f["x"].shape[1] == 2
        assert sorted(np.unique(f["rank"][:])) == list(range(n))
        assert abs(float(f.attrs["accuracy"]) - s["val_accuracy"]) < 1e-9
    assert (out / "model.pt").exists()
    return s


@pytest.mark.parametrize("launcher,n,backend", [("openmpi", 16, "auto"), ("torchrun", 2, "auto"),
                                                (None, 1, "auto")])
def test_example_trains(launcher, n, backend, tmp_path):
    out = tmp_path / "run"
    lau = LAUNCHERS[launcher]() if launcher else None
    prefix = lau.command(n) if lau else []
    python = [] if launcher == "torchrun" else [PY]
    cmd = [*prefix, *python, EXAMPLE, "--epochs", "4", "--samples", "3000", "--backend", backend, "--out", str(out)]
    p = subprocess.run(cmd, env=clean_env(lau.env if lau else {}), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    s = check_outputs(out, n)
    expected = {"openmpi": "hpcsync", "mpich": "hpcsync", "torchrun": "gloo", None: "gloo"}[launcher]
    assert s["backend"] == (backend if backend != "auto" else expected)
    assert p.stdout.count("done:") == 1, "the summary is printed by rank 0 only"


@pytest.mark.parametrize("launcher,form", [("mpich", "ddp"), ("openmpi", "fsdp")])
def test_example_signalled_resumes_bitwise(tmp_path, launcher, form):
    """3 ranks, no Slurm: SIGUSR1 to one rank stops all three at one step, the checkpoint is
    written and the job exits 0 (nothing to requeue); the next start resumes from it and ends with
    the weights and metrics of a run that was never stopped, bit for bit. MPICH with DDP; Open MPI
    with the model sharded (``--fsdp``: sharded checkpoints, periodic ones in the background too)."""
    import torch

    lau = LAUNCHERS[launcher]()
    train = [*lau.command(3), PY, EXAMPLE, "--epochs", "40", "--samples", "1800", "--seed", "5",
             *(["--fsdp"] if form == "fsdp" else [])]
    env = clean_env(lau.env)
    ref = subprocess.run([*train, "--out", str(tmp_path / "ref")], env=env, capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    check_outputs(tmp_path / "ref", 3)
    assert json.loads((tmp_path / "ref" / "summary.json").read_text())["backend"] == "hpcsync"
    if launcher == "mpich":  # h5py links Open MPI: the serial fallback, said in one log line, no warning
        assert "RuntimeWarning" not in ref.stderr and (ref.stdout + ref.stderr).count("writing serially") == 1, \
            ref.stderr

    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    cmd = [*train, "--out", str(out), "--checkpoint-dir", str(ckpt), *(["--checkpoint-every", "40"] if form == "fsdp" else [])]
    log = tmp_path / "run.log"
    with open(log, "w") as f:
        job = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while "training on " not in log.read_text() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # (the guard is installed before rank 0 says "training on")
    ranks = [c for c in psutil.Process(job.pid).children(recursive=True) if EXAMPLE in c.cmdline()]
    assert len(ranks) == 3, log.read_text()
    ranks[2].send_signal(signal.SIGUSR1)
    job.wait(timeout=120)
    first = log.read_text()
    assert job.returncode == 0, first[-3000:]
    [step] = re.findall(r"stopped at step (\d+) \(signal SIGUSR1\)", first)
    kept = sorted(p.name for p in ckpt.iterdir())
    assert "not a Slurm job, nothing to requeue" in first and kept[0] == "OWNER" and kept[-1] == f"step-{int(step):08d}"
    assert len(kept) == 2 or form == "fsdp", kept  # (periodic checkpoints too with --fsdp: keep=2)
    if form == "fsdp":  # every rank wrote its own shard
        assert sorted(p.name for p in (ckpt / kept[-1] / "sharded").iterdir() if p.name.endswith(".distcp")) == \
            [f"__{r}_0.distcp" for r in range(3)], kept
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and f"(step {step})" in again.stderr, again.stderr[-3000:]
    w0, w1 = (torch.load(d / "model.pt")["model"] for d in (tmp_path / "ref", out))
    assert all(torch.equal(w0[k], w1[k]) for k in w0), "the resumed run's weights differ"
    assert (tmp_path / "ref" / "metrics.csv").read_bytes() == (out / "metrics.csv").read_bytes()


def test_sync_file_example(tmp_path):
    from launch import mpich

    target = tmp_path / "m.csv"
    lau = mpich()
    p = subprocess.run([*lau.command(3), PY, str(ROOT / "examples" / "sync_file.py"), str(target)],
                       env=clean_env(lau.env), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert target.read_text().splitlines() == ["rank,step,value"] + [f"{r},{s},{r * 10 + s}" for r in range(3)
                                                                      for s in range(3)]
    assert p.stdout.count("bytes from 3 rank(s)") == 1


@long_run
def test_example_reads_its_dataset_from_a_staged_copy(tmp_path):
    from launch import openmpi

    out, data, local = tmp_path / "run", tmp_path / "data", tmp_path / "local"
    lau = openmpi()
    cmd = [*lau.command(3), PY, EXAMPLE, "--epochs", "3", "--samples", "3000", "--out", str(out), "--data", str(data),
           "--stage-to", str(local)]
    for attempt in range(2):
        p = subprocess.run(cmd, env=clean_env(lau.env), capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        check_outputs(out, 3)
        assert (local / "spirals.npz").read_bytes() == (data / "spirals.npz").read_bytes()
        # the first run copies the file, the second finds it staged already
        said = "1 file(s) copied, 0 up to date" if attempt == 0 else "0 file(s) copied, 1 up to date"
        assert said in p.stderr + p.stdout, p.stderr[-2000:]
