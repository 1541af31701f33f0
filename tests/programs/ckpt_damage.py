"""Damaged checkpoints, many cases in one job: save, damage one file, load, judge.

    ckpt_damage.py FORM SEED CASES BASE

FORM ``rank0`` (shared= and local=) or ``sharded`` (sharded= with a DTensor, a replicated tensor
and a plain value, plus shared= and local=). Two runs are saved once each under BASE ("A", the
one loaded, and "B", another run's root of the same structure), steps 1, 2, 3 with known contents.
Then for each case (drawn from SEED and the case's number, the same on every rank): rank 0 copies
run A's root, applies one damage to one file of one checkpoint (``flip`` 1-3 bytes, ``truncate``,
same-size ``garbage``, ``delete``, ``swap-step``: exchanged with the same file of another step,
``swap-run``: replaced by run B's file of the same step), and every rank loads from a fresh
Checkpoints. Each rank judges what it got: ``right`` (bitwise equal to what was saved at the
newest step left whole), ``error`` (a CheckpointError, though a whole checkpoint was left) or
``wrong`` (anything else: another state, another step, another exception). Then two fixed
checks: every checkpoint damaged (the error must say "damaged" and name the file) and
``load(step=N)`` of a damaged step. Each rank reports its outcomes by case.
"""
import os
import random
import shutil
import sys
import time
import zlib

import torch

import hpcsync
from _report import report

form, seed, cases, base = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
topo = hpcsync.init(backend="gloo", timeout=60)
R, W = topo.rank, topo.world_size
from mpi4py import MPI  # noqa: E402

comm = MPI.COMM_WORLD
KINDS = ["flip", "truncate", "garbage", "delete", "swap-step", "swap-run"]
STEPS = [1, 2, 3]
mesh = None
if form == "sharded":
    from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor  # noqa: E402

    mesh = init_device_mesh("cpu", (W,))


def values(*key, n=16):
    g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    return torch.randn(n, generator=g)


def states(run, step, rank):
    """(shared, local, sharded) as saved by ``run`` at ``step`` on ``rank`` (sharded: full tensors)."""
    shared = {"w": values(run, step, "shared", n=64), "step": step, "run": run}
    local = {"rank": rank, "x": values(run, step, "local", rank)}
    sharded = {"w": values(run, step, "w", n=8 * W), "rep": values(run, step, "rep", n=8), "n": step * 10 + ord(run)}
    return shared, local, sharded


def as_dtensors(full):
    return {"w": distribute_tensor(full["w"], mesh, [Shard(0)]), "rep": full["rep"].clone(), "n": full["n"]}


def save_run(root, run):
    ckpts = hpcsync.Checkpoints(root, keep=3, timeout=30)
    for step in STEPS:
        shared, local, sharded = states(run, step, R)
        if form == "sharded":
            ckpts.save(step, shared=shared, local=local, sharded=as_dtensors(sharded))
        else:
            ckpts.save(step, shared=shared, local=local)


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            bytes(a.contiguous().view(torch.uint8).reshape(-1).tolist()) == \
            bytes(b.contiguous().view(torch.uint8).reshape(-1).tolist())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def load(root, step=None):
    """What this rank got: ("loaded", step, equal-to-saved) or ("error", message) or ("other", repr)."""
    ckpts = hpcsync.Checkpoints(root, keep=3, timeout=30)
    try:
        if form == "sharded":
            template = {"w": distribute_tensor(torch.zeros(8 * W), mesh, [Shard(0)]), "rep": torch.zeros(8), "n": -1}
            got = ckpts.load(step, sharded=template)
        else:
            got = ckpts.load(step)
    except hpcsync.CheckpointError as exc:
        return ("error", str(exc))
    except Exception as exc:
        return ("other", f"{type(exc).__name__}: {exc}")
    if got is None:
        return ("other", "None: no checkpoint at all")
    shared, local, sharded = states("A", got.step, R)
    ok = same(got.shared, shared) and same(got.local, local)
    if form == "sharded":
        want = as_dtensors(sharded)
        ok = ok and same(template["w"].to_local(), want["w"].to_local()) and same(template["rep"], want["rep"]) \
            and template["n"] == want["n"] and isinstance(template["w"], DTensor)
    return ("loaded", got.step, ok)


