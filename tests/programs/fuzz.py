"""Generated programs on the hpcsync backend, checked against numpy, with an optional fault.

    fuzz.py FIRST COUNT [FAULT]

Runs seeds FIRST .. FIRST+COUNT-1. Every rank builds the same program of ~50 operations from the
seed (collectives, point-to-point, object helpers; sizes 0 to ~1 MiB; several dtypes; sync and
async, waited out of order; a sub-group) and computes every rank's inputs itself, so it checks
each result against a numpy reference without communicating. Inputs are small integers: sums,
products and averages are exact in every dtype, so results must be *equal*. One seed in four
also runs a second program in a second thread, on a group of its own (not at THREAD_FUNNELED,
where only the main thread may call MPI). The job runs at the thread level it asks for
(``MPI4PY_RC_THREAD_LEVEL``).

FAULT (one rank, the last, at one operation chosen by the seed): ``op`` / ``dtype`` / ``count`` /
``redop`` / ``root``, or ``mix`` (one of these by seed) (a mismatch: every rank of the group must raise the same error at that
operation and the job goes on with the next seed on fresh groups); ``skip`` / ``extra`` /
``sleep`` / ``raise`` (the job may end: with the same error on every rank, or a report and an
abort, or the exit's abort of a group left with an operation no rank will join, within the
timeout plus a slack). Each rank reports, per seed, the checks that failed (a
wrong result: must never happen), the error it ended with and at which operation.
"""
import random
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

import hpcsync
from _report import report

TIMEOUT = 8
first, count = int(sys.argv[1]), int(sys.argv[2])
fault = sys.argv[3] if len(sys.argv) > 3 else None
topo = hpcsync.init(backend="hpcsync", timeout=TIMEOUT)
R, W = topo.rank, topo.world_size
from mpi4py import MPI  # noqa: E402  (after hpcsync chose the library; the thread level: MPI4PY_RC_THREAD_LEVEL)
ODD = W - 1  # the rank that misbehaves

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.int8, torch.bfloat16]
REDUCE = {"SUM": dist.ReduceOp.SUM, "MAX": dist.ReduceOp.MAX, "MIN": dist.ReduceOp.MIN,
          "PRODUCT": dist.ReduceOp.PRODUCT, "AVG": dist.ReduceOp.AVG, "BAND": dist.ReduceOp.BAND,
          "BOR": dist.ReduceOp.BOR, "BXOR": dist.ReduceOp.BXOR}
KINDS = ["all_reduce", "all_reduce", "broadcast", "all_gather", "all_gather_list", "reduce_scatter", "reduce",
         "gather", "scatter", "all_to_all", "barrier", "p2p_ring", "objects"]


def is_int(dtype):
    return not dtype.is_floating_point


def values(seed, i, rank, n, dtype, lo=-3, hi=3):
    """Rank ``rank``'s input of operation ``i``: small integers, exact in every dtype."""
    g = np.random.default_rng([seed, i, rank])
    lo = 1 if dtype == torch.bfloat16 and lo < 0 else lo  # keep bfloat16 products exact as well
    return torch.from_numpy(g.integers(lo, hi + 1, size=n)).to(dtype)


def generate(seed, members):
    """The program: a list of operation specs, the same on every rank."""
    rng = random.Random(seed)
    ops = []
    for i in range(rng.randint(30, 60)):
        kind = rng.choice(KINDS)
        dtype = rng.choice(DTYPES)
        n = rng.choice([0, 1, 3, 17, 1000, 4096]) if rng.random() < 0.9 else rng.choice([1 << 16, 1 << 18])
        on_sub = len(members) > 1 and kind not in ("p2p_ring",) and rng.random() < 0.25
        ranks = members if on_sub else list(range(W))
        ops_ok = ["SUM", "MAX", "MIN", "PRODUCT", "AVG"] + (["BAND", "BOR", "BXOR"] if is_int(dtype) else [])
        if kind == "reduce_scatter":
            ops_ok = ["SUM", "MAX", "MIN", "AVG"]
        ops.append({"i": i, "kind": kind, "dtype": dtype, "n": n, "redop": rng.choice(ops_ok),
                    "root": rng.choice(ranks), "ranks": ranks, "sub": on_sub, "async": rng.random() < 0.4,
                    "splits": [[rng.randint(0, 3) for _ in ranks] for _ in ranks]})
    return ops


def reference_reduce(xs, redop, dtype):
    """What the backend must return, computed as it computes: integers exactly, bfloat16 in
    float32 and rounded once, other floats in their own dtype (the sums are exact)."""
    wide = torch.int64 if is_int(dtype) else torch.float32 if dtype == torch.bfloat16 else dtype
    stack = torch.stack([x.to(wide) for x in xs])
    if redop == "SUM":
        out = stack.sum(0)
    elif redop == "PRODUCT":
        out = stack.prod(0)
    elif redop == "MAX":
        out = stack.amax(0)
    elif redop == "MIN":
        out = stack.amin(0)
    elif redop == "AVG":
        total = stack.sum(0)
        out = torch.div(total, len(xs), rounding_mode="trunc") if is_int(dtype) else total / len(xs)
    else:
        f = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[redop]
        out = stack[0]
        for row in stack[1:]:
            out = f(out, row)
    return out.to(dtype)


