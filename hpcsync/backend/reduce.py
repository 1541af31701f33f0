"""Reductions of ``ProcessGroupHpcsync``: all_reduce (dense, sparse, coalesced), reduce and
reduce_scatter, each a few lines on the engine; AVG of integers exact."""
from __future__ import annotations

import itertools
import math
from array import array
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from ..core import mpi
from . import checks
from .buffers import (CHUNK_ELEMS, RedOp, byte_view, chunk_spans, divide, fast_types, op_kind, mpi_op, mpi_type, overlap,
                      Staged, avg_parts, avg_result, is_int_avg)
from .desync import Call, redop_id
from .hot import NO_TIMEOUT
from .engine import GroupEngine
from .work import MPIWork

__all__ = ["Reductions"]


class Reductions(GroupEngine):
    """The reducing operations (and the hot-path tests both halves use)."""

    def _reduce_into(self, tensor: torch.Tensor, op: Any, root: Optional[int]) -> None:
        """All-reduce (root None) or reduce to ``root`` in place, for one tensor."""
        kind = op_kind(op)
        s = Staged(tensor, reduce=True)
        mine = root is None or self._coll.Get_rank() == root
        if is_int_avg(op, s.t.dtype):  # summed without overflow, then divided exactly
            size = self._coll.Get_size()
            parts = avg_parts(s.t.reshape(-1), size)
            self._reduce_flat(parts, mpi_op(RedOp.SUM, parts.dtype), root)
            if mine:
                with torch.no_grad():
                    s.t.copy_(avg_result(parts, s.t.dtype, size).view_as(s.t))
                s.finish()
            return
        if kind == RedOp.PREMUL_SUM:
            s.t.mul_(op.factor)
        self._reduce_flat(s.t, mpi_op(op, s.t.dtype), root)
        if kind == RedOp.AVG and mine:
            divide(s.t, self._coll.Get_size())
        if mine:
            s.finish()

    def _reduce_flat(self, t: torch.Tensor, mop: Any, root: Optional[int]) -> None:
        """All-reduce (root None) or reduce to ``root``, in place, of contiguous CPU ``t``, in chunks."""
        MPI = mpi.MPI()
        item = t.element_size()
        for start, n in chunk_spans(t.numel()):
            if n == 0:
                continue
            buf = [byte_view(t, start * item, n * item), n, mpi_type(t.dtype)]
            if root is None:
                self._c("Allreduce", MPI.IN_PLACE, buf, op=mop)
            elif self._coll.Get_rank() == root:
                self._c("Reduce", MPI.IN_PLACE, buf, op=mop, root=root)
            else:
                self._c("Reduce", buf, None, op=mop, root=root)

    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> MPIWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if len(tensors) == 1:  # the common case, with as few calls into torch as possible
            t = tensors[0]
            if self._hot and not self._pending and opts is not None and not opts.asyncOp and opts.timeout <= NO_TIMEOUT:
                work = self._hot_allreduce(t, op, tensors)
                if work is not None:
                    return work
            fast = fast_types(op, t.dtype)
            if fast is not None and t.is_cpu and t.is_contiguous() and not t.is_sparse and 0 < (n := t.numel()) <= CHUNK_ELEMS:
                mtype, mop, item, kind = fast
                buf = [self._address(t.data_ptr(), n * item), n, mtype]
                in_place = self._in_place
                return self._run(lambda: self._c("Allreduce", in_place, buf, op=mop), tensors, opts,
                                 Call("all_reduce", t, -1, kind))
        call = Call("all_reduce", tensors[0] if tensors else None, -1, redop_id(op), tensors=tensors,
                    invalid=checks.reduction(op, tensors))
        if any(t.is_sparse for t in tensors):
            def sparse() -> None:
                for t in tensors:
                    self._allreduce_sparse(t, op)

            return self._run(sparse, tensors, opts, call)

        def fn() -> None:
            for t in tensors:
                self._reduce_into(t, op, None)

        return self._run(fn, tensors, opts, call)

    def _allreduce_sparse(self, t: torch.Tensor, op: Any) -> None:
        """SUM of sparse COO tensors (what gloo supports): all-gather every rank's (index, value)
        rows with Allgatherv, add duplicates by coalescing, write the result into ``t``."""
        c = t.detach().coalesce().cpu()
        rows = c.indices().t().contiguous()  # (nnz, sparse_dim) int64: one row per entry
        vals = c.values().contiguous()  # (nnz, *dense dims)
        size, sd, per = self._coll.Get_size(), rows.shape[1], math.prod(vals.shape[1:])  # per: elements per row
        mine, counts = array("q", [rows.shape[0]]), array("q", bytes(8 * size))
        self._c("Allgather", [mine, self._int64], [counts, self._int64])
        total = sum(counts)
        all_rows = torch.empty((total, sd), dtype=torch.int64)
        all_vals = torch.empty((total, *vals.shape[1:]), dtype=vals.dtype)
        offsets = [sum(counts[:r]) for r in range(size)]
        vtype = mpi_type(vals.dtype)
        self._c("Allgatherv", [byte_view(rows), rows.numel(), self._int64],
                [byte_view(all_rows), ([n * sd for n in counts], [o * sd for o in offsets]), self._int64])
        self._c("Allgatherv", [byte_view(vals), vals.numel(), vtype],
                [byte_view(all_vals), ([n * per for n in counts], [o * per for o in offsets]), vtype])
        summed = torch.sparse_coo_tensor(all_rows.t(), all_vals, t.shape).coalesce()
        with torch.no_grad():
            t.copy_(summed.to(t.device))

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> MPIWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        def fn() -> None:
            for _dtype, group in itertools.groupby(sorted(range(len(tensors)), key=lambda i: str(tensors[i].dtype)),
                                                  key=lambda i: str(tensors[i].dtype)):
                ts = [tensors[i] for i in group]
                flat = torch.cat([t.detach().reshape(-1).cpu() for t in ts])
                self._reduce_into(flat, op, None)
                pos = 0
                with torch.no_grad():
                    for t in ts:
                        t.copy_(flat[pos:pos + t.numel()].view_as(t))
                        pos += t.numel()

        return self._run(fn, tensors, opts, Call("all_reduce_coalesced", tensors[0] if tensors else None, -1,
                                                 redop_id(op), tensors=tensors, invalid=checks.reduction(op, tensors)))

    def reduce(self, tensors: List[torch.Tensor], opts: Any) -> MPIWork:
        def fn() -> None:
            for t in tensors:
                self._reduce_into(t, opts.reduceOp, opts.rootRank)

        return self._run(fn, tensors, opts, Call("reduce", tensors[0], opts.rootRank, redop_id(opts.reduceOp),
                                                 tensors=tensors, invalid=checks.reduction(opts.reduceOp, tensors)))

    # -- data movement ----------------------------------------------------------------------
    def _reduce_scatter_flat(self, out: torch.Tensor, inp: torch.Tensor, op: Any) -> None:
        size = self._coll.Get_size()
        kind = op_kind(op)
        if is_int_avg(op, inp.dtype):  # summed without overflow, then divided exactly
            parts = avg_parts(inp.detach().cpu().reshape(size, -1), size)  # each rank's block stays whole
            mine = torch.empty(parts.shape[1:], dtype=parts.dtype)
            if out.numel():
                self._c("Reduce_scatter_block", Staged(parts).whole(), Staged(mine, read=False).spec(),
                        op=mpi_op(RedOp.SUM, parts.dtype))
            with torch.no_grad():
                out.copy_(avg_result(mine, out.dtype, size).view_as(out))
            return
        si = Staged(inp, reduce=True)
        if not si.copied and (kind == RedOp.PREMUL_SUM or overlap(si.t, out)):
            si.t = si.t.clone()  # never scale the caller's input, never alias send and receive
        if kind == RedOp.PREMUL_SUM:
            si.t.mul_(op.factor)
        so = Staged(out, reduce=True, read=False)
        if so.t.dtype != si.t.dtype:
            so.t = torch.empty(out.shape, dtype=si.t.dtype)
        if out.numel():
            self._c("Reduce_scatter_block", si.whole(), so.spec(), op=mpi_op(op, si.t.dtype))
        if kind == RedOp.AVG:
            divide(so.t, size)
        so.finish()

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> MPIWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if self._hot and not self._pending and opts is not None and not opts.asyncOp and opts.timeout <= NO_TIMEOUT:
            work = self._hot_reduce_scatter(output, input, op)
            if work is not None:
                return work
        return self._run(lambda: self._reduce_scatter_flat(output, input, op), [output], opts, self._rs_call(
            op, input, output.numel(), [input], checks.sizes("reduce_scatter", input.numel(),
                                                             output.numel() * self._size, "the input")))

    def _rs_call(self, op: Any, t: torch.Tensor, count: int, inputs: List[torch.Tensor],
                 bad: Optional[BaseException], name: str = "reduce_scatter", tensors: Any = ()) -> Call:
        """A reduce-scatter described by its output count, whichever form (tensor or list) it came in."""
        return Call(name, t, -1, redop_id(op), count, tensors,
                    invalid=checks.first(checks.reduction(op, inputs), bad))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]],
                       opts: Any = None) -> MPIWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        def fn() -> None:
            for out, ins in zip(outputs, input_lists):
                flat = torch.cat([t.detach().reshape(-1).cpu() for t in ins])
                self._reduce_scatter_flat(out, flat, op)

        ins = [t for group in input_lists for t in group]
        bad = checks.first(*(checks.lengths("reduce_scatter", group, self._size, "the input list")
                             for group in input_lists),
                           *(checks.sizes("reduce_scatter", t.numel(), out.numel(), "an input")
                             for out, group in zip(outputs, input_lists) for t in group))
        return self._run(fn, outputs, opts, self._rs_call(op, ins[0] if ins else outputs[0], outputs[0].numel(),
                                                          ins, bad))

    def reduce_scatter_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                        opts: Any = None) -> MPIWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        def fn() -> None:
            for o, i in zip(outputs, inputs):
                self._reduce_scatter_flat(o, i, op)

        call = self._rs_call(op, inputs[0], sum(o.numel() for o in outputs), inputs, checks.first(*(
            checks.sizes("reduce_scatter", i.numel(), o.numel() * self._size, "an input")
            for o, i in zip(outputs, inputs))), "reduce_scatter_coalesced", inputs)
        return self._run(fn, outputs, opts, call)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced
