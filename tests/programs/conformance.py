"""Conformance matrix of the hpcsync backend: collective x dtype x in-place/out-of-place.

Every rank can build every rank's input (seeded), so each result is checked against a reference
computed locally; where gloo supports the case, the same call on a gloo group (the default group,
initialised by hpcsync.init over a TCP store) must give the same answer.
"""
import itertools
import traceback
import zlib

import torch
import torch.distributed as dist

import hpcsync
from _report import report

topo = hpcsync.init(backend="gloo", timeout=120)
R, W = topo.rank, topo.world_size
ours = dist.new_group(list(range(W)), backend="hpcsync")
gloo = dist.group.WORLD
assert ours._get_backend_name() == "hpcsync" if hasattr(ours, "_get_backend_name") else True

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
ALL = FLOATS + INTS + [torch.bool, torch.complex64]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"]
SHAPE = (3, 5)


def make(rank, dtype, case, shape=SHAPE, small=False):
    g = torch.Generator().manual_seed(zlib.crc32(f"{rank}/{dtype}/{case}".encode()))  # same on every rank
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype) * (1 + 1j)
    if dtype.is_floating_point:
        x = torch.rand(shape, generator=g, dtype=torch.float32)
        return (0.5 + x if small else x * 4 - 2).to(dtype)
    lo, hi = (1, 3) if small else (0, 9)
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def op_ok(op, dtype):
    if op in ("BAND", "BOR", "BXOR"):
        return dtype in INTS or dtype == torch.bool
    if op in ("AVG", "PREMUL_SUM"):
        return dtype in FLOATS
    if dtype.is_complex:
        return op == "SUM"
    return True


def ref_reduce(op, xs):
    xs = [x.to(torch.float64) if x.dtype in (torch.float16, torch.bfloat16, torch.float32) else x for x in xs]
    if xs[0].dtype == torch.bool:
        table = {"SUM": torch.logical_or, "MAX": torch.logical_or, "BOR": torch.logical_or, "MIN": torch.logical_and,
                 "PRODUCT": torch.logical_and, "BAND": torch.logical_and, "BXOR": torch.logical_xor}
        return list(itertools.accumulate(xs, table[op]))[-1]
    if op in ("SUM", "AVG", "PREMUL_SUM"):
        scale = 2.5 if op == "PREMUL_SUM" else 1
        out = sum(x * scale for x in xs)
        return out / len(xs) if op == "AVG" else out
    fn = {"PRODUCT": torch.mul, "MIN": torch.minimum, "MAX": torch.maximum, "BAND": torch.bitwise_and,
          "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
    return list(itertools.accumulate(xs, fn))[-1]


def redop(op):
    if op == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(2.5)
    return getattr(dist.ReduceOp, op)


def close(a, b, dtype):
    wide = torch.complex128 if dtype.is_complex else torch.float64
    a, b = a.to(wide), b.to(wide)
    if dtype in (torch.float16, torch.bfloat16):
        return torch.allclose(a, b, rtol=2e-2, atol=2e-2)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    return torch.equal(a, b)


results = []
TRACE = bool(int(__import__("os").environ.get("CONFORMANCE_TRACE", "0")))


def case(name, fn, dtype, gloo_too=True):
    """fn(group) -> (results, expected) on this rank; checked vs reference, then vs gloo."""
    detail = ""
    try:
        if TRACE:
            print(R, "ours", name, flush=True)
        got, want = fn(ours)
        ok = len(got) == len(want) and all(close(g, w, dtype) for g, w in zip(got, want))
        if not ok:
            detail = f"got {[g.tolist() for g in got]} want {[w.tolist() for w in want]}"
    except Exception:
        ok, detail = False, traceback.format_exc()[-800:]
    agree = torch.tensor([int(ok)])
    dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=ours)  # run gloo on all ranks or on none
    gloo_status = "n/a"
    if agree.item() and gloo_too:
        try:
            if TRACE:
                print(R, "gloo", name, flush=True)
            gg, _ = fn(gloo)
            if all(close(a, b, dtype) for a, b in zip(got, gg)):
                gloo_status = "same"
            elif not all(close(a, b, dtype) for a, b in zip(gg, want)):
                gloo_status = "gloo deviates from the reference (ours matches it)"
            else:
                gloo_status = "DIFFERENT"
        except (RuntimeError, ValueError, TypeError) as exc:
            gloo_status = f"unsupported: {str(exc).splitlines()[0][:80]}"
        if gloo_status == "DIFFERENT":
            ok, detail = False, f"gloo gave {[x.tolist() for x in gg]}, ours {[x.tolist() for x in got]}"
    results.append({"case": name, "ok": ok, "gloo": gloo_status, "detail": detail[:500]})
    dist.barrier(group=ours)


