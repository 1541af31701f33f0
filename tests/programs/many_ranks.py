"""A job of many ranks read as one. ``many_ranks.py MODE BACKEND [ARG]``:

- ``logs LOG_DIR``: logging turned on by init(log_dir=) (``-``: by HPCSYNC_LOG_DIR); every rank logs the same INFO and
  WARNING lines, its own INFO line, rank 2 a warning of its own, every rank prints; the
  application's own handler on logger ``app`` must still be there and see the records.
- ``plain``: init() without a log folder: the root logger's handlers and level stay as they were.
- ``raise RANK [others|frozen0|timeout]``: training steps with an all_reduce each; RANK raises at
  step 40 (with ``others``, every other rank raises too, 0.2 s later; with ``frozen0``, so do all
  but rank 0, which freezes as SIGSTOP does; with ``timeout``, every rank warns first and RANK's
  error is the program's own RuntimeError that says "timed out").
- ``hang KIND``: rank 2 (of 3+) sleeps, loops or skips a collective at step 5; the others go on.
"""
import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from _report import report

import hpcsync

mode, backend = sys.argv[1], sys.argv[2]


class Keep(logging.Handler):
    def __init__(self):
        super().__init__()
        self.seen = []

    def emit(self, record):
        self.seen.append(record.getMessage())


own = Keep()
logging.getLogger("app").addHandler(own)
root_before = (list(logging.getLogger().handlers), logging.getLogger().level)
app = logging.getLogger("app")

if mode == "logs":
    topo = hpcsync.init(backend=backend, log_dir=None if sys.argv[3] == "-" else sys.argv[3])
    app.info("the same info line from every rank")
    app.info("rank %d of %d here", topo.rank, topo.world_size)
    app.warning("the same warning from every rank")
    if topo.rank == 2:
        app.warning("only rank 2 warns about this")
    print(f"a print from rank {topo.rank}")
    report(topo.rank, {"world_size": topo.world_size, "own": own.seen, "own_kept": own in app.handlers})
elif mode == "plain":
    topo = hpcsync.init(backend=backend)
    app.info("not shown: nobody asked")
    root = logging.getLogger()
    report(topo.rank, {"world_size": topo.world_size, "root_kept": (list(root.handlers), root.level) == root_before,
                       "handlers": [type(h).__name__ for h in root.handlers]})
elif mode == "raise":  # raise VICTIM [others|timeout]
    victim, how = int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else ""
    topo = hpcsync.init(backend=backend, timeout=120)
    t = torch.ones(16)
    for step in range(1, 1000):
        hpcsync.observe.failure.note_step(step)  # the step the report names
        if step == 40 and how == "timeout":  # the program's own error that says "timed out"
            app.warning("loss is NaN at step %d", step)
            if topo.rank == victim:
                time.sleep(0.3)
                raise RuntimeError("DataLoader worker timed out after 60 seconds")
        if step == 40 and how == "frozen0" and topo.rank == 0:  # rank 0 freezes as the others raise
            os.kill(os.getpid(), signal.SIGSTOP)
        if step == 40 and topo.rank == victim:
            raise ValueError(f"bad batch on rank {victim}")
        if step == 40 and how in ("others", "frozen0"):
            time.sleep(0.2)
            raise RuntimeError("a consequence elsewhere")
        dist.all_reduce(t)
        t.fill_(1)
elif mode == "hang":
    kind = sys.argv[3]
    topo = hpcsync.init(backend=backend, timeout=4)
    t = torch.ones(8)
    for step in range(10):
        if step == 5 and topo.rank == 2:
            if kind == "sleep":
                time.sleep(120)
            elif kind == "loop":
                while True:
                    pass
            elif kind == "skip":
                continue
        dist.all_reduce(t)
