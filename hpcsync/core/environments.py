"""What each launcher tells a process through its environment: one small class per launcher.

These are the fallbacks used when MPI is not (e.g. torchrun, or ``HPCSYNC_MPI=0``), and the
source of the *expected* world size that exposes silent singletons. MPI's own answer wins
whenever MPI is in use: ``mpirun`` inside an ``sbatch`` allocation leaves ``SLURM_PROCID=0`` on
every rank.
"""
from __future__ import annotations

import re
from typing import List, Mapping, Optional, Sequence, Type

__all__ = [
    "LauncherEnvironment", "TorchrunEnvironment", "OpenMPIEnvironment", "HydraEnvironment", "SlurmEnvironment",
    "PMIxEnvironment", "PMIEnvironment", "SingleProcessEnvironment", "ENVIRONMENTS", "detect_environment",
    "parse_tasks_per_node", "expand_hostlist"
]


def _int(env: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                continue
    return None


class LauncherEnvironment:
    """Base class: ranks and sizes as one launcher exports them (``None`` when it does not)."""

    name = "unknown"

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        raise NotImplementedError

    def world_rank(self) -> Optional[int]:
        return None

    def world_size(self) -> Optional[int]:
        return None

    def local_rank(self) -> Optional[int]:
        return None

    def local_size(self) -> Optional[int]:
        return None

    def node_rank(self) -> Optional[int]:
        return None

    def num_nodes(self) -> Optional[int]:
        return None

    def master_addr(self) -> Optional[str]:
        return None

    def master_port(self) -> Optional[int]:
        return None


class TorchrunEnvironment(LauncherEnvironment):
    """torchrun / torch.distributed.run (and anything else exporting RANK/WORLD_SIZE)."""

    name = "torchrun"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))

    def world_rank(self) -> Optional[int]:
        return _int(self.env, "RANK")

    def world_size(self) -> Optional[int]:
        return _int(self.env, "WORLD_SIZE")

    def local_rank(self) -> Optional[int]:
        return _int(self.env, "LOCAL_RANK")

    def local_size(self) -> Optional[int]:
        return _int(self.env, "LOCAL_WORLD_SIZE")

    def node_rank(self) -> Optional[int]:
        return _int(self.env, "GROUP_RANK")

    def num_nodes(self) -> Optional[int]:
        ws, ls = self.world_size(), self.local_size()
        return ws // ls if ws and ls and ws % ls == 0 else None

    def master_addr(self) -> Optional[str]:
        return self.env.get("MASTER_ADDR") or None

    def master_port(self) -> Optional[int]:
        return _int(self.env, "MASTER_PORT")


class OpenMPIEnvironment(LauncherEnvironment):
    """Open MPI's ``mpirun`` (also inside a Slurm allocation)."""

    name = "openmpi"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return "OMPI_COMM_WORLD_SIZE" in env

    def world_rank(self) -> Optional[int]:
        return _int(self.env, "OMPI_COMM_WORLD_RANK")

    def world_size(self) -> Optional[int]:
        return _int(self.env, "OMPI_COMM_WORLD_SIZE")

    def local_rank(self) -> Optional[int]:
        return _int(self.env, "OMPI_COMM_WORLD_LOCAL_RANK")

    def local_size(self) -> Optional[int]:
        return _int(self.env, "OMPI_COMM_WORLD_LOCAL_SIZE")

    def node_rank(self) -> Optional[int]:
        return _int(self.env, "OMPI_COMM_WORLD_NODE_RANK")

    def num_nodes(self) -> Optional[int]:
        # Open MPI exports no node count; infer it only for an even layout (same ranks per node).
        ws, ls = self.world_size(), self.local_size()
        return ws // ls if ws and ls and ws % ls == 0 else None


class HydraEnvironment(LauncherEnvironment):
    """MPICH / Intel MPI Hydra ``mpiexec`` (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID)."""

    name = "hydra"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return "PMI_SIZE" in env and "MPI_LOCALNRANKS" in env

    def world_rank(self) -> Optional[int]:
        return _int(self.env, "PMI_RANK")

    def world_size(self) -> Optional[int]:
        return _int(self.env, "PMI_SIZE")

    def local_rank(self) -> Optional[int]:
        return _int(self.env, "MPI_LOCALRANKID")

    def local_size(self) -> Optional[int]:
        return _int(self.env, "MPI_LOCALNRANKS")