for dtype in ALL:
    dn = str(dtype).replace("torch.", "")
    for op in OPS:
        if not op_ok(op, dtype):
            continue
        small = op == "PRODUCT"

        def allreduce(g, op=op, dtype=dtype, small=small):
            x = make(R, dtype, "ar" + op, small=small)
            dist.all_reduce(x, op=redop(op), group=g)
            return [x], [ref_reduce(op, [make(r, dtype, "ar" + op, small=small) for r in range(W)])]

        # gloo: no AVG / PREMUL_SUM; compare with the reference only
        case(f"all_reduce/{op}/{dn}", allreduce, dtype, gloo_too=op not in ("AVG", "PREMUL_SUM"))

    def allreduce_noncontig(g, dtype=dtype):
        base = make(R, dtype, "nc", shape=(5, 6))
        x = base.t()[1:4]  # a strided, non-contiguous view: results must land in it
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=g)
        want = ref_reduce("MAX", [make(r, dtype, "nc", shape=(5, 6)).t()[1:4] for r in range(W)])
        return [x, base.t()[0]], [want, make(R, dtype, "nc", shape=(5, 6)).t()[0]]

    if not dtype.is_complex:
        case(f"all_reduce/noncontiguous/{dn}", allreduce_noncontig, dtype)

    def allreduce_empty(g, dtype=dtype):
        x = torch.zeros(0, dtype=dtype)
        dist.all_reduce(x, group=g)
        return [x], [torch.zeros(0, dtype=dtype)]

    case(f"all_reduce/zero-size/{dn}", allreduce_empty, dtype)

    def broadcast(g, dtype=dtype):
        x = make(R, dtype, "bc")
        dist.broadcast(x, src=W - 1, group=g)
        return [x], [make(W - 1, dtype, "bc")]

    case(f"broadcast/{dn}", broadcast, dtype)

    def all_gather(g, dtype=dtype):
        outs = [torch.zeros(SHAPE, dtype=dtype) for _ in range(W)]
        dist.all_gather(outs, make(R, dtype, "ag"), group=g)
        return outs, [make(r, dtype, "ag") for r in range(W)]

    case(f"all_gather/{dn}", all_gather, dtype)

    for inplace in (False, True):
        def agt(g, dtype=dtype, inplace=inplace):
            out = torch.zeros((W * 3, 5), dtype=dtype)
            inp = out[R * 3:(R + 1) * 3] if inplace else make(R, dtype, "agt")
            if inplace:
                inp.copy_(make(R, dtype, "agt"))
            dist.all_gather_into_tensor(out, inp, group=g)
            return [out], [torch.cat([make(r, dtype, "agt") for r in range(W)])]

        case(f"all_gather_into_tensor/{'in' if inplace else 'out-of'}-place/{dn}", agt, dtype)

    for op in ("SUM", "MAX", "AVG"):
        if not op_ok(op, dtype):
            continue
        for inplace in (False, True):
            def rst(g, dtype=dtype, op=op, inplace=inplace):
                inp = make(R, dtype, "rst" + op, shape=(W * 2, 3))
                out = inp[R * 2:(R + 1) * 2] if inplace else torch.zeros((2, 3), dtype=dtype)
                dist.reduce_scatter_tensor(out, inp, op=redop(op), group=g)
                full = ref_reduce(op, [make(r, dtype, "rst" + op, shape=(W * 2, 3)) for r in range(W)])
                return [out], [full[R * 2:(R + 1) * 2]]

            case(f"reduce_scatter_tensor/{op}/{'in' if inplace else 'out-of'}-place/{dn}", rst, dtype,
                 gloo_too=op != "AVG")

        def rs(g, dtype=dtype, op=op):
            ins = [make(R, dtype, f"rs{op}{k}") for k in range(W)]
            out = torch.zeros(SHAPE, dtype=dtype)
            dist.reduce_scatter(out, ins, op=redop(op), group=g)
            return [out], [ref_reduce(op, [make(r, dtype, f"rs{op}{R}") for r in range(W)])]

        case(f"reduce_scatter/{op}/{dn}", rs, dtype, gloo_too=op != "AVG")

        def red(g, dtype=dtype, op=op):
            x = make(R, dtype, "red" + op)
            dist.reduce(x, dst=0, op=redop(op), group=g)
            want = ref_reduce(op, [make(r, dtype, "red" + op) for r in range(W)]) if R == 0 else make(R, dtype, "red" + op)
            return ([x], [want]) if R == 0 else ([], [])

        case(f"reduce/{op}/{dn}", red, dtype, gloo_too=op != "AVG")

    def gather(g, dtype=dtype):
        outs = [torch.zeros(SHAPE, dtype=dtype) for _ in range(W)] if R == 0 else None
        dist.gather(make(R, dtype, "ga"), outs, dst=0, group=g)
        return (outs, [make(r, dtype, "ga") for r in range(W)]) if R == 0 else ([], [])

    case(f"gather/{dn}", gather, dtype)

    def scatter(g, dtype=dtype):
        out = torch.zeros(SHAPE, dtype=dtype)
        dist.scatter(out, [make(k, dtype, "sc") for k in range(W)] if R == 0 else None, src=0, group=g)
        return [out], [make(R, dtype, "sc")]

    case(f"scatter/{dn}", scatter, dtype)

    def a2a(g, dtype=dtype):
        # rank r sends (k + 1) rows to rank k: unequal sizes
        ins = [make(R, dtype, f"a2a{k}", shape=(k + 1, 2)) for k in range(W)]
        outs = [torch.zeros((R + 1, 2), dtype=dtype) for _ in range(W)]
        dist.all_to_all(outs, ins, group=g)
        return outs, [make(r, dtype, f"a2a{R}", shape=(R + 1, 2)) for r in range(W)]

    case(f"all_to_all/{dn}", a2a, dtype)

    def a2as(g, dtype=dtype):
        inp = make(R, dtype, "a2as", shape=(W * 2, 3))
        out = torch.zeros_like(inp)
        dist.all_to_all_single(out, inp, group=g)
        return [out], [torch.cat([make(r, dtype, "a2as", shape=(W * 2, 3))[R * 2:(R + 1) * 2] for r in range(W)])]

    case(f"all_to_all_single/{dn}", a2as, dtype)

    def a2as_splits(g, dtype=dtype):
        # rank r sends (r + k) % 3 rows to rank k
        ins_split = [(R + k) % 3 for k in range(W)]
        outs_split = [(r + R) % 3 for r in range(W)]
        inp = make(R, dtype, "a2asp", shape=(sum(ins_split), 2))
        out = torch.zeros((sum(outs_split), 2), dtype=dtype)
        dist.all_to_all_single(out, inp, outs_split, ins_split, group=g)
        parts = []
        for r in range(W):
            src = make(r, dtype, "a2asp", shape=(sum((r + k) % 3 for k in range(W)), 2))
            start = sum((r + k) % 3 for k in range(R))
            parts.append(src[start:start + (r + R) % 3])
        return [out], [torch.cat(parts)]

    case(f"all_to_all_single/splits/{dn}", a2as_splits, dtype)


