"""In process: how a rank finds its launcher, and the watcher that ends a launcher still waiting."""
import os
import shutil
import subprocess
import sys
import time

from launch import ROOT
from hpcsync import jobend


def test_launcher_is_found_among_the_ancestors(tmp_path):
    """A rank started (through a shell) by a process named mpirun finds it; a plain process does not."""
    mpirun = tmp_path / "mpirun"
    os.symlink(shutil.which("sh"), mpirun)  # /proc/PID/comm is the name it was executed as
    probe = f"{sys.executable} -c 'from hpcsync.jobend import launcher_pid; print(launcher_pid())'"
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
