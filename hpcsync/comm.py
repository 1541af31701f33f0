"""detectron2-style communication helpers, over MPI.

Same names and meaning as ``detectron2.utils.comm`` so users can switch imports. They talk MPI
when it is in use (no torch.distributed needed), fall back to torch.distributed when only that is
initialised (torchrun without mpi4py), and are no-ops in one process. Object gathers pickle to
bytes and move them with big-count-safe rounds, so any size works (past 2 GiB too).

``group`` may be an mpi4py communicator (default ``COMM_WORLD``); with the torch fallback it is a
torch ProcessGroup.
"""
from __future__ import annotations

import pickle
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

from . import _bigmpi, _mpi
from .topology import topology


def _mpi_comm(group: Any = None) -> Any:
    if group is not None and hasattr(group, "Get_rank"):
        return group
    if _mpi.use_mpi():
        topology()  # runs the silent-singleton check once
        return _mpi.MPI().COMM_WORLD
    return None


def _torch_dist_ready() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_initialized()


def get_world_size() -> int:
    if _torch_dist_ready():
        import torch.distributed as dist

        return dist.get_world_size()
    return topology().world_size


def get_rank() -> int:
    if _torch_dist_ready():
        import torch.distributed as dist

        return dist.get_rank()
    return topology().rank


def get_local_rank() -> int:
    """Rank within this node (from ``COMM_TYPE_SHARED`` under MPI)."""
    return topology().local_rank


def get_local_size() -> int:
    """Number of ranks on this node."""
    return topology().local_size


def is_main_process() -> bool:
    return get_rank() == 0


def synchronize(group: Any = None) -> None:
    """Barrier among all ranks (no-op in one process)."""
    comm = _mpi_comm(group)
    if comm is not None:
        if comm.Get_size() > 1:
            comm.Barrier()
    elif _torch_dist_ready():
        import torch.distributed as dist

        if dist.get_world_size(group) > 1:
            dist.barrier(group=group)


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _loads_all(parts: List[bytearray]) -> List[Any]:
    out = []
    for i in range(len(parts)):
        out.append(pickle.loads(parts[i]))
        parts[i] = bytearray()  # free as we go: bounds peak memory
    return out


def all_gather(data: Any, group: Any = None) -> List[Any]:
    """Gather any picklable object from every rank; every rank gets the list in rank order."""
    comm = _mpi_comm(group)
    if comm is not None:
        if comm.Get_size() == 1:
            return [data]
        parts = _bigmpi.allgatherv_bytes(comm, _dumps(data))
        return _loads_all(parts)
    if _torch_dist_ready():
        import torch.distributed as dist

        out: List[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, data, group=group)
        return out
    return [data]


def gather(data: Any, dst: int = 0, group: Any = None) -> List[Any]:
    """Gather any picklable object to rank ``dst``; it gets the list, the others ``[]``."""
    comm = _mpi_comm(group)
    if comm is not None:
        if comm.Get_size() == 1:
            return [data]
        parts = _bigmpi.gatherv_bytes(comm, _dumps(data), root=dst)
        return [] if parts is None else _loads_all(parts)
    if _torch_dist_ready():
        import torch.distributed as dist

        rank = dist.get_rank(group)
        objs: Optional[List[Any]] = [None] * dist.get_world_size(group) if rank == dst else None
        dist.gather_object(data, objs, dst=dst, group=group)
        return objs if objs is not None else []
    return [data]


def broadcast_object(obj: Any = None, src: int = 0, group: Any = None) -> Any:
    """Return rank ``src``'s ``obj`` on every rank (any size)."""
    comm = _mpi_comm(group)
    if comm is not None:
        if comm.Get_size() == 1:
            return obj
        is_src = comm.Get_rank() == src
        return pickle.loads(_bigmpi.bcast_bytes(comm, _dumps(obj) if is_src else None, root=src))
    if _torch_dist_ready():
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]
    return obj


def shared_random_seed() -> int:
    """A random int in [0, 2**31) that is the same on every rank (drawn on rank 0)."""
    return int(broadcast_object(int(np.random.randint(2**31)) if get_rank() == 0 else None))


