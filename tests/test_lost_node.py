"""A node lost mid-training ends the job, under each launcher, with the plain command line.

Two routed namespace nodes, 2 ranks each, the hpcsync backend in a loop of all_reduce
(``programs/training_loop.py``). Node 1 then fails in one of three ways: its link goes down
(its processes live on, unreachable), every process on it is SIGKILLed (a crash), or its ranks
are SIGSTOPped (a swapping node, a stalled NFS). Each time the job must exit non-zero within the
group timeout + 45 s. Where the survivors report (all but a crash under mpirun/mpiexec, which
end the job themselves within seconds), the report names the silent ranks and their node.
"""
import os
import signal
import subprocess
import time

import pytest

from launch import PY, PROGRAMS, clean_env
from netns_cluster import ROUTED, Cluster

TIMEOUT = 6  # the group's timeout
FAILURES = ("link", "kill", "stop")
LAUNCHERS = ("openmpi", "mpich", "srun")


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path, 2, ROUTED).start()
    yield c
    c.stop()


def break_node(cluster, failure, out):
    if failure == "link":
        cluster.link_down(1)
    elif failure == "kill":
        cluster.kill_node(1)
    else:
        for f in out.glob("ready*"):
            pid, host = f.read_text().split()
            if host == cluster.names[1]:
                os.kill(int(pid), signal.SIGSTOP)


@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_lost_node_ends_the_job(cluster, launcher, failure, tmp_path):
    if launcher == "srun":
        cluster.start_slurm()
        lau = cluster.srun([2, 2], "pmix")
    else:
        lau = getattr(cluster, launcher)([2, 2])
    out = tmp_path / "out"
    out.mkdir()
    env = clean_env({**lau.env, "HPCSYNC_TEST_OUT": str(out), "HPCSYNC_REPORT_DIR": str(out)})
    cmd = [*lau.command(4, env), PY, str(PROGRAMS / "training_loop.py"), "hpcsync", str(TIMEOUT), "300"]
    log = tmp_path / "job.log"
    with open(log, "w") as f:
        job = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        t0 = time.monotonic()
        while len(list(out.glob("ready*"))) < 4:  # every rank is training
            assert job.poll() is None and time.monotonic() - t0 < 120, log.read_text()[-3000:]
            time.sleep(0.1)
        hosts = sorted(f.read_text().split()[1] for f in out.glob("ready*"))
        assert hosts == sorted(cluster.names * 2)
        broken = time.monotonic()
        break_node(cluster, failure, out)
        try:
            rc = job.wait(timeout=TIMEOUT + 45)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{launcher}: the job still runs {TIMEOUT + 45} s after node 1 was lost ({failure})\n"
                        + log.read_text()[-4000:])
        took = time.monotonic() - broken
    finally:
        if job.poll() is None:
            job.kill()
    text = log.read_text(errors="replace")
    print(f"{launcher} {failure}: ended rc={rc} {took:.1f} s after the failure")
    assert rc != 0, text[-3000:]
    assert not list(out.glob("rank*.json")), "no rank may finish as if nothing happened"
    if failure == "kill" and launcher != "srun":
        assert took < 15, took  # the launcher sees its node daemon die and ends the job at once
        return
    assert f"no reply: rank(s) 2-3 on {cluster.names[1]}" in text, text[-4000:]
    assert "inside #" in text and f"rank(s) 0-1 on {cluster.names[0]}" in text, text[-4000:]
