"""Tensors as MPI buffers: dtype and reduce-op tables, staging of non-contiguous, device and
16-bit tensors, aliasing checks, chunking past C-int counts."""
from __future__ import annotations

import logging
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..core import mpi

__all__ = [
    "CHUNK_ELEMS", "RedOp", "mpi_type", "op_kind", "mpi_op", "fast_types", "EMPTY_SEND", "EMPTY_RECV", "byte_view",
    "Staged", "overlap", "spans_overlap", "chunk_spans", "divide", "avg_parts", "avg_result", "is_int_avg"
]

log = logging.getLogger(__name__)

CHUNK_ELEMS = 1 << 30  # elements per MPI call: counts are C ints

RedOp = dist.ReduceOp.RedOpType
_HALF = (torch.float16, torch.bfloat16)


_TYPES: dict = {}
_OPS: dict = {}
_BOOL_OPS: dict = {}


def _tables() -> None:
    """dtype -> MPI datatype and ReduceOp -> MPI.Op, built once (they sit on the hot path)."""
    MPI = mpi.MPI()
    _TYPES.update({
        torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.int8: MPI.INT8_T, torch.uint8: MPI.UINT8_T,
        torch.int16: MPI.INT16_T, torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T, torch.bool: MPI.C_BOOL,
        torch.complex64: MPI.C_FLOAT_COMPLEX, torch.complex128: MPI.C_DOUBLE_COMPLEX,
        torch.uint16: MPI.UINT16_T, torch.uint32: MPI.UINT32_T, torch.uint64: MPI.UINT64_T,
        torch.float16: MPI.INT16_T, torch.bfloat16: MPI.INT16_T,  # moved as bits, reduced in float32
    })
    _BOOL_OPS.update({RedOp.SUM: MPI.LOR, RedOp.MAX: MPI.LOR, RedOp.BOR: MPI.LOR, RedOp.MIN: MPI.LAND,
                      RedOp.PRODUCT: MPI.LAND, RedOp.BAND: MPI.LAND, RedOp.BXOR: MPI.LXOR, RedOp.AVG: MPI.LOR})
    _OPS.update({RedOp.SUM: MPI.SUM, RedOp.AVG: MPI.SUM, RedOp.PREMUL_SUM: MPI.SUM, RedOp.PRODUCT: MPI.PROD,
                 RedOp.MIN: MPI.MIN, RedOp.MAX: MPI.MAX, RedOp.BAND: MPI.BAND, RedOp.BOR: MPI.BOR,
                 RedOp.BXOR: MPI.BXOR})


def mpi_type(dtype: torch.dtype) -> Any:
    try:
        return _TYPES[dtype]
    except KeyError:
        if not _TYPES:
            _tables()
            return mpi_type(dtype)
        raise TypeError(f"hpcsync backend: unsupported dtype {dtype}") from None


def op_kind(op: Any) -> Any:
    return op.op if hasattr(op, "op") else op


def mpi_op(op: Any, dtype: torch.dtype) -> Any:
    if not _OPS:
        _tables()
    table = _BOOL_OPS if dtype == torch.bool else _OPS
    try:
        return table[op_kind(op)]
    except KeyError:
        raise ValueError(f"hpcsync backend: unsupported reduce op {op_kind(op)} for {dtype}") from None


_FAST: dict = {}


def fast_types(op: Any, dtype: torch.dtype) -> Optional[Tuple[Any, Any, int]]:
    """``(MPI datatype, MPI op, item size, op kind)`` for reducing ``dtype`` with ``op`` straight from the
    tensor's memory, or None when that cannot be done (16-bit floats are reduced in float32; AVG
    and PREMUL_SUM need a pass over the data). Cached by ``(hash(op), dtype)``: a ReduceOp's hash
    is its kind, and reading the kind through torch's binding costs more than this whole lookup
    (the hot path of every small all_reduce)."""
    key = (hash(op), dtype)
    try:
        return _FAST[key]
    except KeyError:
        ok = dtype not in _HALF and op_kind(op) not in (RedOp.AVG, RedOp.PREMUL_SUM)
        hit = _FAST[key] = (mpi_type(dtype), mpi_op(op, dtype), torch.empty(0, dtype=dtype).element_size(),
                            key[0]) if ok else None
        return hit


# Empty send and receive buffers at two addresses of their own. Every empty bytearray is at one
# address, and Open MPI's non-blocking collectives (libnbc) take a send buffer at the receive
# buffer's address for MPI_IN_PLACE: a rank with nothing to send or receive in an all_to_all then
# ran the in-place exchange while the others did not, and the group's next collective never
# completed (polled groups, which call the non-blocking forms).
EMPTY_SEND, EMPTY_RECV = bytearray(8), bytearray(8)


