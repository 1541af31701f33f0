"""Collective HDF5 output: every rank contributes a block of rows to the same datasets.

Parallel path (h5py built against parallel HDF5 and the same MPI that mpi4py loaded):
``h5py.File(..., driver="mpio")``; offsets from an exclusive scan of the row counts; every rank
takes part in creating and resizing datasets (HDF5 metadata operations are collective) and in
every collective write -- ranks with zero rows write an empty selection. Datasets are chunked
and resizable along the first axis, so several calls append.

Fallback (serial h5py, an h5py built against another MPI, or no MPI): rows are gathered to the
root with big-count-safe rounds and written there serially -- the same file content -- with one
warning. Row blocks are checked collectively: dtype and trailing shape must agree, else every
rank raises the same :class:`ValueError`.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..core import bounded, jobend, mpi
from ..core.torchcomm import world as _world  # MPI's world, else torch.distributed's, else None
from ..core.errors import MissingDependencyError, raise_if_any

__all__ = [
    "WRITE_PIECE_BYTES", "loaded_mpi_libraries", "mpi_abi_mismatch", "parallel_available", "CollectiveWriter",
    "write_rows"
]

log = logging.getLogger(__name__)

WRITE_PIECE_BYTES = 1 << 30  # per collective write: stays clear of 2 GiB limits in MPI-IO / HDF5
_warned = False


def _h5py() -> Any:
    try:
        import h5py
    except ImportError as exc:
        raise MissingDependencyError("hpcsync.h5 needs h5py: pip install h5py (for the parallel path, "
                                     "build it against parallel HDF5: see jobs/setup_env.sh)") from exc
    return h5py


def loaded_mpi_libraries() -> Sequence[str]:
    """Distinct MPI libraries mapped into this process (two means h5py and mpi4py disagree)."""
    found = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                m = re.search(r"/(libmpi(?:ch)?\.so(?:\.\d+)?)", line)
                if m:
                    found.add(m.group(1))
    except OSError:
        pass
    return sorted(found)


_PROBE = r"""
import os, sys
from mpi4py import MPI
import h5py
path = os.path.join(sys.argv[1], "probe.h5")
with h5py.File(path, "w", driver="mpio", comm=MPI.COMM_SELF) as f:
    f.create_dataset("x", data=[1, 2, 3])
with h5py.File(path, "r", driver="mpio", comm=MPI.COMM_SELF) as f:
    assert list(f["x"][:]) == [1, 2, 3]