def run_op(spec, seed, group, gmembers, mutate=None):
    """Issue one operation; return (work or None, check), where check() -> None or a failure."""
    s = dict(spec)
    if mutate:
        s.update(mutate)
    kind, dtype, n, ranks = s["kind"], s["dtype"], s["n"], gmembers
    me = ranks.index(R)
    size = len(ranks)
    x = values(seed, s["i"], R, n, dtype)
    inputs = [values(seed, s["i"], r, n, dtype) for r in ranks]
    asy = s["async"]
    redop = REDUCE[s["redop"]]

    def equal(got, want, what):
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            return f"{kind} #{s['i']} {what}: got {got.tolist()[:6]} want {want.tolist()[:6]} ({dtype}, n={n})"
        return None

    if kind == "all_reduce":
        w = dist.all_reduce(x, op=redop, group=group, async_op=asy)
        return w, lambda: equal(x, reference_reduce(inputs, s["redop"], dtype), s["redop"])
    if kind == "broadcast":
        w = dist.broadcast(x, src=s["root"], group=group, async_op=asy)
        return w, lambda: equal(x, inputs[ranks.index(s["root"])], "root")
    if kind == "all_gather":
        out = torch.empty(n * size, dtype=dtype)
        w = dist.all_gather_single(out, x, group=group, async_op=asy)
        return w, lambda: equal(out, torch.cat(inputs), "into_tensor")
    if kind == "all_gather_list":
        outs = [torch.empty(n, dtype=dtype) for _ in ranks]
        w = dist.all_gather(outs, x, group=group, async_op=asy)
        return w, lambda: equal(torch.cat(outs), torch.cat(inputs), "list")
    if kind == "reduce_scatter":
        big = [values(seed, s["i"], r, n * size, dtype) for r in ranks]
        out = torch.empty(n, dtype=dtype)
        w = dist.reduce_scatter_single(out, big[me], op=redop, group=group, async_op=asy)
        return w, lambda: equal(out, reference_reduce(big, s["redop"], dtype)[me * n:(me + 1) * n], s["redop"])
    if kind == "reduce":
        w = dist.reduce(x, dst=s["root"], op=redop, group=group, async_op=asy)
        return w, lambda: equal(x, reference_reduce(inputs, s["redop"], dtype), s["redop"]) if R == s["root"] else None
    if kind == "gather":
        outs = [torch.empty(n, dtype=dtype) for _ in ranks] if R == s["root"] else None
        w = dist.gather(x, outs, dst=s["root"], group=group, async_op=asy)
        return w, lambda: equal(torch.cat(outs), torch.cat(inputs), "gather") if R == s["root"] else None
    if kind == "scatter":
        root_parts = [values(seed, s["i"] * 1000 + k, s["root"], n, dtype) for k in range(size)]
        out = torch.empty(n, dtype=dtype)
        w = dist.scatter(out, root_parts if R == s["root"] else None, src=s["root"], group=group, async_op=asy)
        return w, lambda: equal(out, root_parts[me], "scatter")
    if kind == "all_to_all":
        sp = s["splits"]  # sp[a][b]: rows group rank a sends to group rank b
        rows = max(n // 64, 1) if n else 0
        send = [values(seed, s["i"] * 7 + 1, r, sum(sp[ranks.index(r)]) * rows, dtype) for r in ranks]
        out = torch.empty(sum(sp[a][me] for a in range(size)) * rows, dtype=dtype)

        def piece(a, b):
            start = sum(sp[a][:b]) * rows
            return send[a][start:start + sp[a][b] * rows]

        w = dist.all_to_all_single(out, send[me], [sp[a][me] * rows for a in range(size)],
                                   [k * rows for k in sp[me]], group=group, async_op=asy)
        return w, lambda: equal(out, torch.cat([piece(a, me) for a in range(size)]), "splits")
    if kind == "barrier":
        return dist.barrier(group=group, async_op=asy), lambda: None
    if kind == "p2p_ring":
        y = torch.empty(n, dtype=dtype)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, ranks[(me + 1) % size], group=group),
                                       dist.P2POp(dist.irecv, y, ranks[(me - 1) % size], group=group)])
        for q in reqs:
            q.wait()
        return None, lambda: equal(y, inputs[(me - 1) % size], "ring")
    if kind == "objects":
        got = [None] * size
        dist.all_gather_object(got, {"rank": R, "n": n, "i": s["i"]}, group=group)
        box = [{"from": s["root"], "i": s["i"]} if R == s["root"] else None]
        dist.broadcast_object_list(box, src=s["root"], group=group)
        want = [{"rank": r, "n": n, "i": s["i"]} for r in ranks]
        return None, lambda: None if got == want and box[0] == {"from": s["root"], "i": s["i"]} else \
            f"objects #{s['i']}: {got} {box}"
    raise AssertionError(kind)


