"""A torch.distributed ``Store`` over MPI: gloo and nccl rendezvous without rank 0's TCP store.

``hpcsync.init(backend="gloo", store="mpi")`` (or ``HPCSYNC_STORE=mpi``) hands torch an
:class:`MPIStore` instead of a ``TCPStore``: the key-value table lives in rank 0's process and the
other ranks reach it with MPI point-to-point messages on a private communicator -- no listening
port for the rendezvous. (gloo and NCCL still open their own data connections; the socket-free
path for the data is ``backend="hpcsync"``.)

Rank 0 serves requests from a thread (polled every 0.2 ms within a second of the last request,
every 5 ms when idle). ``get``/``wait`` block until the keys exist or the store's timeout passes;
the server answers with the value or a timeout, so a client never waits for nothing; a client
whose answer has not come :data:`REPLY_GRACE_S` after that (rank 0 gone or stuck) raises. Below
``THREAD_MULTIPLE`` every MPI call here holds the process's MPI lock (:mod:`hpcsync.core.serial`),
as hpcsync's own calls do; a program's own mpi4py calls on rank 0 must too (or the job asks for
``THREAD_MULTIPLE``). Under ``THREAD_FUNNELED`` the server thread may not call MPI at all: the
store is refused.
"""
from __future__ import annotations

import datetime as _dt
import itertools
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist

from ..core import bounded, mpi, serial, settings

__all__ = ["REPLY_GRACE_S", "MPIStore"]

_TAG_REQ, _TAG_REP = settings.TAG_STORE_REQUEST, settings.TAG_STORE_REPLY
REPLY_GRACE_S = 30.0  # past the store's own timeout, for rank 0's answer to arrive


class _Table:
    """The key-value table on rank 0, with waiters for keys that do not exist yet."""

    def __init__(self) -> None:
        self.data: Dict[str, bytes] = {}
        self.cv = threading.Condition()

    def apply(self, op: str, args: Tuple[Any, ...]) -> Any:
        d = self.data
        with self.cv:
            if op == "set":
                d[args[0]] = args[1]
                self.cv.notify_all()
                return None
            if op == "add":
                value = int(d.get(args[0], b"0")) + int(args[1])
                d[args[0]] = str(value).encode()
                self.cv.notify_all()
                return value
            if op == "compare_set":
                key, expected, desired = args
                cur = d.get(key)
                if (cur is None and expected == b"") or cur == expected:
                    d[key] = desired
                    self.cv.notify_all()
                    return desired
                return expected if cur is None else cur
            if op == "check":
                return all(k in d for k in args[0])
            if op == "num_keys":
                return len(d)
            if op == "delete_key":
                return d.pop(args[0], None) is not None
            if op == "get_now":
                return d.get(args[0])
        raise ValueError(f"MPIStore: unknown operation {op!r}")

    def ready(self, keys: List[str]) -> bool:
        with self.cv:
            return all(k in self.data for k in keys)


