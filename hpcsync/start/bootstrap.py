"""``hpcsync.init()``: torch.distributed from MPI, with a routable master address.

Under MPI, ranks and sizes come from MPI and rank 0's choices (address, port) travel by
``MPI_Bcast``: no guessing, no probe-then-bind port race. Without MPI (torchrun, HPCSYNC_MPI=0)
the launcher's environment is used.
"""
from __future__ import annotations

import datetime as _dt
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, List, Optional, Union

from ..core import mpi, bounded, jobend, settings
from ..observe import digest, failure, flight, responder, watchdog
from ..core.errors import AddressError, HpcsyncError, MissingDependencyError, SetupError
from . import precheck
from .network import (Acceptor, MasterChoice, NodeInterfaces, choose_master, describe_nodes, kernel_route_source,
                      local_interfaces, master_candidates, open_listener, try_connect)
from ..core.topology import Topology, topology

__all__ = [
    "BACKENDS", "master_address", "init", "InitOptions", "Rendezvous", "is_initialized", "shutdown", "install_abort_hook",
    "uninstall_abort_hook"
]

log = logging.getLogger(__name__)

_lock = threading.RLock()
_state: dict = {}

BACKENDS = ("auto", "nccl", "mpi", "hpcsync", "gloo")


def _timeout(timeout: Union[None, float, _dt.timedelta]) -> _dt.timedelta:
    if timeout is None:
        td = _dt.timedelta(seconds=settings.number("HPCSYNC_TIMEOUT"))
    else:
        td = timeout if isinstance(timeout, _dt.timedelta) else _dt.timedelta(seconds=float(timeout))
    if td.total_seconds() <= 0:
        raise ValueError(f"hpcsync.init: timeout must be positive (it bounds every collective), got {timeout!r}")
    return td


def master_address(topo: Optional[Topology] = None, verify: bool = True, timeout: Optional[float] = None) -> MasterChoice:
    """Rank 0's routable address, chosen from every node's interfaces (collective under MPI).

    With ``verify`` and several nodes, the choice is proven before anyone uses it: rank 0 listens
    on each candidate (and accepts on a thread, so no accept-queue cap drops connections), one rank
    per other node connects to all of them (bounded by ``HPCSYNC_CONNECT_TIMEOUT``, default 3 s),
    and the first candidate every node reached wins. None reached: the same
    :class:`AddressError` on every rank, with what each node has and what failed. Every exchange
    between the ranks waits at most ``timeout`` seconds (default ``HPCSYNC_TIMEOUT``).
    """
    topo = topo or topology()
    env_addr = settings.text("HPCSYNC_MASTER_ADDR")
    ifname = settings.text("HPCSYNC_IFNAME")
    if not topo.uses_mpi:
        launcher_addr = _env_master_addr()
        if env_addr or launcher_addr:
            return MasterChoice(env_addr or launcher_addr, None, "environment")  # type: ignore[arg-type]
        return choose_master([NodeInterfaces(topo.hostname, local_interfaces())], ifname=ifname)
    comm = bounded.control("hpcsync.init: choosing the master address", timeout=timeout)
    mine = NodeInterfaces(topo.hostname, local_interfaces()) if topo.local_rank == 0 else None
    tables = comm.gather((topo.node_rank, mine), root=0)
    result: Any = None
    ordered: List[NodeInterfaces] = []
    if topo.rank == 0:
        nodes = {n: t for n, t in tables if t is not None}
        ordered = [nodes[topo.node_rank]] + [t for n, t in sorted(nodes.items()) if n != topo.node_rank]
        try:
            if env_addr:
                result = [choose_master(ordered, address=env_addr)]
            else:
                result = master_candidates(ordered, ifname=ifname, route=kernel_route_source)
        except AddressError as exc:
            result = str(exc)
    result = comm.bcast(result, root=0)
    if isinstance(result, str):
        raise AddressError(result)
    if not verify or topo.num_nodes == 1 or env_addr:
        return result[0]
    return _prove(comm, topo, result, ordered)


