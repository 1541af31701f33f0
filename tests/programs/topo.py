"""Report hpcsync.topology() and the node layout for simulated block / round-robin nodes."""
import os
import sys

import hpcsync
from _report import report

topo = hpcsync.topology()
data = topo.as_dict()
data["imported_torch"] = "torch" in sys.modules
if topo.uses_mpi:
    from mpi4py import MPI

    from hpcsync.core.topology import node_layout

    world = MPI.COMM_WORLD
    # Real communicators standing in for nodes of 2 ranks: block (0,1|2,3|..) and round-robin.
    for name, color in (("block", world.rank // 2), ("roundrobin", world.rank % max(1, world.size // 2))):
        local = world.Split(color, key=world.rank)
        node_rank, num_nodes = node_layout(world, local)
        data[name] = {"node_rank": node_rank, "num_nodes": num_nodes, "local_rank": local.rank,
                      "local_size": local.size}
        local.Free()
data["env_slurm_procid"] = os.environ.get("SLURM_PROCID")
report(topo.rank, data)