def reduce_dict(input_dict: Mapping[str, Any], average: bool = True) -> Dict[str, Any]:
    """Sum (or average) a dict of scalars/tensors over all ranks.

    Like detectron2 the main process gets the reduced values; unlike it, every rank does (an
    allreduce costs the same for a few scalars). Keys must match on every rank: a mismatch is a
    ``ValueError`` on every rank. Tensors come back as tensors on their device and dtype.
    """
    keys = sorted(input_dict.keys())
    comm = _mpi_comm()
    world = comm.Get_size() if comm is not None else get_world_size()
    if world == 1:
        return dict(input_dict)
    every = all_gather(keys)
    if any(k != keys for k in every):
        diff = [r for r, k in enumerate(every) if k != every[0]]
        raise ValueError(f"reduce_dict: keys differ between ranks (ranks {diff} differ from rank 0: "
                         f"{every[0]} vs {every[diff[0]]})")
    values = [_to_numpy(input_dict[k]) for k in keys]
    flat = np.concatenate([v.astype(np.float64).ravel() for v in values]) if values else np.zeros(0)
    if comm is not None:
        total = np.empty_like(flat)
        comm.Allreduce(flat, total, op=_mpi.MPI().SUM)
    else:
        import torch
        import torch.distributed as dist

        t = torch.from_numpy(flat)
        dist.all_reduce(t)
        total = t.numpy()
    if average:
        total /= world
    out: Dict[str, Any] = {}
    pos = 0
    for k, v in zip(keys, values):
        chunk = total[pos: pos + v.size].reshape(v.shape)
        pos += v.size
        out[k] = _like(input_dict[k], chunk)
    return out


def _to_numpy(v: Any) -> np.ndarray:
    if hasattr(v, "detach"):
        return v.detach().cpu().double().numpy()
    return np.asarray(v, dtype=np.float64)


def _like(orig: Any, values: np.ndarray) -> Any:
    if hasattr(orig, "detach"):
        import torch

        return torch.from_numpy(values.copy()).to(device=orig.device, dtype=orig.dtype)
    if isinstance(orig, np.ndarray):
        return values.astype(orig.dtype)
    return type(orig)(values.item()) if values.size == 1 and isinstance(orig, (int, float)) else values


_MB_TAG = 31200  # point-to-point tags reserved for monitored_barrier (31200..32199)
_mb_seq = 0


def monitored_barrier(group: Any = None, timeout: Optional[float] = None, wait_all_ranks: bool = False) -> None:
    """A barrier that names the ranks that did not arrive, like torch's gloo-only ``monitored_barrier``.

    Every rank reports to rank 0 over MPI point-to-point; rank 0 waits at most ``timeout`` seconds
    (default ``HPCSYNC_TIMEOUT`` or 1800) and raises ``RuntimeError`` naming the first missing rank
    (all of them with ``wait_all_ranks=True``); the ranks that did arrive get the same error. Works
    without torch.distributed and with any backend; ``group`` is an mpi4py communicator.
    """
    global _mb_seq
    import os
    import time

    comm = _mpi_comm(group)
    if comm is None:
        if _torch_dist_ready():
            import datetime

            import torch.distributed as dist

            dist.monitored_barrier(group=group, wait_all_ranks=wait_all_ranks,
                                   timeout=None if timeout is None else datetime.timedelta(seconds=timeout))
        return
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        return
    limit = float(timeout if timeout is not None else os.environ.get("HPCSYNC_TIMEOUT", 1800))
    tag = _MB_TAG + _mb_seq % 1000
    _mb_seq += 1
    MPI = _mpi.MPI()
    deadline = time.monotonic() + limit
    if rank == 0:
        bufs = {r: bytearray(1) for r in range(1, size)}
        reqs = {r: comm.Irecv([bufs[r], MPI.BYTE], source=r, tag=tag) for r in range(1, size)}
        while reqs and time.monotonic() < deadline:
            reqs = {r: q for r, q in reqs.items() if not q.Test()}
            time.sleep(0.001)
        missing = sorted(reqs)
        verdict = (b"\x00" if not missing else b"\x01")
        msg = "" if not missing else (
            f"monitored_barrier: rank(s) {missing if wait_all_ranks else missing[:1]} did not reach the barrier "
            f"within {limit:g}s")
        for r in range(1, size):
            if r not in reqs:
                comm.Send([verdict + msg.encode(), MPI.BYTE], dest=r, tag=tag)
        if missing:
            for q in reqs.values():
                q.Cancel()
            raise RuntimeError(msg)
        return
    comm.Send([b"\x00", MPI.BYTE], dest=0, tag=tag)
    status = MPI.Status()
    while not comm.Iprobe(source=0, tag=tag, status=status):
        if time.monotonic() > deadline + 5:
            raise RuntimeError(f"monitored_barrier: no answer from rank 0 within {limit:g}s")
        time.sleep(0.001)
    answer = bytearray(status.Get_count(MPI.BYTE))
    comm.Recv([answer, MPI.BYTE], source=0, tag=tag)
    if answer[:1] != b"\x00":
        raise RuntimeError(bytes(answer[1:]).decode())
