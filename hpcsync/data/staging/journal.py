"""A stage's journal in ``dst``: what a running stage finished, so that a killed one is resumed.

One file per rank that copies (the node leader's :data:`JOURNAL`, ``JOURNAL.<rank>`` for the
other ranks of a one-node job): a first line naming the source, then one line per checkpoint,
``[[rel, record], ...]``. A journal that exists means a stage was killed here (a stage that ends
removes them), so the next call removes the temporary names it left, and rewrites the journal
(under a temporary name that replaces it once written) carrying the killed stage's records.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["JOURNAL", "journals", "read_journals", "Journal"]

log = logging.getLogger(__name__)

JOURNAL = ".hpcsync-stage.journal"


def journals(dst: str) -> List[str]:
    """The journals in ``dst``: the root's, and one per rank that helped on a one-node job."""
    try:
        return sorted(n for n in os.listdir(dst) if n == JOURNAL or n.startswith(JOURNAL + "."))
    except OSError:
        return []


def read_journals(dst: str, names: Sequence[str], src: str, records: Dict[str, list], host: str) -> Dict[str, list]:
    """Add the records of the journals ``names`` (those of a stage of ``src``) to ``records``;
    returns the ones added. A torn last line (a kill amid a write) is ignored."""
    resumed: Dict[str, list] = {}
    for name in names:
        try:
            with open(os.path.join(dst, name)) as f:
                head = f.readline()
                if not head.endswith("\n") or json.loads(head).get("source") != src:
                    continue
                for line in f:
                    if not line.endswith("\n"):
                        break  # torn last line of a killed stage
                    batch = json.loads(line)  # one line per checkpoint: [[rel, record], ...]
                    for rel, rec in [batch] if batch and isinstance(batch[0], str) else batch:
                        records[rel] = resumed[rel] = rec  # (a line of one [rel, record]: an older journal)
        except (OSError, ValueError, AttributeError, TypeError) as exc:
            log.warning("%s: ignoring the rest of stage journal %s in %s: %s", host, name, dst, exc)
    return resumed


class Journal:
    """One rank's journal. A write that fails (a full disk, an I/O error, a path that cannot be
    a file) is this rank's error, returned, never raised: the stage then ends with it on every
    rank, and the journal is not written again."""

    def __init__(self, dst: str, name: str, src: str, durable: bool, tmp: str) -> None:
        self.path, self.src, self.durable = os.path.join(dst, name), src, durable
        self.tmp = tmp  # where it is written first (beside it: a hidden temporary name)
        self.file: Optional[Any] = None
        self.error: Optional[str] = None
        self.carried: Dict[str, list] = {}  # a killed stage's records, which this journal replaces

    @property
    def started(self) -> bool:
        return self.file is not None

    def start(self) -> Optional[str]:
        """Create the journal (its first line names the source; its second carries
        :attr:`carried`, so a stage killed twice still skips what the first run finished). It is
        written under :attr:`tmp`, then renamed over the journal it replaces: a kill amid the
        write leaves that journal whole, never truncated."""
        if self.file is None and self.error is None:
            try:
                self.file = open(self.tmp, "w")
                self.file.write(json.dumps({"source": self.src}) + "\n")
                if self.carried:
                    self.file.write(json.dumps(list(self.carried.items()), separators=(",", ":")) + "\n")
                self._flush(self.durable)
                os.replace(self.tmp, self.path)  # the open file is the journal from here on
                self.carried = {}
            except OSError as exc:
                self._failed(exc)
                try:
                    os.unlink(self.tmp)
                except OSError:
                    pass
        return self.error

    def append(self, done: List[Tuple[str, list]]) -> Optional[str]:
        """One line of records (the C encoder's JSON), flushed; synced when ``durable``."""
        if self.start() is None:
            try:
                self.file.write(json.dumps(done, separators=(",", ":")) + "\n")  # type: ignore[union-attr]
                self._flush(self.durable)
            except OSError as exc:
                self._failed(exc)
        return self.error

    def close(self) -> None:
        if self.file is not None:
            try:
                self.file.close()
            except OSError:
                pass
            self.file = None

    def _flush(self, sync: bool) -> None:
        self.file.flush()  # type: ignore[union-attr]
        if sync:
            os.fsync(self.file.fileno())  # type: ignore[union-attr]

    def _failed(self, exc: OSError) -> None:
        self.error = f"cannot write the stage journal {self.path}: {exc.strerror or exc}"
        self.close()
