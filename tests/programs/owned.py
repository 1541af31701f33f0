"""bounded.owned: the private duplicate of a with block is freed when the block ends, by an
exception too, and kept after a timeout (its operation is still in flight on it).

    owned.py

mpi4py's ``Free`` turns the communicator object into ``COMM_NULL`` in place, so the test asks the
duplicate itself whether it was freed.
"""
import time

from mpi4py import MPI

from _report import report
from hpcsync.core import bounded
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
with bounded.owned(MPI.COMM_SELF, "alone", 10) as same:
    out["self_given_back"] = same.Get_size() == 1
if rank == 1:  # never arrives at the barrier below
    report(rank, out)
    time.sleep(3)
    import os

    os._exit(0)
try:
    with bounded.owned(world, "a timeout", 0.5) as comm:
        comm.Barrier()
except CollectiveTimeout:
    out["timed_out"] = True
    out["kept_after_timeout"] = bounded.broken() is not None
report(rank, out)
import os  # noqa: E402

os._exit(0)  # an abandoned barrier: MPI cannot finalize with it in flight (the exit hook would abort)
