"""torch's Flight Recorder for gloo and NCCL groups: where this rank is in each group's collectives.

hpcsync's own backend records every operation itself (:mod:`hpcsync.observe.watchdog`); a gloo or NCCL
group is torch's, and torch keeps a ring buffer of its last collectives per process (the Flight
Recorder: group, sequence number, operation, sizes, the Python frames of the call) when
``TORCH_FR_BUFFER_SIZE`` is set before the group is made. :func:`enable` sets it (unless the
user did); :func:`group_state` answers, for one group and one sequence number, what the hang
report asks of every rank: not there yet (``never``), in it (``inside``) or past it (``finished``).
torch numbers a group's collectives in call order on each rank, so a rank whose count is lower
never entered the collective the others wait in, and one at the same count but another call
site or size is out of step with them.
"""
from __future__ import annotations

import os
import pickle
import time
from typing import Any, Dict, List, Optional

__all__ = ["BUFFER", "enable", "entries", "describe", "group_ranks", "collectives", "latest", "group_state"]

BUFFER = "2000"  # entries kept per process (torch's ring; a few hundred bytes each)
_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def enable(backend: str = "gloo") -> None:
    """Turn the recorder on for groups made from now on (the user's own settings win). For NCCL,
    whose own watchdog may end the process on a timeout before Python sees an error, torch is
    also asked to dump the recorder then, into ``HPCSYNC_REPORT_DIR`` when it is set (rather than
    each node's /tmp). What it sets is logged at DEBUG."""
    import logging

    from ..core import settings

    changed = []
    if not any(os.environ.get(v) for v in _VARS):  # TORCH_FR_BUFFER_SIZE=0 turns it off
        os.environ["TORCH_FR_BUFFER_SIZE"] = BUFFER
        changed.append(f"TORCH_FR_BUFFER_SIZE={BUFFER}")
    folder = settings.text("HPCSYNC_REPORT_DIR")
    if backend == "nccl" and folder and "TORCH_NCCL_DUMP_ON_TIMEOUT" not in os.environ:
        os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", os.path.join(folder, "nccl-trace-rank-"))
        changed.append(f"TORCH_NCCL_DUMP_ON_TIMEOUT=1 into {folder}")
    if changed:
        logging.getLogger(__name__).debug("hpcsync: torch's flight recorder: %s", ", ".join(changed))


def entries() -> List[Dict[str, Any]]:
    """This process's recorded collectives, oldest first; empty when the recorder is off. Without
    the Python frames of each call: torch symbolizes those slowly (seconds, measured, for a few
    entries; more on a rank whose main thread spins in Python), and the report has the frames of
    each rank's main thread anyway."""
    try:
        import torch._C._distributed_c10d as c10d

        return list(pickle.loads(c10d._dump_fr_trace(True, False, False)).get("entries", []))
    except Exception:  # no recorder in this torch, or it is off: the report says less, nothing fails
        return []


def _group_id(entry: Dict[str, Any]) -> str:
    return str(entry["process_group"][0])


def _call_site(entry: Dict[str, Any]) -> str:
    """The innermost frame of the program that made the call (not torch's own)."""
    frames = [f for f in entry.get("frames") or [] if f"{os.sep}torch{os.sep}" not in f.get("filename", "")]
    return f"{frames[0]['filename']}:{frames[0]['line']}" if frames else "?"


def describe(entry: Dict[str, Any]) -> str:
    """``all_reduce #12 (Float[4, 8]) at train.py:88`` (the call site when the entry has frames)."""
    name = str(entry.get("profiling_name", "?")).split(":")[-1]
    dtypes = entry.get("input_dtypes") or []
    sizes = entry.get("input_sizes") or []
    what = f"{dtypes[0] if dtypes else ''}{sizes[0]}" if sizes else ""
    at = f" at {_call_site(entry)}" if entry.get("frames") else ""
    return f"{name} #{entry['collective_seq_id']}" + (f" ({what})" if what else "") + at


def group_ranks(group: str) -> List[int]:
    """The world ranks of torch's group named ``group`` (the world when torch does not say)."""
    import torch.distributed as dist

    world = list(range(dist.get_world_size())) if dist.is_initialized() else []
    try:
        for pg, name in dist.distributed_c10d._world.pg_names.items():
            if str(name) == group:
                return list(dist.get_process_group_ranks(pg))
    except Exception:  # a private table of torch's: the world is the safe answer
        return world
    return world


def collectives(group: str) -> List[Dict[str, Any]]:
    """This rank's recorded collectives of ``group`` (torch's group name), in call order."""
    return [e for e in entries() if _group_id(e) == group and not e.get("is_p2p")]


def latest() -> Optional[Dict[str, Any]]:
    """This rank's newest recorded collective, in any group: the one a timeout came from, when the
    error came out of torch.distributed (torch retires a gloo collective that failed, as one that
    finished: the flag cannot tell them apart)."""
    own = [e for e in entries() if not e.get("is_p2p")]
    return max(own, key=lambda e: e.get("time_created_ns", 0)) if own else None


def group_state(group: str, seq: int) -> Dict[str, Any]:
    """Where this rank is relative to collective ``seq`` of ``group``, in the shape of
    :func:`hpcsync.observe.watchdog.digest`'s ``state`` and ``last`` fields, plus the call itself."""
    ops = collectives(group)
    last = ops[-1] if ops else None
    count = last["collective_seq_id"] if last else 0
    this = next((e for e in ops if e["collective_seq_id"] == seq), None)
    state = "never" if count < seq else "inside" if count == seq else "finished"
    created = (last or {}).get("time_created_ns") or 0
    return {"state": state,
            "last": last and {"seq": count, "op": describe(last), "finished": count < seq,
                              "age_s": round(time.time() - created / 1e9, 1) if created else 0.0},
            "call": describe(this) if this is not None else None}
