"""Ranks that disagree in ways the fingerprint once missed, and integer averages; 2 ranks.

    mismatch.py [CASE ...]

Each case runs on a fresh ``dist.new_group`` (a polled-mode mismatch breaks its group), rank 1
being the odd one out; every rank records its result or error and how long the call took. After
the mismatch cases, a matching all_reduce on the world shows it still works. Ranks that agree but
call different forms of one operation must get the right result, not a false desync.
"""
import sys
import time
import warnings

import torch
import torch.distributed as dist

import hpcsync
from _report import report

warnings.filterwarnings("ignore")  # torch deprecates the coalesced helpers
TIMEOUT = 30
topo = hpcsync.init(backend="hpcsync", timeout=TIMEOUT)
R, W = topo.rank, topo.world_size
assert W == 2
SUM, MAX, AVG = dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG
odd = R == 1


def redop_small(g):
    x = torch.tensor([float(R + 1)])
    dist.all_reduce(x, op=MAX if odd else SUM, group=g)
    return x.tolist()


def redop_async(g):  # 1 MiB, async: the worker thread's path (DDP buckets)
    x = torch.full((1 << 18,), float(R + 1))
    dist.all_reduce(x, op=MAX if odd else SUM, group=g, async_op=True).wait()
    return x[:2].tolist()


def avg_vs_sum(g):
    x = torch.tensor([float(R + 1)] * 3)
    dist.all_reduce(x, op=SUM if odd else AVG, group=g)
    return x.tolist()


def reduce_redop(g):
    x = torch.tensor([float(R + 1)])
    dist.reduce(x, dst=0, op=MAX if odd else SUM, group=g)
    return x.tolist()


def rs_redop(g):
    out = torch.zeros(2)
    dist.reduce_scatter_tensor(out, torch.ones(4) * (R + 1), op=MAX if odd else SUM, group=g)
    return out.tolist()


def coalesced_second_tensor(g):  # the first tensors match; the second differs in size
    ts = [torch.ones(4), torch.ones(5 if odd else 4)]
    dist.all_reduce_coalesced(ts, group=g)
    return [t.tolist() for t in ts]


def gather_coalesced_second(g):  # the first inputs match; the second differs in size
    ins = [torch.ones(2), torch.ones(3 if odd else 2)]
    outs = [[torch.zeros_like(t) for t in ins] for _ in range(W)]
    dist.all_gather_coalesced(outs, ins, group=g)
    return [[t.tolist() for t in row] for row in outs]


def sparse_vs_dense(g):
    dense = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    x = dense.to_sparse() if odd else dense.clone()
    dist.all_reduce(x, group=g)
    return x.to_dense().tolist()


def a2a_bad_splits(g):  # rank 1's input splits add up to 3 rows of its 4
    out = torch.zeros(4)
    dist.all_to_all_single(out, torch.arange(4.0), output_split_sizes=[2, 2],
                           input_split_sizes=[2, 1] if odd else [2, 2], group=g)
    return out.tolist()


def gather_bad_size(g):  # rank 1 passes an output one element short
    out = torch.zeros(2 * 3 - (1 if odd else 0))
    dist.all_gather_into_tensor(out, torch.ones(3), group=g)
    return out.tolist()


def rs_forms(g):  # rank 0 the tensor form, rank 1 the list form: the same MPI call, right data
    inp = torch.arange(4.0) + 10 * R
    out = torch.zeros(2)
    if odd:
        dist.reduce_scatter(out, list(inp.chunk(2)), group=g)
    else:
        dist.reduce_scatter_tensor(out, inp, group=g)
    return out.tolist()


def ag_forms(g):
    inp = torch.tensor([float(R), R + 0.5])
    if odd:
        outs = [torch.zeros(2) for _ in range(W)]
        dist.all_gather(outs, inp, group=g)
        return torch.cat(outs).tolist()
    out = torch.zeros(2 * W)
    dist.all_gather_into_tensor(out, inp, group=g)
    return out.tolist()


