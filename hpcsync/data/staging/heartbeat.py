"""A node's other ranks wait for their leader's transfer, bounded by its progress, not its length.

Across nodes only the node leaders move the bytes; the other ranks of a node wait until their
leader is done, which takes as long as the dataset takes. A plain deadline on that wait would
either cut a large stage short or let a frozen leader hold its node for ever. Instead the leader
sends its node's ranks a small message whenever it makes progress (a broadcast round, a new
phase; at most every ``timeout / 4`` seconds) and a last one with its outcome. A rank that hears
nothing for twice the timeout raises :class:`~hpcsync.core.errors.StageTimeout` naming its
leader and node; one whose leader failed raises that failure at once, without waiting for an
exchange the leader will never reach.
"""
from __future__ import annotations

import time
from typing import Any, List, Optional, Tuple

from ...core import bounded, serial
from ...core.errors import StageError, StageTimeout

__all__ = ["TAG", "MAX_BYTES", "Heartbeat"]

TAG = 0x5EA1  # on the node's private duplicate: never matches the program's own messages
MAX_BYTES = 2000  # a leader's error, as sent, in UTF-8 (the receive buffer bounds a message; small: sent eagerly)


class Heartbeat:
    """Between a node leader (rank 0 of ``node``) and the node's other ranks."""

    def __init__(self, node: Any, timeout: float, leader_names: str) -> None:
        self.node, self.timeout, self.leader = node, timeout, leader_names
        self.interval = max(0.05, min(timeout / 4, 5.0))
        self.last = time.monotonic()
        self.sends: List[Any] = []
        self.alone = node.Get_size() == 1

    def beat(self) -> None:
        """The leader made progress: tell the node (at most every ``interval`` seconds)."""
        now = time.monotonic()
        if self.alone or now - self.last < self.interval:
            return
        self.last = now
        self._send(("alive", None, False))

    def done(self, error: Optional[str], timed_out: bool = False) -> None:
        """The leader's last word: ``error`` (None: its part went well), and whether that error is
        a timeout (the node's ranks then raise :class:`StageTimeout` too)."""
        if self.alone:
            return
        words = error.encode()[:MAX_BYTES].decode(errors="ignore") if error else None
        self._send(("done", words, timed_out))
        deadline = time.monotonic() + self.timeout  # a few bytes each: sent at once unless a rank is gone
        while self.sends and time.monotonic() < deadline:
            self.sends = [r for r in self.sends if not serial.call(r.Test)]
            time.sleep(0.001)
        for r in self.sends:
            bounded.abandon("a stage's last message to a rank of this node was never received", r)

    def _send(self, msg: Tuple[Any, ...]) -> None:
        raw = self.node.raw()
        self.sends = [r for r in self.sends if not serial.call(r.Test)]
        self.sends += [serial.call(raw.isend, msg, dest=r, tag=TAG) for r in range(1, self.node.Get_size())]

    def follow(self, what: str) -> None:
        """A non-leader's wait: returns when the leader is done and its part went well; raises its
        error as this rank's, or :class:`StageTimeout` after ``2 * timeout`` seconds of silence."""
        raw = self.node.raw()
        patience = 2 * self.timeout
        deadline = time.monotonic() + patience
        req = serial.call(raw.irecv, bytearray(MAX_BYTES + 512), source=0, tag=TAG)
        pause = 0.0002
        while True:
            ok, msg = serial.call(req.test)
            now = time.monotonic()
            if ok:
                kind, error, timed_out = msg
                if kind == "done":
                    if error is not None:
                        raise (StageTimeout if timed_out else StageError)(f"{what}{error}")
                    return
                deadline, pause = now + patience, 0.0002
                req = serial.call(raw.irecv, bytearray(MAX_BYTES + 512), source=0, tag=TAG)
                continue
            if now > deadline:
                serial.call(req.Cancel)  # a receive not yet matched can be cancelled: nothing stays in flight
                serial.call(req.Wait)
                raise StageTimeout(f"{what}this node's leader, rank {self.leader}, showed no progress for "
                                   f"{patience:g} s "
                                   "while it staged for the node (twice the timeout): it is frozen or stuck, or "
                                   "its node lost")
            time.sleep(pause)
            pause = min(pause * 2, 0.002)
