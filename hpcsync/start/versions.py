"""The versions hpcsync is tested with: what ``pyproject.toml`` claims and ``hpcsync doctor`` checks.

CI runs one stack (docs/harness.md): Python 3.11 on Debian 12, torch 2.13.0, and the mpi4py,
numpy, h5py and psutil releases ``jobs/setup_env.sh`` installs. ``pyproject.toml`` (and the Spack
recipe) require at least that stack's release series, except where the verified Spack route
needs one lower (``floor``: Spack's newest py-torch is 2.12.x, its newest py-psutil 7.1); no upper
bounds, so a newer release installs. ``hpcsync doctor`` warns, and does not fail, on any version
outside the tested series (``low`` up to ``high``): it may work, but nobody ran the tests there.
``tests/test_packaging.py`` checks ``pyproject.toml`` against :data:`TESTED`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

__all__ = ["Tested", "TESTED", "parse", "outside"]


@dataclass(frozen=True)
class Tested:
    """``name`` is tested from release ``low`` (inclusive) to ``high`` (exclusive, None: open);
    installs require at least ``floor`` (default ``low``)."""

    name: str
    low: str
    high: Optional[str] = None
    floor: Optional[str] = None

    def spec(self) -> str:
        """As pyproject.toml writes it: ``>=3.11``."""
        return f">={self.floor or self.low}"

    def tested(self) -> str:
        return f">={self.low}" + (f",<{self.high}" if self.high else "")


TESTED = {t.name: t for t in (
    Tested("python", "3.11", "3.12"),
    Tested("torch", "2.13", "2.14", floor="2.12"),  # spack.yaml concretizes py-torch@2.12.1, Spack's newest
    Tested("mpi4py", "4.1", "5"),
    Tested("numpy", "2.4", "3"),
    Tested("h5py", "3.16", "4"),
    Tested("psutil", "7.2", "8", floor="7.1"),  # Spack's newest py-psutil is 7.1.0
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
        return f"{name} {version}: hpcsync is tested with {name} {tested.tested()}"
    return None