def _prove(comm: Any, topo: Topology, candidates: List[MasterChoice], nodes: List[NodeInterfaces]) -> MasterChoice:
    """Pick the first candidate that one rank on every other node can connect to (collective)."""
    timeout = settings.number("HPCSYNC_CONNECT_TIMEOUT")
    listeners: List[Any] = []
    ports: Any = None
    acceptor = None
    if topo.rank == 0:
        opened = [open_listener(c.address, backlog=max(128, topo.num_nodes + 16)) for c in candidates]
        listeners = [sock for sock, _, _ in opened if sock is not None]
        ports = [port for _, port, _ in opened]
        acceptor = Acceptor(listeners)
    ports = comm.bcast(ports, root=0)
    errors = None
    if topo.local_rank == 0 and topo.rank != 0:
        errors = try_connect([(c.address, p) for c, p in zip(candidates, ports)], timeout)
    every = comm.gather((topo.hostname, errors), root=0)
    result: Any = None
    if topo.rank == 0:
        acceptor.close()  # type: ignore[union-attr]
        for sock in listeners:
            sock.close()
        reports = [(host, errs) for host, errs in every if errs is not None]
        for k, cand in enumerate(candidates):
            if ports[k] and all(errs[k] is None for _, errs in reports):
                result = MasterChoice(cand.address, cand.ifname, cand.reason + ", reached from every node")
                break
        else:
            tried = "\n".join(
                f"  {c.address} ({c.ifname}; {c.reason}): "
                + ("; ".join(f"{host}: {errs[k]}" for host, errs in reports if errs[k]) or "rank 0 could not listen")
                for k, c in enumerate(candidates))
            result = (f"no candidate master address was reachable from every node; tried:\n{tried}\n"
                      f"Interfaces per node:\n{describe_nodes(nodes)}\n"
                      "Set HPCSYNC_MASTER_ADDR or HPCSYNC_IFNAME, or use backend='hpcsync' (needs no address).")
    result = comm.bcast(result, root=0)
    if isinstance(result, str):
        raise AddressError(result)
    return result


def _env_master_addr() -> Optional[str]:
    from ..core.environments import detect_environment

    return detect_environment(os.environ).master_addr()


def _pick_backend(backend: str, topo: Topology) -> str:
    import torch
    import torch.distributed as dist

    if backend == "hpcsync" and not topo.uses_mpi and topo.world_size > 1:
        raise HpcsyncError("backend 'hpcsync' moves tensors with MPI, but this job runs without MPI "
                           f"(launcher {topo.launcher}); launch with mpirun/srun --mpi=..., or use backend='gloo'")
    if backend != "auto":
        return backend
    if torch.cuda.is_available() and torch.cuda.device_count() >= topo.local_size and dist.is_nccl_available():
        return "nccl"
    if topo.uses_mpi and dist.is_mpi_available():
        return "mpi"
    if topo.uses_mpi and _our_backend_available():
        return "hpcsync"
    return "gloo"


def _our_backend_available() -> bool:
    try:
        from .. import backend  # noqa: F401
    except ImportError:
        return False
    return True


def _export_env(topo: Topology, addr: Optional[str], port: Optional[int]) -> None:
    os.environ["RANK"] = str(topo.rank)
    os.environ["WORLD_SIZE"] = str(topo.world_size)
    os.environ["LOCAL_RANK"] = str(topo.local_rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(topo.local_size)
    os.environ["NODE_RANK"] = str(topo.node_rank)
    if addr is not None:
        os.environ["MASTER_ADDR"] = addr
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)


