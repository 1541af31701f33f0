"""A node lost mid-training ends the job, under each launcher, with the plain command line.

Two routed namespace nodes per launcher, one rank each, the hpcsync backend in a loop of
all_reduce (``programs/training_loop.py``). Node 1 then fails in one of three ways: its link
goes down (its processes live on, unreachable), every process on it is SIGKILLed (a crash), or
its ranks are SIGSTOPped (a swapping node, a stalled NFS). Each time the job must exit non-zero
within the group timeout + 45 s. Where the survivors report (all but a crash under mpirun and
mpiexec, which end the job themselves within seconds), the report names the silent ranks and
their node. The three launchers run side by side, each on its own nodes (they mostly wait).
"""
import os
import signal
import subprocess
import time

import pytest

from launch import PY, PROGRAMS, clean_env
from netns_cluster import ROUTED, Cluster

TIMEOUT = 6  # the group's timeout
LAUNCHERS = ("openmpi", "mpich", "srun")


class Job:
    def __init__(self, launcher, base):
        self.name = launcher
        self.cluster = Cluster(base, 2, ROUTED).start()
        if launcher == "srun":
            self.cluster.start_slurm()
            lau = self.cluster.srun([1, 1], "pmix")
        else:
            lau = getattr(self.cluster, launcher)([1, 1])
        self.out = base / f"out-{launcher}"
        self.out.mkdir()
        env = clean_env({**lau.env, "HPCSYNC_TEST_OUT": str(self.out), "HPCSYNC_REPORT_DIR": str(self.out)})
        cmd = [*lau.command(2, env), PY, str(PROGRAMS / "training_loop.py"), "hpcsync", str(TIMEOUT), "300"]
        self.log = base / f"{launcher}.log"
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=base)

    def ready(self):
        assert self.proc.poll() is None, f"{self.name} ended early:\n{self.log.read_text()[-3000:]}"
        return len(list(self.out.glob("ready[0-9]"))) == 2

    def break_node(self, failure):
        c = self.cluster
        if failure == "link":
            c.link_down(1)
        elif failure == "kill":
            c.kill_node(1)
        else:
            for f in self.out.glob("ready[0-9]"):
                pid, host = f.read_text().split()
                if host == c.names[1]:
                    os.kill(int(pid), signal.SIGSTOP)
        self.broken = time.monotonic()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.cluster.stop()


@pytest.mark.parametrize("failure", ["link", "kill", "stop"])
def test_lost_node_ends_the_job(failure, tmp_path):
    jobs = []
    try:
        for name in LAUNCHERS:
            (tmp_path / name).mkdir()
            jobs.append(Job(name, tmp_path / name))
        t0 = time.monotonic()
        while not all(j.ready() for j in jobs):  # every rank of every job is training
            assert time.monotonic() - t0 < 150, {j.name: j.log.read_text()[-2000:] for j in jobs}
            time.sleep(0.1)
        for j in jobs:
            hosts = sorted(f.read_text().split()[1] for f in j.out.glob("ready[0-9]"))
            assert hosts == sorted(j.cluster.names), (j.name, hosts)
            j.break_node(failure)
        ended = {}
        while len(ended) < len(jobs):  # each job's own end time, all watched at once
            for j in jobs:
                if j.name not in ended and j.proc.poll() is not None:
                    ended[j.name] = (j.proc.returncode, time.monotonic() - j.broken)
                elif j.name not in ended and time.monotonic() - j.broken > TIMEOUT + 45:
                    pytest.fail(f"{j.name}: the job still runs {TIMEOUT + 45} s after node 1 was lost ({failure})\n"
                                + j.log.read_text()[-4000:])
            time.sleep(0.05)
        print({k: f"rc={rc} after {s:.1f} s" for k, (rc, s) in ended.items()})
        for j in jobs:
            rc, took = ended[j.name]
            text = j.log.read_text(errors="replace")
            assert rc != 0, (j.name, text[-3000:])
            assert not list(j.out.glob("rank*.json")), f"{j.name}: no rank may finish as if nothing happened"
            if failure == "kill" and j.name != "srun":
                assert took < 15, (j.name, took)  # the launcher sees its node daemon die and ends the job
                continue
            names = j.cluster.names
            assert f"no reply: rank(s) 1 on {names[1]}" in text, (j.name, text[-4000:])
            assert "inside #" in text and f"rank(s) 0 on {names[0]}" in text, (j.name, text[-4000:])
    finally:
        for j in jobs:
            j.stop()