class MPIStore(dist.Store):
    """A ``Store`` whose table lives on rank 0 of ``comm`` (default ``COMM_WORLD``); collective to create."""

    def __init__(self, comm: Any = None, timeout: _dt.timedelta = _dt.timedelta(minutes=30)) -> None:
        super().__init__()
        MPI = mpi.MPI()
        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise ValueError("store='mpi' needs MPI_THREAD_SERIALIZED or more (rank 0 serves the store from a thread "
                             "of its own); this MPI runs at THREAD_FUNNELED or less: use the TCP store "
                             "(store='tcp') or ask for more (MPI4PY_RC_THREAD_LEVEL=multiple)")
        self._comm = (comm or MPI.COMM_WORLD).Dup()
        self._rank = self._comm.Get_rank()
        self._timeout = timeout
        self._lock = threading.Lock()  # one request in flight per client process
        self._ids = itertools.count()
        self._table: Optional[_Table] = _Table() if self._rank == 0 else None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if self._table is not None and self._comm.Get_size() > 1:
            self._thread = threading.Thread(target=self._serve, name="hpcsync-store", daemon=True)
            self._thread.start()
            from ..core import jobend

            jobend.at_exit("store", self.close)  # before MPI_Finalize

    # -- rank 0: the server ----------------------------------------------------------------
    def _serve(self) -> None:
        MPI = mpi.MPI()
        table = self._table
        assert table is not None
        waiting: List[Tuple[int, int, str, List[str], float]] = []  # (src, id, op, keys, deadline)
        sends: List[Any] = []
        last = time.monotonic()
        held = serial.lock()  # below THREAD_MULTIPLE: one MPI call at a time in the process
        while not self._stop.is_set():
            busy = False
            if held is not None:
                held.acquire()  # a pass over the requests: non-blocking calls only
            try:
                msg = self._comm.improbe(source=MPI.ANY_SOURCE, tag=_TAG_REQ)
                while msg is not None:
                    busy = True
                    status = MPI.Status()
                    rid, op, args, timeout_s = msg.recv(status=status)
                    src = status.Get_source()
                    if op in ("get", "wait"):
                        waiting.append((src, rid, op, list(args[0]), time.monotonic() + timeout_s))
                    else:
                        try:
                            sends.append(self._comm.isend((rid, True, table.apply(op, args)), dest=src, tag=_TAG_REP))
                        except Exception as exc:  # noqa: BLE001 - the client raises it
                            sends.append(self._comm.isend((rid, False, str(exc)), dest=src, tag=_TAG_REP))
                    msg = self._comm.improbe(source=MPI.ANY_SOURCE, tag=_TAG_REQ)
                still = []
                now = time.monotonic()
                for src, rid, op, keys, deadline in waiting:
                    if table.ready(keys):
                        value = table.apply("get_now", (keys[0],)) if op == "get" else None
                        sends.append(self._comm.isend((rid, True, value), dest=src, tag=_TAG_REP))
                    elif now > deadline:
                        sends.append(self._comm.isend((rid, False, f"timed out waiting for keys {keys}"),
                                                      dest=src, tag=_TAG_REP))
                    else:
                        still.append((src, rid, op, keys, deadline))
                waiting = still
                sends = [s for s in sends if not s.Test()]
            except Exception:  # noqa: BLE001
                if MPI.Is_finalized():
                    return
            finally:
                if held is not None:
                    held.release()
            now = time.monotonic()
            if busy or waiting or sends:
                last = now
            self._stop.wait(0.0002 if now - last < 1.0 else 0.005)  # quick while a rendezvous is under way

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None

    # -- every rank: the client ------------------------------------------------------------
    def _call(self, op: str, *args: Any, timeout: Optional[float] = None) -> Any:
        t = self._timeout.total_seconds() if timeout is None else timeout
        if self._table is not None:  # rank 0: the table is here
            if op in ("get", "wait"):
                keys = list(args[0])
                with self._table.cv:
                    if not self._table.cv.wait_for(lambda: all(k in self._table.data for k in keys), t):
                        raise dist.DistStoreError(f"MPIStore: timed out after {t:g}s waiting for keys {keys}")
                return self._table.apply("get_now", (keys[0],)) if op == "get" else None
            return self._table.apply(op, args)
        with self._lock:
            rid = next(self._ids)
            sent = serial.call(self._comm.isend, (rid, op, args, t), dest=0, tag=_TAG_REQ)
            # the server answers a get or wait by t (a timeout, at worst), anything else at once
            allowed = (t if op in ("get", "wait") else 0.0) + REPLY_GRACE_S
            deadline = time.monotonic() + allowed
            while True:
                msg = serial.call(self._comm.improbe, source=0, tag=_TAG_REP)
                if msg is None:
                    if time.monotonic() > deadline:
                        if not serial.call(sent.Test):  # MPI may still read its buffer: kept for good
                            bounded.abandon(f"MPIStore: a request to rank 0 was never received ({op})", sent)
                        raise dist.DistStoreError(f"MPIStore: no answer from rank 0 (the store's server) within "
                                                  f"{allowed:g}s to {op}: rank 0 is gone or stuck")
                    time.sleep(0.0005)
                    continue
                got, ok, value = serial.call(msg.recv)
                if got == rid:
                    break
            serial.call(sent.wait)  # (answered: the request arrived)
        if not ok:
            raise dist.DistStoreError(f"MPIStore: {value}")
        return value

    @staticmethod
    def _b(value: Any) -> bytes:
        return value if isinstance(value, bytes) else bytes(value) if isinstance(value, (bytearray, list)) \
            else str(value).encode()

    def set(self, key: str, value: Any) -> None:
        self._call("set", key, self._b(value))

    def get(self, key: str) -> bytes:
        return self._call("get", [key])

    def add(self, key: str, value: int) -> int:
        return self._call("add", key, int(value))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._call("compare_set", key, self._b(expected), self._b(desired))

    def wait(self, keys: List[str], timeout: Optional[_dt.timedelta] = None) -> None:
        self._call("wait", list(keys), timeout=None if timeout is None else timeout.total_seconds())

    def check(self, keys: List[str]) -> bool:
        return self._call("check", list(keys))

    def num_keys(self) -> int:
        return self._call("num_keys")

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def set_timeout(self, timeout: _dt.timedelta) -> None:
        self._timeout = timeout

    @property
    def timeout(self) -> _dt.timedelta:
        return self._timeout
