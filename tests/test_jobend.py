"""In process: how a rank finds its launcher, and the watcher that ends a launcher still waiting."""
import os
import shutil
import subprocess
import sys
import time

from launch import ROOT
from hpcsync.core import jobend


def test_launcher_is_found_among_the_ancestors(tmp_path):
    """A rank started (through a shell) by a process named mpirun finds it; a plain process does not."""
    mpirun = tmp_path / "mpirun"
    os.symlink(shutil.which("sh"), mpirun)  # /proc/PID/comm is the name it was executed as
    probe = f"{sys.executable} -c 'from hpcsync.core.jobend import launcher_pid; print(launcher_pid())'"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([str(mpirun), "-c", f"sh -c \"{probe}\"; true"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    pid, name = eval(out.stdout)  # (pid, 'mpirun')
    assert name == "mpirun" and pid > 1
    assert jobend.launcher_pid() is None  # pytest does not run under a launcher


def test_watcher_terminates_a_launcher_that_outlives_the_grace(tmp_path):
    mpirun = tmp_path / "mpirun"
    os.symlink(shutil.which("sleep"), mpirun)
    waiting = subprocess.Popen([str(mpirun), "60"])
    try:
        t0 = time.monotonic()
        jobend.watch_launcher(waiting.pid, "mpirun", 0.5)
        assert waiting.wait(timeout=10) == -15  # SIGTERM, after the grace
        assert 0.4 < time.monotonic() - t0 < 5
    finally:
        waiting.kill()


def test_watcher_leaves_a_finished_launcher_alone(tmp_path):
    """The pid checked by name before every signal: a launcher that ended is not mistaken for another."""
    other = subprocess.Popen(["sleep", "30"])  # alive, but not named mpirun
    try:
        jobend.watch_launcher(other.pid, "mpirun", 0.2)
        time.sleep(1.0)
        assert other.poll() is None
    finally:
        other.kill()


_STUCK_ABORT = """
import os, re, time, types
from hpcsync.core import jobend, mpi as _mpi

class World:  # an MPI_Abort that never returns and holds the GIL (mpi4py's Abort does not release it)
    def Get_rank(self):
        return 0
    def Abort(self, code):
        re.match(r"(a+)+$", "a" * 64 + "b")  # catastrophic backtracking: C code holding the GIL for ages

_mpi.MPI = lambda: types.SimpleNamespace(COMM_WORLD=World())
jobend.abort(3)
"""


def test_an_abort_that_blocks_holding_the_gil_still_ends_the_process():
    """A Python timer cannot run while MPI_Abort holds the GIL; faulthandler's C thread can: the
    process ends within the grace (1 s here), with every thread's stack on stderr."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HPCSYNC_ABORT_GRACE": "1"}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", _STUCK_ABORT], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and time.monotonic() - t0 < 15, out
    assert "Timeout" in out.stderr and "Abort" in out.stderr, out.stderr  # faulthandler's dump names the frame


def test_the_abort_grace_never_means_forever(monkeypatch):
    for bad in ("0", "-1", "soon", "inf"):
        monkeypatch.setenv("HPCSYNC_ABORT_GRACE", bad)
        assert jobend.grace_s() == 10.0
    monkeypatch.setenv("HPCSYNC_ABORT_GRACE", "2.5")
    assert jobend.grace_s() == 2.5


def test_malformed_settings_are_named_together(monkeypatch):
    from hpcsync.core import settings

    monkeypatch.setenv("HPCSYNC_DEBUG", "maybe")
    monkeypatch.setenv("HPCSYNC_TIMEOUT", "0")
    monkeypatch.setenv("HPCSYNC_STORE", "redis")
    monkeypatch.setenv("HPCSYNC_PROGRESS", "off")  # well-formed
    try:
        settings.validate()
    except ValueError as exc:
        msg = str(exc)
    else:
        raise AssertionError("validate accepted malformed settings")
    assert "HPCSYNC_DEBUG='maybe'" in msg and "HPCSYNC_TIMEOUT='0'" in msg and "HPCSYNC_STORE='redis'" in msg
    assert "PROGRESS" not in msg
    for name in ("HPCSYNC_DEBUG", "HPCSYNC_TIMEOUT", "HPCSYNC_STORE"):
        monkeypatch.delenv(name)
    settings.validate()
