"""Collective HDF5 writer on the real parallel path (h5py + mpio) and on the gather fallback."""
import subprocess

import h5py
import numpy as np
import pytest

from launch import PY, clean_env, mpich, openmpi, run


def expected(size):
    feats, ids, second = [], [], []
    for r in range(size):
        n = 0 if r == 1 else r + 2
        f = np.full((n, 3), r, dtype=np.float32) + np.arange(n, dtype=np.float32)[:, None] / 100
        feats.append(f)
        second.append(f[: max(0, n - 1)] * -1)
        ids.append(np.arange(n, dtype=np.int64) + 1000 * r)
    return np.concatenate(feats + second), np.concatenate(ids)


def test_parallel_hdf5_is_really_available():
    assert h5py.get_config().mpi, "CI must build h5py against parallel HDF5 (bash tests/run.sh)"


@pytest.mark.parametrize("launcher,n,mode", [(openmpi, 4, "parallel"), (openmpi, 16, "parallel"),
                                              (openmpi, 4, "fallback"), (mpich, 5, "fallback-small-rounds"),
                                              (mpich, 3, "auto"), (openmpi, 2, "auto")])
def test_ragged_rows(launcher, n, mode, tmp_path):
    path = tmp_path / "out.h5"
    res = run(launcher(), n, "h5write.py", str(path), mode, tmp_path=tmp_path)
    # MPICH + auto: h5py is linked to Open MPI -> detected, falls back; Open MPI + auto: parallel
    want_parallel = mode == "parallel" or (mode == "auto" and launcher is openmpi)
    assert all(d["parallel"] is want_parallel for d in res.ranks)
    feats, ids = expected(n)
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(f["feats"][:], feats)
        np.testing.assert_array_equal(f["ids"][:], ids)
        assert f.attrs["world_size"] == n and f.attrs["note"] == "hpcsync" and f["feats"].attrs["units"] == "m"
        assert f["feats"].maxshape == (None, 3) and f["feats"].chunks is not None
    starts = [d["block"][0] for d in res.ranks]
    assert starts == [sum(0 if q == 1 else q + 2 for q in range(r)) for r in range(n)]
    assert res.ranks[1]["block"] == [starts[1], 0]


@pytest.mark.parametrize("mode", ["parallel", "fallback"])
def test_mismatched_trailing_shape_is_an_error_everywhere(mode, tmp_path):
    res = run(openmpi(), 4, "h5write.py", str(tmp_path / "bad.h5"), mode, "bad", tmp_path=tmp_path)
    errors = {d.get("error") for d in res.ranks}
    assert len(errors) == 1 and "rank(s) [3]" in errors.pop()


def test_abi_probe_catches_a_crashing_h5py(tmp_path):
    """An h5py whose mpio open segfaults (as one compiled with MPICH's mpi.h but linked to Open MPI
    does) is detected in a child process, before this process calls into HDF5.

    The crashing h5py here is a stand-in that really dies of SIGSEGV: building a mis-linked h5py
    in CI costs minutes (the real one was checked by hand when the probe was written)."""
    fake = tmp_path / "fake" / "h5py"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "import os, signal\n"
        "class _C:\n    mpi = True\n"
        "def get_config():\n    return _C()\n"
        "def File(*a, **k):\n    os.kill(os.getpid(), signal.SIGSEGV)\n")
    code = ("import hpcsync.data.h5 as h; r = h.mpi_abi_mismatch(); print(r); "
            "assert r == h.mpi_abi_mismatch()")  # second call: from the cache
    env = clean_env({"PYTHONPATH": str(tmp_path / "fake"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
                     "MPI4PY_MPIABI": "openmpi"})
    p = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "compiled against another MPI's headers" in p.stdout and "signal 11" in p.stdout
    assert len(list((tmp_path / "cache" / "hpcsync").iterdir())) == 1
    # the real, correctly built h5py of this environment passes the same probe
    env.pop("PYTHONPATH")
    p = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "", p.stdout + p.stderr
