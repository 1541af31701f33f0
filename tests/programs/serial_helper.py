"""Below THREAD_MULTIPLE one MPI call at a time in the process: a comm helper, a bounded control
exchange, the preemption guard's flags and the MPI store (its client on rank 1; its server thread
on rank 0, with the lock held on rank 0 alone: ``store-server``) wait while another thread holds
the process's MPI lock (as a backend operation does around each of its calls), then complete.

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
if MPI.Query_thread() < MPI.THREAD_SERIALIZED:  # the store's server thread may not call MPI: refused
    try:
        MPIStore(timeout=datetime.timedelta(seconds=30))
        refused = None
    except ValueError as exc:
        refused = str(exc)
    guard.close()
    report(rank, {"rank": rank, "level": names[MPI.Query_thread()], "refused": refused, "world_size": world.Get_size()})
    raise SystemExit(0)
store = MPIStore(timeout=datetime.timedelta(seconds=30))


def through_the_store():  # rank 1 asks rank 0's server (rank 0's own calls need no message)
    if rank == 1:
        store.set("k", b"v")
        return store.get("k").decode()
    time.sleep(1.6)  # (the server answers while rank 1 waits)
    return "v"


calls = {"helper": lambda: comm.all_gather(rank), "control": lambda: control.allgather(rank),
         "guard": lambda: [guard.should_stop() for _ in range(2)][-1] is False, "store": through_the_store,
         "store-server": through_the_store}
for name, call in calls.items():  # the private duplicates made first, outside the measure
    if not name.startswith("store"):
        call()
took, results = {}, {}


def hold(held, seconds):
    with serial.SERIAL:
        held.set()
        time.sleep(seconds)


for name, call in calls.items():
    control.Barrier()  # (non-blocking, the lock held per test: rank 0's store server answers meanwhile)
    held = threading.Event()
    t = threading.Thread(target=hold, args=(held, 1.5 if name != "store-server" else 2.0))
    if name != "store-server" or rank == 0:
        t.start()
        held.wait()
    else:
        time.sleep(0.3)  # (rank 0's thread holds the lock by then: its server cannot answer for 1.7 s)
    t0 = time.monotonic()
    results[name] = call()
    took[name] = time.monotonic() - t0
    if t.is_alive():
        t.join()
control.Barrier()  # (rank 0's store serves until rank 1 is done with it)
guard.close()
store.close()
report(rank, {"rank": rank, "level": names[MPI.Query_thread()], "took": took, "results": results,
              "world_size": world.Get_size()})
