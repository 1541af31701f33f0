"""One job of a run's life on ROOT: hpcsync.Checkpoints operations in order, every rank a "node"
of its own on this host (hostname ``fake<R>``, node-local folder ``LOCAL/fake<R>``).

    ckpt_runs.py ROOT LOCAL OP...

OP: ``local:STEP=V`` (a sharded save with ``local_dir``, ``shared_every=0``: the nodes only),
``root:STEP=V`` (a sharded save into ROOT, no ``local_dir``), ``plain:STEP=V`` (the rank-0 form),
``load`` (with ``local_dir``: ``{"step", "v", "from"}``, None, or ``{"error"}``). V goes into the
sharded state (its bytes), ``shared`` and ``local``. A save's error is recorded and the job goes on.
``HPCSYNC_TEST_FAULTS``: faults (``_fault.py``) injected first; ``HPCSYNC_TEST_STUCK=MODE``: on rank 1,
the node-local disk stops answering the copies' code (hpcsync.resilience.peer_transfer) at its first
``open`` of a file there in MODE (``xb``: a copy received on save; ``rb``: a read on load), which
never returns; ``HPCSYNC_TEST_CKPT_TIMEOUT``: the Checkpoints' timeout. Each rank reports its results, each op's seconds and its node's copies.
"""
import json
import os
import socket
import sys
import time

import torch

import hpcsync
from _fault import inject_faults
from _report import report

root, local = sys.argv[1], sys.argv[2]
topo = hpcsync.init(backend="gloo", timeout=120)
R = topo.rank
socket.gethostname = lambda: f"fake{R}"  # (after init: hpcsync's own view of the nodes is per rank)
inject_faults(json.loads(os.environ.get("HPCSYNC_TEST_FAULTS", "[]")), R)
timeout = float(os.environ["HPCSYNC_TEST_CKPT_TIMEOUT"]) if os.environ.get("HPCSYNC_TEST_CKPT_TIMEOUT") else None
here = os.path.join(local, f"fake{R}")
if os.environ.get("HPCSYNC_TEST_STUCK") and R == 1:
    import builtins
    import threading

    real_open, stuck_mode = builtins.open, os.environ["HPCSYNC_TEST_STUCK"]

    def stuck_open(file, mode="r", *args, **kwargs):
        if mode == stuck_mode and str(file).startswith(here) and \
                sys._getframe(1).f_globals.get("__name__") == "hpcsync.resilience.peer_transfer":
            threading.Event().wait()  # a disk that stopped answering: this call never returns
        return real_open(file, mode, *args, **kwargs)

    builtins.open = stuck_open


def state(value: str = "") -> dict:
    return {"v": torch.tensor(list(value.ljust(8).encode()), dtype=torch.uint8)}


def checkpoints(form: str) -> hpcsync.Checkpoints:
    options = {"local_dir": here, "shared_every": 0, "replicas": 1} if form in ("local", "load") else {}
    return hpcsync.Checkpoints(root, keep=2, timeout=timeout, **options)


out = {"rank": R, "world_size": topo.world_size, "results": [], "seconds": []}
for op in sys.argv[3:]:
    form, _, item = op.partition(":")
    t0 = time.monotonic()
    try:
        if form == "load":
            template = state()
            got = checkpoints(form).load(sharded=template)
            result = got and {"step": got.step, "v": bytes(template["v"].tolist()).decode().strip(),
                              "shared": got.shared, "local": got.local, "from": (got.read or {}).get("from", "root")}
        else:
            step, value = item.split("=")
            if form == "plain":
                path = checkpoints(form).save(int(step), shared={"v": value}, local={"v": value})
            else:
                path = checkpoints(form).save(int(step), shared={"v": value}, local={"v": value},
                                              sharded=state(value))
            result = {"saved": os.path.basename(path)}
    except hpcsync.CheckpointError as exc:
        result = {"error": str(exc)}
    out["seconds"].append(time.monotonic() - t0)
    out["results"].append(result)
out["copies"] = sorted(n for d in (os.listdir(here) if os.path.isdir(here) else [])
                       for n in os.listdir(os.path.join(here, d)) if n.startswith("step-"))
report(R, out)
hpcsync.shutdown()
