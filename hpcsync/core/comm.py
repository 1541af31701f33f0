"""detectron2-style communication helpers, over MPI.

Same names and behaviour as ``detectron2.utils.comm`` so users can switch imports. One transport
underneath, shared with file sync and HDF5 (:func:`hpcsync.core.torchcomm.world`): MPI when it is in
use (no torch.distributed needed), else torch.distributed when it is initialised (torchrun without
mpi4py), else -- one process -- the identity (``SelfComm``). A multi-rank job with neither gets a clear error naming
``hpcsync.init()``, never N one-rank answers. Object gathers pickle to bytes and move them with
big-count-safe rounds under MPI, so any size works (past 2 GiB too). Under MPI, over the world
and this node's group, every collective here waits at most ``HPCSYNC_TIMEOUT`` (default 1,800 s;
:mod:`hpcsync.core.bounded`): a rank that never arrives is a ``CollectiveTimeout`` naming the
helper on the ranks that wait, never a hang (raise ``HPCSYNC_TIMEOUT`` for a longer wait, such as
a rank-0-only evaluation the others wait for). Every helper's first collective is the same header
Allgather, carrying which helper it is (:class:`Helper`) and its root: ranks in different helpers,
or with different roots, or a root that is not a rank, raise the same ``ValueError`` on every rank
there, never a pairing of one helper's messages with another's.

``group`` may be an mpi4py communicator or a torch ``ProcessGroup`` (``dist.new_group``); under
MPI a torch group maps to the MPI sub-communicator of its ranks. Ranks (``dst``, ``src``) are
ranks *within* the group. Differences from detectron2, on purpose: ``get_local_rank`` /
``get_local_size`` come from MPI's node-local communicator and need no
:func:`create_local_process_group`; :func:`reduce_dict` returns the reduced values on every rank.
"""
from __future__ import annotations

import enum
import functools
import pickle
import sys
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

from . import bigmpi, mpi, serial, settings
from .errors import ranks_by_value
from .torchcomm import SELF, TorchComm, transport, world
from .topology import local_comm, topology

__all__ = [
    "group_comm", "get_world_size", "get_rank", "create_local_process_group", "get_local_process_group",
    "get_local_rank", "get_local_size", "is_main_process", "global_gloo_group", "synchronize", "all_gather",
    "gather", "broadcast_object", "shared_random_seed", "reduce_dict", "monitored_barrier"
]

_LOCAL_PROCESS_GROUP: Any = None
_MISSING_LOCAL_PG_ERROR = (
    "Local process group is not yet created! Please use hpcsync.comm.create_local_process_group() "
    "(detectron2's launch() does this); hpcsync's get_local_rank()/get_local_size() do not need it")


def _torch_dist_ready() -> bool:
    if "torch.distributed" not in sys.modules:  # never import torch just to ask
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _is_mpi_comm(comm: object) -> bool:
    return hasattr(comm, "Allgatherv")


def group_comm(group: Any = None) -> Any:  # as _bounded
    """The transport for a public call's ``group=``: a torch process group or an mpi4py
    communicator, default (None) the world (:func:`hpcsync.core.torchcomm.transport`)."""
    return transport(group)


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


