"""``ProcessGroupHpcsync``: torch's collectives and point-to-point as MPI calls on the group's engine."""
from __future__ import annotations

from typing import Any, List

import torch

from ..core import mpi
from ..core.bigmpi import INT_MAX
from . import checks
from .buffers import EMPTY_RECV, EMPTY_SEND, byte_view, chunk_spans, mpi_type, overlap, Staged
from .desync import Call
from .hot import NO_TIMEOUT
from .work import MPIWork
from .reduce import Reductions

__all__ = ["ProcessGroupHpcsync"]


class ProcessGroupHpcsync(Reductions):
    """A torch ProcessGroup over an mpi4py communicator: each operation a few lines on the engine."""

    def broadcast(self, tensors: List[torch.Tensor], opts: Any) -> MPIWork:
        root = opts.rootRank
        if self._hot and not self._pending and len(tensors) == 1 and not opts.asyncOp and opts.timeout <= NO_TIMEOUT:
            work = self._hot_broadcast(tensors[0], root, tensors)
            if work is not None:
                return work

        def fn() -> None:
            me = self._coll.Get_rank()
            for t in tensors:
                s = Staged(t, read=me == root)
                for start, n in chunk_spans(s.t.numel()):
                    if n:
                        self._c("Bcast", s.spec(start, n), root=root)
                if me != root:
                    s.finish()

        return self._run(fn, tensors, opts, Call("broadcast", tensors[0], root, tensors=tensors,
                                                 invalid=checks.dtypes(tensors)))

    def _allgather_flat(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        size = self._coll.Get_size()
        so, si = Staged(out, read=False), Staged(inp)
        n = si.t.numel()
        me = self._coll.Get_rank()
        if overlap(so.t, si.t):  # in-place: the input is (part of) the output
            mine = so.t.reshape(-1)[me * n:(me + 1) * n]
            if mine.data_ptr() == si.t.data_ptr() and si.t.is_contiguous():
                si = None  # exactly this rank's slot: MPI_IN_PLACE
            else:
                si.t = si.t.clone()
        if n and n * size <= INT_MAX:
            self._c("Allgather", mpi.MPI().IN_PLACE if si is None else si.spec(), so.whole())
        elif n:  # big counts: one broadcast per rank, in chunks
            for r in range(size):
                if r == me and si is not None:
                    so.t.reshape(-1)[r * n:(r + 1) * n].copy_(si.t.reshape(-1))
                for start, k in chunk_spans(n):
                    self._c("Bcast", so.spec(r * n + start, k), root=r)
        so.finish()

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> MPIWork:
        if self._hot and not self._pending and opts is not None and not opts.asyncOp and opts.timeout <= NO_TIMEOUT:
            work = self._hot_allgather(output, input)
            if work is not None:
                return work
        n = input.numel()
        return self._run(lambda: self._allgather_flat(output, input), [output], opts,
                         Call("all_gather", input, invalid=checks.first(
                             checks.dtypes((input, output)),
                             checks.sizes("all_gather", output.numel(), n * self._size, "the output"))))

    _allgather_base = all_gather_single

    def allgather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any = None) -> MPIWork:
        def fn() -> None:
            for outs, inp in zip(output_lists, inputs):
                flat = torch.empty((len(outs), *inp.shape), dtype=inp.dtype)
                self._allgather_flat(flat, inp)
                with torch.no_grad():
                    for o, src in zip(outs, flat):
                        o.copy_(src)

        return self._run(fn, [t for outs in output_lists for t in outs], opts, Call(
            "all_gather", inputs[0], tensors=inputs, invalid=checks.first(
                checks.dtypes(inputs), *(checks.lengths("all_gather", outs, self._size, "the output list")
                                         for outs in output_lists))))

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

        return self._run(fn, [t for outs in output_lists for t in outs], opts, Call(
            "all_gather_coalesced", inputs[0] if inputs else None, tensors=inputs, invalid=checks.first(
                checks.dtypes(inputs), checks.lengths("all_gather_coalesced", output_lists, self._size,
                                                      "the output list"))))

    def all_gather_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                    opts: Any = None) -> MPIWork:
        def fn() -> None:
            for o, i in zip(outputs, inputs):
                self._allgather_flat(o, i)

        return self._run(fn, outputs, opts, Call(
            "all_gather_coalesced", inputs[0] if inputs else None, tensors=inputs, invalid=checks.first(
                checks.dtypes(inputs), *(checks.sizes("all_gather", o.numel(), i.numel() * self._size, "an output")
                                         for o, i in zip(outputs, inputs)))))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any) -> MPIWork:
        root = opts.rootRank

        def fn() -> None:
            me, size = self._coll.Get_rank(), self._coll.Get_size()
            inp = Staged(inputs[0])
            if me == root:
                flat = torch.empty((size, *inputs[0].shape), dtype=inputs[0].dtype)
                self._c("Gather", inp.spec(), Staged(flat, read=False).whole(), root=root)
                with torch.no_grad():
                    for o, src in zip(output_lists[0], flat):
                        o.copy_(src)
            else:
                self._c("Gather", inp.spec(), None, root=root)

        me = self._coll.Get_rank()
        return self._run(fn, [t for outs in output_lists for t in outs], opts, Call(
            "gather", inputs[0], root, invalid=checks.first(checks.dtypes(inputs), checks.lengths(
                "gather", output_lists[0] if output_lists else [], self._size, "the output list")
                if me == root else None)))

    def scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]], opts: Any) -> MPIWork:
        root = opts.rootRank

        def fn() -> None:
            out = Staged(outputs[0], read=False)
            if self._coll.Get_rank() == root:
                flat = torch.stack([t.detach().cpu() for t in input_lists[0]]).contiguous()
                self._c("Scatter", Staged(flat).whole(), out.spec(), root=root)
            else:
                self._c("Scatter", None, out.spec(), root=root)
            out.finish()

        me = self._coll.Get_rank()
        return self._run(fn, outputs, opts, Call("scatter", outputs[0], root, invalid=checks.first(
            checks.dtypes(outputs), checks.lengths("scatter", input_lists[0] if input_lists else [], self._size,
                                                   "the input list") if me == root else None,
            *(checks.sizes("scatter", t.numel(), outputs[0].numel(), "an input")
              for t in (input_lists[0] if me == root and input_lists else ())))))

    def _alltoallv(self, out: torch.Tensor, inp: torch.Tensor, send_counts: List[int], recv_counts: List[int]) -> None:
        so, si = Staged(out, read=False), Staged(inp)
        if overlap(so.t, si.t):
            si.t = si.t.clone()
        if max(sum(send_counts), sum(recv_counts)) > INT_MAX:
            raise ValueError("all_to_all: more than 2**31-1 elements in one call is not supported")
        sd = [sum(send_counts[:r]) for r in range(len(send_counts))]
        rd = [sum(recv_counts[:r]) for r in range(len(recv_counts))]
        t = mpi_type(si.t.dtype)
        self._c("Alltoallv", [byte_view(si.t) if si.t.numel() else EMPTY_SEND, (send_counts, sd), t],
                [byte_view(so.t) if so.t.numel() else EMPTY_RECV, (recv_counts, rd), t])
        so.finish()

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: List[int],
                          input_split_sizes: List[int], opts: Any = None) -> MPIWork:
        send, bad_in = checks.splits(input, list(input_split_sizes), self._size, "input")
        recv, bad_out = checks.splits(output, list(output_split_sizes), self._size, "output")
        return self._run(lambda: self._alltoallv(output, input, send, recv), [output], opts, Call(
            "all_to_all", input, invalid=checks.first(checks.dtypes((input, output)), bad_in, bad_out),
            counts=(send, recv)))

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

        return self._run(fn, outputs, opts, Call("all_to_all", inputs[0] if inputs else None, tensors=inputs,
                                                 counts=([t.numel() for t in inputs], [t.numel() for t in outputs]),
                                                 invalid=checks.first(
                                                     checks.dtypes(inputs),
                                                     checks.lengths("all_to_all", inputs, self._size, "the input list"),
                                                     checks.lengths("all_to_all", outputs, self._size,
                                                                    "the output list"))))

    def barrier(self, opts: Any = None) -> MPIWork:
        return self._run(lambda: self._c("Barrier"), [], opts, Call("barrier", None))
