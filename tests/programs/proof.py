"""The master-address choice and its connect proof, without torch: what gloo/nccl would get.

Every rank reports the address (or the AddressError) and how long the choice took.
"""
import time

from hpcsync import topology
from hpcsync.start.bootstrap import master_address
from hpcsync.core.errors import AddressError
from _report import report

t0 = time.monotonic()
topo = topology()
out = {"rank": topo.rank, "world_size": topo.world_size, "num_nodes": topo.num_nodes}
try:
    choice = master_address(topo)
    out.update(master=choice.address, reason=choice.reason)
except AddressError as exc:
    out["error"] = f"AddressError: {exc}"
out["seconds"] = time.monotonic() - t0
report(topo.rank, out)
