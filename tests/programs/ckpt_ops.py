"""One process, one hpcsync.Checkpoints operation on ROOT, the outcome in rank0.json.

    ckpt_ops.py save ROOT KEEP STEP=VALUE...  save shared={"v": VALUE} for each; report each path and
                                              whether it still exists after the save
    ckpt_ops.py load ROOT                     report the latest: step, v (or None), or the error
    ckpt_ops.py crash ROOT K STEP VALUE MODE  save (MODE sync or background, then wait), but die (os._exit, no clean-up) just before the K-th
                                              filesystem change of the save (rename, replace, rmtree,
                                              makedirs, fsync); report how many there were if it got through
    ckpt_ops.py hold ROOT SECONDS             load, write ROOT.held, sleep (a second job using the root)

MODE sharded or sharded-background: the value goes into a sharded state ({"v": tensor of its
bytes}) instead, and torch.distributed.checkpoint's own filesystem changes count too;
``load-sharded ROOT`` loads such a checkpoint (v decoded back to a string). ``save-local``,
``load-local`` and MODE ``sharded-local``: the same with node-local copies (``local_dir`` ROOT-local,
never into the root).
"""
import os
import shutil
import sys
import time

import hpcsync
from _report import report

op, root = sys.argv[1], sys.argv[2]
out: dict = {"world_size": 1, "op": op}


def sharded(value: str = "") -> dict:
    import torch

    return {"v": torch.tensor(list(value.ljust(8).encode()), dtype=torch.uint8)}


def checkpoints(root, keep=2, local=False):
    return hpcsync.Checkpoints(root, keep=keep, **({"local_dir": root + "-local", "shared_every": 0} if local else {}))


def load(ckpts, as_sharded=False):
    try:
        if as_sharded:
            template = sharded()
            got = ckpts.load(sharded=template)
            return {"step": got.step, "v": bytes(template["v"].tolist()).decode().strip(), "seq": got.seq} if got \
                else None
        got = ckpts.load()
        return {"step": got.step, "v": got.shared["v"], "seq": got.seq} if got else None
    except hpcsync.CheckpointError as exc:
        return {"error": str(exc)}


if op in ("save", "save-sharded", "save-local"):
    ckpts = checkpoints(root, int(sys.argv[3]), op == "save-local")
    out["saved"] = []
    for item in sys.argv[4:]:
        step, value = item.split("=")
        path = ckpts.save(int(step), sharded=sharded(value)) if op != "save" else \
            ckpts.save(int(step), shared={"v": value})
        out["saved"].append([os.path.basename(path), os.path.isdir(path)])
    out["listing"] = sorted(os.listdir(root))
elif op in ("load", "load-sharded", "load-local"):
    out["loaded"] = load(checkpoints(root, local=op == "load-local"), op != "load")
elif op == "crash":
    k, count = int(sys.argv[3]), [0]

    def dying(fn):
        def wrapper(*args, **kwargs):  # counts hpcsync's own calls only (not torch's, not os's recursion)
            if sys._getframe(1).f_globals.get("__name__", "").startswith(counted):
                count[0] += 1
                if count[0] == k:
                    os._exit(9)
            return fn(*args, **kwargs)
        return wrapper

    mode = sys.argv[6]
    counted = ("hpcsync.", "torch.distributed.checkpoint") if mode.startswith("sharded") else ("hpcsync.",)
    ckpts = checkpoints(root, 1, mode == "sharded-local")
    for mod, name in ((os, "rename"), (os, "replace"), (os, "fsync"), (os, "makedirs"), (shutil, "rmtree")):
        setattr(mod, name, dying(getattr(mod, name)))
    if mode.startswith("sharded"):
        ckpts.save(int(sys.argv[4]), sharded=sharded(sys.argv[5]), background=mode == "sharded-background")
    else:
        ckpts.save(int(sys.argv[4]), shared={"v": sys.argv[5]}, background=mode == "background")
    ckpts.wait()
    out["points"] = count[0]
elif op == "hold":
    ckpts = hpcsync.Checkpoints(root)
    out["loaded"] = load(ckpts)
    with open(root + ".held", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(float(sys.argv[3]))
report(0, out)
