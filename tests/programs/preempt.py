"""A training-like loop under hpcsync.preemption: every rank reports the step it stopped at.

    preempt.py STEPS [--loader]

Each rank writes its pid to ``$HPCSYNC_TEST_OUT/pid<rank>`` once the guard is installed, then
runs up to STEPS steps of about 20 ms: every 5th step a 32 MiB Allreduce (under torchrun a
torch.distributed all_reduce over gloo), every 7th a ``sync_file``; ``--loader``: each step's batch from a torch DataLoader with 2 workers (the guard's
``worker_init_fn``). When ``should_stop()`` says so, rank 0 writes the checkpoint (the step),
``guard.requeue()`` says what comes next, every rank reports, and the job exits with its code
(0 after SIGUSR1 outside Slurm, 143 after SIGTERM).
"""
import json
import os
import signal
import sys
import time

import numpy as np

import hpcsync
from hpcsync.core.topology import topology
from _report import report

steps, loader_on = int(sys.argv[1]), "--loader" in sys.argv
topo = topology()
if topo.uses_mpi:
    from mpi4py import MPI  # (after hpcsync chose the MPI library)

    comm = MPI.COMM_WORLD

    def allreduce(buf):
        comm.Allreduce(MPI.IN_PLACE, buf)
else:  # torchrun: the guard agrees over torch.distributed
    import torch
    import torch.distributed as dist

    hpcsync.init(backend="gloo", timeout=60)

    def allreduce(buf):
        dist.all_reduce(torch.from_numpy(buf))
out_dir = os.environ["HPCSYNC_TEST_OUT"]
guard = hpcsync.preemption()
phase, landed = "step", []  # where this rank was when the signal arrived (for the test's tally)
_guard_handler = signal.getsignal(signal.SIGUSR1)


def _note_phase(signum, frame):
    landed.append(phase)
    _guard_handler(signum, frame)


signal.signal(signal.SIGUSR1, _note_phase)
batches = None
if loader_on:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(10_000, dtype=torch.float32))
    batches = iter(DataLoader(data, batch_size=4, num_workers=2, worker_init_fn=guard.worker_init_fn))
with open(os.path.join(out_dir, f"pid{topo.rank}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(out_dir, f"pid{topo.rank}.tmp"), os.path.join(out_dir, f"pid{topo.rank}"))
big = np.ones(4 << 20)  # 32 MiB
part = os.path.join(out_dir, "metrics.csv")
stopped = None
for step in range(steps):
    phase = "step"
    time.sleep(0.02)
    if batches is not None:
        phase = "loader"
        next(batches)
    if step % 5 == 4:
        phase = "allreduce"
        allreduce(big)
    if step % 7 == 6:
        phase = "sync_file"
        with open(os.path.join(out_dir, f"metrics.rank{topo.rank}.csv"), "w") as f:
            f.write(f"{topo.rank},{step}\n")
        hpcsync.sync_file(part, part=os.path.join(out_dir, "metrics.rank{rank}.csv"))
    phase = "should_stop"
    if guard.should_stop():
        stopped = guard.stop_step
        if topo.rank == 0:
            with open(os.path.join(out_dir, "ckpt.tmp"), "w") as f:
                json.dump({"step": stopped}, f)
            os.replace(os.path.join(out_dir, "ckpt.tmp"), os.path.join(out_dir, "ckpt.json"))
        break
del batches  # the workers end here, before MPI finalizes
outcome = guard.requeue()  # not a Slurm job: nothing to requeue, but the exit code says why it stopped
guard.close()
term = signal.getsignal(signal.SIGTERM)
report(topo.rank, {"rank": topo.rank, "world_size": topo.world_size, "stop_step": stopped, "reason": guard.reason,
                   "received": guard.received, "ran": step + 1, "landed": landed, "exit_code": outcome.exit_code,
                   "message": outcome.message, "requeued": outcome.requeued,
                   "sigterm_after_close": getattr(term, "name", str(term))})
sys.exit(outcome.exit_code)
