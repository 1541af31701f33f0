"""examples/train.py trains (loss falls) under every local launcher; srun/sbatch: test_slurm.py."""
import json
import subprocess

import h5py
import numpy as np
import pytest

from launch import LAUNCHERS, PY, ROOT, clean_env

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


@pytest.mark.parametrize("launcher,n,backend", [("openmpi", 16, "auto"), ("mpich", 4, "auto"), ("openmpi", 4, "gloo"),
                                                ("torchrun", 2, "auto"), (None, 1, "auto")])
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
    if launcher == "mpich":  # h5py links Open MPI: the serial fallback, said in one log line, no warning
        assert "RuntimeWarning" not in p.stderr, p.stderr[-3000:]
        assert (p.stdout + p.stderr).count("writing serially") == 1, p.stdout + p.stderr[-3000:]


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
