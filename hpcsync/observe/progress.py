"""A dependency-free progress bar for long merges and stage-ins, on the root rank's stderr: a bar
on a terminal, and where stderr is a pipe (under mpiexec, mpirun or srun, as users run) one plain
line every :data:`LINE_EVERY_S` seconds once the work has taken that long."""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

from ..core import settings

__all__ = ["LINE_EVERY_S", "Progress"]

LINE_EVERY_S = 10  # seconds between two lines where stderr is not a terminal


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


class Progress:
    """``label  42% 1.2 GiB/2.9 GiB  850.0 MiB/s``: on a terminal redrawn at most 5 times a
    second; elsewhere a line every :data:`LINE_EVERY_S` seconds (none for work done sooner).

    ``enabled``: True draws the bar whatever the stream, False draws nothing; None (default): the
    bar on a TTY, the lines otherwise, neither when ``HPCSYNC_PROGRESS`` is 0.
    """

    def __init__(self, label: str, total: int, enabled: Optional[bool] = None, stream: Optional[TextIO] = None):
        self.stream = stream or sys.stderr
        self.lines = False
        if enabled is None:
            enabled = settings.flag("HPCSYNC_PROGRESS")
            self.lines = enabled and not self.stream.isatty()
        self.enabled = enabled and total > 0
        self.label, self.total, self.done = label, total, 0
        self.t0 = self.last = time.monotonic()
        self._printed = False  # a line printed, in lines mode
        self._complete = False  # the last line printed says 100%

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if self.lines:
            if now - self.last >= LINE_EVERY_S:
                self.last = now
                self._line(now)
        elif now - self.last >= 0.2 or self.done >= self.total:
            self.last = now
            self._draw(now)

    def _text(self, now: float) -> str:
        rate = self.done / max(now - self.t0, 1e-9)
        pct = 100.0 * self.done / self.total
        return f"{self.label} {pct:5.1f}% {_human(self.done)}/{_human(self.total)} {_human(rate)}/s"

    def _draw(self, now: float) -> None:
        self.stream.write(f"\r{self._text(now)}")
        self.stream.flush()

    def _line(self, now: float) -> None:
        self.stream.write(self._text(now) + "\n")
        self.stream.flush()
        self._printed, self._complete = True, self.done >= self.total

    def close(self) -> None:
        if not self.enabled:
            return
        if self.lines:
            if self._printed and not self._complete:
                self._line(time.monotonic())
            return
        self._draw(time.monotonic())
        self.stream.write("\n")
        self.stream.flush()
