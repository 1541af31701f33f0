"""A dependency-free progress bar for long merges, on the root rank's stderr."""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

from ..core import settings

__all__ = ["Progress"]


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


class Progress:
    """``label  42% 1.2 GiB/2.9 GiB  850.0 MiB/s``, redrawn at most 5 times a second.

    Enabled when ``enabled`` is True, or when it is None, the stream is a TTY and
    ``HPCSYNC_PROGRESS`` is not 0.
    """

    def __init__(self, label: str, total: int, enabled: Optional[bool] = None, stream: Optional[TextIO] = None):
        self.stream = stream or sys.stderr
        if enabled is None:
            enabled = settings.flag("HPCSYNC_PROGRESS") and self.stream.isatty()
        self.enabled = enabled and total > 0
        self.label, self.total, self.done = label, total, 0
        self.t0 = self.last = time.monotonic()

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self.last >= 0.2 or self.done >= self.total):
            self.last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        rate = self.done / max(now - self.t0, 1e-9)
        pct = 100.0 * self.done / self.total
        self.stream.write(f"\r{self.label} {pct:5.1f}% {_human(self.done)}/{_human(self.total)} {_human(rate)}/s")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
