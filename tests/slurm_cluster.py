"""A real single-node Slurm cluster (munge + slurmctld + slurmd from Debian) for the tests.

    python tests/slurm_cluster.py start DIR   # prints `export SLURM_CONF=DIR/slurm.conf`
    python tests/slurm_cluster.py stop DIR

Everything lives under DIR (config, state, spool, logs, pid files); the node declares 16 CPUs
(``SlurmdParameters=config_overrides``) so 16-rank jobs fit on a 2-core machine. Needs root and
the packages ``slurm-wlm munge libpmix-dev`` (installed by ``jobs/setup_env.sh --full``).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence, Tuple

CPUS = 16


def config(d: Path, controller: Tuple[str, str], nodes: Sequence[Tuple[str, str]], cpus: int = CPUS,
           ports: Tuple[int, int] = (16817, 16818)) -> str:
    """slurm.conf for ``nodes`` = [(name, address), ...], every daemon's files under ``d``.

    Per-node files carry ``%n`` (the node name), so several slurmd on one machine do not collide;
    ``ports`` (slurmctld's, slurmd's) let two test clusters run side by side on one machine. Each
    cluster numbers its jobs from its own FirstJobId (the time in milliseconds, mod 5e7): the
    job scripts name their folders after the job id (runs/slurm-<id>), which a second cluster
    numbering from 1 would hand out again, into a folder an earlier job left.
    """
    first_job_id = 1000 + int(time.time() * 1000) % 50_000_000
    mem_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 // 2
    node_lines = "".join(f"NodeName={n} NodeAddr={a} CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN\n"
                         for n, a in nodes)
    return f"""\