def files_of(folder):
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


def read(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def damage(rng, root, other):
    """Rank 0: one drawn damage; ``(description, the steps whose files changed)``."""
    step = rng.choice(STEPS)
    folder = os.path.join(root, f"step-{step:08d}")
    name = rng.choice(files_of(folder))
    kind = rng.choice(KINDS)
    path = os.path.join(folder, name)
    touched = {step: [path]}
    data = read(path)
    before = {p: read(p) for p in [path]}
    if kind == "flip":
        buf = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            if buf:
                buf[rng.randrange(len(buf))] ^= rng.randint(1, 255)
        with open(path, "wb") as f:
            f.write(bytes(buf))
    elif kind == "truncate":
        os.truncate(path, rng.randrange(len(data)) if data else 0)
    elif kind == "garbage":
        with open(path, "wb") as f:
            f.write(bytes(rng.getrandbits(8) for _ in range(len(data))))
    elif kind == "delete":
        os.remove(path)
    elif kind == "swap-step":
        to = rng.choice([s for s in STEPS if s != step])
        theirs = os.path.join(root, f"step-{to:08d}", name)
        before[theirs] = read(theirs)
        touched[to] = [theirs]
        if before[theirs] is None:  # (another step without that file: a move)
            os.rename(path, theirs)
        else:
            os.rename(path, path + ".swap")
            os.rename(theirs, path)
            os.rename(path + ".swap", theirs)
    else:  # swap-run: run B's file of the same step
        theirs = os.path.join(other, f"step-{step:08d}", name)
        os.remove(path)
        if os.path.exists(theirs):
            shutil.copyfile(theirs, path)
    changed = sorted(s for s, paths in touched.items() if any(read(p) != before[p] for p in paths))
    return f"{kind} {os.path.basename(folder)}/{name}", changed


def judge(got, expected):
    if expected is None:
        return "right" if got[0] == "error" and "damaged" in got[1] else "wrong"
    if got[0] == "loaded":
        return "right" if got[1] == expected and got[2] else "wrong"
    return "error" if got[0] == "error" else "wrong"


A, B = os.path.join(base, "A"), os.path.join(base, "B")
t0 = time.monotonic()
save_run(A, "A")
save_run(B, "B")
out = {"rank": R, "world_size": W, "form": form, "seed": seed, "cases": [], "save_s": time.monotonic() - t0}
t0 = time.monotonic()
for case in range(cases):
    rng = random.Random(f"{seed}-{case}")
    root = os.path.join(base, f"case{case}")
    what = None
    if R == 0:
        shutil.copytree(A, root)
        what = damage(rng, root, B)
    what, changed = comm.bcast(what, root=0)
    expected = max((s for s in STEPS if s not in changed), default=None)
    got = load(root)
    out["cases"].append({"case": case, "damage": what, "changed": changed, "expected": expected,
                         "got": list(got), "outcome": judge(got, expected)})
    comm.Barrier()
    if R == 0:
        shutil.rmtree(root)
out["cases_s"] = time.monotonic() - t0

# nothing whole left: each step's biggest file overwritten with same-size garbage
special = {}
root = os.path.join(base, "all")
biggest = None
if R == 0:
    shutil.copytree(A, root)
    for step in STEPS:
        folder = os.path.join(root, f"step-{step:08d}")
        names = [n for n in files_of(folder) if n != "COMPLETE"]
        biggest = max(names, key=lambda n: (os.path.getsize(os.path.join(folder, n)), n))
        size = os.path.getsize(os.path.join(folder, biggest))
        with open(os.path.join(folder, biggest), "wb") as f:
            f.write(random.Random(step).randbytes(size))
biggest = comm.bcast(biggest, root=0)
special["all"] = {"file": biggest, "got": list(load(root))}
# load(step=3) of a damaged step 3 (its biggest file); step 2 still loads
root = os.path.join(base, "step")
if R == 0:
    shutil.copytree(A, root)
    with open(os.path.join(root, "step-00000003", biggest), "r+b") as f:
        f.seek(5)
        first = f.read(1)
        f.seek(5)
        f.write(bytes([first[0] ^ 0xFF]))
comm.Barrier()
special["step3"] = list(load(root, 3))
special["step2"] = list(load(root, 2))
out["special"] = special
report(R, out)
