"""The failure record, typed and versioned: what a rank writes when it sees the job end
(:mod:`hpcsync.observe.failure`) and what ``hpcsync run`` reads back
(:mod:`hpcsync.resilience.verdict`), written and read by this one piece of code.

On disk it stays JSON a person can read (one key a line, the same keys as before the record had
a version)::

    {"kind": "hpcsync failure record", "version": 1, "cause": "hang", "reporter": {"rank": 0,
     "node": "n0"}, "silent": [13], "silent_at": {"13": "n1"}, "reached": [0, 1, ...], ...}

:meth:`FailureRecord.from_json` refuses what this code did not write: another kind, a version
it does not know, a key it does not know, a value of the wrong type, an unknown cause
(:class:`RecordError`, a ``ValueError``); the reader skips such a file with a warning, never
believes it and never fails on it.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Dict, List, Mapping, Optional, Tuple

__all__ = ["KIND", "VERSION", "Cause", "Reporter", "RecordError", "FailureRecord"]

KIND = "hpcsync failure record"
VERSION = 1  #: the record's layout; a reader refuses any other


class Cause(str, Enum):
    """What ended the job, as the reporter saw it."""

    EXCEPTION = "exception"  #: an uncaught exception of the program's own code
    HANG = "hang"  #: a wait past its timeout with ranks that did not answer (silent)
    STALL = "stall"  #: the same, but every rank answered: some never entered the operation
    TIMEOUT = "timeout"  #: a bounded wait another rank never met, an error out of the transport
    HARDWARE = "hardware"  #: a GPU's uncorrectable fault: this rank's node


class RecordError(ValueError):
    """A file that is not a failure record this code can read."""


@dataclass(frozen=True)
class Reporter:
    """The rank that wrote the record and its node (-1: before MPI was up)."""

    rank: int
    node: str


@dataclass(frozen=True)
class FailureRecord:
    """One rank's account of a failure (see :mod:`hpcsync.observe.failure` for who writes which).

    ``ranks``/``nodes``: whom it implicates; ``blame_nodes``: the nodes it would leave out (empty
    for a program error); ``silent``: the ranks that answered nobody, ``silent_at`` their nodes;
    ``never_entered``: ranks that answered but never reached the operation, ``elsewhere`` those of
    them whose own wait timed out (stuck in another operation: a desync, a deadlock); ``reached``: the
    ranks that answered the reporter, itself included (its side of a split; None: not said) and
    ``reached_nodes`` their nodes. ``path``: where it was read from (not written)."""

    cause: Cause
    reporter: Reporter
    detail: str = ""
    program_error: bool = False
    ranks: Tuple[int, ...] = ()
    nodes: Tuple[str, ...] = ()
    blame_nodes: Tuple[str, ...] = ()
    time: float = 0.0
    attempt: Optional[str] = None
    silent: Tuple[int, ...] = ()
    never_entered: Tuple[int, ...] = ()
    elsewhere: Tuple[int, ...] = ()
    silent_at: Mapping[int, str] = field(default_factory=dict)
    reached: Optional[Tuple[int, ...]] = None
    reached_nodes: Tuple[str, ...] = ()
    exit_code: Optional[int] = None
    version: int = VERSION
    path: Optional[str] = field(default=None, compare=False)

    def reached_ranks(self) -> Tuple[int, ...]:
        """The ranks the reporter reached, itself included (its rank alone when not said)."""
        return self.reached if self.reached is not None else (self.reporter.rank,)

    def to_dict(self) -> Dict[str, Any]:
        """The record as its JSON object (``path`` left out)."""
        out: Dict[str, Any] = {"kind": KIND, "version": self.version, "cause": self.cause.value,
                               "reporter": {"rank": self.reporter.rank, "node": self.reporter.node}}
        for f in fields(self):
            if f.name in ("version", "cause", "reporter", "path"):
                continue
            value = getattr(self, f.name)
            if f.name == "silent_at":
                value = {str(k): v for k, v in sorted(value.items())}
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    def to_json(self) -> str:
        """The record as JSON, one key a line and each value on its line (a person reads it; a
        list of 8,192 ranks is one line, not 8,192)."""
        items = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in self.to_dict().items()]
        return "{\n" + ",\n".join(items) + "\n}\n"

    @classmethod
    def from_json(cls, text: str, path: Optional[str] = None) -> "FailureRecord":
        """The record in ``text``; :class:`RecordError` for anything this code did not write."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise RecordError(f"not JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
        return cls.from_dict(data, path)

    @classmethod
    def from_dict(cls, data: Any, path: Optional[str] = None) -> "FailureRecord":
        """The record of a decoded JSON object; :class:`RecordError` as for :meth:`from_json`."""
        if not isinstance(data, dict) or data.get("kind") != KIND:
            raise RecordError("not an hpcsync failure record")
        version = data.get("version")
        if type(version) is not int or version != VERSION:
            raise RecordError(f"version {version!r}: this hpcsync reads version {VERSION} only")
        known = {f.name for f in fields(cls)} - {"path"} | {"kind"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RecordError(f"unknown key(s) {', '.join(map(repr, unknown))}")
        try:
            cause = Cause(data.get("cause"))
        except ValueError:
            raise RecordError(f"unknown cause {data.get('cause')!r}") from None
        rep = data.get("reporter")
        if not isinstance(rep, dict) or set(rep) != {"rank", "node"}:
            raise RecordError("reporter: want {'rank': int, 'node': str}")
        reached = data.get("reached")
        silent_at = data.get("silent_at", {})
        if not isinstance(silent_at, dict) or not all(isinstance(k, str) and re.fullmatch(r"-?[0-9]+", k, re.ASCII)
                                                      and isinstance(v, str) for k, v in silent_at.items()):
            raise RecordError("silent_at: want {'<rank>': '<node>'}")
        return cls(cause=cause, reporter=Reporter(_int(rep["rank"], "reporter.rank"), _str(rep["node"], "reporter.node")),
                   detail=_str(data.get("detail", ""), "detail"),
                   program_error=_bool(data.get("program_error", False), "program_error"),
                   ranks=_ints(data.get("ranks", []), "ranks"), nodes=_strs(data.get("nodes", []), "nodes"),
                   blame_nodes=_strs(data.get("blame_nodes", []), "blame_nodes"),
                   time=_number(data.get("time", 0.0), "time"),
                   attempt=None if data.get("attempt") is None else _str(data["attempt"], "attempt"),
                   silent=_ints(data.get("silent", []), "silent"),
                   never_entered=_ints(data.get("never_entered", []), "never_entered"),
                   elsewhere=_ints(data.get("elsewhere", []), "elsewhere"),
                   silent_at={int(k): v for k, v in silent_at.items()},
                   reached=None if reached is None else _ints(reached, "reached"),
                   reached_nodes=_strs(data.get("reached_nodes", []), "reached_nodes"),
                   exit_code=None if data.get("exit_code") is None else _int(data["exit_code"], "exit_code"),
                   version=version, path=path)


def _int(value: Any, key: str) -> int:
    if type(value) is not int:
        raise RecordError(f"{key}: want an integer, not {value!r}")
    return value


def _str(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise RecordError(f"{key}: want a string, not {value!r}")
    return value


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise RecordError(f"{key}: want true or false, not {value!r}")
    return value


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecordError(f"{key}: want a number, not {value!r}")
    return float(value)


def _ints(value: Any, key: str) -> Tuple[int, ...]:
    if not isinstance(value, list):
        raise RecordError(f"{key}: want a list of integers")
    return tuple(_int(v, key) for v in value)


def _strs(value: Any, key: str) -> Tuple[str, ...]:
    if not isinstance(value, list):
        raise RecordError(f"{key}: want a list of strings")
    out: List[str] = [_str(v, key) for v in value]
    return tuple(out)
