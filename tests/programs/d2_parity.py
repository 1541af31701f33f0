"""detectron2.utils.comm semantics, name for name, through hpcsync.comm.

    d2_parity.py BACKEND|noinit

Expectations are detectron2's documented behaviour: helpers take a ``group``; all_gather returns
one item per group member, gather gives the list on ``dst`` and [] elsewhere, the local process
group holds this machine's ranks. ``noinit``: under torchrun without any init a collective helper
must raise a clear error (not answer for one rank while get_world_size() says 2).
"""
import sys

import hpcsync
from hpcsync import comm
from _report import report

mode = sys.argv[1]
out = {}
if mode == "noinit":
    out.update(rank=comm.get_rank(), world_size=comm.get_world_size())
    for name, call in (("all_gather", lambda: comm.all_gather(1)), ("gather", lambda: comm.gather(1)),
                       ("shared_random_seed", comm.shared_random_seed), ("synchronize", comm.synchronize)):
        try:
            call()
            out[name] = "no error"
        except hpcsync.HpcsyncError as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    report(out["rank"], out)
    sys.exit(0)

import torch.distributed as dist  # noqa: E402

hpcsync.init(backend=mode, timeout=60)
rank, size = comm.get_rank(), comm.get_world_size()
halves = [dist.new_group(list(range(0, size // 2))), dist.new_group(list(range(size // 2, size)))]
mine = halves[0] if rank < size // 2 else halves[1]
comm.synchronize(group=mine)
comm.create_local_process_group()
local = comm.get_local_process_group()
out.update(
    rank=rank, world_size=size,
    all_gather_world=comm.all_gather(rank),
    all_gather_half=comm.all_gather(rank, group=mine),
    gather_half=comm.gather(rank * 10, dst=1, group=mine),
    bcast_half=comm.broadcast_object(f"from {rank}", src=1, group=mine),
    all_gather_local=comm.all_gather(rank, group=local),
    local_pg_is_module_attr=comm._LOCAL_PROCESS_GROUP is local,
    gloo_group_is_world=comm.global_gloo_group() is dist.group.WORLD,
    seed_same=len(set(comm.all_gather(comm.shared_random_seed()))) == 1,
    reduced=comm.reduce_dict({"x": float(rank)}, average=False)["x"],
    main=comm.is_main_process(),
)
try:
    comm.create_local_process_group()
    out["second_create"] = "no error"
except RuntimeError as exc:
    out["second_create"] = str(exc)
hpcsync.shutdown()
report(rank, out)
