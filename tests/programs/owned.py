"""bounded.owned: the private duplicate of a with block is freed when the block ends, by an
exception too, and kept after a timeout (its operation is still in flight on it).

    owned.py

mpi4py's ``Free`` turns the communicator object into ``COMM_NULL`` in place, so the test asks the
duplicate itself whether it was freed.
"""
import time

from mpi4py import MPI

from _report import report
from hpcsync.core import bounded, torchcomm
from hpcsync.core.errors import CollectiveTimeout

world = MPI.COMM_WORLD
rank = world.Get_rank()
out = {"rank": rank}
with bounded.owned(world, "a test", 10) as comm:
    out["gathered"] = comm.allgather(rank)
    first = comm.raw()
out["freed_after_block"] = first == MPI.COMM_NULL or not bool(first)
try:
    with bounded.owned(world, "a test", 10) as comm:
        comm.Barrier()
        second = comm.raw()
        raise KeyError("inside the block")
except KeyError:
    pass
out["freed_after_exception"] = second == MPI.COMM_NULL or not bool(second)
out["world_kept"] = bool(world) and world.Get_size() == 2
alone = torchcomm.SELF  # no Idup: over() gives it back as it is, and nothing frees it
with bounded.owned(alone, "alone", 10) as same:
    out["self_given_back"] = same is alone
out["self_kept"] = alone.Get_size() == 1 and alone.allgather(7) == [7]
import os  # noqa: E402

try:
    with bounded.owned(world, "a timeout", 0.5) as comm:
        held = comm.raw()  # both ranks make the duplicate; rank 1 then never arrives at the barrier
        if rank == 1:
            report(rank, out)
            time.sleep(3)
            os._exit(0)
        comm.Barrier()
except CollectiveTimeout:
    out["timed_out"] = True
    out["kept_after_timeout"] = held != MPI.COMM_NULL and bounded.broken() is not None
report(rank, out)
os._exit(0)  # an abandoned barrier: MPI cannot finalize with it in flight (the exit hook would abort)
