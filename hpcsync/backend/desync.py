"""What every rank must agree on for each collective, as integers, and how to explain a mismatch."""
from __future__ import annotations

import os
import zlib
from typing import Any, List, Optional, Tuple

import torch

from .. import settings

_OP_IDS = {name: k for k, name in enumerate((
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_coalesced", "gather",
    "scatter", "reduce_scatter", "reduce_scatter_coalesced", "all_to_all", "barrier"))}
_OP_NAMES = {k: name for name, k in _OP_IDS.items()}
_DTYPE_IDS = {name: zlib.crc32(name.encode()) for name in sorted(
    {str(v).replace("torch.", "") for v in vars(torch).values() if isinstance(v, torch.dtype)})}
DTYPE_NAMES = {v: str(v).replace("torch.", "") for v in vars(torch).values() if isinstance(v, torch.dtype)}
DTYPE_IDS = {v: _DTYPE_IDS[name] for v, name in DTYPE_NAMES.items()}  # by torch dtype: the hot path
OP_IDS = _OP_IDS


def _describe(rec: Any, t: Optional[torch.Tensor]) -> List[int]:
    """What every rank must agree on, as integers: seq, op, dtype, count, root (all-to-all: counts may differ)."""
    dtype = _DTYPE_IDS.get(rec.dtype, 0) if t is not None else -1
    count = t.numel() if t is not None and rec.op != "all_to_all" else -1
    return [rec.seq, _OP_IDS[rec.op], dtype, count, rec.root]


def _explain(row: Tuple[int, ...]) -> str:
    seq, op, dtype, count, root = row
    names = {v: k for k, v in _DTYPE_IDS.items()}
    return (f"#{seq} {_OP_NAMES.get(op, op)} dtype={names.get(dtype, '-')} count={count if count >= 0 else '-'}"
            + (f" root={root}" if root >= 0 else ""))


def debug_mode() -> bool:
    """Full pre-agreement of every collective: ``HPCSYNC_DEBUG=1`` or torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``."""
    return (settings.flag("HPCSYNC_DEBUG")
            or os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL")

