"""hpcsync's own warnings from several sources, under the program's logging set up as MODE:

    warn_default.py MODE FOLDER

MODE: ``none`` (no logging), ``before`` / ``after`` (``logging.basicConfig`` before or after
``hpcsync.init()``), ``ours`` (a handler of the program's own on the ``hpcsync`` logger),
``errors`` (``basicConfig`` whose handler takes ERROR and above only: it takes no warning).
The program's handlers print ``USER <level> <logger>: <message>``.

The sources: every rank logs one alike warning under ``hpcsync`` and rank 1 one of its own; rank 0
skips an incomplete checkpoint under FOLDER (``Checkpoints.load``); rank 2 of 3 is slow for a
monitor of windows of 4 steps (a straggler verdict on rank 0); a requeue after SIGTERM outside
Slurm (rank 0's warning)."""
import logging
import os
import sys
import time

import hpcsync
from hpcsync import comm
from hpcsync.resilience.requeue import requeue
from _report import report

USER = "USER %(levelname)s %(name)s: %(message)s"
mode, folder = sys.argv[1], sys.argv[2]
if mode in ("before", "errors"):
    logging.basicConfig(format=USER)
if mode == "errors":
    logging.getLogger().handlers[0].setLevel(logging.ERROR)
if mode == "ours":
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(USER))
    logging.getLogger("hpcsync").addHandler(handler)
topo = hpcsync.init(timeout=60)
if mode == "after":
    logging.basicConfig(format=USER)
rank = topo.rank
log = logging.getLogger("hpcsync.resilience.checkpoint")
log.warning("checkpoint step-7 skipped: incomplete")
if rank == 1:
    log.warning("only rank one says this")

os.makedirs(os.path.join(folder, "ckpt", "step-00000007"), exist_ok=True)  # its marker lost: damaged
with hpcsync.Checkpoints(os.path.join(folder, "ckpt")) as ckpts:
    try:  # (nothing whole is left: one error on every rank, after the warning that skips it)
        ckpts.load()
        raise AssertionError("a checkpoint whose marker is lost was loaded")
    except hpcsync.CheckpointError as exc:
        assert "damaged" in str(exc), exc

with hpcsync.monitor(steps=4, windows="1/1") as mon:
    wait = mon.section("comm")
    for _ in range(12):
        time.sleep(0.03 if rank == topo.world_size - 1 else 0.003)
        with wait:
            comm.synchronize()
        mon.step()
stragglers = list(mon.stragglers)

requeue(ending="SIGTERM")
report(rank, {"rank": rank, "world_size": topo.world_size, "stragglers": stragglers})
