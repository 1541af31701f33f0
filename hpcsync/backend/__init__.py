"""``hpcsync``: a socket-free torch.distributed backend that moves tensors with mpi4py.

Works with stock pip wheels of torch (which have no MPI backend) and opens no listening socket:
ranks come from MPI, rendezvous uses an in-process ``HashStore``, data goes through MPI.

    import hpcsync.backend                      # registers "hpcsync" (also done by hpcsync.init)
    dist.init_process_group("hpcsync", init_method="hpcsync://")

How it works. Each process group owns a private duplicate of its MPI communicator for
collectives and another for point-to-point, so torch's traffic never matches the program's own
MPI messages. Collectives run in issue order on one worker thread per group with blocking mpi4py
calls (the GIL is released inside MPI): ``async_op=True`` (and DDP's bucket all-reduces) return at
once and overlap with the caller's computation; a blocking call with nothing queued runs inline
as the blocking MPI call, with no thread hand-off (:mod:`.engine`, :mod:`.deadline`). Point-to-point uses ``Isend``/``Irecv`` started in the caller's thread,
so sends and receives never block each other.

Types: every torch dtype. MPI has no float16/bfloat16: reductions on them are computed in
float32 and rounded once (at least as accurate as reducing in 16 bits). CUDA tensors are staged
through host memory (a CUDA-aware MPI could take them directly; not detected yet).
Errors: an exception inside an operation fails its work (``wait()`` raises). Every operation is
bounded by the group's timeout: past it :mod:`hpcsync.observe.watchdog` reports who is stuck where and,
by default, the job ends (``MPI_Abort``); with ``abort_on_exception=False`` the waiting ranks
raise ``DistBackendError`` instead and the group is broken for good (MPI cannot cancel a
collective). Mismatched collectives are detected (a 16-byte fingerprint is agreed before each
blocking one, travels beside the others) and raise on every rank instead of returning wrong data.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist

from ..core import mpi, jobend, nodemap
from ..observe import responder
from . import deadline
from .deadline import broken_groups
from .engine import BACKEND_NAME
from .group import ProcessGroupHpcsync
from ..core.serial import SERIAL

__all__ = ["INIT_METHOD", "follow_default_timeout", "register"]

log = logging.getLogger(__name__)

INIT_METHOD = "hpcsync://"


_default_timeout: Optional[timedelta] = None  # the default group's (init's): see follow_default_timeout


def follow_default_timeout(timeout: Optional[timedelta]) -> None:
    """Give every group created without ``timeout=`` this timeout (the default group's, i.e.
    ``init``'s) instead of torch's global default of 30 minutes (10 for nccl). Set when the
    default hpcsync group is created and by :func:`hpcsync.init` for every backend; None undoes it."""
    global _default_timeout
    _default_timeout = timeout


def _patch_default_timeout() -> None:
    """torch asks ``distributed_c10d._get_default_timeout(backend)`` for the timeout of a group
    created without one: answer with the default group's timeout when one was set."""
    c10d = dist.distributed_c10d
    torch_default = getattr(c10d, "_get_default_timeout", None)
    if torch_default is None or getattr(torch_default, "_hpcsync", False):
        if torch_default is None:
            log.warning("hpcsync: this torch has no _get_default_timeout; groups created without timeout= "
                        "get torch's default, not init's")
        return

    def default_timeout(backend: Any) -> timedelta:
        return _default_timeout if _default_timeout is not None else torch_default(backend)

    default_timeout._hpcsync = True  # type: ignore[attr-defined]
    c10d._get_default_timeout = default_timeout


def _bounded_call(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """``fn()`` (a blocking MPI call of group creation), on a helper thread when MPI allows it, so
    that a rank that never joins fails here within ``timeout_s`` instead of blocking forever
    (the helper stays blocked inside MPI; the job must end)."""
    MPI = mpi.MPI()
    if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        return fn()
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001  re-raised in the caller
            box["error"] = exc

    helper = threading.Thread(target=target, name="hpcsync-create", daemon=True)
    helper.start()
    helper.join(timeout_s)
    if helper.is_alive():
        broken_groups.append((f"creating {what} timed out", 0.0, helper))
        raise dist.DistBackendError(f"hpcsync backend: creating {what} timed out after {timeout_s:g}s: not every "
                                    "rank of the group called new_group")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _create(opts: Any, _backend_options: Any = None) -> ProcessGroupHpcsync:
    """A group for torch; below THREAD_MULTIPLE made under the process's MPI lock."""
    MPI = mpi.MPI()
    if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
        return _create_group(opts)
    with SERIAL:
        return _create_group(opts)


def _create_group(opts: Any) -> ProcessGroupHpcsync:
    from ..core.topology import topology

    topology()  # silent-singleton check, MPI initialised
    world = mpi.MPI().COMM_WORLD
    ranks = list(opts.global_ranks_in_group) or list(range(world.Get_size()))
    if opts.timeout.total_seconds() <= 0:
        raise ValueError(f"hpcsync backend: a group's timeout must be positive, got {opts.timeout}")
    if not dist.is_initialized():  # this is the default group: groups made without timeout= follow it
        follow_default_timeout(opts.timeout)
    what = f"group {opts.group_id} (ranks {nodemap.describe(ranks)})"
    comm = _bounded_call(lambda: mpi.sub_communicator(world, ranks, str(opts.group_id)),
                         opts.timeout.total_seconds(), what)
    if comm.Get_rank() != opts.group_rank or comm.Get_size() != opts.group_size:
        raise RuntimeError(f"hpcsync backend: torch expects rank {opts.group_rank}/{opts.group_size} in group "
                           f"{opts.group_id}, MPI gives {comm.Get_rank()}/{comm.Get_size()}")
    if comm is world and mpi.MPI().Query_thread() == mpi.MPI().THREAD_MULTIPLE:
        responder.start()  # collective over the world: the default group is created by every rank
    pg = ProcessGroupHpcsync(comm, opts.timeout, str(opts.group_id), ranks)
    if comm is not world:
        comm.Free()  # the group keeps its own duplicates
    return pg


def _rendezvous(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs: Any):
    """``hpcsync://``: rank and size from MPI, an in-process store: no TCP listener at all."""
    from ..core.topology import topology

    topo = topology()
    yield dist.HashStore(), topo.rank, topo.world_size


def _at_exit() -> None:
    """Stop the watchdog before MPI_Finalize; end the job if a group is broken.

    A group that timed out or desynchronised still has MPI operations in flight, and MPI_Finalize
    would hang or crash on them. Every rank first meets the others in a bounded exit barrier (its
    watchdog still answering): a broken rank waits up to that group's timeout + 20 s, so every
    rank can finish handling its own error and report, then ends the job with MPI_Abort, saying
    why; a healthy rank waits up to 30 s (MPI_Finalize would wait for the others anyway).
    """
    MPI = mpi.MPI()
    if MPI.Is_finalized():
        return
    resp = responder.responder()
    if resp is not None:
        req = resp.comm.Ibarrier()
        until = time.monotonic() + (max(t for _, t, _ in broken_groups) + 20 if broken_groups else 30)
        while not req.Test() and time.monotonic() < until:
            time.sleep(0.01)
    deadline.stop()  # it may call MPI (a report); the responder next, then MPI_Finalize
    if resp is not None:
        resp.stop()
    if broken_groups:
        sys.stdout.flush()
        sys.stderr.write(f"[hpcsync] rank {MPI.COMM_WORLD.Get_rank()}: exiting with a broken process group "
                         f"({broken_groups[0][0]}); MPI cannot finalize with collectives in flight: MPI_Abort\n")
        sys.stderr.flush()
        jobend.abort(1)


def register() -> None:
    """Register the backend and the ``hpcsync://`` rendezvous with torch (idempotent)."""
    _patch_default_timeout()
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    from torch.distributed.rendezvous import register_rendezvous_handler

    try:
        register_rendezvous_handler("hpcsync", _rendezvous)
    except (ValueError, RuntimeError) as exc:  # torch 2.13 raises RuntimeError, older releases ValueError
        if "already registered" not in str(exc):
            raise


register()
jobend.at_exit("backend", _at_exit)