def init(
    backend: str = "auto",
    init_method: Optional[str] = None,
    timeout: Union[None, float, _dt.timedelta] = None,
    master_port: Optional[int] = None,
    set_device: bool = True,
    abort_on_exception: bool = True,
    store: Optional[str] = None,
    log_dir: Optional[str] = None,
) -> Topology:
    """Initialise torch.distributed from MPI (or the launcher) and return the topology.

    backend: ``auto`` picks nccl (a GPU per local rank), native ``mpi`` (torch built with it),
    ``hpcsync`` (the socket-free mpi4py backend), else ``gloo``.
    init_method: ``None``/``"tcp"`` -- rank 0 binds a TCPStore (port ``master_port`` or 0, i.e.
    any free port) and broadcasts the bound port over MPI; ``"env://"`` -- MASTER_ADDR/PORT;
    ``"file:///shared/path"`` -- a file on a shared filesystem. ``mpi``/``hpcsync`` need none.
    store: ``"tcp"`` (default; ``HPCSYNC_STORE``) or ``"mpi"`` -- gloo/nccl rendezvous through
    :class:`hpcsync.start.store.MPIStore` (MPI messages to rank 0, no listening port for the store).
    log_dir: a file per rank there, rank 0 and every rank's warnings on the console
    (:func:`hpcsync.setup_logging`; ``HPCSYNC_LOG_DIR`` does the same without code).
    A malformed ``HPCSYNC_*`` setting or a bad argument raises :class:`SetupError` (a
    ``ValueError``) on every rank, the same one under MPI (the ranks exchange what each found
    first); uncaught, it is said once and every rank exits (:mod:`hpcsync.start.precheck`).
    Calling it again returns the same topology; a second call that asks for something else than
    the first set up (``init()`` then ``init(backend="gloo")``) raises :class:`SetupError` (each
    rank checks its own call): :func:`shutdown` first. :func:`shutdown` undoes it.
    """
    asked = InitOptions(backend, init_method, timeout, master_port, set_device, abort_on_exception, store, log_dir)
    with _lock:
        if _state.get("topology") is not None:
            return _again(asked)
        # Before anything that can fail on one rank only (a setting, MPI itself): an exception
        # escaping init ends the job as one from training does, instead of leaving the other
        # ranks waiting in MPI (a launcher need not end the job when one rank exits).
        jobend.set_abort_on_error(abort_on_exception)
        if jobend.abort_on_error():
            install_abort_hook()
        topo = precheck.check(precheck.argument_problems(backend, BACKENDS, store, timeout, master_port), timeout)
        jobend.stacks_on_crash()  # after MPI_Init: its handler for SIGSEGV runs after ours
        store_kind = (store or settings.text("HPCSYNC_STORE") or "tcp").lower()
        dist = _torch_distributed()
        _our_backend_available()  # registers "hpcsync" with torch, so new_group(backend="hpcsync") works
        from ..observe import logs

        if log_dir or settings.text("HPCSYNC_LOG_DIR"):
            logs.setup_logging(log_dir)
        else:
            logs.console_warnings()  # hpcsync's own warnings on the console, unless the program logs
        td = _timeout(timeout)
        if dist.is_initialized():
            log.info("torch.distributed was already initialised; checking it against MPI")
            _check_ranks(topo)
            _state.update(topology=topo, owner=False, asked=asked, backend=dist.get_backend())
            return topo
        name = _pick_backend(backend, topo)
        if name == "mpi":
            done = _rendezvous_mpi(topo, td)
        elif name == "hpcsync":
            done = _rendezvous_hpcsync(topo, td)
        else:
            done = _rendezvous_sockets(name, topo, td, asked, store_kind)
        _started(topo, name, done, td, asked)
        _state["store_kind"] = store_kind if name in ("gloo", "nccl") else None
        return topo


@dataclass(frozen=True)
class InitOptions:
    """The arguments of one :func:`init` call, as given (a second call is checked against them)."""

    backend: str = "auto"
    init_method: Optional[str] = None
    timeout: Union[None, float, _dt.timedelta] = None
    master_port: Optional[int] = None
    set_device: bool = True
    abort_on_exception: bool = True
    store: Optional[str] = None
    log_dir: Optional[str] = None


@dataclass(frozen=True)
class Rendezvous:
    """What a backend's rendezvous leaves: the store (a TCPStore, an MPIStore or None), the TCP
    store's port and the master address (None for the MPI-based backends)."""

    store: Any = None
    port: Optional[int] = None
    master: Optional[MasterChoice] = None