def create_local_process_group(num_workers_per_machine: Optional[int] = None) -> None:
    """Create the group of this node's ranks (collective): ``get_local_process_group()`` returns it.

    With torch.distributed initialised it is a torch group (``dist.new_group`` for every node, as
    detectron2 does); under MPI alone, the node-local MPI communicator. Under MPI the real nodes
    are used (``COMM_TYPE_SHARED``, right for any placement); ``num_workers_per_machine``, if
    given, must match them. Without MPI the ranks are split in blocks of that size, like detectron2.
    """
    global _LOCAL_PROCESS_GROUP
    if _LOCAL_PROCESS_GROUP is not None:
        raise RuntimeError("create_local_process_group() was already called")
    topo = topology()
    if num_workers_per_machine is not None and num_workers_per_machine != topo.local_size and topo.uses_mpi:
        raise ValueError(f"num_workers_per_machine={num_workers_per_machine}, but MPI places {topo.local_size} "
                         f"rank(s) on this node ({topo.hostname})")
    if not _torch_dist_ready():
        if topo.world_size > 1 and not topo.uses_mpi:
            world()  # raises: a multi-rank job needs MPI or hpcsync.init()
        _LOCAL_PROCESS_GROUP = local_comm() if topo.uses_mpi else SELF
        return
    import torch.distributed as dist

    size = dist.get_world_size()
    if topo.uses_mpi:
        nodes = mpi.MPI().COMM_WORLD.allgather(topo.node_rank)
        members = [[r for r in range(size) if nodes[r] == n] for n in sorted(set(nodes))]
    else:
        per = num_workers_per_machine or topo.local_size
        if size % per:
            raise ValueError(f"world size {size} is not a multiple of num_workers_per_machine={per}")
        members = [list(range(i * per, (i + 1) * per)) for i in range(size // per)]
    for ranks in members:  # every rank creates every group, in the same order
        pg = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            _LOCAL_PROCESS_GROUP = pg


def get_local_process_group() -> Any:
    """The group made by :func:`create_local_process_group`."""
    if _LOCAL_PROCESS_GROUP is None:
        raise RuntimeError(_MISSING_LOCAL_PG_ERROR)
    return _LOCAL_PROCESS_GROUP


def get_local_rank() -> int:
    """Rank within this node (from ``COMM_TYPE_SHARED`` under MPI)."""
    return topology().local_rank


def get_local_size() -> int:
    """Number of ranks on this node."""
    return topology().local_size


def is_main_process() -> bool:
    return get_rank() == 0


@functools.lru_cache()
def global_gloo_group() -> Any:
    """detectron2's CPU-side group: a gloo group when the default backend is NCCL, else the world
    group (under MPI without torch.distributed: ``COMM_WORLD``)."""
    if not _torch_dist_ready():
        return world()
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return dist.new_group(backend="gloo")
    return dist.group.WORLD


def _bounded(group: Any, what: str) -> Any:  # an MPI communicator, or an ObjectComm
    """:func:`group_comm`; for the world and this node's group (``group`` None or
    :func:`get_local_process_group`'s), every collective bounded under MPI
    (:func:`hpcsync.core.bounded.helper`: ``HPCSYNC_TIMEOUT``, on a private duplicate of the
    helpers' own): a rank that never arrives (stuck, frozen, its node cut off) is a
    ``CollectiveTimeout`` naming ``what`` on the ranks that wait, not a hang. A communicator or
    torch group of the program's own is used as it is (a private duplicate for each would be one
    more communicator per group, kept to the end)."""
    from . import bounded

    base = group_comm(group)
    if group is None or (group is _LOCAL_PROCESS_GROUP and group is not None):
        return bounded.helper(f"hpcsync.comm.{what}", base)
    return base


class Helper(enum.IntEnum):
    """Which helper a rank is in. Every helper's first collective is the same one, a header
    Allgather carrying this (:func:`hpcsync.core.bigmpi.allgather_sizes`): ranks in different
    helpers, or in the same one with different roots, or with a root that is not a rank, find it
    there and raise the same ``ValueError`` on every rank -- before, the helpers' collectives
    paired up across ranks (one rank's all_gather returned another's reduce_dict keys)."""

    SYNCHRONIZE = 1
    ALL_GATHER = 2
    GATHER = 3
    BROADCAST_OBJECT = 4
    SHARED_RANDOM_SEED = 5
    REDUCE_DICT = 6

    def __str__(self) -> str:
        return f"hpcsync.comm.{self.name.lower()}"


def _header(comm: Any, call: Helper, root: Optional[int] = None) -> None:
    """The header alone, for what moves no bytes through :mod:`hpcsync.core.bigmpi`
    (synchronize, and every helper over torch.distributed without MPI)."""
    bigmpi.allgather_sizes(comm, 0, root=root, call=call)


def synchronize(group: Any = None) -> None:
    """Barrier among all ranks (no-op in one process): the helpers' header, an Allgather (no rank
    leaves before every rank has sent its part), so a rank in another helper is an error, not a
    barrier that passes."""
    comm = _bounded(group, "synchronize")
    if comm.Get_size() > 1:
        _header(comm, Helper.SYNCHRONIZE)


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _loads_all(parts: List[bytearray]) -> List[Any]:
    out = []
    for i in range(len(parts)):
        out.append(pickle.loads(parts[i]))
        parts[i] = bytearray()  # free as we go: bounds peak memory
    return out


def all_gather(data: Any, group: Any = None) -> List[Any]:
    """Gather any picklable object from every rank of ``group``; each gets the list in rank order."""
    return _all_gather(data, _bounded(group, "all_gather"), Helper.ALL_GATHER)


def _all_gather(data: Any, comm: Any, call: Helper) -> List[Any]:
    if comm.Get_size() == 1:
        return [data]
    if _is_mpi_comm(comm):
        return _loads_all(bigmpi.allgatherv_bytes(comm, _dumps(data), call=call))
    _header(comm, call)
    out: List[Any] = comm.allgather(data)
    return out


def gather(data: Any, dst: int = 0, group: Any = None) -> List[Any]:
    """Gather any picklable object to rank ``dst`` of ``group``; it gets the list, the others ``[]``.
    A ``dst`` that is not a rank of the group is a ``ValueError`` on every rank."""
    comm = _bounded(group, "gather")
    if comm.Get_size() == 1:
        bigmpi.check_root(dst, 1, f" in {Helper.GATHER}")  # (in one process no header carries it)
        return [data]
    if _is_mpi_comm(comm):
        parts = bigmpi.gatherv_bytes(comm, _dumps(data), root=dst, call=Helper.GATHER)
        return [] if parts is None else _loads_all(parts)
    _header(comm, Helper.GATHER, root=dst)
    out = comm.gather(data, root=dst)
    return out if out is not None else []


def broadcast_object(obj: Any = None, src: int = 0, group: Any = None) -> Any:
    """Return rank ``src``'s ``obj`` on every rank of ``group`` (any size). A ``src`` that is not
    a rank of the group is a ``ValueError`` on every rank."""
    return _broadcast(obj, src, _bounded(group, "broadcast_object"), Helper.BROADCAST_OBJECT)


def _broadcast(obj: Any, src: int, comm: Any, call: Helper) -> Any:
    if comm.Get_size() == 1:
        bigmpi.check_root(src, 1, f" in {call}")  # (in one process no header carries it)
        return obj
    if _is_mpi_comm(comm):
        is_src = comm.Get_rank() == src
        return pickle.loads(bigmpi.bcast_bytes(comm, _dumps(obj) if is_src else None, root=src, call=call))
    _header(comm, call, root=src)
    return comm.bcast(obj, root=src)


def shared_random_seed() -> int:
    """A random int in [0, 2**31) that is the same on every rank (drawn on rank 0)."""
    comm = _bounded(None, "shared_random_seed")
    seed = int(np.random.randint(2**31)) if comm.Get_rank() == 0 else None
    return int(_broadcast(seed, 0, comm, Helper.SHARED_RANDOM_SEED))


def reduce_dict(input_dict: Mapping[str, Any], average: bool = True) -> Dict[str, Any]:
    """Sum (or average) a dict of scalars/tensors over all ranks.

    Like detectron2 the main process gets the reduced values; unlike it, every rank does (an
    allreduce costs the same for a few scalars). Keys, and each value's shape, must match on every
    rank: a mismatch is a ``ValueError`` on every rank naming the keys, the ranks and the shapes
    (found in the first exchange, before anything is reduced). Values are python numbers, numpy
    arrays or scalars, or tensors (ints, floats, bools), and come back as the same kind of value,
    tensors on their device:

    - a sum (``average=False``) of integers (int or bool on every rank) is exact: an ``int``, or
      an int64 array or tensor (like ``torch.sum`` and ``numpy.sum``: the sum of int32 or bool
      values may not fit their own dtype);
    - a mean of integers is the true mean in floating point: a python ``float``, a float64 numpy
      value, a tensor of torch's default float dtype (``torch.get_default_dtype()``) -- not the
      mean rounded to an integer;
    - a float on any rank makes the key's reduction floating point: floats keep their dtype,
      integer values on the other ranks come back as floats as above.

    In one process the values go through the same conversions (so the types do not depend on
    the world size).
    """
    keys = sorted(input_dict.keys())
    comm = _bounded(None, "reduce_dict")
    size = comm.Get_size()
    values = [_to_numpy(input_dict[k]) for k in keys]
    mine = [(k, tuple(v.shape), bool(v.dtype == np.int64)) for k, v in zip(keys, values)]
    every = _all_gather(mine, comm, Helper.REDUCE_DICT)
    _same_keys_and_shapes(every)
    exact = [all(rank[i][2] for rank in every) for i in range(len(keys))]  # integers on every rank
    totals: List[np.ndarray] = [np.zeros(0)] * len(keys)
    for integers in (True, False):  # one allreduce per kind (the same on every rank: they agree on it)
        idx = [i for i in range(len(keys)) if exact[i] == integers]
        if not idx:
            continue
        flat = np.concatenate([values[i].astype(np.int64 if integers else np.float64).ravel() for i in idx])
        total = _allreduce(comm, flat) if size > 1 else flat
        pos = 0
        for i in idx:
            totals[i] = total[pos: pos + values[i].size].reshape(values[i].shape)
            pos += values[i].size
    out: Dict[str, Any] = {}
    for i, k in enumerate(keys):
        total = totals[i] / size if average else totals[i]
        out[k] = _like(input_dict[k], total, exact[i] and not average)
    return out


def _same_keys_and_shapes(every: List[List[Any]]) -> None:
    """Every rank's ``[(key, shape, integral), ...]``: a ValueError (on every rank: they all see
    all of it) if the keys or any shape differ between ranks."""
    keys = [[k for k, _, _ in rank] for rank in every]
    if any(k != keys[0] for k in keys):
        diff = [r for r, k in enumerate(keys) if k != keys[0]]
        raise ValueError(f"reduce_dict: keys differ between ranks (ranks {diff} differ from rank 0: "
                         f"{keys[0]} vs {keys[diff[0]]})")
    bad = []
    for i, k in enumerate(keys[0]):
        by = ranks_by_value([rank[i][1] for rank in every])
        if len(by) > 1:
            bad.append(f"{k!r}: " + ", ".join(f"rank(s) {ranks} have shape {shape}" for shape, ranks in by.items()))
    if bad:
        raise ValueError("reduce_dict: values differ in shape between ranks: " + "; ".join(bad))


def _allreduce(comm: Any, flat: np.ndarray) -> np.ndarray:
    if _is_mpi_comm(comm):
        total = np.empty_like(flat)
        comm.Allreduce(flat, total, op=mpi.MPI().SUM)
        return total
    import torch
    import torch.distributed as dist

    t = torch.from_numpy(flat)
    dist.all_reduce(t, group=getattr(comm, "group", None))
    out: np.ndarray = t.numpy()
    return out


def _to_numpy(v: Any) -> np.ndarray:
    """``v`` as int64 (integers and bools) or float64 (anything else)."""
    if hasattr(v, "detach"):
        t = v.detach().cpu()
        out: np.ndarray = (t.double() if t.is_floating_point() or t.is_complex() else t.long()).numpy()
        return out
    arr = np.asarray(v)
    return arr.astype(np.int64 if arr.dtype == np.bool_ or np.issubdtype(arr.dtype, np.integer) else np.float64)


def _like(orig: Any, values: np.ndarray, exact: bool) -> Any:
    """``values`` (int64 when ``exact``: a sum of integers; else float64) as the kind of ``orig``."""
    if hasattr(orig, "detach"):
        import torch

        if exact:
            dtype = torch.int64
        else:
            dtype = orig.dtype if orig.is_floating_point() or orig.is_complex() else torch.get_default_dtype()
        return torch.from_numpy(np.array(values)).to(device=orig.device, dtype=dtype)
    if isinstance(orig, (np.ndarray, np.generic)):
        dt: Any = np.int64 if exact else orig.dtype if np.issubdtype(orig.dtype, np.inexact) else np.float64
        arr = np.asarray(values).astype(dt)
        return arr if isinstance(orig, np.ndarray) else arr[()]
    if isinstance(orig, (int, float)) and values.size == 1:  # (bool is an int)
        return int(values.item()) if exact else float(values.item())
    return values


_MB_TAG = settings.TAG_BARRIER_FIRST  # one tag per monitored_barrier call, cycling
_mb_seq = 0


def monitored_barrier(group: Any = None, timeout: Optional[float] = None, wait_all_ranks: bool = False) -> None:
    """A barrier that names the ranks that did not arrive, like torch's gloo-only ``monitored_barrier``.

    Every rank reports to rank 0 over MPI point-to-point; rank 0 waits at most ``timeout`` seconds
    (default ``HPCSYNC_TIMEOUT`` or 1800) and raises ``RuntimeError`` naming the first missing rank
    (all of them with ``wait_all_ranks=True``); the ranks that did arrive get the same error. Works
    without torch.distributed and with any backend; ``group`` as for the other helpers.
    """
    global _mb_seq
    import time

    comm = group_comm(group)
    if isinstance(comm, TorchComm):  # torch.distributed without MPI: torch's own (gloo)
        import datetime

        import torch.distributed as dist

        dist.monitored_barrier(group=group, wait_all_ranks=wait_all_ranks,
                               timeout=None if timeout is None else datetime.timedelta(seconds=timeout))
        return
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        return
    limit = float(timeout if timeout is not None else settings.number("HPCSYNC_TIMEOUT"))
    tag = _MB_TAG + _mb_seq % settings.TAG_BARRIER_COUNT
    _mb_seq += 1
    MPI = mpi.MPI()
    deadline = time.monotonic() + limit
    if rank == 0:
        bufs = {r: bytearray(1) for r in range(1, size)}
        reqs = {r: serial.call(comm.Irecv, [bufs[r], MPI.BYTE], source=r, tag=tag) for r in range(1, size)}
        while reqs and time.monotonic() < deadline:
            reqs = {r: q for r, q in reqs.items() if not serial.call(q.Test)}
            time.sleep(0.001)
        missing = sorted(reqs)
        verdict = (b"\x00" if not missing else b"\x01")
        msg = "" if not missing else (
            f"monitored_barrier: rank(s) {missing if wait_all_ranks else missing[:1]} did not reach the barrier "
            f"within {limit:g}s")
        for r in range(1, size):
            if r not in reqs:
                serial.call(comm.Send, [verdict + msg.encode(), MPI.BYTE], dest=r, tag=tag)  # (1 byte+: eager)
        if missing:
            for q in reqs.values():
                serial.call(q.Cancel)
            raise RuntimeError(msg)
        return
    serial.call(comm.Send, [b"\x00", MPI.BYTE], dest=0, tag=tag)  # (one byte: sent eagerly)
    status = MPI.Status()
    while not serial.call(comm.Iprobe, source=0, tag=tag, status=status):
        if time.monotonic() > deadline + 5:
            raise RuntimeError(f"monitored_barrier: no answer from rank 0 within {limit:g}s")
        time.sleep(0.001)
    answer = bytearray(status.Get_count(MPI.BYTE))
    serial.call(comm.Recv, [answer, MPI.BYTE], source=0, tag=tag)  # (probed: it is here)
    if answer[:1] != b"\x00":
        raise RuntimeError(bytes(answer[1:]).decode())
