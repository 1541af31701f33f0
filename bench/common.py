"""What every benchmark script shares: the Open MPI job environment and how results are saved."""
from __future__ import annotations

import json
import os
from typing import Any, Dict


def mpirun_env(**extra: str) -> Dict[str, str]:
    """Environment for ``mpirun.openmpi`` jobs on one node: mpi4py's wheel on Debian's Open MPI,
    shared memory only, root allowed (CI runs as root)."""
    return {**os.environ, "MPI4PY_MPIABI": os.environ.get("MPI4PY_MPIABI", "openmpi"), "OMPI_MCA_btl": "self,vader",
            "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **extra}


def save_json(path: str, key: str, rows: Any, **about: Any) -> None:
    """Write ``{key: rows, "host_cpus": N, **about}`` to ``path`` (folders made as needed) and say so."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({key: rows, "host_cpus": os.cpu_count(), **about}, f, indent=1)
    print(f"\nwrote {path}")
