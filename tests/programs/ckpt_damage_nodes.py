"""Damaged node-local checkpoints, many cases in one job: save, damage, load, judge.

    ckpt_damage_nodes.py SEED CASES BASE

Every rank is a node of its own on this host (hostname ``fake<R>``), ``local_dir`` ``LOCAL/fake<R>``,
``replicas=1`` (each node holds every file: its ranks' and a copy of the other's), steps 1 and 2
also copied into the root (``to_root=True``), step 3 on the nodes only. Two runs are saved once each under
BASE ("A", the one loaded, and "B", another run of the same structure), steps 1, 2, 3 (a DTensor,
a replicated tensor, a plain value, shared= and local=). Then for each case (drawn from SEED and
the case's number, the same on every rank) rank 0 copies run A's root and node folders (renamed
for the case's root), and damages one file of one checkpoint: in one node's copy (``one``), the
same file in every node's copy (``both``), or, with the node copies removed, in the root
(``root``), with one damage: ``flip`` 1-3 bytes, ``truncate``, same-size ``garbage``, ``delete``,
``swap-step`` (exchanged with the same file of another step), ``swap-run`` (replaced by run B's
file of the same step). Every rank asks ``latest()`` and then loads, from fresh Checkpoints, and
judges what it got:
``right`` (bitwise what was saved at the newest step left whole: in the root, or on the nodes,
some node's whole copy of each file), ``error`` (a CheckpointError though a whole one was left) or ``wrong`` (anything else).
Then: every step's biggest file damaged on every node (a CheckpointError saying "damaged" and
naming it). Each rank reports its outcomes by case.
"""
import os
import random
import shutil
import socket
import sys
import time
import zlib

import torch

import hpcsync
from _report import report

seed, cases, base = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
topo = hpcsync.init(backend="gloo", timeout=60)
R, W = topo.rank, topo.world_size
socket.gethostname = lambda: f"fake{R}"  # (after init: hpcsync's own view of the nodes is per rank)
from mpi4py import MPI  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard, distribute_tensor  # noqa: E402

comm = MPI.COMM_WORLD
KINDS = ["flip", "truncate", "garbage", "delete", "swap-step", "swap-run"]
WHERE = ["one"] * 5 + ["both"] * 3 + ["root"] * 2
STEPS = [1, 2, 3]
IN_ROOT = [1, 2]  # the steps also copied into the root (to_root=True); 3 is on the nodes only
NODES = [f"fake{r}" for r in range(W)]
mesh = init_device_mesh("cpu", (W,))


def values(*key, n=16):
    g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    return torch.randn(n, generator=g)


def states(run, step, rank):
    shared = {"w": values(run, step, "shared", n=64), "step": step, "run": run}
    local = {"rank": rank, "x": values(run, step, "local", rank)}
    sharded = {"w": values(run, step, "w", n=8 * W), "rep": values(run, step, "rep", n=8), "n": step * 10 + ord(run)}
    return shared, local, sharded


def as_dtensors(full):
    return {"w": distribute_tensor(full["w"], mesh, [Shard(0)]), "rep": full["rep"].clone(), "n": full["n"]}


def checkpoints(root, local):
    return hpcsync.Checkpoints(root, keep=3, timeout=30, local_dir=os.path.join(local, f"fake{R}"), replicas=1,
                               shared_every=0)


def node_dir(root, local, node):
    """A node's folder of ``root``'s copies (named as hpcsync.resilience.node_copies.base names it)."""
    return os.path.join(local, node, f"hpcsync-{os.path.basename(root)}-{zlib.crc32(root.encode()):08x}")


def save_run(root, local, run):
    ckpts = checkpoints(root, local)
    for step in STEPS:
        shared, local_state, sharded = states(run, step, R)
        ckpts.save(step, shared=shared, local=local_state, sharded=as_dtensors(sharded), to_root=step in IN_ROOT)


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            bytes(a.contiguous().view(torch.uint8).reshape(-1).tolist()) == \
            bytes(b.contiguous().view(torch.uint8).reshape(-1).tolist())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def load(root, local, step=None):
    """("loaded", step, equal-to-saved, from, peer bytes) or ("error", message) or ("other", repr)."""
    template = {"w": distribute_tensor(torch.zeros(8 * W), mesh, [Shard(0)]), "rep": torch.zeros(8), "n": -1}
    try:
        got = checkpoints(root, local).load(step, sharded=template)
    except hpcsync.CheckpointError as exc:
        return ("error", str(exc))
    except Exception as exc:
        return ("other", f"{type(exc).__name__}: {exc}")
    if got is None:
        return ("other", "None: no checkpoint at all")
    shared, local_state, sharded = states("A", got.step, R)
    want = as_dtensors(sharded)
    ok = same(got.shared, shared) and same(got.local, local_state) and isinstance(template["w"], DTensor) and \
        same(template["w"].to_local(), want["w"].to_local()) and same(template["rep"], want["rep"]) and \
        template["n"] == want["n"]
    read = got.read or {}
    return ("loaded", got.step, ok, read.get("from", "root"), read.get("peers", 0))


def files_of(folder):
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


