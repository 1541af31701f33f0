"""``hpcsync doctor``: check, under the user's launcher, what would break training, with the fix.

Every check runs on every rank; rank 0 prints one line per check (worst status over ranks, with
the ranks it concerns) and the command exits non-zero when any check failed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

__all__ = ["OK", "WARN", "FAIL", "Check", "KEEPALIVE_FLAGS", "tensor_hugepages", "version_check", "run"]

OK, WARN, FAIL = "ok", "warn", "FAIL"
_JOB_WIDE = ("interfaces", "interface names")  # checks rank 0 makes from every node's answer
_ORDER = {OK: 0, WARN: 1, FAIL: 2}


@dataclass
class Check:
    name: str
    status: str
    detail: str


def _mpi_checks(checks: List[Check]) -> Any:
    """Library, thread level, silent singletons. Returns the topology, or None if unusable."""
    from ..core import mpi
    from ..core.errors import HpcsyncError
    from ..core.topology import topology

    try:
        topo = topology()
    except HpcsyncError as exc:
        checks.append(Check("launcher / MPI", FAIL, str(exc)))
        return None
    checks.append(Check("launcher", OK, f"{topo.launcher}: rank {topo.rank}/{topo.world_size}, local "
                                         f"{topo.local_rank}/{topo.local_size}, node {topo.node_rank}/{topo.num_nodes}"))
    if topo.uses_mpi:
        MPI = mpi.MPI()
        level = MPI.Query_thread()
        names = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED", MPI.THREAD_SERIALIZED: "SERIALIZED",
                 MPI.THREAD_MULTIPLE: "MULTIPLE"}
        status = OK if level == MPI.THREAD_MULTIPLE else WARN
        checks.append(Check("MPI", status, f"{topo.mpi_library}, thread level {names.get(level, level)}"
                            + ("" if status == OK else " (the hpcsync backend then runs every operation "
                               "synchronously: no overlap of communication with backward)")))
    elif topo.world_size == 1:
        checks.append(Check("MPI", WARN if topo.launcher == "single" else OK,
                            "not in use (one process)" if topo.launcher == "single" else "not in use"))
    else:
        checks.append(Check("MPI", OK, f"not in use: ranks from {topo.launcher}'s environment"))
    return topo


def _hostname_check(topo: Any, checks: List[Check]) -> None:
    from .network import hostname_addresses

    addrs = hostname_addresses(topo.hostname)
    if not addrs:
        checks.append(Check("hostname", WARN, f"{topo.hostname} does not resolve here; hpcsync does not need it "
                                              "(addresses come from interfaces), but tools that use the hostname will fail"))
    elif all(a.startswith("127.") or a == "::1" for a in addrs):
        status = WARN if topo.num_nodes > 1 else OK
        checks.append(Check("hostname", status, f"{topo.hostname} resolves to {', '.join(addrs)} (loopback): "
                            + ("other nodes cannot use it; hpcsync picks a routable interface address instead, "
                               "set HPCSYNC_IFNAME to choose one" if status == WARN else "fine on one node")))
    else:
        checks.append(Check("hostname", OK, f"{topo.hostname} resolves to {', '.join(addrs)}"))


def _address_checks(topo: Any, checks: List[Check], connect: bool) -> None:
    from ..core import mpi
    from .bootstrap import master_address
    from ..core.errors import HpcsyncError

    try:
        choice = master_address(topo, verify=connect)
    except HpcsyncError as exc:
        checks.append(Check("master address", FAIL, str(exc)))
        return
    checks.append(Check("master address", OK, f"{choice.address} ({choice.ifname or '?'}): {choice.reason}"))
    _interface_checks(topo, choice, checks, connect)
    if not (connect and topo.uses_mpi and topo.world_size > 1):
        return
    from .network import Acceptor, open_listener, try_connect

    comm = mpi.MPI().COMM_WORLD
    server, port, err = open_listener(choice.address, backlog=max(128, topo.world_size + 16)) if topo.rank == 0 \
        else (None, 0, None)
    acceptor = Acceptor([server]) if server is not None else None  # every rank connects: no queue cap may drop one
    port, err = comm.bcast((port, err), root=0)
    result = err
    if err is None and topo.rank != 0:
        result = try_connect([(choice.address, port)], timeout=5)[0]
    results = comm.gather(result, root=0)
    comm.Barrier()
    if server is not None:
        acceptor.close()  # type: ignore[union-attr]
        server.close()
    if topo.rank == 0:
        bad = [(r, m) for r, m in enumerate(results) if m]
        checks.append(Check("reachability", FAIL if bad else OK,
                            "; ".join(f"rank {r}: {m}" for r, m in bad[:5]) + " -- set HPCSYNC_IFNAME or "
                            "HPCSYNC_MASTER_ADDR to an address all nodes can reach" if bad else
                            f"every rank connected to {choice.address} (a TCP test; --no-connect skips it)"))


def _interface_checks(topo: Any, choice: Any, checks: List[Check], connect: bool) -> None:
    """Each node's own interface for gloo and NCCL (and, with ``connect``, every pair of nodes
    proven), a warning when the names differ between nodes, a failure when a user-set interface
    does not exist on some node."""
    import os

    from ..core import mpi, bounded
    from . import interfaces
    from ..core.errors import AddressError

    links, errors = [], []
    for backend, var in interfaces.BACKEND_VARS.items():
        if backend != "gloo" and var not in os.environ:
            continue  # NCCL's only when the user set it
        try:
            link = interfaces.own_link(choice.address, backend, node=topo.node_rank, hostname=topo.hostname)
        except AddressError as exc:
            errors.append(str(exc))
            continue
        if backend == "gloo":
            links.append(link)
    multi = topo.uses_mpi and topo.world_size > 1
    every = mpi.MPI().COMM_WORLD.allgather((errors, links)) if multi else [(errors, links)]
    failed = sorted({e for es, _ in every for e in es})
    if not failed and multi and connect and topo.num_nodes > 1:
        try:
            interfaces.prove_peers(bounded.control("hpcsync doctor: proving every pair of nodes"), topo, links[0],
                                   "gloo")
        except AddressError as exc:
            failed = [str(exc)]
    if failed:
        if topo.rank == 0:  # a user's variable that names nothing there: gloo / NCCL would fail on that node
            status = WARN if all("set by the user" in e for e in failed) else FAIL
            checks.append(Check("interfaces", status, "; ".join(failed[:4])))
        return
    if topo.rank != 0:
        return
    per_node = {lk.node: lk for _, lks in every for lk in lks}
    table = "\n".join(f"{'':22}node {lk.node} {lk.hostname}: {lk}" for _, lk in sorted(per_node.items()))
    proven = " (every pair of nodes connected: a TCP test)" if connect and topo.num_nodes > 1 else ""
    checks.append(Check("interfaces", OK, f"each node's own, for gloo and NCCL{proven}:\n{table}"))
    differ = interfaces.names_differ(list(per_node.values()))
    if differ:
        checks.append(Check("interface names", WARN, f"differ between nodes ({differ}): hpcsync gives each rank its "
                            "own; one GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME exported to every node would break"))


KEEPALIVE_FLAGS = "--mca oob_tcp_keepalive_time 5 --mca oob_tcp_keepalive_intvl 2 --mca oob_tcp_keepalive_probes 3"


def _lost_node_check(topo: Any, checks: List[Check], env: Any = None) -> None:
    """Does the launcher notice a lost node, or a rank that died, soon enough to end the job?"""
    import os

    env = os.environ if env is None else env
    name = "lost node"
    if topo.launcher == "openmpi":
        idle = float(env.get("OMPI_MCA_oob_tcp_keepalive_time", 300))
        probes = float(env.get("OMPI_MCA_oob_tcp_keepalive_probes", 9)) * float(env.get("OMPI_MCA_oob_tcp_keepalive_intvl", 20))
        if topo.num_nodes > 1 and idle + probes > 60:
            checks.append(Check(name, WARN, f"mpirun notices a node that dropped off the network after ~{idle + probes:g} s "
                                            "(oob keepalive); hpcsync ends the job itself HPCSYNC_ABORT_GRACE s after "
                                            f"its abort, from mpirun's node only. Add: mpirun {KEEPALIVE_FLAGS}"))
        else:
            checks.append(Check(name, OK, f"mpirun notices a lost node within ~{idle + probes:g} s"
                                          if topo.num_nodes > 1 else "one node: nothing to lose"))
    elif topo.launcher == "slurm" and topo.world_size > 1:
        if env.get("SLURM_KILL_BAD_EXIT") == "1":
            checks.append(Check(name, OK, "SLURM_KILL_BAD_EXIT=1: a task that fails ends the step"))
        else:
            checks.append(Check(name, WARN, "srun keeps the other tasks running when one exits with an error "
                                            "(unless it aborts through MPI): srun --kill-on-bad-exit=1, or "
                                            "export SLURM_KILL_BAD_EXIT=1 in the batch script"))


def _torch_checks(topo: Any, checks: List[Check]) -> None:
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        checks.append(Check("torch", FAIL, "torch is not installed: pip install torch"))
        return
    names = [n for n, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                             ("mpi", dist.is_mpi_available())) if ok]
    ours = "hpcsync (socket-free, needs MPI)" if topo is not None and topo.uses_mpi else "hpcsync unavailable without MPI"
    checks.append(Check("torch", OK, f"{torch.__version__}; backends: {', '.join(names) or 'none'}, {ours}"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if topo is None:
        return
    if gpus == 0:
        checks.append(Check("GPUs", OK, f"none on {topo.hostname}: backend auto picks "
                                        f"{'hpcsync' if topo.uses_mpi else 'gloo'}"))
    elif gpus < topo.local_size:
        checks.append(Check("GPUs", FAIL, f"{gpus} GPU(s) on {topo.hostname} for {topo.local_size} local ranks: "
                                          "NCCL needs one GPU per rank; request --gpus-per-task=1 or fewer tasks per node"))
    else:
        checks.append(Check("GPUs", OK, f"{gpus} GPU(s) for {topo.local_size} local rank(s)"))
    _binding_check(torch.get_num_threads(), checks)
    _hugepage_check(torch, checks)


def tensor_hugepages(t: Any) -> Optional[int]:
    """Kilobytes of transparent huge pages backing the mapping that holds CPU tensor ``t``
    (None where /proc/self/smaps cannot tell)."""
    ptr, inside = t.data_ptr(), False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= ptr < hi
                elif inside and head == "AnonHugePages:":
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _hugepage_check(torch: Any, checks: List[Check]) -> None:
    """Large torch CPU tensors on huge pages: MPI moves them ~1.7x faster (see hpcsync/__init__.py)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return
    if mode == "never":
        checks.append(Check("huge pages", OK, "transparent huge pages are off on this kernel (never): "
                                              "large MPI messages move at 4 KiB-page speed"))
        return
    kb = tensor_hugepages(torch.empty(4 << 20, dtype=torch.uint8).fill_(1))
    if kb is None:
        return
    if kb > 0:
        checks.append(Check("huge pages", OK, f"torch CPU tensors >= 2 MiB use transparent huge pages (THP {mode})"))
    else:
        checks.append(Check("huge pages", WARN, "torch CPU tensors use 4 KiB pages: large MPI messages move up to "
                            "~1.7x slower. Import hpcsync before torch allocates its first tensor, or export "
                            "THP_MEM_ALLOC_ENABLE=1 (unset HPCSYNC_HUGEPAGES=0)"))


