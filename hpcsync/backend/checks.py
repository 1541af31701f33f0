"""Argument checks made on each rank before the ranks agree on an operation.

Each returns the exception to raise, or None. The engine does not raise it at once: the rank
joins the operation's agreement marked invalid (:class:`~.desync.Call`), so every other rank
fails at once too, naming it, instead of waiting for the timeout; then this rank raises it.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence, Tuple

import torch

from .buffers import RedOp, op_kind, mpi_op, mpi_type

__all__ = ["dtypes", "reduction", "sizes", "lengths", "first", "splits"]


def dtypes(tensors: Sequence[torch.Tensor]) -> Optional[BaseException]:
    """Every tensor's dtype has an MPI type."""
    for t in tensors:
        try:
            mpi_type(t.dtype)
        except TypeError as exc:
            return exc
    return None


def reduction(op: Any, tensors: Sequence[torch.Tensor]) -> Optional[BaseException]:
    """The reduce op exists for every dtype; sparse tensors: SUM only, never mixed with dense;
    AVG of uint64 would overflow (the other integer types are averaged exactly)."""
    bad = dtypes(tensors)
    if bad is not None:
        return bad
    sparse = [t.is_sparse for t in tensors]
    if any(sparse) and not all(sparse):
        return ValueError("hpcsync backend: all_reduce of a mix of sparse and dense tensors")
    kind = op_kind(op)
    for t in tensors:
        if t.is_sparse and (kind != RedOp.SUM or t.layout != torch.sparse_coo):
            return ValueError("hpcsync backend: sparse all_reduce supports ReduceOp.SUM only, of COO tensors (as gloo)")
        if kind == RedOp.AVG and t.dtype == torch.uint64:
            return ValueError("hpcsync backend: ReduceOp.AVG of uint64 tensors is not supported (the sum "
                              "overflows); reduce with SUM into a wider type and divide")
        try:
            mpi_op(op, t.dtype)
        except ValueError as exc:
            return exc
    return None


def sizes(what: str, have: int, expected: int, of: str) -> Optional[BaseException]:
    if have != expected:
        return ValueError(f"{what}: {of} has {have} elements, expected {expected}")
    return None


def lengths(what: str, items: Sequence[Any], size: int, of: str) -> Optional[BaseException]:
    if len(items) != size:
        return ValueError(f"{what}: {of} has {len(items)} tensors, expected one per rank ({size})")
    return None


def first(*found: Optional[BaseException]) -> Optional[BaseException]:
    return next((f for f in found if f is not None), None)


def splits(t: torch.Tensor, given: List[int], size: int, of: str) -> Tuple[List[int], Optional[BaseException]]:
    """Element counts per rank of an ``all_to_all_single`` tensor from its split sizes (rows of
    dim 0; empty: even), and the error when they do not describe the tensor."""
    rows = t.shape[0] if t.dim() else 1
    per_row = math.prod(t.shape[1:]) if t.dim() else 1
    if not given:
        if t.dim() == 0 or rows % size:
            return [], ValueError(f"all_to_all_single: {of} dim 0 ({rows if t.dim() else 0}) must divide by the "
                                  f"group size {size}")
        return [t.numel() // size] * size, None
    if len(given) != size:
        return [], ValueError(f"all_to_all_single: {len(given)} {of} split sizes for a group of {size}")
    if any(s < 0 for s in given) or sum(given) != rows:
        return [], ValueError(f"all_to_all_single: {of} split sizes {list(given)} do not add up to its dim 0 "
                              f"({rows})")
    return [s * per_row for s in given], None