def _again(asked: InitOptions) -> Topology:
    """A second :func:`init`: the first one's topology, unless an argument given now (not left
    at its default) means something else than what the first call set up -- compared as
    resolved: the backend with the one running, the timeout as a duration, the store's kind,
    the log folder as an absolute path. Each rank checks its own call against its own first."""
    first: InitOptions = _state.get("asked") or InitOptions()
    default = InitOptions()
    clashes = []
    running = str(_state.get("backend") or "")  # "gloo", or torch's "cpu:gloo,cuda:nccl"
    if asked.backend != "auto" and asked.backend not in running.replace(",", ":").split(":"):
        clashes.append(f"backend={asked.backend!r} (the first started {running!r})")
    started = _state.get("timeout")  # the first call's, resolved then (HPCSYNC_TIMEOUT may have changed since)
    if asked.timeout is not None and started is not None and _timeout(asked.timeout) != started:
        clashes.append(f"timeout={asked.timeout!r} (the first gave {first.timeout!r})")
    kind = _state.get("store_kind")
    if asked.store is not None and kind is not None and asked.store.lower() != kind:
        clashes.append(f"store={asked.store!r} (the first used {kind!r})")
    if asked.log_dir is not None and os.path.abspath(asked.log_dir) != os.path.abspath(first.log_dir or
                                                                                       settings.text("HPCSYNC_LOG_DIR") or ""):
        clashes.append(f"log_dir={asked.log_dir!r} (the first gave {first.log_dir!r})")
    for name in ("init_method", "master_port", "set_device", "abort_on_exception"):
        now, then = getattr(asked, name), getattr(first, name)
        if now != getattr(default, name) and now != then:
            clashes.append(f"{name}={now!r} (the first gave {then!r})")
    if clashes:  # each rank's own: uncaught, the failure report says it once (hpcsync.observe.digest)
        raise SetupError("hpcsync.init: already initialised, and this call asks for something else: "
                         + ", ".join(clashes) + "; call hpcsync.shutdown() first to start again")
    return _state["topology"]


def _torch_distributed() -> Any:
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise MissingDependencyError(f"hpcsync.init needs torch: pip install torch ({exc})") from exc
    return dist


def _rendezvous_mpi(topo: Topology, td: _dt.timedelta) -> Rendezvous:
    """torch's own MPI backend (torch built with it): MPI is the rendezvous."""
    import torch.distributed as dist

    _export_env(topo, None, None)
    dist.init_process_group("mpi", timeout=td)
    return Rendezvous()


def _rendezvous_hpcsync(topo: Topology, td: _dt.timedelta) -> Rendezvous:
    """The socket-free backend: its ``hpcsync://`` rendezvous runs over MPI, no address, no port."""
    import torch.distributed as dist

    from ..backend import INIT_METHOD
    from ..backend.engine import BACKEND_NAME

    _export_env(topo, None, None)
    dist.init_process_group(BACKEND_NAME, init_method=INIT_METHOD, timeout=td)
    return Rendezvous()


def _rendezvous_sockets(name: str, topo: Topology, td: _dt.timedelta, asked: InitOptions,
                        store_kind: str) -> Rendezvous:
    """gloo and nccl: a master address every node reaches, each rank's own interface, then an
    ``init_method`` of the user's (``env://``, ``file://``) or a store (TCP, or over MPI)."""
    import torch
    import torch.distributed as dist

    flight.enable(name)  # where each rank is in each group, for a report when a collective stalls
    choice = master_address(topo, timeout=td.total_seconds())
    _own_interface(topo, choice, name, td.total_seconds())
    if name == "nccl" and asked.set_device:
        torch.cuda.set_device(topo.local_rank % torch.cuda.device_count())
    init_method = asked.init_method
    if init_method is None and not topo.uses_mpi:
        init_method = "env://"  # torchrun's agent store, or MASTER_ADDR/PORT from the launcher
    if init_method and init_method != "tcp":
        port = None
        if init_method == "env://":
            port = int(os.environ.get("MASTER_PORT") or asked.master_port or _default_port())
            _export_env(topo, os.environ.get("MASTER_ADDR") or choice.address, port)
        else:
            _export_env(topo, choice.address, None)
        dist.init_process_group(name, init_method=init_method, rank=topo.rank, world_size=topo.world_size, timeout=td)
        return Rendezvous(None, port, choice)
    if store_kind == "mpi" and topo.uses_mpi:
        from .store import MPIStore

        kv: Any = MPIStore(timeout=td)
        port = None
    else:
        kv, port = _tcp_store(topo, choice.address, asked.master_port, td)
    _export_env(topo, choice.address, port)
    dist.init_process_group(name, store=kv, rank=topo.rank, world_size=topo.world_size, timeout=td)
    return Rendezvous(kv, port, choice)