def read(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def step_dirs(parent):
    """{step: its folder} of the checkpoints in ``parent`` (a root, or a node's folder)."""
    out = {}
    for name in os.listdir(parent):
        if name.startswith("step-") and os.path.isfile(os.path.join(parent, name, "COMPLETE")):
            out[int(name.split(".")[0][5:])] = os.path.join(parent, name)
    return out


def hurt(rng, kind, folders, other, step, name):
    """Damage ``name`` of ``folders[step]`` with ``kind``; the paths it touched."""
    path = os.path.join(folders[step], name)
    data = read(path)
    touched = [path]
    if kind == "flip":
        buf = bytearray(data)
        for _ in range(rng.randint(1, 3)):
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
        theirs = os.path.join(folders[rng.choice([s for s in sorted(folders) if s != step])], name)
        touched.append(theirs)
        if read(theirs) is None:  # (another step without that file: a move)
            os.rename(path, theirs)
        else:
            os.rename(path, path + ".swap")
            os.rename(theirs, path)
            os.rename(path + ".swap", theirs)
    else:  # swap-run: run B's file of the same step
        theirs = os.path.join(other[step], name)
        os.remove(path)
        if os.path.exists(theirs):
            shutil.copyfile(theirs, path)
    return touched


def whole(changed, dirs, names, where):
    """The steps left whole: in the root, each of its files unchanged there; on the nodes (not
    in a ``root`` case: they are removed), each file unchanged on some node whose marker is."""
    out = []
    for step in STEPS:
        in_root = step in dirs["root"] and not any(p.startswith(dirs["root"][step] + os.sep) for p in changed)
        usable = [n for n in NODES if os.path.join(dirs[n][step], "COMPLETE") not in changed]
        on_nodes = where != "root" and all(any(os.path.join(dirs[n][step], f) not in changed for n in usable)
                                           for f in names[step])
        if in_root or on_nodes:
            out.append(step)
    return out


def copy_case(root, local):
    shutil.copytree(A, root)
    for node in NODES:
        shutil.copytree(node_dir(A, LA, node), node_dir(root, local, node))


def damage(rng, root, local):
    """Rank 0: one drawn damage; ``(description, the steps left whole)``."""
    where, kind = rng.choice(WHERE), rng.choice(KINDS)
    step = rng.choice(IN_ROOT if where == "root" else STEPS)
    dirs = {"root": step_dirs(root), **{n: step_dirs(node_dir(root, local, n)) for n in NODES}}
    names = {s: files_of(dirs[NODES[0]][s]) for s in STEPS}  # (every node holds every file)
    if where == "root":
        for node in NODES:
            shutil.rmtree(node_dir(root, local, node))
        targets, other = ["root"], step_dirs(B)
        names = {s: files_of(dirs["root"][s]) for s in IN_ROOT}
    else:
        targets = [rng.choice(NODES)] if where == "one" else NODES
        other = None
    name = rng.choice(files_of(dirs[targets[0]][step]))
    before, changed = {}, set()
    for t in targets:
        theirs = other if other is not None else step_dirs(node_dir(B, LB, t))
        paths = [os.path.join(dirs[t][s], name) for s in dirs[t]]
        for p in paths:
            before[p] = read(p)
        hurt(rng, kind, dirs[t], theirs, step, name)
        changed |= {p for p in paths if read(p) != before[p]}
    desc = f"{kind} {where} {'+'.join(targets)} step-{step}/{name}"
    return desc, whole(changed, dirs, names, where)


def judge(got, expected):
    if expected is None:
        return "right" if got[0] == "error" and "damaged" in got[1] else "wrong"
    if got[0] == "loaded":
        return "right" if got[1] == expected and got[2] else "wrong"
    return "error" if got[0] == "error" else "wrong"


A, B = os.path.join(base, "A"), os.path.join(base, "B")
LA, LB = os.path.join(base, "local-A"), os.path.join(base, "local-B")
t0 = time.monotonic()
save_run(A, LA, "A")
save_run(B, LB, "B")
out = {"rank": R, "world_size": W, "seed": seed, "cases": [], "save_s": time.monotonic() - t0}
t0 = time.monotonic()
for case in range(cases):
    rng = random.Random(f"{seed}-{case}")
    root, local = os.path.join(base, f"case{case}"), os.path.join(base, f"local{case}")
    what = None
    if R == 0:
        copy_case(root, local)
        what = damage(rng, root, local)
    what, left = comm.bcast(what, root=0)
    expected = max(left, default=None)
    try:
        latest = checkpoints(root, local).latest()  # (from the markers: before the load reads the bytes)
    except hpcsync.CheckpointError as exc:
        latest = f"error: {exc}"
    got = load(root, local)
    out["cases"].append({"case": case, "damage": what, "expected": expected, "got": list(got), "latest": latest,
                         "outcome": judge(got, expected)})
    comm.Barrier()
    if R == 0:
        shutil.rmtree(root)
        shutil.rmtree(local)
out["cases_s"] = time.monotonic() - t0

# nothing whole left: each step's biggest file overwritten with same-size garbage on every node
root, local = os.path.join(base, "all"), os.path.join(base, "local-all")
biggest = None
if R == 0:
    copy_case(root, local)
    shutil.rmtree(root)  # (the root's copies too: nothing whole anywhere)
    os.makedirs(root)
    for name in os.listdir(A):  # (the root's own records: its owner, run, counter)
        if not name.startswith("step-") and not name.startswith("."):
            src = os.path.join(A, name)
            (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, os.path.join(root, name))
    for node in NODES:
        for step, folder in step_dirs(node_dir(root, local, node)).items():
            names = [n for n in files_of(folder) if n != "COMPLETE"]
            biggest = max(names, key=lambda n: (os.path.getsize(os.path.join(folder, n)), n))
            size = os.path.getsize(os.path.join(folder, biggest))
            with open(os.path.join(folder, biggest), "wb") as f:
                f.write(random.Random(step).randbytes(size))
biggest = comm.bcast(biggest, root=0)
out["special"] = {"all": {"file": biggest, "got": list(load(root, local))}}
report(R, out)