def mutation(kind, spec):
    """What the odd rank changes in its operation for a mismatch fault."""
    if kind == "op":
        return {"kind": "broadcast" if spec["kind"] != "broadcast" else "all_reduce", "root": spec["ranks"][0]}
    if kind == "dtype":
        return {"dtype": torch.float64 if spec["dtype"] != torch.float64 else torch.float32}
    if kind == "count":
        if spec["kind"] == "all_to_all":  # one more row to the group's first rank than it expects
            me = spec["ranks"].index(R)
            return {"splits": [[c + (a == me and b == 0) for b, c in enumerate(row)]
                               for a, row in enumerate(spec["splits"])], "n": max(spec["n"], 64)}
        return {"n": spec["n"] + 1}
    if kind == "redop":
        return {"redop": "MAX" if spec["redop"] != "MAX" else "MIN"}
    if kind == "root":
        return {"root": spec["ranks"][(spec["ranks"].index(spec["root"]) + 1) % len(spec["ranks"])]}
    return None


MISMATCHES = ("op", "dtype", "count", "redop", "root")
_FAULTABLE = {"op": None, "dtype": None, "count": None, "redop": ("all_reduce", "reduce", "reduce_scatter"),
              "root": ("broadcast", "reduce", "gather", "scatter")}


def program(seed, group, sub, members, failures, errors, where, fault_at=None):
    """Run one generated program; ``fault_at``: (index, kind) for the odd rank."""
    ops = generate(seed, members)
    rng = random.Random(seed * 31 + 7)  # when to wait: drawn for every operation, the same on every rank
    order = random.Random(seed * 31 + R)  # the order of a batch of waits: each rank its own
    pending = []  # (work, check)
    done_upto = -1

    def issue(spec):
        g = sub if spec["sub"] else group
        mutate = None
        if fault_at is not None and spec["i"] == fault_at[0] and R == ODD:
            kind = fault_at[1]
            if kind == "extra":
                dist.all_reduce(torch.ones(3), group=g)
            if kind == "sleep":
                time.sleep(TIMEOUT + 6)  # STUCK HERE
            if kind == "raise":
                raise RuntimeError(f"injected fault at operation {spec['i']}")  # escapes: the job must end
            mutate = mutation(kind, spec)
        where[0] = spec["i"]
        pending.append(run_op(spec, seed, g, spec["ranks"], mutate))

    def settle(batch):
        for w, c in batch:
            if w is not None:
                w.wait()
            bad = c()
            if bad:
                failures.append(bad)

    try:
        since = 0  # operations since the last batch of waits, members or not: every rank waits at the same one
        for spec in ops:
            wait_now = rng.random() < 0.5
            since += 1
            if R in spec["ranks"] and not (fault_at == (spec["i"], "skip") and R == ODD):
                issue(spec)
            if wait_now or since > 6:  # wait some, not in issue order
                order.shuffle(pending)
                settle(pending)
                done_upto = spec["i"]
                pending = []
                since = 0
        settle(pending)
    except (dist.DistBackendError, ValueError) as exc:
        errors.append({"at": where[0], "done_upto": done_upto, "error": f"{type(exc).__name__}: {exc}"})


out = {"rank": R, "world_size": W, "seeds": {}}
for seed in range(first, first + count):
    rng = random.Random(seed)
    members = sorted(rng.sample(range(W), rng.randint(1, W)))
    group = dist.new_group(list(range(W)))
    sub = dist.new_group(members)
    failures, errors, where = [], [], [0]
    fault_at = None
    kind = MISMATCHES[seed % len(MISMATCHES)] if fault == "mix" else fault
    if kind:
        ops = generate(seed, members)
        # on the world group (every rank then meets the fault at the same operation), of a kind
        # the fault applies to
        allowed = [s for s in ops if not s["sub"] and W > 1 and s["kind"] not in ("objects", "p2p_ring")
                   and (_FAULTABLE.get(kind) is None or s["kind"] in _FAULTABLE[kind])
                   and not (kind in ("count", "dtype") and s["kind"] == "barrier")]
        fault_at = (random.Random(seed * 17).choice(allowed)["i"], kind) if allowed else None
    second = None
    if seed % 4 == 0 and not fault and MPI.Query_thread() != MPI.THREAD_FUNNELED:
        # a second program, in a second thread, on a group of its own (FUNNELED: no thread but the
        # main one may call MPI, and the backend refuses one that does)
        other = dist.new_group(list(range(W)))
        other_sub = dist.new_group(members)
        f2, e2 = [], []
        second = threading.Thread(target=program, args=(seed + 10**6, other, other_sub, members, f2, e2, [0]))
        second.start()
    t0 = time.monotonic()
    program(seed, group, sub, members, failures, errors, where, fault_at)
    if second is not None:
        second.join()
        failures += f2
        errors += e2
    out["seeds"][str(seed)] = {"failures": failures, "errors": errors, "fault_at": fault_at,
                               "seconds": round(time.monotonic() - t0, 2)}
    for g in (group, sub) + ((other, other_sub) if second is not None else ()):
        if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(g)  # thousands of seeds must not run out of communicators
report(R, out)
