"""The step a monitor's verdicts name, after a resume at step 55 (20 steps, the last rank slowed
tenfold, windows of 4 steps judged alone):

    monitor_step.py MODE

MODE ``given``: ``mon.step(step)``; ``noted``: the program notes each step
(``hpcsync.observe.failure.note_step``) and calls ``mon.step()``; ``count``: ``mon.step()``
alone (the count of calls). Every rank reports the verdicts and the step a failure report would
name at the end."""
import logging
import sys
import time

import hpcsync
from hpcsync import comm
from hpcsync.observe import failure
from _report import report

logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
mode = sys.argv[1]
topo = hpcsync.init(timeout=60)
rank = topo.rank
START = 55  # as after a resume from the checkpoint of step 54
with hpcsync.monitor(steps=4, windows="1/1") as mon:
    wait = mon.section("comm")
    for step in range(START, START + 20):
        if mode == "noted":
            failure.note_step(step)
        time.sleep(0.03 if rank == topo.world_size - 1 else 0.003)
        with wait:
            comm.synchronize()
        if mode == "given":
            mon.step(step)
        else:
            mon.step()
report(rank, {"rank": rank, "world_size": topo.world_size, "calls": mon.steps, "verdicts": mon.verdicts,
              "failure_step": failure.current_step(), "failure_words": failure.step_words()})
