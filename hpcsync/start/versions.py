"""The versions hpcsync is tested with: what ``pyproject.toml`` claims and ``hpcsync doctor`` checks.

CI runs one stack (docs/harness.md): Python 3.11 on Debian 12, torch 2.13.0, and the mpi4py,
numpy, h5py and psutil releases ``jobs/setup_env.sh`` installs. The claims are that stack's, not
wider: Python and torch with an upper bound too (the backend leans on torch internals that move
between releases), the others from the release tested on. ``tests/test_packaging.py`` checks
``pyproject.toml`` against :data:`TESTED`; a run on another version is a warning of the doctor's,
not an error.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

__all__ = ["Tested", "TESTED", "parse", "outside"]


@dataclass(frozen=True)
class Tested:
    """``name`` is tested from release ``low`` (inclusive) to ``high`` (exclusive, None: open)."""

    name: str
    low: str
    high: Optional[str] = None

    def spec(self) -> str:
        """As pyproject.toml writes it: ``>=3.11,<3.12``."""
        return f">={self.low}" + (f",<{self.high}" if self.high else "")


TESTED = {t.name: t for t in (
    Tested("python", "3.11", "3.12"),
    Tested("torch", "2.13", "2.14"),
    Tested("mpi4py", "4.1"),
    Tested("numpy", "2.4"),
    Tested("h5py", "3.16"),
    Tested("psutil", "7.2"),
)}


def parse(version: str) -> Tuple[int, ...]:
    """The leading numbers of a version string: ``2.13.0+cpu`` -> (2, 13, 0)."""
    numbers = []
    for part in version.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        numbers.append(int(digits))
        if not part.isdigit():
            break
    return tuple(numbers)


def outside(name: str, version: str) -> Optional[str]:
    """Why ``version`` of ``name`` is outside what was tested, or None when it is inside."""
    tested = TESTED[name]
    have = parse(version)
    if have < parse(tested.low) or (tested.high is not None and have >= parse(tested.high)):
        return f"{name} {version}: hpcsync is tested with {name} {tested.spec()}"
    return None