def _binding_check(torch_threads: int, checks: List[Check]) -> None:
    """Ranks bound to fewer cores than they run threads on (torch's intra-op threads + the hpcsync
    backend's worker): ``mpirun --bind-to core`` (Open MPI's default for <= 2 ranks) gives one core."""
    import os

    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return
    need = torch_threads + 1
    if cores < need:
        checks.append(Check("CPU binding", WARN, f"this rank may run on {cores} core(s) but uses {torch_threads} torch "
                            f"thread(s) + 1 communication thread: they share cores and communication cannot overlap "
                            f"compute. Bind each rank to {need} cores (Open MPI: --map-by slot:PE={need}; Slurm: "
                            f"--cpus-per-task={need}) or use --bind-to none; or set OMP_NUM_THREADS"))
    else:
        checks.append(Check("CPU binding", OK, f"{cores} core(s) for {torch_threads} torch thread(s) + 1 communication thread"))


def _hdf5_check(checks: List[Check]) -> None:
    try:
        import h5py  # noqa: F401
    except ImportError:
        checks.append(Check("HDF5", WARN, "h5py not installed: hpcsync.h5 unavailable (pip install h5py)"))
        return
    from ..core import mpi
    from ..core.torchcomm import SELF
    from ..data.h5 import parallel_available

    comm = mpi.MPI().COMM_WORLD if mpi.use_mpi() else SELF  # each process alone without MPI
    ok, why = parallel_available(comm)
    mismatch = "different MPI" in why or "another MPI's headers" in why
    fix = ("run under the MPI that h5py was built against, or rebuild h5py against this one (its mpicc and "
           "include directory first: jobs/setup_env.sh --full)" if mismatch
           else "build h5py against parallel HDF5: jobs/setup_env.sh --full")
    status = OK if ok else FAIL if mismatch else WARN
    checks.append(Check("HDF5", status, "parallel (h5py + mpio)" if ok else f"serial fallback: {why} ({fix})"))