def same_buffer_other_layout(g):  # one address and element count, each time another tensor
    base = torch.arange(16.0) + R
    got = []
    x = base.view(4, 4)
    dist.all_reduce(x, group=g)  # contiguous
    got.append(x.reshape(-1).tolist())
    y = base.view(4, 4).t()  # the same address and count, not contiguous: the general path
    y.copy_((torch.arange(16.0).view(4, 4) + R).t())
    dist.all_reduce(y, group=g)
    got.append(y.reshape(-1).tolist())
    z = base.view(torch.int32)  # the same address and count, another dtype
    z.copy_(R - torch.arange(16, dtype=torch.int32))
    dist.all_reduce(z, op=MAX, group=g)
    got.append(z.tolist())
    b = base[:8]  # the same address, another count; broadcast from each root in turn
    for root in range(W):
        b.fill_(R + 1)
        dist.broadcast(b, src=root, group=g)
        got.append(b.tolist())
    return got


def hot_vs_general(g):  # rank 1's tensor is a strided view: the general path on it, the hot one on rank 0
    x = torch.arange(8.0) + R if not odd else torch.zeros(8, 2)[:, 0].copy_(torch.arange(8.0) + R)
    dist.all_reduce(x, group=g)
    out = torch.zeros(2 * W)
    src = torch.tensor([float(R), R + 0.5])
    dist.all_gather_into_tensor(out, src if not odd else torch.stack([src, src], 1)[:, 0], group=g)
    return [x.tolist(), out.tolist()]


def a2a_one_rank_empty(g):  # rank 1 sends and receives nothing, then an all_reduce on the group
    out = torch.zeros(4 if not odd else 0)
    splits = [0, 0] if odd else [4, 0]
    dist.all_to_all_single(out, torch.arange(4.0) if not odd else torch.zeros(0), output_split_sizes=splits,
                           input_split_sizes=splits, group=g)
    x = torch.ones(3)
    dist.all_reduce(x, group=g)
    return [out.tolist(), x.tolist()]


def kept_works(g):  # blocking calls whose Work the caller keeps: each keeps its own outputs
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    a, b = torch.ones(3), torch.full((3,), 2.0)
    wa = g.allreduce([a], opts)
    wb = g.allreduce([b], opts)
    wa.wait()
    wb.wait()
    return [wa.result()[0] is a, wb.result()[0] is b, a.tolist(), b.tolist(),
            wa.get_future().value()[0] is a, wb.get_future().value()[0] is b]


def avg_ints(g):
    got = {}
    for name, dtype, values in (("int8", torch.int8, (100, 100)), ("uint8", torch.uint8, (200, 250)),
                                ("int32", torch.int32, (-3, 0)), ("int64", torch.int64, (2**62 + 1, 2**62 + 4)),
                                ("int64_min", torch.int64, (-2**63, -2**63 + 1))):
        x = torch.tensor([values[R]] * 3, dtype=dtype)
        dist.all_reduce(x, op=AVG, group=g)
        got[name] = x.tolist()
        big = torch.full((1 << 17,), values[R], dtype=dtype)  # async: the worker's path
        dist.all_reduce(big, op=AVG, group=g, async_op=True).wait()
        got[name + "_async"] = sorted(set(big.tolist()))
    out = torch.zeros(2, dtype=torch.int8)
    dist.reduce_scatter_tensor(out, torch.full((4,), 100 + 10 * R, dtype=torch.int8), op=AVG, group=g)
    got["rs_int8"] = out.tolist()
    y = torch.tensor([7 + R], dtype=torch.int16)
    dist.reduce(y, dst=0, op=AVG, group=g)
    got["reduce_int16_root"] = y.tolist() if R == 0 else None
    return got


def avg_uint64(g):  # refused the same way on every rank, at once
    x = torch.tensor([1, 2], dtype=torch.uint64)
    dist.all_reduce(x, op=AVG, group=g)
    return x.tolist()


CASES = [redop_small, redop_async, avg_vs_sum, reduce_redop, rs_redop, coalesced_second_tensor, gather_coalesced_second,
         sparse_vs_dense, a2a_bad_splits, gather_bad_size, rs_forms, ag_forms, same_buffer_other_layout,
         hot_vs_general, kept_works, a2a_one_rank_empty, avg_ints, avg_uint64]
chosen = [c for c in CASES if not sys.argv[1:] or c.__name__ in sys.argv[1:]]
out = {"rank": R, "world_size": W, "cases": {}}
for case in chosen:
    g = dist.new_group(list(range(W)))
    t0 = time.monotonic()
    entry = {"result": None, "error": None}
    try:
        entry["result"] = case(g)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        entry["error"] = f"{type(exc).__name__}: {exc}"
    entry["seconds"] = time.monotonic() - t0
    out["cases"][case.__name__] = entry
x = torch.ones(2)
dist.all_reduce(x)
out["world_after"] = x.tolist()
report(R, out)
