"""Point-to-point on the hpcsync backend at the MPI thread level the job asked for
(``MPI4PY_RC_THREAD_LEVEL``): neighbour exchanges that post both sides before waiting, which
deadlock when a request completes at issue.

    p2p_levels.py

3+ ranks in a ring, each case with 16 floats and with 4 MiB (past every eager limit): ``irecv``
from the left then ``isend`` to the right, then both waited; ``isend`` first; a
``batch_isend_irecv`` ring; ``is_completed()`` polled instead of ``wait()``. Each rank reports the
thread level MPI gave, and per case whether the data was right and how long it took; under
``THREAD_FUNNELED``, the error an all_reduce from another thread gets.
"""
import time

import torch
import torch.distributed as dist

import hpcsync
from _report import report

topo = hpcsync.init(backend="hpcsync", timeout=10)
from mpi4py import MPI  # noqa: E402  (after hpcsync chose the library)

R, W = topo.rank, topo.world_size
left, right = (R - 1) % W, (R + 1) % W
LEVELS = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled", MPI.THREAD_SERIALIZED: "serialized",
          MPI.THREAD_MULTIPLE: "multiple"}
out = {"rank": R, "world_size": W, "level": LEVELS[MPI.Query_thread()], "cases": {}}


def exchange(order, n):
    x, y = torch.full((n,), float(R)), torch.zeros(n)
    if order == "isend-first":
        works = [dist.isend(x, dst=right), dist.irecv(y, src=left)]
    elif order == "batch":
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, right), dist.P2POp(dist.irecv, y, left)])
    else:  # irecv-first, poll
        works = [dist.irecv(y, src=left), dist.isend(x, dst=right)]
    if order == "poll":
        while not all(w.is_completed() for w in works):
            time.sleep(0.0005)
    for w in works:
        w.wait()
    return bool(torch.equal(y, torch.full((n,), float(left))))


for order in ("irecv-first", "isend-first", "batch", "poll"):
    for n in (16, 1 << 20):
        t0 = time.monotonic()
        try:
            ok = exchange(order, n)
        except Exception as exc:
            ok = f"{type(exc).__name__}: {exc}"[:300]
        out["cases"][f"{order}/{n}"] = [ok, round(time.monotonic() - t0, 3)]
if MPI.Query_thread() == MPI.THREAD_FUNNELED:  # only the main thread may call MPI: another is refused
    import threading

    box = {}

    def from_a_thread():
        try:
            dist.all_reduce(torch.ones(4))
            box["error"] = None
        except RuntimeError as exc:
            box["error"] = str(exc)

    t = threading.Thread(target=from_a_thread, name="worker")
    t.start()
    t.join()
    out["thread_error"] = box["error"]
dist.barrier()
hpcsync.shutdown()
report(R, out)
