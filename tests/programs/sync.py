"""sync_file / SyncedFile on parts the test prepared (or writes here); report result or error.
``_fault``: faults to inject (``_fault.py``); ``_uncaught``: let the error escape."""
import csv
import json
import os
import resource
import sys
from dataclasses import asdict

import hpcsync
from hpcsync import comm
from _fault import inject_faults
from _report import report

target = sys.argv[1]  # options: JSON in argv[2], or in $HPCSYNC_TEST_SYNC_OPTS (what crosses a node's shell)
opts = json.loads(sys.argv[2] if len(sys.argv) > 2 else os.environ.get("HPCSYNC_TEST_SYNC_OPTS", "{}"))
mode = opts.pop("_mode", "sync_file")
if opts.pop("_init", False):
    hpcsync.init(backend="gloo", timeout=60)
rank, size = comm.get_rank(), comm.get_world_size()
inject_faults(opts.pop("_fault", []), rank)  # see _fault.py
uncaught = opts.pop("_uncaught", False)  # let the error escape (the abort hook's failure report)
opts.update(opts.pop("_rank1", {}) if rank == 1 else {})  # a rank that diverges
opts.pop("_rank1", None)
if opts.pop("_chdir_per_rank", False):  # "/proc/self/cwd/..." then names another file on every rank
    os.chdir(os.path.join(os.path.dirname(target), f"cwd{rank}"))
if opts.pop("_target_per_rank", False):
    target = target.replace(".csv", f".{rank}.csv")
out = {"rank": rank, "world_size": size}
try:
    if mode == "synced_file":
        fail_rank = opts.pop("_fail_rank", None)
        with hpcsync.SyncedFile(target, **opts) as part:
            out["part"] = part.path
            with open(part.path, "w", newline="", encoding="utf-8") as f:
                w = csv.writer(f)
                w.writerow(["rank", "i", "text"])
                for i in range(rank + 1):
                    w.writerow([rank, i, f"rång {rank}·{i}"])
            if rank == fail_rank:
                raise KeyError("boom inside the block")
        res = part.result
    elif mode == "sync_part":
        res = hpcsync.sync_file(target, opts.pop("part"), **opts)
    else:
        res = hpcsync.sync_file(target, **opts)
    out.update(ok=True, result=asdict(res))
except (hpcsync.SyncError, KeyError) as exc:
    out.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    if uncaught:
        report(rank, out)
        raise
out["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
report(rank, out)
sys.exit(0 if out["ok"] else 3)
