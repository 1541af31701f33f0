"""hpcsync.init() on real launchers: ranks, port broadcast, exported variables, abort on failure."""
import subprocess
import time

import pytest

from launch import LAUNCHERS, PY, clean_env, openmpi, run


@pytest.mark.parametrize("launcher,n", [("openmpi", 4), ("mpich", 4), ("torchrun", 2)])
def test_init_gloo_allreduce(launcher, n, tmp_path):
    res = run(LAUNCHERS[launcher](), n, "init.py", "gloo", tmp_path=tmp_path)
    ports = {d["env"]["MASTER_PORT"] for d in res.ranks}
    assert len(ports) == 1 and int(ports.pop()) > 0, "every rank must use the port rank 0 bound"
    for r, d in enumerate(res.ranks):
        assert (d["rank"], d["world_size"], d["backend"]) == (r, n, "gloo")
        assert d["allreduce"] == n * (n + 1) / 2
        assert d["env"]["RANK"] == str(r) and d["env"]["WORLD_SIZE"] == str(n)
        assert d["env"]["LOCAL_RANK"] == str(r) and d["env"]["LOCAL_WORLD_SIZE"] == str(n)
        assert d["env"]["MASTER_ADDR"] == ("localhost" if launcher == "torchrun" else "127.0.0.1")
        assert d["same_topology"] is True and d["after_shutdown"] is False
        if launcher != "torchrun":
            assert d["env"]["GLOO_SOCKET_IFNAME"] == "lo"


def test_requested_port_and_file_init(tmp_path):
    res = run(openmpi(), 2, "init.py", "gloo", f"file://{tmp_path}/rendezvous", tmp_path=tmp_path)
    assert [d["allreduce"] for d in res.ranks] == [3.0, 3.0]


def test_single_process(tmp_path):
    res = run(None, 1, "init.py", "gloo", tmp_path=tmp_path)
    assert res.ranks[0]["allreduce"] == 1.0 and res.ranks[0]["backend"] == "gloo"


def test_uncaught_exception_ends_the_job(tmp_path):
    t0 = time.monotonic()
    res = run(openmpi(), 4, "fail.py", tmp_path=tmp_path, expect_ok=False, timeout=120)
    elapsed = time.monotonic() - t0
    assert res.returncode != 0
    assert elapsed < 60, f"job took {elapsed:.0f}s to end"
    assert "uncaught exception on rank 1" in res.stderr
    assert "RuntimeError: deliberate failure on rank 1" in res.stderr
    assert "MPI_Abort" in res.stderr


def test_uncaught_exception_under_mpich_ends_the_job(tmp_path):
    res = run(LAUNCHERS["mpich"](), 2, "fail.py", tmp_path=tmp_path, expect_ok=False, timeout=120)
    assert res.returncode != 0 and "deliberate failure on rank 1" in res.stderr


def test_abort_hook_can_be_turned_off(tmp_path):
    code = ("import sys, hpcsync; hpcsync.init(backend='gloo', abort_on_exception={arg});"
            "print(sys.excepthook.__module__)")
    for arg, env, ours in (("True", {}, True), ("False", {}, False), ("True", {"HPCSYNC_ABORT_ON_EXCEPTION": "0"}, False)):
        out = subprocess.run([PY, "-c", code.format(arg=arg)], env=clean_env(env), capture_output=True, text=True,
                             check=True).stdout.split()[-1]
        assert (out == "hpcsync.start.bootstrap") is ours, (arg, env, out)  # otherwise torch's own hook


def test_hpcsync_backend_without_mpi_is_a_clear_error(tmp_path):
    prog = tmp_path / "p.py"
    prog.write_text("import hpcsync\ntry:\n    hpcsync.init(backend='hpcsync')\n"
                    "except hpcsync.HpcsyncError as e:\n    print('ERR', e)\n")
    p = subprocess.run([*LAUNCHERS["torchrun"]().command(2), str(prog)], env=clean_env(), capture_output=True,
                       text=True, timeout=120)
    assert p.stdout.count("ERR backend 'hpcsync' moves tensors with MPI") == 2, p.stdout + p.stderr[-2000:]


@pytest.mark.parametrize("launcher,n", [(None, 1), ("openmpi", 2)], ids=["one-process", "openmpi-2"])
def test_a_second_init_that_asks_for_something_else_is_an_error(launcher, n, tmp_path):
    """``init()`` then ``init(backend="gloo")`` returned the first topology and kept the first
    backend without a word; now it is a ValueError on every rank naming what differs (the
    backend, the timeout, the store a socket backend uses, the port), while ``init()`` again,
    naming the backend it started, or the same timeout as a timedelta still returns the same
    topology."""
    res = run(LAUNCHERS[launcher]() if launcher else None, n, "init_twice.py", tmp_path=tmp_path, timeout=120)
    for d in res.ranks:
        assert d["same"] and d["same_backend_named"] and d["same_spelled_otherwise"] and d["still"], d
        assert f"backend={'gloo' if d['started'] != 'gloo' else 'hpcsync'!r} (the first started {d['started']!r})" \
            in d["errors"]["backend"], d
        assert "timeout=5 (the first gave 60)" in d["errors"]["timeout"], d
        assert "master_port=1234 (the first gave None)" in d["errors"]["master_port"], d
        if d["started"] == "gloo":  # a store only a socket backend uses: asking for another one is a clash
            assert "store='mpi' (the first used 'tcp')" in d["errors"]["store"], d
        else:
            assert d["errors"].pop("store") is None, d
        assert all("call hpcsync.shutdown() first" in e for e in d["errors"].values()), d