def byte_view(t: torch.Tensor, start: int = 0, nbytes: Optional[int] = None) -> Any:
    """A writable buffer over a contiguous CPU tensor's memory, from byte ``start`` (no copy).

    ``MPI.buffer.fromaddress`` is about ten times cheaper than a numpy view, and this is the hot
    path of every small message. The caller keeps the tensor alive for the duration of the MPI call.
    """
    if not t.is_contiguous():  # a reshaped copy would receive the data instead of the tensor
        raise AssertionError("hpcsync backend: internal error, buffer is not contiguous")
    total = t.numel() * t.element_size()
    size = total - start if nbytes is None else nbytes
    if size == 0:
        return bytearray(0)
    return mpi.MPI().buffer.fromaddress(t.data_ptr() + start, size)


class Staged:
    """A contiguous CPU (and, for 16-bit floats under reduction, float32) stand-in for a tensor."""

    def __init__(self, t: torch.Tensor, reduce: bool = False, read: bool = True) -> None:
        self.orig = t
        work = t.detach()
        if work.device.type != "cpu":
            work = work.cpu() if read else torch.empty(work.shape, dtype=work.dtype)
        if reduce and work.dtype in _HALF:
            work = work.to(torch.float32, memory_format=torch.contiguous_format)
        elif not work.is_contiguous():
            work = work.contiguous() if read else torch.empty(work.shape, dtype=work.dtype)
        self.t = work

    @property
    def copied(self) -> bool:
        return self.t.data_ptr() != self.orig.data_ptr() or self.t.dtype != self.orig.dtype

    def spec(self, start: int = 0, count: Optional[int] = None) -> List[Any]:
        """``[buffer, count, type]`` for a point-to-point / per-rank message."""
        n = self.t.numel() - start if count is None else count
        item = self.t.element_size()
        return [byte_view(self.t, start * item, n * item), n, mpi_type(self.t.dtype)]

    def whole(self) -> List[Any]:
        """``[buffer, type]``: mpi4py splits it evenly among the ranks (Allgather, Gather, Scatter)."""
        return [byte_view(self.t), mpi_type(self.t.dtype)]

    def finish(self) -> None:
        if self.copied:
            with torch.no_grad():
                self.orig.copy_(self.t)


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share bytes (MPI forbids aliased send and receive buffers)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + a.numel() * a.element_size() if a.is_contiguous() else a.untyped_storage().nbytes() + a0
    b1 = b0 + b.numel() * b.element_size() if b.is_contiguous() else b.untyped_storage().nbytes() + b0
    return a0 < b1 and b0 < a1


def spans_overlap(a: int, a_bytes: int, b: int, b_bytes: int) -> bool:
    """Whether the byte ranges ``[a, a + a_bytes)`` and ``[b, b + b_bytes)`` meet: :func:`overlap`
    for two contiguous tensors whose addresses and sizes the caller already has."""
    return a < b + b_bytes and b < a + a_bytes


def chunk_spans(n: int) -> Sequence[Tuple[int, int]]:
    return [(s, min(CHUNK_ELEMS, n - s)) for s in range(0, n, CHUNK_ELEMS)] or [(0, 0)]



def divide(t: torch.Tensor, n: int) -> None:
    if t.is_floating_point() or t.is_complex():
        t.div_(n)
    elif t.dtype != torch.bool:
        t.copy_(torch.div(t, n, rounding_mode="trunc"))


# AVG of integers, exactly (truncated toward zero, as torch divides integers), never overflowing:
# types narrower than 64 bits are summed in int64; int64 sums each rank's quotient and remainder
# by n separately (neither sum can overflow) and recombines them.
_NARROW_INTS = (torch.int8, torch.int16, torch.int32, torch.uint8, torch.uint16, torch.uint32)


def avg_parts(x: torch.Tensor, n: int) -> torch.Tensor:
    """What to SUM over ``n`` ranks for the AVG of integer tensor ``x`` (flat): ``x`` in int64 for
    narrow types, else its quotients and remainders by ``n`` side by side (``(..., 2, len)``
    when ``x`` is ``(rows, len)``: each row's pair stays together for reduce-scatter)."""
    if x.dtype in _NARROW_INTS:
        return x.to(torch.int64)
    q = torch.div(x, n, rounding_mode="trunc")
    return torch.stack([q, x - q * n], dim=-2).contiguous()


def avg_result(summed: torch.Tensor, dtype: torch.dtype, n: int) -> torch.Tensor:
    """The average from :func:`avg_parts`' sums: trunc(S / n) in ``dtype``."""
    if dtype in _NARROW_INTS:
        return torch.div(summed, n, rounding_mode="trunc").to(dtype)
    q, r = summed.unbind(-2)
    a = torch.div(r, n, rounding_mode="trunc")
    b, f = r - a * n, q + a  # S / n = f + b / n, |b| < n
    return f + ((b > 0) & (f < 0)).to(f.dtype) - ((b < 0) & (f > 0)).to(f.dtype)


def is_int_avg(op: Any, dtype: torch.dtype) -> bool:
    return op_kind(op) == RedOp.AVG and not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool

