"""``ProcessGroupHpcsync``: torch's collectives and point-to-point as MPI calls on the group's engine."""
from __future__ import annotations

import itertools
import math
from array import array
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from .. import _mpi
from .._bigmpi import INT_MAX
from .buffers import (_CHUNK_ELEMS, RedOp, _bytes, _chunks, _divide, _fast_types, _kind, _mpi_op, _mpi_type,
                      _overlap, _spans_overlap, _Staged)
from .work import MPIWork
from .engine import GroupEngine


class ProcessGroupHpcsync(GroupEngine):
    """A torch ProcessGroup over an mpi4py communicator: each operation a few lines on the engine."""

    def _reduce_into(self, tensor: torch.Tensor, op: Any, root: Optional[int]) -> None:
        """All-reduce (root None) or reduce to ``root`` in place, for one tensor."""
        MPI = _mpi.MPI()
        kind = _kind(op)
        s = _Staged(tensor, reduce=True)
        if kind == RedOp.PREMUL_SUM:
            s.t.mul_(op.factor)
        mop = _mpi_op(op, s.t.dtype)
        for start, n in _chunks(s.t.numel()):
            if n == 0:
                continue
            buf = s.spec(start, n)
            if root is None:
                self._c("Allreduce", MPI.IN_PLACE, buf, op=mop)
            elif self._coll.Get_rank() == root:
                self._c("Reduce", MPI.IN_PLACE, buf, op=mop, root=root)
            else:
                self._c("Reduce", buf, None, op=mop, root=root)
        if kind == RedOp.AVG and (root is None or self._coll.Get_rank() == root):
            _divide(s.t, self._coll.Get_size())
        if root is None or self._coll.Get_rank() == root:
            s.finish()

    def _direct(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s own memory can be the MPI buffer: a dense contiguous CPU tensor whose
        count fits one call (reductions also need :func:`_fast_types`: no 16-bit floats)."""
        return t.is_cpu and not t.is_sparse and t.is_contiguous() and 0 < t.numel() <= _CHUNK_ELEMS

    def _hot_now(self, opts: Any) -> bool:
        """A blocking request with nothing queued, in the default mode: :meth:`_blocking_op`."""
        return self._hot and self._pending == 0 and not getattr(opts, "asyncOp", True)

    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> MPIWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if len(tensors) == 1:  # the common case, with as few calls into torch as possible
            t = tensors[0]
            fast = _fast_types(op, t.dtype)
            if fast is not None and t.is_cpu and t.is_contiguous() and not t.is_sparse and 0 < (n := t.numel()) <= _CHUNK_ELEMS:
                mtype, mop, item = fast
                buf = [self._address(t.data_ptr(), n * item), n, mtype]
                if self._hot and self._pending == 0 and opts is not None and not opts.asyncOp:
                    return self._blocking_op("all_reduce", t, -1, "Allreduce", (self._in_place, buf),
                                             {"op": mop}, tensors, n)
                in_place = self._in_place
                return self._run(lambda: self._c("Allreduce", in_place, buf, op=mop), tensors, opts,
                                 ("all_reduce", t, -1))
        if any(t.is_sparse for t in tensors):
            def sparse() -> None:
                for t in tensors:
                    self._allreduce_sparse(t, op)

            return self._run(sparse, tensors, opts, ("all_reduce", tensors[0], -1))

        def fn() -> None:
            for t in tensors:
                self._reduce_into(t, op, None)

        return self._run(fn, tensors, opts, ("all_reduce", tensors[0] if tensors else None, -1))

    def _allreduce_sparse(self, t: torch.Tensor, op: Any) -> None:
        """SUM of sparse COO tensors (what gloo supports): all-gather every rank's (index, value)
        rows with Allgatherv, add duplicates by coalescing, write the result into ``t``."""
        if _kind(op) != RedOp.SUM:
            raise ValueError("hpcsync backend: sparse all_reduce supports ReduceOp.SUM only (as gloo)")
        if not t.is_sparse or t.layout != torch.sparse_coo:
            raise ValueError("hpcsync backend: all_reduce of a mix of sparse and dense tensors")
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
        vtype = _mpi_type(vals.dtype)
        self._c("Allgatherv", [_bytes(rows), rows.numel(), self._int64],
                [_bytes(all_rows), ([n * sd for n in counts], [o * sd for o in offsets]), self._int64])
        self._c("Allgatherv", [_bytes(vals), vals.numel(), vtype],
                [_bytes(all_vals), ([n * per for n in counts], [o * per for o in offsets]), vtype])
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

        return self._run(fn, tensors, opts, ("all_reduce_coalesced", tensors[0] if tensors else None, -1))

    def reduce(self, tensors: List[torch.Tensor], opts: Any) -> MPIWork:
        def fn() -> None:
            for t in tensors:
                self._reduce_into(t, opts.reduceOp, opts.rootRank)

        return self._run(fn, tensors, opts, ("reduce", tensors[0], opts.rootRank))

    # -- data movement ----------------------------------------------------------------------
    def broadcast(self, tensors: List[torch.Tensor], opts: Any) -> MPIWork:
        root = opts.rootRank
        if len(tensors) == 1 and self._hot_now(opts) and self._direct(t := tensors[0]):
            buf = [self._address(t.data_ptr(), t.numel() * t.element_size()), t.numel(), _mpi_type(t.dtype)]
            return self._blocking_op("broadcast", t, root, "Bcast", (buf,), {"root": root}, tensors)

        def fn() -> None:
            me = self._coll.Get_rank()
            for t in tensors:
                s = _Staged(t, read=me == root)
                for start, n in _chunks(s.t.numel()):
                    if n:
                        self._c("Bcast", s.spec(start, n), root=root)
                if me != root:
                    s.finish()

        return self._run(fn, tensors, opts, ("broadcast", tensors[0], root))

    def _allgather_flat(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        size = self._coll.Get_size()
        if out.numel() != inp.numel() * size:
            raise ValueError(f"all_gather: output has {out.numel()} elements, expected {inp.numel()} x {size}")
        so, si = _Staged(out, read=False), _Staged(inp)
        n = si.t.numel()
        me = self._coll.Get_rank()
        if _overlap(so.t, si.t):  # in-place: the input is (part of) the output
            mine = so.t.reshape(-1)[me * n:(me + 1) * n]
            if mine.data_ptr() == si.t.data_ptr() and si.t.is_contiguous():
                si = None  # exactly this rank's slot: MPI_IN_PLACE
            else:
                si.t = si.t.clone()
        if n and n * size <= INT_MAX:
            self._c("Allgather", _mpi.MPI().IN_PLACE if si is None else si.spec(), so.whole())
        elif n:  # big counts: one broadcast per rank, in chunks
            for r in range(size):
                if r == me and si is not None:
                    so.t.reshape(-1)[r * n:(r + 1) * n].copy_(si.t.reshape(-1))
                for start, k in _chunks(n):
                    self._c("Bcast", so.spec(r * n + start, k), root=r)
        so.finish()

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> MPIWork:
        n = input.numel()
        if (self._hot_now(opts) and self._direct(input) and self._direct(output) and input.dtype == output.dtype
                and output.numel() == n * self._size and output.numel() <= INT_MAX):
            out = [self._address(output.data_ptr(), output.numel() * output.element_size()), _mpi_type(output.dtype)]
            item, o0, i0 = output.element_size(), output.data_ptr(), input.data_ptr()
            if i0 == o0 + self._me * n * item:  # exactly this rank's slot: MPI_IN_PLACE
                send: Any = self._in_place
            elif _spans_overlap(i0, n * item, o0, n * self._size * item):
                return self._run(lambda: self._allgather_flat(output, input), [output], opts, ("all_gather", input, -1))
            else:
                send = [self._address(i0, n * item), n, out[1]]
            return self._blocking_op("all_gather", input, -1, "Allgather", (send, out), {}, [output])
        return self._run(lambda: self._allgather_flat(output, input), [output], opts, ("all_gather", input, -1))

    _allgather_base = all_gather_single

    def allgather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any = None) -> MPIWork:
        def fn() -> None:
            for outs, inp in zip(output_lists, inputs):
                flat = torch.empty((len(outs), *inp.shape), dtype=inp.dtype)
                self._allgather_flat(flat, inp)
                with torch.no_grad():
                    for o, src in zip(outs, flat):
                        o.copy_(src)

        return self._run(fn, [t for outs in output_lists for t in outs], opts, ("all_gather", inputs[0], -1))

    def allgather_coalesced(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor],
                            opts: Any = None) -> MPIWork:
        # torch: output_lists[r][i] is input i of rank r
        def fn() -> None:
            for i, inp in enumerate(inputs):
                flat = torch.empty((self._coll.Get_size(), *inp.shape), dtype=inp.dtype)
                self._allgather_flat(flat, inp)
                with torch.no_grad():
                    for r, outs in enumerate(output_lists):
                        outs[i].copy_(flat[r])

        return self._run(fn, [t for outs in output_lists for t in outs], opts,
                         ("all_gather_coalesced", inputs[0] if inputs else None, -1))

    def all_gather_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                    opts: Any = None) -> MPIWork:
        def fn() -> None:
            for o, i in zip(outputs, inputs):
                self._allgather_flat(o, i)

        return self._run(fn, outputs, opts, ("all_gather_coalesced", inputs[0] if inputs else None, -1))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any) -> MPIWork:
        root = opts.rootRank

        def fn() -> None:
            me, size = self._coll.Get_rank(), self._coll.Get_size()
            inp = _Staged(inputs[0])
            if me == root:
                flat = torch.empty((size, *inputs[0].shape), dtype=inputs[0].dtype)
                self._c("Gather", inp.spec(), _Staged(flat, read=False).whole(), root=root)
                with torch.no_grad():
                    for o, src in zip(output_lists[0], flat):
                        o.copy_(src)
            else:
                self._c("Gather", inp.spec(), None, root=root)

        return self._run(fn, [t for outs in output_lists for t in outs], opts, ("gather", inputs[0], root))

    def scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]], opts: Any) -> MPIWork:
        root = opts.rootRank

        def fn() -> None:
            out = _Staged(outputs[0], read=False)
            if self._coll.Get_rank() == root:
                flat = torch.stack([t.detach().cpu() for t in input_lists[0]]).contiguous()
                self._c("Scatter", _Staged(flat).whole(), out.spec(), root=root)
            else:
                self._c("Scatter", None, out.spec(), root=root)
            out.finish()

        return self._run(fn, outputs, opts, ("scatter", outputs[0], root))

    def _reduce_scatter_flat(self, out: torch.Tensor, inp: torch.Tensor, op: Any) -> None:
        size = self._coll.Get_size()
        if inp.numel() != out.numel() * size:
            raise ValueError(f"reduce_scatter: input has {inp.numel()} elements, expected {out.numel()} x {size}")
        kind = _kind(op)
        si = _Staged(inp, reduce=True)
        if not si.copied and (kind == RedOp.PREMUL_SUM or _overlap(si.t, out)):
            si.t = si.t.clone()  # never scale the caller's input, never alias send and receive
        if kind == RedOp.PREMUL_SUM:
            si.t.mul_(op.factor)
        so = _Staged(out, reduce=True, read=False)
        if so.t.dtype != si.t.dtype:
            so.t = torch.empty(out.shape, dtype=si.t.dtype)
        if out.numel():
            self._c("Reduce_scatter_block", si.whole(), so.spec(), op=_mpi_op(op, si.t.dtype))
        if kind == RedOp.AVG:
            _divide(so.t, size)
        so.finish()

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> MPIWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if (self._hot_now(opts) and (fast := _fast_types(op, input.dtype)) is not None and self._direct(input)
                and self._direct(output) and input.dtype == output.dtype
                and (n := output.numel()) * self._size == input.numel()):
            t, mop, item = fast
            i0, o0 = input.data_ptr(), output.data_ptr()
            if not _spans_overlap(i0, n * self._size * item, o0, n * item):
                send = [self._address(i0, n * self._size * item), t]
                recv = [self._address(o0, n * item), n, t]
                return self._blocking_op("reduce_scatter", input, -1, "Reduce_scatter_block", (send, recv),
                                         {"op": mop}, [output])
        return self._run(lambda: self._reduce_scatter_flat(output, input, op), [output], opts,
                         ("reduce_scatter", input, -1))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]],
                       opts: Any = None) -> MPIWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        def fn() -> None:
            for out, ins in zip(outputs, input_lists):
                flat = torch.cat([t.detach().reshape(-1).cpu() for t in ins])
                self._reduce_scatter_flat(out, flat, op)

        return self._run(fn, outputs, opts, ("reduce_scatter", outputs[0], -1))

    def reduce_scatter_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                        opts: Any = None) -> MPIWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        def fn() -> None:
            for o, i in zip(outputs, inputs):
                self._reduce_scatter_flat(o, i, op)

        return self._run(fn, outputs, opts, ("reduce_scatter_coalesced", inputs[0] if inputs else None, -1))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _alltoallv(self, out: torch.Tensor, inp: torch.Tensor, send_counts: List[int], recv_counts: List[int]) -> None:
        so, si = _Staged(out, read=False), _Staged(inp)
        if _overlap(so.t, si.t):
            si.t = si.t.clone()
        if max(sum(send_counts), sum(recv_counts)) > INT_MAX:
            raise ValueError("all_to_all: more than 2**31-1 elements in one call is not supported")
        sd = [sum(send_counts[:r]) for r in range(len(send_counts))]
        rd = [sum(recv_counts[:r]) for r in range(len(recv_counts))]
        t = _mpi_type(si.t.dtype)
        self._c("Alltoallv", [_bytes(si.t), (send_counts, sd), t], [_bytes(so.t), (recv_counts, rd), t])
        so.finish()

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: List[int],
                          input_split_sizes: List[int], opts: Any = None) -> MPIWork:
        size = self._coll.Get_size()

        def counts(t: torch.Tensor, splits: List[int]) -> List[int]:
            row = t[0].numel() if t.dim() and t.shape[0] else (t.numel() // max(t.shape[0], 1) if t.dim() else 1)
            if not splits:
                if t.dim() == 0 or t.shape[0] % size:
                    raise ValueError(f"all_to_all_single: dim 0 ({t.shape[0] if t.dim() else 0}) "
                                     f"must divide by the group size {size}")
                return [t.numel() // size] * size
            return [s * row for s in splits]

        return self._run(lambda: self._alltoallv(output, input, counts(input, input_split_sizes),
                                                 counts(output, output_split_sizes)), [output], opts,
                         ("all_to_all", input, -1))

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: List[int],
                      input_split_sizes: List[int], opts: Any = None) -> MPIWork:
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any = None) -> MPIWork:
        def fn() -> None:
            dtype = inputs[0].dtype
            send = torch.cat([t.detach().reshape(-1).cpu() for t in inputs]) if inputs else torch.empty(0, dtype=dtype)
            recv = torch.empty(sum(t.numel() for t in outputs), dtype=dtype)
            self._alltoallv(recv, send, [t.numel() for t in inputs], [t.numel() for t in outputs])
            pos = 0
            with torch.no_grad():
                for o in outputs:
                    o.copy_(recv[pos:pos + o.numel()].view_as(o))
                    pos += o.numel()

        return self._run(fn, outputs, opts, ("all_to_all", inputs[0] if inputs else None, -1))

    def barrier(self, opts: Any = None) -> MPIWork:
        return self._run(lambda: self._c("Barrier"), [], opts, ("barrier", None, -1))
