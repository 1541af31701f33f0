"""The bytes and files of a checkpoint: ``torch.save`` bytes, loaded without running code
(``weights_only=True``, numpy's data types allowed), files written whole and flushed to disk, and
rank 0's part of a collective step with its outcome agreed on every rank."""
from __future__ import annotations

import io
import os
from typing import Any, List, Sequence

from ..core import settings
from ..core.errors import CheckpointError
from . import checksums

__all__ = ["dumps", "numpy_safe_globals", "loads", "write_file", "from_rank0", "allow_for", "tensor_bytes"]


def dumps(obj: Any) -> bytes:
    """``obj`` as ``torch.save`` writes it."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def numpy_safe_globals() -> List[Any]:
    """What ``torch.load(weights_only=True)`` needs to rebuild numpy arrays, dtypes and scalars
    (numpy's RNG state is an array): data, no code."""
    import numpy as np

    try:
        from numpy._core import multiarray
    except ImportError:  # numpy 1
        from numpy.core import multiarray  # type: ignore[no-redef]
    dtypes = [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")] if hasattr(np, "dtypes") else []
    return [np.dtype, np.ndarray, multiarray.scalar, multiarray._reconstruct, *dtypes]


def loads(data: bytes, extra: Sequence[Any]) -> Any:
    """:func:`dumps`'s bytes back, with ``weights_only=True``: data only, plus ``extra`` types."""
    import torch

    with torch.serialization.safe_globals([*numpy_safe_globals(), *extra]):
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def write_file(path: str, data: bytes) -> str:
    """A new file at ``path`` holding ``data``, flushed to disk before this returns; the
    checksum of the bytes written (:mod:`hpcsync.resilience.checksums`, hex), taken from them as
    they are written, not read back."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return checksums.hex_sum(checksums.digest(data))


def from_rank0(ctl: Any, fn: Any, failed: str) -> Any:
    """Collective: ``fn()`` on rank 0, its result on every rank; its error as one
    :class:`CheckpointError` on every rank (``failed`` with ``{}`` for the error)."""
    value, error = None, None
    if ctl.Get_rank() == 0:
        try:
            value = fn()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    value, error = ctl.bcast((value, error), root=0)
    if error:
        raise CheckpointError(f"hpcsync.checkpoint: {failed.format(error)}; the previous complete checkpoint is untouched")
    return value


def allow_for(ctl: Any, nbytes: int) -> None:
    """Give the waits of ``ctl`` (a bounded communicator; others have no deadline of their own)
    the time to write ``nbytes`` at ``HPCSYNC_CHECKPOINT_MBPS`` on top of their timeout: a
    deadline that fits the size being written, the same on every rank."""
    if hasattr(ctl, "timeout"):  # (from its own timeout: a communicator the caller gave is not stretched twice)
        base = ctl.__dict__.setdefault("base_timeout", ctl.timeout)
        ctl.timeout = base + nbytes / (settings.number("HPCSYNC_CHECKPOINT_MBPS") * 1e6)


def tensor_bytes(state: Any) -> int:
    """The bytes of the tensors in ``state`` that this rank holds (a DTensor's local shard)."""
    import torch

    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(v) for v in state)
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    return 0
