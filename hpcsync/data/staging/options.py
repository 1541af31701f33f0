"""One stage's options, as every rank agreed on them: what :func:`hpcsync.stage` was asked for,
checked and made absolute, passed down whole instead of a dozen arguments."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from .listing import Entry

__all__ = ["StageOptions", "Listing"]


@dataclass(frozen=True)
class StageOptions:
    """``src`` and ``dst`` absolute; ``limit``: the exchanges' timeout in seconds (the node's own
    reads and writes get a quarter); the rest as :func:`hpcsync.stage` describes them."""

    src: str
    dst: str
    root: int
    chunk_bytes: int
    durable: bool
    progress: Optional[bool]
    limit: float
    names: bool

    def agreed(self) -> Dict[str, Any]:
        """What every rank must give alike (``progress`` may differ: only the root draws)."""
        return {"src": self.src, "dst": self.dst, "root": self.root, "chunk_bytes": self.chunk_bytes,
                "durable": self.durable, "timeout": self.limit, "names": self.names}


@dataclass(frozen=True)
class Listing:
    """The source as the node leaders see it for a stage in rounds: every entry (on the root; the
    others get theirs round by round), the names left out, the files, their bytes, the number
    of entries and of entries per round, and whether the source is one file."""

    entries: List[Entry]
    ignored: List[str]
    files: List[Entry]
    total: int
    count: int
    per_round: int
    single: bool
