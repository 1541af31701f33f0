"""What MPI itself does with a mismatched collective when nothing checks before it: why the
hpcsync backend agrees on every collective *before* its data call (docs/backend.md).

    python bench/raw_mismatch.py [--mpi openmpi mpich] [--elements 262144] [--wait 10]

Two ranks, raw mpi4py on numpy, the communicator's errors returned (``MPI.ERRORS_RETURN``), rank 1
the odd one out: a count one larger (broadcast, all_gather, all_reduce), a root of its own, or
another collective (all_reduce on rank 0, broadcast on rank 1). Each job then meets in a
barrier. Per case and library: what each rank got (returned with its data, an MPI error, or
nothing: the job was killed after ``--wait`` seconds or crashed).
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys

from common import mpirun_env

CASES = ("bcast_count", "allgather_count", "allreduce_count", "bcast_root", "op")


def rank_program(case: str, n: int) -> None:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    r = comm.Get_rank()
    x = np.full(n + (r == 1 and case.endswith("count")), float(r + 1), np.float32)
    out = np.zeros(2 * n + 2, np.float32)  # all_gather: room for the larger count from each rank
    try:
        if case == "bcast_count":
            comm.Bcast(x, root=0)
        elif case == "allgather_count":
            comm.Allgather(x, out)
        elif case == "allreduce_count":
            comm.Allreduce(MPI.IN_PLACE, x)
        elif case == "bcast_root":
            comm.Bcast(x, root=r)
        elif r == 0:
            comm.Allreduce(MPI.IN_PLACE, x)
        else:
            comm.Bcast(x, root=0)
        comm.Barrier()
        wrong = ""  # what no rank sent: a broadcast that left rank 1's own last value, a gathered slot never written
        if case == "bcast_count" and x[-1] != 1.0:
            wrong = ", wrong data: its own last element kept"
        if case == "allgather_count" and out[n] == 0:
            wrong = ", wrong data: a slot of the output never written"
        print(f"RANK {r}: returned{wrong}", flush=True)
    except MPI.Exception as exc:
        print(f"RANK {r}: MPI error ({exc.Get_error_string().splitlines()[0][:40]})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mpi", nargs="+", default=["openmpi", "mpich"], choices=["openmpi", "mpich"])
    ap.add_argument("--elements", type=int, default=1 << 18, help="float32 elements per rank (default: 1 MiB)")
    ap.add_argument("--wait", type=float, default=10.0, help="seconds before a job counts as hung")
    ap.add_argument("--rank", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank:
        rank_program(a.rank[0], int(a.rank[1]))
        return
    print("| MPI | mismatch (rank 1) | rank 0 | rank 1 |\n|---|---|---|---|")
    for mpi in a.mpi:
        env = mpirun_env()
        if mpi == "openmpi":
            argv = ["mpirun.openmpi", "--oversubscribe", "-n", "2"]
        else:
            env.pop("MPI4PY_MPIABI", None)
            argv = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", "2"]
        for case in CASES:
            cmd = [*argv, sys.executable, os.path.abspath(__file__), "--rank", case, str(a.elements)]
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                    start_new_session=True)  # its own process group: a hung job is killed whole
            try:
                out, _ = proc.communicate(timeout=a.wait)
                gone = "crashed"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
                gone = f"hung ({a.wait:g} s)"
            said = {int(k): v.strip() for k, v in re.findall(r"RANK (\d): (.*?)(?=RANK \d:|\n|$)", out)}
            print(f"| {mpi} | {case} | {said.get(0, gone)} | {said.get(1, gone)} |", flush=True)


if __name__ == "__main__":
    main()
