"""A rank that stops without an exception, or ranks that call different collectives.

    stall.py BACKEND CASE TIMEOUT

CASE: ``stuck`` -- the last rank sleeps before its third all_reduce (line marked STUCK HERE);
``barrier`` -- only rank 0 enters a barrier of ``new_group(timeout=1s)`` (torch's
test_barrier_timeout_full_group); ``count`` / ``dtype`` -- rank 1's all_reduce has one more
element / float64; ``newgroup`` -- the last rank stalls in a group made without ``timeout=``;
``futures`` -- futures of two async all_reduces
behind a stalled rank; ``barrier_opts`` -- only rank 0 enters a barrier with a 1 s per-call timeout; ``allreduce_opts`` (``broadcast_opts``, ``allgather_opts``,
``reducescatter_opts``) -- the same for that blocking collective; ``never_joins`` --
the last rank never creates the group the others create; ``p2p`` -- rank 0's irecv is never
matched; ``local_error`` -- rank 0's all_gather fails on its own argument check (run with
HPCSYNC_DESYNC_CHECK=0); ``report_fails`` -- ``stuck`` on 2 ranks with the hang report made to
raise (an injected fault); ``two_threads`` -- a second thread issues an all_reduce on the same group
while the main thread's is inside MPI, 20 times; ``two_threads_stuck`` -- the same, with the last
rank's main thread stalled; ``exit_in_flight`` -- rank 0 leaves the program with an async
all_reduce the others never join; ``callback_waits`` -- a future callback (on the backend's worker)
waits on the future of an all_reduce queued behind its own. Ranks report what happened (with the abort hook off they raise and go on).
"""
import datetime
import sys
import threading
import time

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

import hpcsync
import hpcsync.observe.watchdog
from _report import report


def _second_thread(entering: threading.Event, delay: float, b: torch.Tensor, into: dict) -> None:
    """Once the main thread is about to enter its all_reduce: another on the same group."""
    entering.wait()
    time.sleep(delay)
    try:
        dist.all_reduce(b)
        into["b"] = b.tolist()
    except Exception as exc:  # noqa: BLE001
        into["error"] = f"{type(exc).__name__}: {exc}"


backend, case, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
topo = hpcsync.init(backend=backend, timeout=timeout)
if case == "report_fails":  # injected fault: building the hang report raises
    def _broken_report(*_args, **_kwargs):
        raise RuntimeError("injected: the hang report cannot be built")

    hpcsync.observe.watchdog.format_report = _broken_report
