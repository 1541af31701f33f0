"""Drawn (seeded) helper calls, one per rank per case: every rank draws the same cases, so each
knows what every rank calls. The case's outcome on this rank is written down, not judged here
(tests/test_comm.py judges: the same helper and root everywhere gives the right result, anything
else the same ValueError on every rank, at once).

    comm_pairs.py SEED CASES [torch]

Modes of a case: every rank the same helper and root; the same helper, roots drawn per rank;
each rank a helper of its own; every rank the same helper and a root out of range. Roots are
drawn mostly in range, sometimes not (the size, -1).
"""
import random
import sys
import time

import hpcsync
from hpcsync import comm
from _report import report

seed, cases = int(sys.argv[1]), int(sys.argv[2])
if len(sys.argv) > 3 and sys.argv[3] == "torch":
    hpcsync.init(backend="gloo", timeout=60)
rank, size = comm.get_rank(), comm.get_world_size()
HELPERS = ["synchronize", "all_gather", "gather", "broadcast_object", "shared_random_seed", "reduce_dict"]
ROOTED = ("gather", "broadcast_object")
rng = random.Random(seed)


def root() -> int:
    return rng.randrange(size) if rng.random() < 0.85 else rng.choice([size, -1])


def draw() -> list:
    mode = rng.choice(["same", "same helper", "any", "out of range"])
    first = rng.choice(ROOTED if mode == "out of range" else HELPERS)
    calls = []
    r0 = rng.choice([size, size + 3, -1]) if mode == "out of range" else root()
    for _ in range(size):
        h = first if mode != "any" else rng.choice(HELPERS)
        calls.append([h, (r0 if mode in ("same", "out of range") else root()) if h in ROOTED else None])
    return calls


def payload(r: int, case: int) -> dict:
    return {"case": case, "rank": r, "blob": "x" * (97 * r + case)}


def call(h: str, root_: int, case: int):
    p = payload(rank, case)
    if h == "synchronize":
        return comm.synchronize()
    if h == "all_gather":
        return comm.all_gather(p)
    if h == "gather":
        return comm.gather(p, dst=root_)
    if h == "broadcast_object":
        return comm.broadcast_object(p, src=root_)
    if h == "shared_random_seed":
        return comm.shared_random_seed()
    return comm.reduce_dict({"x": float(rank + case), "n": rank + case}, average=False)


def expected(h: str, root_: int, case: int):
    if h == "synchronize":
        return None
    if h == "all_gather":
        return [payload(r, case) for r in range(size)]
    if h == "gather":
        return [payload(r, case) for r in range(size)] if rank == root_ else []
    if h == "broadcast_object":
        return payload(root_, case)
    total = sum(r + case for r in range(size))
    return {"x": float(total), "n": total}


out = {"rank": rank, "world_size": size, "cases": []}
for case in range(cases):
    calls = draw()
    h, root_ = calls[rank]
    t0 = time.monotonic()
    seed_ = None
    try:
        got = call(h, root_, case)
        if h == "shared_random_seed":  # the same on every rank: the test compares them
            ok, seed_ = type(got) is int and 0 <= got < 2**31, got
        else:
            ok = got == expected(h, root_, case) and (h != "reduce_dict" or type(got["n"]) is int)
        outcome = "ok" if ok else f"wrong: {got!r}"[:300]
    except Exception as exc:  # noqa: BLE001 - what the rank saw is the result
        outcome = f"{type(exc).__name__}: {exc}"
    out["cases"].append({"calls": calls, "outcome": outcome, "seed": seed_, "took": time.monotonic() - t0})
report(rank, out)
