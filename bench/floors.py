"""The floors a Python backend cannot go below, as process groups the benchmark measures beside hpcsync.

- ``noop``: a ProcessGroup whose operations do nothing: what torch's ``dist.*`` functions and
  its dispatch into a Python backend cost per call.
- ``thin``: the thinnest backend that moves data: each operation is one raw mpi4py call, bound
  once to the benchmark's own buffers (:data:`Thin.calls`: the call hpcsync makes), after the
  16-byte agreement when the group's ``agree`` is set. Against it, what hpcsync's own code costs per call is told apart from
  what torch's dispatch and the agreement cost, in the same job and with the same memory.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch.distributed as dist


class _Done(dist.Work):
    """A Work that is already done: the least a backend can return."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class Noop(dist.ProcessGroup):
    """all_reduce that does nothing: torch's ``dist.*`` and its dispatch into Python, alone."""

    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        return _Done()

    def getBackendName(self) -> str:
        return "noop"


class Thin(dist.ProcessGroup):
    """One prepared raw call per operation (ignoring the tensors torch passes: the benchmark
    passes the buffers the calls were bound to), the same finished ``Work`` every time."""

    calls: Dict[str, Callable[[], Any]] = {}  # op -> the raw call, set before each size
    _done = _Done()

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.agree: Optional[Callable[[], Any]] = None  # the agreement, or None

    def _run(self, op: str) -> dist.Work:
        if self.agree is not None:
            self.agree()
        Thin.calls[op]()
        return self._done

    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        return self._run("all_reduce")

    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:
        return self._run("broadcast")

    def all_gather_single(self, output: Any, input: Any, opts: Any = None) -> dist.Work:
        return self._run("all_gather")

    def reduce_scatter_single(self, output: Any, input: Any, opts: Any = None) -> dist.Work:
        return self._run("reduce_scatter")

    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single

    def getBackendName(self) -> str:
        return "thin"


def register() -> None:
    """Register ``noop`` and ``thin`` with torch (once per process)."""
    for name, cls in (("noop", Noop), ("thin", Thin)):
        if name not in dist.Backend.backend_list:
            dist.Backend.register_backend(name, lambda o, _b=None, cls=cls: cls(o.group_rank, o.group_size),
                                          extended_api=True, devices=["cpu"])