def version_check(installed: Dict[str, str]) -> Check:
    """``installed``: name -> version of Python and the packages hpcsync is tested with
    (:data:`hpcsync.start.versions.TESTED`): ok inside those bounds, a warning naming each one
    outside them (it may work; nobody has run the tests there)."""
    from .versions import outside

    off = [why for name, version in installed.items() if (why := outside(name, version))]
    if off:
        return Check("versions", WARN, "; ".join(off) + " (untested: it may work, but nobody ran the tests there)")
    return Check("versions", OK, ", ".join(f"{name} {version}" for name, version in installed.items()) +
                 ": inside the tested bounds")


def _installed() -> Dict[str, str]:
    import importlib.metadata
    import platform

    from .versions import TESTED

    found = {"python": platform.python_version()}
    for name in TESTED:
        if name != "python":
            try:
                found[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                pass  # the feature's own check says what is missing
    return found


def run(connect: bool = True) -> int:
    """Run every check; rank 0 prints the report. Returns the exit code (agreed by all ranks)."""
    checks: List[Check] = [version_check(_installed())]
    topo = _mpi_checks(checks)
    if topo is not None:
        _hostname_check(topo, checks)
        _address_checks(topo, checks, connect)
        _lost_node_check(topo, checks)
    _torch_checks(topo, checks)
    if topo is not None:
        _hdf5_check(checks)
    rows = [(c.name, c.status, c.detail) for c in checks]
    if topo is not None and topo.uses_mpi:
        from ..core import mpi

        every = mpi.MPI().COMM_WORLD.gather(rows, root=0)
        rank = topo.rank
    else:
        every, rank = [rows], 0
    failed = False
    if rank == 0:
        merged: dict = {}
        for r, rs in enumerate(every):
            for name, status, detail in rs:
                cur = merged.setdefault(name, {"status": status, "detail": detail, "ranks": []})
                if _ORDER[status] > _ORDER[cur["status"]]:
                    cur.update(status=status, detail=detail, ranks=[])
                if status == cur["status"] and status != OK:
                    cur["ranks"].append(r)
        for name, m in merged.items():
            job_wide = name in _JOB_WIDE  # rank 0 judged every node: no one rank to name
            where = f" [rank(s) {','.join(map(str, m['ranks'][:8]))}]" if m["ranks"] and len(every) > 1 and not job_wide \
                else ""
            print(f"{m['status']:>4}  {name:15s} {m['detail']}{where}", flush=True)
        failed = any(m["status"] == FAIL for m in merged.values())
        print("doctor: " + ("problems found (FAIL above)" if failed else "no blocking problem found"), flush=True)
    if topo is not None and topo.uses_mpi:
        from ..core import mpi

        failed = mpi.MPI().COMM_WORLD.bcast(failed, root=0)
    return 1 if failed else 0