def p2p_ring(g):
    x = torch.full((4,), float(R))
    y = torch.zeros(4)
    if W == 1:
        return [x], [torch.zeros(4)]
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (R + 1) % W, group=g),
                                   dist.P2POp(dist.irecv, y, (R - 1) % W, group=g)])
    for q in reqs:
        q.wait()
    return [y], [torch.full((4,), float((R - 1) % W))]


case("batch_isend_irecv/ring/float32", p2p_ring, torch.float32)


def send_recv_any(g):
    if W == 1:
        return [], []
    if R == 0:
        got = []
        for _ in range(W - 1):
            y = torch.zeros(2, dtype=torch.int64)
            src = dist.recv(y, group=g)
            got.append((src, y.tolist()))
        got.sort()
        return [torch.tensor([s for s, _ in got])], [torch.arange(1, W)]
    dist.send(torch.tensor([R, R * R]), dst=0, group=g)
    return [], []


case("send/recv_anysource/int64", send_recv_any, torch.int64, gloo_too=False)


def objects(g):
    objs = [None] * W
    dist.all_gather_object(objs, {"rank": R, "pad": "x" * (R * 100)}, group=g)
    box = [{"from": R}] if R == W - 1 else [None]
    dist.broadcast_object_list(box, src=W - 1, group=g)
    gathered = [None] * W if R == 0 else None
    dist.gather_object(R * 10, gathered, dst=0, group=g)
    recv = [None]
    dist.scatter_object_list(recv, [f"item{k}" for k in range(W)] if R == 0 else None, src=0, group=g)
    ok = (objs == [{"rank": r, "pad": "x" * (r * 100)} for r in range(W)] and box == [{"from": W - 1}]
          and (R != 0 or gathered == [r * 10 for r in range(W)]) and recv == [f"item{R}"])
    return [torch.tensor(ok)], [torch.tensor(True)]


case("objects/all_gather,broadcast,gather,scatter", objects, torch.bool)


def async_overlap(g):
    xs = [make(R, torch.float32, f"as{k}") for k in range(4)]
    works = [dist.all_reduce(x, group=g, async_op=True) for x in xs]
    futs = [w.get_future() for w in works]
    torch.futures.wait_all(futs)
    for w in works:
        w.wait()
    return xs, [ref_reduce("SUM", [make(r, torch.float32, f"as{k}") for r in range(W)]) for k in range(4)]


case("all_reduce/async_op+futures/float32", async_overlap, torch.float32)


def subgroup(g):
    # odd and even ranks form two groups (new_group over MPI sub-communicators)
    if g is gloo:
        return [], []
    evens, odds = list(range(0, W, 2)), list(range(1, W, 2))
    ge = dist.new_group(evens, backend="hpcsync")
    go = dist.new_group(odds, backend="hpcsync") if odds else None
    mine = evens if R % 2 == 0 else odds
    x = torch.tensor([float(R)])
    dist.all_reduce(x, group=ge if R % 2 == 0 else go)
    return [x], [torch.tensor([float(sum(mine))])]


case("new_group/even-odd/float32", subgroup, torch.float32, gloo_too=False)

dist.barrier()
report(R, {"rank": R, "world_size": W, "results": results})
hpcsync.shutdown()