def _started(topo: Topology, name: str, done: Rendezvous, td: _dt.timedelta, asked: InitOptions) -> None:
    """After the rendezvous: the ranks checked, the responder, the exit order, the log line."""
    _check_ranks(topo)
    if topo.uses_mpi and mpi.MPI().Query_thread() == mpi.MPI().THREAD_MULTIPLE:
        responder.start()  # answers report questions (a stalled gloo/NCCL collective, a failure)
    _state.update(topology=topo, owner=True, store=done.store, backend=name, master=done.master, asked=asked,
                  timeout=td)
    if _our_backend_available():  # groups created without timeout= (any backend) follow init's
        from ..backend import follow_default_timeout

        follow_default_timeout(td)
    # Destroy the group before interpreter teardown: a gloo group left alive at exit can abort
    # the process ("terminate called without an active exception"), measured under torchrun.
    jobend.at_exit("torch", shutdown)
    if jobend.abort_on_error():
        install_abort_hook()  # again: on top of the hook torch's init_process_group wrapped around it
    if topo.rank == 0:
        failure.note_started()
        choice = done.master
        log.info("torch.distributed ready: backend=%s world=%d nodes=%d master=%s", name, topo.world_size,
                 topo.num_nodes, f"{choice.address}:{done.port} ({choice.reason})" if choice else "none (MPI)")


def _own_interface(topo: Topology, choice: MasterChoice, backend: str, timeout: float) -> None:
    """This rank's own interface for gloo / NCCL (the one its kernel routes to the master by, never
    a name from another node), proven between every pair of nodes when there are several."""
    from . import interfaces

    link = None
    err: Optional[str] = None
    try:
        link = interfaces.own_link(choice.address, backend, node=topo.node_rank, hostname=topo.hostname)
    except AddressError as exc:
        err = str(exc)
    if topo.uses_mpi and topo.world_size > 1:  # one error, the same on every rank, whichever failed
        ctl = bounded.control("hpcsync.init: each node's own interface", timeout=timeout)
        errs = [e for e in ctl.allgather(err) if e]
        if errs:
            raise AddressError("\n".join(sorted(set(errs))))
    elif err:
        raise AddressError(err)
    assert link is not None
    if topo.uses_mpi and topo.num_nodes > 1:
        interfaces.prove_peers(bounded.control("hpcsync.init: proving every pair of nodes", timeout=timeout),
                               topo, link, backend)
    interfaces.export(link, backend)
    log.debug("rank %d: %s uses %s", topo.rank, backend, link)


def _default_port() -> int:
    from ..core.environments import detect_environment

    return detect_environment(os.environ).master_port() or 29500


def _tcp_store(topo: Topology, addr: str, port: Optional[int], td: _dt.timedelta) -> Any:
    """Rank 0 binds the store and broadcasts the port it really got (no probe-then-bind race)."""
    import torch.distributed as dist

    comm = bounded.control("hpcsync.init: the TCP store's port", timeout=td.total_seconds())
    store, err = None, None
    if topo.rank == 0:
        try:
            store = dist.TCPStore(addr, port or 0, topo.world_size, True, timeout=td, wait_for_workers=False)
            port = store.port
        except Exception as exc:  # tell every rank, do not leave them waiting
            err = f"rank 0 could not bind a TCPStore on {addr}:{port or 0}: {exc}"
    port, err = comm.bcast((port, err), root=0)
    if err:
        raise HpcsyncError(err)
    if topo.rank != 0:
        store = dist.TCPStore(addr, port, topo.world_size, False, timeout=td)
    return store, port


def _check_ranks(topo: Topology) -> None:
    import torch.distributed as dist

    r, w = dist.get_rank(), dist.get_world_size()
    if (r, w) != (topo.rank, topo.world_size):
        raise HpcsyncError(f"torch.distributed says rank {r}/{w} but the launcher/MPI says "
                           f"{topo.rank}/{topo.world_size}; was it initialised with other settings?")