R, W = topo.rank, topo.world_size
out = {"rank": R, "world_size": W, "results": [], "errors": []}
t = torch.ones(4)
t0 = time.monotonic()
try:
    if case == "stuck":
        for i in range(5):
            if i == 2 and R == W - 1:
                time.sleep(timeout + 8)  # STUCK HERE
            dist.all_reduce(t)
            out["results"].append(t.tolist())
    elif case == "report_fails":
        if R == W - 1:
            time.sleep(timeout + 60)  # STUCK HERE: never joins within the bound
        dist.all_reduce(t)
    elif case in ("two_threads", "two_threads_stuck"):
        # The main thread's all_reduce is inside MPI (the last rank enters it late) when a second
        # thread issues another on the same group: the same order on every rank, two threads at once.
        rounds = 1 if case == "two_threads_stuck" else 20
        for _ in range(rounds):
            a, b = torch.full((1 << 16,), float(R + 1)), torch.full((5,), R + 1, dtype=torch.int64)
            entering, second = threading.Event(), {}
            th = threading.Thread(target=_second_thread, args=(
                entering, timeout / 2 if case == "two_threads_stuck" else 0.05, b, second))
            th.start()
            if R == W - 1:
                time.sleep(timeout + 3 if case == "two_threads_stuck" else 0.2)  # STUCK HERE (stuck case)
            entering.set()
            try:
                dist.all_reduce(a)
                first = {"a": sorted(set(a.tolist()))}
            except Exception as exc:  # noqa: BLE001
                first = {"a_error": f"{type(exc).__name__}: {exc}"}
            th.join(timeout + 15)
            out["results"].append({**first, **second})
    elif case == "callback_waits":
        first = dist.all_reduce(torch.ones(1 << 22), async_op=True)  # 16 MiB: x and y queue behind it
        x = dist.all_reduce(torch.ones(4), async_op=True)
        y = dist.all_reduce(torch.ones(4), async_op=True).get_future()
        chained = x.get_future().then(lambda _: y.wait())  # runs on the worker: y can never start
        try:
            chained.wait()
            out["results"].append("chained")
        except Exception as exc:  # noqa: BLE001
            out["errors"].append(f"{type(exc).__name__}: {exc}")
        first.wait()
    elif case == "exit_in_flight":
        if R == 0:
            dist.all_reduce(torch.ones(1 << 18), async_op=True)  # never waited for, never joined
            out["results"].append("left")
        else:
            time.sleep(1)
    elif case == "async":  # DDP-style: queued async operations behind one that never completes
        big = [torch.ones(1 << 18) for _ in range(2)]  # 1 MiB each: run by the group's worker thread
        if R == W - 1:
            time.sleep(timeout + 8)  # STUCK HERE
        works = [dist.all_reduce(b, async_op=True) for b in big]
        for w in works:
            try:
                w.wait()
                out["results"].append("done")
            except Exception as exc:  # noqa: BLE001
                out["errors"].append(f"{type(exc).__name__}: {exc}")
    elif case == "futures":  # futures of queued work behind a stuck operation (DDP's reducer waits on these)
        big = [torch.ones(1 << 18) for _ in range(2)]
        if R == W - 1:
            time.sleep(timeout + 3)  # STUCK HERE
        futs = [dist.all_reduce(b, async_op=True).get_future() for b in big]
        for f in futs:
            try:
                torch.futures.wait_all([f])
                out["results"].append("done")
            except Exception as exc:  # noqa: BLE001
                out["errors"].append(f"{type(exc).__name__}: {exc}")
    elif case == "barrier":
        group = dist.new_group(list(range(W)), timeout=datetime.timedelta(seconds=1))
        if R == 0:
            dist.barrier(group=group)
        else:
            time.sleep(timeout + 5)
    elif case == "newgroup":  # a group made without timeout= follows init's timeout, not torch's 30 min
        g = dist.new_group(list(range(W)))
        if R == W - 1:
            time.sleep(timeout + 3)  # STUCK HERE
        dist.all_reduce(t, group=g)
        out["results"].append(t.tolist())
    elif case == "barrier_opts":  # a per-call timeout (BarrierOptions.timeout) bounds that barrier
        opts = dist.BarrierOptions()
        opts.timeout = datetime.timedelta(seconds=1)
        if R == 0:
            dist.distributed_c10d._get_default_group().barrier(opts).wait()
        else:
            time.sleep(timeout + 5)
    elif case.endswith("_opts"):  # the same for a blocking all_reduce, broadcast, all_gather or reduce_scatter
        opts = {"allreduce": dist.AllreduceOptions, "broadcast": dist.BroadcastOptions,
                "allgather": c10d.AllgatherOptions, "reducescatter": c10d.ReduceScatterOptions}[case[:-5]]()
        opts.timeout = datetime.timedelta(seconds=1)
        opts.asyncOp = False
        pg = dist.distributed_c10d._get_default_group()
        calls = {"allreduce": lambda: pg.allreduce([torch.ones(1024)], opts),
                 "broadcast": lambda: pg.broadcast([torch.ones(1024)], opts),
                 "allgather": lambda: pg._allgather_base(torch.empty(1024 * W), torch.ones(1024), opts),
                 "reducescatter": lambda: pg._reduce_scatter_base(torch.empty(1024), torch.ones(1024 * W), opts)}
        if R == 0:
            calls[case[:-5]]().wait()
        else:
            time.sleep(timeout + 5)
    elif case == "never_joins":  # the last rank never creates the group: creation is bounded too
        if R != W - 1:
            dist.new_group(list(range(W)))
        else:
            time.sleep(timeout + 3)  # STUCK HERE
    elif case == "p2p":  # an irecv nobody matches: a later send still completes; the irecv times out
        if R == 0:
            never = dist.irecv(torch.zeros(2), src=1, tag=7)
            dist.isend(torch.ones(3), dst=1, tag=8).wait()
            out["results"].append("sent")
            never.wait()
        else:
            y = torch.zeros(3)
            dist.recv(y, src=0, tag=8)
            out["results"].append(y.tolist())
            time.sleep(timeout + 3)  # STUCK HERE
    elif case == "local_error":  # rank 0 fails on its own (no desync check to tell the others)
        if R == 0:
            try:
                dist.all_gather_into_tensor(torch.zeros(2 * W - 1), torch.ones(2))
            except ValueError as exc:
                out["errors"].append(f"{type(exc).__name__}: {exc}")
            time.sleep(timeout + 8)
        else:
            dist.all_gather_into_tensor(torch.zeros(2 * W), torch.ones(2))
    else:
        n = 5 if case == "count" and R == 1 else 4
        dtype = torch.float64 if case == "dtype" and R == 1 else torch.float32
        x = torch.ones(n, dtype=dtype)
        dist.all_reduce(x)
        out["results"].append(x.tolist())
except Exception as exc:  # noqa: BLE001 - reported to the test
    out["errors"].append(f"{type(exc).__name__}: {exc}")
    try:  # the group is broken now: it must say so
        dist.all_reduce(torch.ones(1))
    except Exception as again:  # noqa: BLE001
        out["errors"].append(f"{type(again).__name__}: {again}")
out["seconds"] = time.monotonic() - t0
report(R, out)