class SlurmEnvironment(LauncherEnvironment):
    """A task of an ``srun`` step (with or without a PMI plugin)."""

    name = "slurm"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return "SLURM_STEP_ID" in env and "SLURM_PROCID" in env

    def world_rank(self) -> Optional[int]:
        return _int(self.env, "SLURM_PROCID")

    def world_size(self) -> Optional[int]:
        return _int(self.env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")

    def local_rank(self) -> Optional[int]:
        return _int(self.env, "SLURM_LOCALID")

    def local_size(self) -> Optional[int]:
        counts = parse_tasks_per_node(self.env.get("SLURM_STEP_TASKS_PER_NODE") or
                                      self.env.get("SLURM_TASKS_PER_NODE", ""))
        node = self.node_rank()
        if counts and node is not None and node < len(counts):
            return counts[node]
        return None

    def node_rank(self) -> Optional[int]:
        return _int(self.env, "SLURM_NODEID")

    def num_nodes(self) -> Optional[int]:
        return _int(self.env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES")

    def master_addr(self) -> Optional[str]:
        nodes = expand_hostlist(self.env.get("SLURM_STEP_NODELIST") or self.env.get("SLURM_NODELIST", ""))
        return nodes[0] if nodes else None

    def master_port(self) -> Optional[int]:
        job = _int(self.env, "SLURM_JOB_ID")
        # Deterministic per job so every task agrees without talking; inside the ephemeral range.
        return 15000 + job % 20000 if job is not None else None


class PMIxEnvironment(LauncherEnvironment):
    """A bare PMIx launcher (prrte, Open MPI 5): only the rank is exported."""

    name = "pmix"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return "PMIX_RANK" in env

    def world_rank(self) -> Optional[int]:
        return _int(self.env, "PMIX_RANK")


class PMIEnvironment(LauncherEnvironment):
    """A bare PMI-1/2 launcher (e.g. ``srun --mpi=pmi2`` outside Slurm variables)."""

    name = "pmi"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return "PMI_RANK" in env or "PMI_SIZE" in env

    def world_rank(self) -> Optional[int]:
        return _int(self.env, "PMI_RANK")

    def world_size(self) -> Optional[int]:
        return _int(self.env, "PMI_SIZE")


class SingleProcessEnvironment(LauncherEnvironment):
    """Plain ``python script.py``: one process."""

    name = "single"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return True

    def world_rank(self) -> int:
        return 0

    def world_size(self) -> int:
        return 1

    def local_rank(self) -> int:
        return 0

    def local_size(self) -> int:
        return 1

    def node_rank(self) -> int:
        return 0

    def num_nodes(self) -> int:
        return 1


# Most specific first: mpirun inside sbatch must be seen as Open MPI, not Slurm; srun with a PMI
# plugin as Slurm (it exports the full set), a bare PMIx/PMI launcher last.
ENVIRONMENTS: Sequence[Type[LauncherEnvironment]] = (
    TorchrunEnvironment,
    OpenMPIEnvironment,
    HydraEnvironment,
    SlurmEnvironment,
    PMIxEnvironment,
    PMIEnvironment,
    SingleProcessEnvironment,
)


def detect_environment(env: Mapping[str, str]) -> LauncherEnvironment:
    for cls in ENVIRONMENTS:
        if cls.detect(env):
            return cls(env)
    raise AssertionError("SingleProcessEnvironment always matches")  # pragma: no cover


def parse_tasks_per_node(spec: str) -> List[int]:
    """Expand Slurm's ``SLURM_TASKS_PER_NODE`` ('2(x3),1') into [2, 2, 2, 1]."""
    out: List[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if not m:
            raise ValueError(f"cannot parse tasks-per-node spec {spec!r}")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def expand_hostlist(spec: str) -> List[str]:
    """Expand a Slurm hostlist ('node[01-03,07],gpu5') into host names, in order."""
    hosts: List[str] = []
    for item in _split_top_level(spec):
        hosts.extend(_expand_one(item))
    return hosts


def _split_top_level(spec: str) -> List[str]:
    items, depth, cur = [], 0, ""
    for ch in spec.strip():
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise ValueError(f"unbalanced brackets in hostlist {spec!r}")
    if cur:
        items.append(cur)
    return [i for i in items if i]


def _expand_one(item: str) -> List[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if not m:
        return [item]
    head, tail = item[: m.start()], item[m.end():]
    out: List[str] = []
    for rng in m.group(1).split(","):
        if "-" in rng:
            lo, hi = rng.split("-", 1)
            width = len(lo)
            for n in range(int(lo), int(hi) + 1):
                out.extend(_expand_one(f"{head}{n:0{width}d}{tail}"))
        else:
            out.extend(_expand_one(f"{head}{rng}{tail}"))
    return out