"""
_probe_cache: Dict[str, str] = {}
# Launcher variables the probe must not see: it runs as an MPI singleton, not as a rank of this job.
_LAUNCH_VARS = ("OMPI_", "PMIX_", "PMI_", "SLURM_", "HYDRA_", "MPI_LOCAL", "PALS_", "MV2_")


def mpi_abi_mismatch() -> str:
    """Why h5py's compiled MPI calls would crash with the MPI that mpi4py loaded ('' if they work).

    h5py built with one MPI's ``mpi.h`` (e.g. MPICH's, 32-bit ``MPI_Comm``) but linked at run time
    to another (Open MPI, pointer handles) segfaults inside ``H5Pset_fapl_mpio``. No symbol shows
    it, so a child process opens a file with ``driver="mpio"`` on ``COMM_SELF``; a crash there
    means mismatch. Cached per process and on disk (``$XDG_CACHE_HOME/hpcsync``), keyed by the
    h5py build and the MPI library.
    """
    import hashlib
    import json
    import subprocess
    import sys
    import tempfile

    h5py = _h5py()
    folder = os.path.dirname(h5py.__file__)
    stamp = [(n, os.stat(os.path.join(folder, n)).st_mtime_ns) for n in sorted(os.listdir(folder)) if n.endswith(".so")]
    lib = mpi.library_version() if mpi.mpi4py_importable() else "none"
    abi = [os.environ.get(k, "") for k in ("MPI4PY_MPIABI", "MPI4PY_LIBMPI", "LD_LIBRARY_PATH")]
    key = hashlib.sha256(json.dumps([folder, stamp, lib, abi, sys.executable]).encode()).hexdigest()[:20]
    if key in _probe_cache:
        return _probe_cache[key]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hpcsync",
                         f"h5-mpi-probe-{key}.json")
    try:
        with open(cache) as f:
            _probe_cache[key] = json.load(f)["reason"]
            return _probe_cache[key]
    except (OSError, ValueError, KeyError):
        pass
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_VARS)}
    with tempfile.TemporaryDirectory(prefix="hpcsync-h5probe-") as tmp:
        try:
            proc = subprocess.run([sys.executable, "-c", _PROBE, tmp], env=env, capture_output=True, text=True,
                                  timeout=120)
            code, err = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired:
            code, err = None, "timed out after 120 s"
    if code == 0:
        reason = ""
    elif code is not None and code < 0:
        reason = (f"h5py was compiled against another MPI's headers than the MPI mpi4py loads ({lib.split(',')[0]}): "
                  f"a test open with driver='mpio' died of signal {-code}; rebuild h5py with that MPI's mpicc "
                  "and its include directory first (jobs/setup_env.sh --full does)")
    else:
        reason = f"a test open with driver='mpio' failed: {(err or '').strip().splitlines()[-1:] or code}"
    _probe_cache[key] = reason
    if code is not None:
        try:
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            with open(cache, "w") as f:
                json.dump({"reason": reason, "library": lib}, f)
        except OSError:
            pass
    return reason


def parallel_available(comm: Any = None) -> Tuple[bool, str]:
    """Whether the collective path can run here, and why not. Agreed by every rank of ``comm``.

    ``comm``: default the world. Checks, in order: MPI in use, h5py built with MPI, one MPI library
    in the process, and (rank 0 of ``comm``, cached) :func:`mpi_abi_mismatch` -- never a segfault
    in HDF5.
    """
    h5py = _h5py()
    comm = comm if comm is not None else _world()
    reason = ""
    if not hasattr(comm, "Allgather"):
        reason = "no MPI in use"
    elif not h5py.get_config().mpi:
        reason = "h5py was built without MPI (the PyPI wheel is serial)"
    else:
        libs = loaded_mpi_libraries()
        if len(libs) > 1:
            reason = f"h5py and mpi4py use different MPI libraries ({', '.join(libs)})"
        elif comm.Get_rank() == 0:
            reason = mpi_abi_mismatch()
    reason = next((r for r in comm.allgather(reason) if r), "")
    return not reason, reason


class CollectiveWriter:
    """Open ``path`` collectively; :meth:`write` appends each rank's rows in rank order.
    ``group``: the ranks writing (a torch process group under MPI, or an mpi4py communicator;
    default the world).

    >>> with CollectiveWriter("preds.h5") as w:
    ...     w.write("pred", my_rows)          # collective; my_rows may have 0 rows
    ...     w.attrs({"epoch": 3})
    """

    def __init__(self, path: str, mode: str = "w", group: Any = None, root: int = 0,
                 parallel: Optional[bool] = None, round_bytes: int = 256 << 20) -> None:
        global _warned
        if mode not in ("w", "a", "r+", "w-", "x"):
            raise ValueError(f"unsupported mode {mode!r}")
        self.h5py = _h5py()
        from ..core.comm import group_comm

        self.base = group_comm(group)  # what HDF5 itself is given (driver="mpio")
        # hpcsync's own exchanges, each bounded by HPCSYNC_TIMEOUT on a private duplicate (HDF5's
        # collectives inside a write are not: every rank has passed a bounded exchange just before)
        self.comm = bounded.over(self.base, f"hpcsync.h5.CollectiveWriter({path})", bounded.default_timeout())
        self.root = root
        self.round_bytes = round_bytes  # fallback: bytes per gather round (bounds the root's memory)
        self.rank = self.comm.Get_rank()
        ok, why = parallel_available(self.comm)
        if parallel and not ok:
            raise MissingDependencyError(f"parallel HDF5 requested but unavailable: {why}")
        self.parallel = ok if parallel is None else bool(parallel)
        self.path = os.path.abspath(path)
        self.path = self.comm.bcast(self.path, root=root)
        if not self.parallel and self.comm.Get_size() > 1 and not _warned and self.rank == root:
            # one log line, not a warning with a source line: serial h5py is a normal install (the PyPI wheel)
            log.info("hpcsync.h5: %s; gathering rows to rank %d and writing serially", why, root)
            _warned = True
        self.file: Any = None
        err = None
        try:
            if self.parallel:
                self.file = self.h5py.File(self.path, mode, driver="mpio", comm=self.base)
            elif self.rank == root:
                self.file = self.h5py.File(self.path, mode)
        except Exception as exc:  # agree, so no rank waits for a file another could not open
            err = f"cannot open {self.path}: {exc}"
        self._agree(err)

    def _agree(self, err: Optional[str]) -> None:
        raise_if_any(self.comm, err, ValueError, "")

    def _layout(self, name: str, rows: np.ndarray) -> Tuple[np.dtype, Tuple[int, ...], List[int]]:
        """Validate collectively; return dtype, trailing shape and every rank's row count."""
        info = (rows.dtype.str, rows.shape[1:], rows.shape[0], rows.dtype.kind)
        every = self.comm.allgather(info)
        with_rows = [(r, i) for r, i in enumerate(every) if i[2] > 0]
        ref_rank, ref = with_rows[0] if with_rows else (0, every[0])
        bad = [r for r, i in with_rows if (i[0], i[1]) != (ref[0], ref[1])]
        if bad:
            raise ValueError(f"dataset {name!r}: rank(s) {bad} give dtype/trailing shape "
                             f"{every[bad[0]][0]}/{every[bad[0]][1]} but rank {ref_rank} gives {ref[0]}/{ref[1]}")
        if ref[3] == "O":
            raise ValueError(f"dataset {name!r}: object arrays cannot be written; use fixed-size dtypes")
        return np.dtype(ref[0]), tuple(ref[1]), [i[2] for i in every]

    def write(self, name: str, rows: Any) -> Tuple[int, int]:
        """Append this rank's ``rows`` (first axis = rows) to dataset ``name``. Collective.

        Returns ``(first_row, n_rows)`` of this rank's block in the dataset.
        """
        rows = np.ascontiguousarray(rows)
        if rows.ndim == 0:
            raise ValueError(f"dataset {name!r}: rows need at least one dimension")
        dtype, trailing, counts = self._layout(name, rows)
        start, total = sum(counts[: self.rank]), sum(counts)
        if rows.shape[0] == 0:
            rows = np.zeros((0, *trailing), dtype=dtype)
        if self.parallel or self.rank == self.root:
            f = self.file
            if name in f:
                dset = f[name]
                if dset.shape[1:] != trailing or dset.dtype != dtype:
                    err = f"dataset {name!r} exists with shape {dset.shape}/{dset.dtype}, cannot append {trailing}/{dtype}"
                else:
                    err = None
            else:
                err = None
        else:
            err = None
        self._agree(err)
        if self.parallel:
            base = self._create_or_grow(name, dtype, trailing, total)
            self._write_collective(self.file[name], rows, base + start)
        else:
            base = self._create_or_grow(name, dtype, trailing, total) if self.rank == self.root else 0
            self._write_gathered(self.file[name] if self.rank == self.root else None, rows, base, counts)
            base = self.comm.bcast(base if self.rank == self.root else None, root=self.root)
        return base + start, rows.shape[0]

    def _create_or_grow(self, name: str, dtype: np.dtype, trailing: Tuple[int, ...], total: int) -> int:
        f = self.file
        if name not in f:
            chunk_rows = max(1, min(max(total, 1), (1 << 20) // max(1, dtype.itemsize * int(np.prod(trailing or (1,))))))
            f.create_dataset(name, shape=(total, *trailing), maxshape=(None, *trailing), dtype=dtype,
                             chunks=(chunk_rows, *trailing))
            return 0
        dset = f[name]
        base = dset.shape[0]
        dset.resize(base + total, axis=0)
        return base

    def _write_collective(self, dset: Any, rows: np.ndarray, first: int) -> None:
        h5py = self.h5py
        row_bytes = max(1, rows.itemsize * int(np.prod(rows.shape[1:] or (1,))))
        per = max(1, WRITE_PIECE_BYTES // row_bytes)
        pieces = max(self.comm.allgather((rows.shape[0] + per - 1) // per))
        dxpl = h5py.h5p.create(h5py.h5p.DATASET_XFER)
        dxpl.set_dxpl_mpio(h5py.h5fd.MPIO_COLLECTIVE)
        trailing = rows.shape[1:]
        for k in range(max(pieces, 1)):
            lo, hi = k * per, min(rows.shape[0], (k + 1) * per)
            fspace = dset.id.get_space()
            n = max(0, hi - lo)
            if n:
                fspace.select_hyperslab((first + lo, *([0] * len(trailing))), (n, *trailing))
                mspace = h5py.h5s.create_simple((n, *trailing))
                buf = rows[lo:hi]
            else:  # an empty selection still takes part in the collective write
                fspace.select_none()
                mspace = h5py.h5s.create_simple((1, *trailing))
                mspace.select_none()
                buf = np.zeros((1, *trailing), dtype=rows.dtype)
            dset.id.write(mspace, fspace, buf, dxpl=dxpl)

    def _write_gathered(self, dset: Any, rows: np.ndarray, base: int, counts: List[int]) -> None:
        """Fallback: rows travel to the root in rounds of Gatherv (root memory bounded by the round
        size, not the total) and the root writes whole rows as they arrive."""
        if self.comm.Get_size() == 1:
            if len(rows):
                dset[base: base + len(rows)] = rows
            return
        from ..core import bigmpi

        row_bytes = rows.itemsize * int(np.prod(rows.shape[1:] or (1,)))
        mine = memoryview(rows.reshape(-1)).cast("B") if rows.size else memoryview(b"")

        def fill(view: memoryview, offset: int) -> None:
            view[:] = mine[offset: offset + len(view)]

        sizes = [c * row_bytes for c in counts]
        first = [base + sum(counts[:r]) for r in range(len(sizes))]
        carry: Dict[int, bytes] = {}  # the start of a row split between two rounds
        written = [0] * len(sizes)

        def put(r: int, data: Any) -> None:  # data: whole rows of rank r
            n = len(data) // row_bytes
            block = np.frombuffer(data, dtype=rows.dtype).reshape(n, *rows.shape[1:])
            dset[first[r] + written[r]: first[r] + written[r] + n] = block
            written[r] += n

        for chunks in bigmpi.iter_gatherv_rounds(self.comm, sizes, fill, self.root, self.round_bytes):
            for r, _, chunk in chunks:  # one rank's chunks arrive in order
                if r in carry:
                    need = row_bytes - len(carry[r])
                    head = carry.pop(r) + bytes(chunk[:need])
                    if len(head) < row_bytes:
                        carry[r] = head
                        continue
                    put(r, head)
                    chunk = chunk[need:]
                whole = len(chunk) // row_bytes * row_bytes
                if whole:
                    put(r, chunk[:whole])
                if len(chunk) > whole:
                    carry[r] = bytes(chunk[whole:])

    def attrs(self, values: Mapping[str, Any], dataset: Optional[str] = None) -> None:
        """Set attributes on the file or a dataset (root's values win). Collective."""
        values = self.comm.bcast(dict(values), root=self.root)
        if self.parallel or self.rank == self.root:
            target = self.file if dataset is None else self.file[dataset]
            for k, v in values.items():
                target.attrs[k] = v

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        self.comm.Barrier()  # the file is complete for every rank once close returns
        if self.comm is not self.base:
            self.comm.free()
            self.comm = self.base

    def __enter__(self) -> "CollectiveWriter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None and jobend.exception_ends_job(exc_type):
            return  # no collective on this rank alone: the others are in the program's next one; the job ends
        self.close()


def write_rows(path: str, datasets: Mapping[str, Any], attrs: Optional[Mapping[str, Any]] = None,
               mode: str = "w", **kwargs: Any) -> Dict[str, Tuple[int, int]]:
    """One call: write each rank's rows of every dataset (sorted by name) and file attributes."""
    out = {}
    with CollectiveWriter(path, mode=mode, **kwargs) as w:
        names = sorted(datasets)
        every = w.comm.allgather(names)
        differ = [r for r, n in enumerate(every) if n != every[0]]
        if differ:
            raise ValueError(f"write_rows: rank(s) {differ} give datasets {every[differ[0]]}, rank 0 gives {every[0]}")
        for name in names:
            out[name] = w.write(name, datasets[name])
        if attrs:
            w.attrs(attrs)
    return out
