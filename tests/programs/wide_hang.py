"""Many ranks, one stuck: the hang report's size must not grow with the number of ranks.

    wide_hang.py TIMEOUT

No torch (32 processes importing it would take a minute on a small machine): the flight
recorder and report of ``hpcsync.observe.watchdog`` driven directly over real MPI, as the backend drives
them. Every rank does two all_reduce, then every rank but the last enters a third one and waits
against the deadline; the last sleeps (STUCK HERE). The timed-out ranks report and abort.
"""
import sys
import time

from mpi4py import MPI

from hpcsync import topology

from hpcsync.observe import responder, watchdog

timeout = float(sys.argv[1])
topo = topology()
world = MPI.COMM_WORLD
responder.start()
log = watchdog.group_log(1, "0", list(range(world.size)))
buf = bytearray(16)
for _ in range(2):
    rec = log.start("all_reduce", "float32", (4,), -1)
    world.Allreduce(MPI.IN_PLACE, [buf, MPI.FLOAT])
    rec.finished = time.time()
if world.rank == world.size - 1:
    time.sleep(timeout + 60)  # STUCK HERE
rec = log.start("all_reduce", "float32", (4,), -1)
req = world.Iallreduce(MPI.IN_PLACE, [buf, MPI.FLOAT])
deadline = time.monotonic() + timeout
while not req.Test():
    if time.monotonic() > deadline:
        watchdog.report_timeout(log, rec, timeout)  # prints (one rank), then MPI_Abort
        raise SystemExit("hang report returned")
    time.sleep(0.001)
