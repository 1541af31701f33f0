"""Below THREAD_MULTIPLE one MPI call at a time in the process: a comm helper, a bounded control
exchange, the preemption guard's flags and the MPI store (its client on rank 1, its server thread
on rank 0) wait while another thread holds the process's MPI lock (as a backend operation does
around each of its calls), then complete.

Reports the thread level MPI gave and, for each, how long it took while the lock was held 1.5 s."""
import datetime
import threading
import time

from hpcsync import comm
from hpcsync.core import bounded, mpi, serial
from hpcsync.resilience.preemption import PreemptionGuard
from hpcsync.start.store import MPIStore
from _report import report

MPI = mpi.MPI()
world = MPI.COMM_WORLD
rank = world.Get_rank()
names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled", MPI.THREAD_SERIALIZED: "serialized",
         MPI.THREAD_MULTIPLE: "multiple"}
control = bounded.control("the serial lock test")
guard = PreemptionGuard(signals=())
store = MPIStore(timeout=datetime.timedelta(seconds=30))


def through_the_store():  # rank 1 asks rank 0's server (rank 0's own calls need no message)
    if rank == 1:
        store.set("k", b"v")
        return store.get("k").decode()
    time.sleep(1.6)  # (the server answers while rank 1 waits)
    return "v"


calls = {"helper": lambda: comm.all_gather(rank), "control": lambda: control.allgather(rank),
         "guard": lambda: [guard.should_stop() for _ in range(2)][-1] is False, "store": through_the_store}
for call in calls.values():  # the private duplicates made first, outside the measure
    call()
took, results = {}, {}


def hold(held):
    with serial.SERIAL:
        held.set()
        time.sleep(1.5)


for name, call in calls.items():
    world.Barrier()
    held = threading.Event()
    t = threading.Thread(target=hold, args=(held,))
    t.start()
    held.wait()
    t0 = time.monotonic()
    results[name] = call()
    took[name] = time.monotonic() - t0
    t.join()
guard.close()
store.close()
report(rank, {"rank": rank, "level": names[MPI.Query_thread()], "took": took, "results": results,
              "world_size": world.Get_size()})
