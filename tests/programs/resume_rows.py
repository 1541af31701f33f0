"""The README's resume pattern with a joined CSV: checkpoints, the preemption guard and
``SyncedFile(append=True)``, for STEPS steps from the latest checkpoint.

    resume_rows.py FOLDER STEPS [STOP_RANK STOP_STEP [HOW]]

With STOP_RANK and STOP_STEP, that rank sends itself SIGUSR1 at that step: the ranks agree on a
stop step, save, leave the block (which joins this run's rows after the earlier runs'), and exit
with the guard's code. HOW: ``break`` (out of the loop, then the exit) or ``exit`` (the README's
``raise SystemExit(guard.requeue().exit_code)`` inside the block); ``crash``: that rank raises
instead (no checkpoint, nothing joined). Every rank reports where it started and stopped.
"""
import os
import signal
import sys

import torch
import torch.distributed as dist

import hpcsync
from _report import report

folder, steps = sys.argv[1], int(sys.argv[2])
stop_rank, stop_step = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (None, None)
how = sys.argv[5] if len(sys.argv) > 5 else "break"
topo = hpcsync.init()
rank = topo.rank
guard, ckpts = hpcsync.preemption(), hpcsync.Checkpoints(os.path.join(folder, "ckpt"))
saved = ckpts.load()
start = 0 if saved is None else saved.step + 1
stopped = None
with hpcsync.SyncedFile(os.path.join(folder, "metrics.csv"), strip_header=True, append=True) as part:
    with part.open("w") as f:
        f.write("rank,step,value\n")
        for step in range(start, steps):
            t = torch.tensor([float(step)])
            dist.all_reduce(t)
            f.write(f"{rank},{step},{t.item():g}\n")
            if rank == stop_rank and step == stop_step:
                if how == "crash":
                    raise RuntimeError(f"injected crash on rank {rank} at step {step}")
                os.kill(os.getpid(), signal.SIGUSR1)
            if guard.should_stop():
                ckpts.save(step, shared={"step": step})
                stopped = step
                if how == "exit":
                    report(rank, {"rank": rank, "world_size": topo.world_size, "start": start, "stopped": stopped})
                    raise SystemExit(guard.requeue().exit_code)
                break
report(rank, {"rank": rank, "world_size": topo.world_size, "start": start, "stopped": stopped})
ckpts.close()
guard.close()
code = guard.requeue().exit_code if stopped is not None else 0
hpcsync.shutdown()
sys.exit(code)