ClusterName=hpcsync-test
SlurmctldHost={controller[0]}({controller[1]})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SchedulerType=sched/builtin
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.%n.log
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
MinJobAge=300
FirstJobId={first_job_id}
KillWait=5
InactiveLimit=0
{node_lines}PartitionName=debug Nodes={",".join(n for n, _ in nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def free_ports(n: int) -> Tuple[int, ...]:
    """``n`` TCP ports free on loopback now (bound together, so they differ, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return tuple(s.getsockname()[1] for s in socks)
    finally:
        for s in socks:
            s.close()


def munge() -> None:
    """Start the machine's one munged (if not running): every Slurm daemon and node shares it."""
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0:
        return
    run = Path("/run/munge")
    run.mkdir(parents=True, exist_ok=True)
    shutil.chown(run, "munge", "munge")
    if not Path("/etc/munge/munge.key").exists():
        subprocess.run(["mungekey", "-c", "-k", "/etc/munge/munge.key"], check=True)
        shutil.chown("/etc/munge/munge.key", "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True)


def start(d: Path, timeout: float = 60) -> dict:
    """Start the cluster; return the environment clients need (SLURM_CONF)."""
    if os.geteuid() != 0:
        raise RuntimeError("the test Slurm cluster needs root")
    for exe in ("slurmctld", "slurmd", "munged", "srun", "sbatch"):
        if not shutil.which(exe):
            raise RuntimeError(f"{exe} not found: run `bash jobs/setup_env.sh --full` (slurm-wlm munge)")
    host = socket.gethostname()
    d = d.resolve()
    for sub in ("state", f"spool/{host}"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    conf = d / "slurm.conf"
    conf.write_text(config(d, (host, "127.0.0.1"), [(host, "127.0.0.1")], ports=free_ports(2)))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    munge()
    subprocess.run(["slurmctld", "-c"], env=env, check=True)
    subprocess.run(["slurmd", "-N", host], env=env, check=True)
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        state = subprocess.run(["sinfo", "-h", "-n", host, "-o", "%t"], env=env, capture_output=True,
                               text=True).stdout.strip()
        if state == "idle":
            return {"SLURM_CONF": str(conf)}
        time.sleep(0.2)
    log = (d / "slurmctld.log").read_text()[-2000:] if (d / "slurmctld.log").exists() else ""
    stop(d)
    raise RuntimeError(f"slurm node never became idle (state {state!r}); slurmctld.log tail:\n{log}")


def stop(d: Path) -> None:
    for pidfile in [*d.glob("slurmd.*pid"), d / "slurmctld.pid"]:
        if pidfile.exists():
            try:
                pid = int(pidfile.read_text().strip())
                os.kill(pid, signal.SIGTERM)
                for _ in range(50):
                    os.kill(pid, 0)
                    time.sleep(0.1)
            except (ProcessLookupError, ValueError):
                pass


def wait_job(job_id: str, env: dict, timeout: float = 300, on=lambda *argv: list(argv)) -> dict:
    """Poll until the job left the queue; return its scontrol fields (JobState, ExitCode, ...).

    ``on(*argv)``: the argv that runs a client command where the controller is reachable."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        q = subprocess.run(on("squeue", "-h", "-j", job_id), env=env, capture_output=True, text=True)
        if q.returncode == 0 and not q.stdout.strip():
            break
        time.sleep(0.3)
    else:
        subprocess.run(on("scancel", job_id), env=env)
        raise TimeoutError(f"job {job_id} still queued or running after {timeout}s")
    return jobs(job_id, env, on)[0]


def jobs(job_id: str, env: dict, on=lambda *argv: list(argv)) -> list:
    """``scontrol show job -o``: one dict of fields per job (an array's tasks each get one)."""
    out = subprocess.run(on("scontrol", "show", "job", "-o", job_id), env=env, capture_output=True, text=True,
                         check=True).stdout
    return [dict(kv.split("=", 1) for kv in line.split() if "=" in kv) for line in out.splitlines() if line.strip()]


def wait_for(what: str, check, timeout: float = 120, every: float = 0.2, explain=None):
    """Poll ``check()`` until it returns something true; TimeoutError naming ``what`` past
    ``timeout``, with ``explain()``'s text (what the job and Slurm said) when given."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"waited {timeout:g}s for {what}" + (f"\n{explain()}" if explain else ""))


def start_requeued_now(job_id: str, env: dict, restarts: int, on=lambda *argv: list(argv),
                       timeout: float = 120, log=None) -> None:
    """Wait until the job is back in the queue after its ``restarts``-th requeue, then start it at
    once: Slurm holds a requeued job about two minutes (its BeginTime) before it may run again.

    Back in the queue means squeue no longer says COMPLETING (scontrol says PENDING a little
    earlier), and then 2 s more: slurmd compares the new start's credential with the revoked one
    of the run before in whole seconds, and refuses a start within the same second ("Job
    credential revoked": the job then ends FAILED). Past ``timeout`` the error gives the job's
    state as Slurm has it and the end of its output ``log`` (a path), when given."""
    def requeued():
        info = jobs(job_id, env, on)[0]
        state = subprocess.run(on("squeue", "-h", "-j", job_id, "-o", "%T"), env=env, capture_output=True,
                               text=True).stdout.strip()
        return state == "PENDING" and info["JobState"] == "PENDING" and info.get("Restarts") == str(restarts)

    def explain():
        fields = subprocess.run(on("scontrol", "show", "job", "-o", job_id), env=env, capture_output=True,
                                text=True).stdout.strip()
        tail = Path(log).read_text(errors="replace")[-4000:] if log is not None and Path(log).exists() else ""
        return f"scontrol: {fields}" + (f"\nthe end of {log}:\n{tail}" if log is not None else "")

    wait_for(f"job {job_id} to be requeued (restart {restarts})", requeued, timeout, explain=explain)
    time.sleep(2)
    subprocess.run(on("scontrol", "update", f"JobId={job_id}", "StartTime=now"), env=env, check=True,
                   capture_output=True)


if __name__ == "__main__":
    cmd, folder = sys.argv[1], Path(sys.argv[2])
    if cmd == "start":
        print(f"export SLURM_CONF={start(folder)['SLURM_CONF']}")
    else:
        stop(folder)
