"""Ranks that disagree on the root of gather / broadcast_object: an error on every rank, not wrong data."""
import hpcsync  # noqa: F401  (as a user program does; registers the backend if torch is loaded)
from hpcsync import comm
from _report import report

rank = comm.get_rank()
out = {"rank": rank, "world_size": comm.get_world_size()}
for name, call in (("gather", lambda: comm.gather(rank, dst=rank % 2)),
                   ("broadcast_object", lambda: comm.broadcast_object(f"from {rank}", src=rank % 2))):
    try:
        out[name] = call()
    except ValueError as exc:
        out[name] = f"ValueError: {exc}"
report(rank, out)