def is_initialized() -> bool:
    return _state.get("topology") is not None


def shutdown() -> None:
    """Undo :func:`init`: destroy the process group it created and restore the exception hook."""
    with _lock:
        if not _state:
            return
        if _state.get("owner"):
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
                # Drop the last Python references (DDP, Fabric, finished works) now, so gloo's C++
                # group is destroyed -- and its worker threads joined -- before the interpreter
                # finalizes: a gloo thread releasing a tensor then aborts ("terminate called
                # without an active exception"), seen 1 in ~10 Fabric runs.
                import gc

                gc.collect()
            close = getattr(_state.get("store"), "close", None)  # an MPIStore's server thread
            if close is not None:
                close()
        uninstall_abort_hook()
        jobend.set_abort_on_error(True)
        if _state.get("owner") and _our_backend_available():
            from ..backend import follow_default_timeout

            follow_default_timeout(None)
        _state.clear()


# -- abort on uncaught exception ---------------------------------------------------------------

_prev_hook: Any = None
_hook: Any = None


def install_abort_hook() -> None:
    """On an uncaught exception print the traceback with the rank, then ``MPI_Abort`` the job.

    Without it the other ranks wait forever in their next collective. A :class:`SetupError` that
    every rank raised (a malformed setting, a bad argument of init) is said once, by rank 0,
    without a traceback, and each rank exits non-zero without an abort. :func:`init` installs it
    first thing (an error inside init ends the job too) and again after ``init_process_group``:
    torch wraps the hook that is current at init time and holds back stderr until it returns,
    which would swallow the traceback before the abort, so ours must be outermost.
    """
    global _prev_hook, _hook
    if _prev_hook is not None:
        if _hook is not None and sys.excepthook is not _hook:
            sys.excepthook = _hook  # back on top of whatever wrapped it (its output is ours anyway)
        return
    _prev_hook = sys.excepthook

    def hook(exc_type: Any, exc: BaseException, tb: Any) -> None:
        rank = precheck.rank_label()
        interrupted = issubclass(exc_type, KeyboardInterrupt)
        if isinstance(exc, SetupError) and exc.agreed:  # every rank raised it: said once, each rank exits
            precheck.end_agreed(exc, tb)
            return
        try:
            printed = None if interrupted else digest.report(exc_type, exc, tb)  # one report for the job
        except Exception as err:  # the report failing must not keep the job from ending
            sys.stderr.write(f"[hpcsync] rank {rank}: the failure report failed ({err!r})\n")
            printed = None
        if printed is None and isinstance(exc, SetupError):  # a plain user error: said, without a traceback
            sys.stderr.write(precheck.block(exc, tb, f"rank {rank}: "))
            sys.stderr.flush()
        elif printed is None:  # no report of the job's: this rank's own traceback
            text = "".join(traceback.format_exception(exc_type, exc, tb))
            sys.stderr.write(f"[hpcsync] uncaught exception on rank {rank}:\n{text}")
            sys.stderr.flush()
        if not interrupted:
            failure.note_exception(exc)
        if mpi.use_mpi() and not interrupted:
            world = mpi.MPI().COMM_WORLD
            if world.Get_size() > 1:
                if printed is not False:  # the rank that reported says it, not every rank
                    sys.stderr.write(f"[hpcsync] rank {rank}: calling MPI_Abort so the other ranks do not hang "
                                     f"(HPCSYNC_ABORT_ON_EXCEPTION=0 to disable)\n")
                    sys.stderr.flush()
                # the launcher forwards a remote rank's stderr asynchronously, and the abort kills
                # the forwarding: give the traceback a moment to reach the user first (a rank whose
                # report another printed waits for that rank's abort, and aborts itself only if none)
                if printed is not False:
                    watchdog.flush_before_abort()
                time.sleep(0.25 if printed is not False else 5.0)
                jobend.abort(1)

    sys.excepthook = _hook = hook
    jobend.set_hook_installed(True)


def uninstall_abort_hook() -> None:
    global _prev_hook, _hook
    if _prev_hook is not None:
        sys.excepthook = _prev_hook
        _prev_hook = _hook = None
        jobend.set_hook_installed(False)
