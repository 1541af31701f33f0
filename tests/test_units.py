"""In process, no mpirun: the backend's pure pieces (fingerprints, aliasing, chunking) and the
gather round schedule."""
import subprocess
import sys
import time

import pytest
import torch

from hpcsync.core import bigmpi as _bigmpi
from hpcsync.backend import buffers, desync
from hpcsync.observe.watchdog import OpRecord


def test_fingerprint_description_and_explanation():
    rec = OpRecord(7, "all_reduce", "float32", (4,), -1, 0.0)
    vec = desync.describe(rec, desync.Call("all_reduce", torch.ones(4)))
    assert vec[0] == 7 and vec[3] == 4 and vec[4] == -1
    other = desync.describe(OpRecord(7, "all_reduce", "float64", (4,), -1, 0.0),
                             desync.Call("all_reduce", torch.ones(4, dtype=torch.float64)))
    assert vec != other and hash(tuple(vec)) != hash(tuple(other))  # a dtype mismatch changes the fingerprint
    assert desync.explain_row(tuple(vec)) == "#7 all_reduce dtype=float32 count=4"
    bc = desync.describe(OpRecord(2, "broadcast", "int64", (3,), 1, 0.0),
                          desync.Call("broadcast", torch.ones(3, dtype=torch.int64), 1))
    assert desync.explain_row(tuple(bc)) == "#2 broadcast dtype=int64 count=3 root=1"
    a2a = desync.describe(OpRecord(3, "all_to_all", "float32", (5,), -1, 0.0), desync.Call("all_to_all", torch.ones(5)))
    assert a2a[3] == -1  # all-to-all counts may differ between ranks: not part of the agreement


def test_fingerprint_tells_apart_what_makes_different_mpi_calls():
    """Reduce op, sparse vs dense, every tensor of a multi-tensor call, invalid arguments: each
    changes the description; the hot path's row equals the general path's for one dense tensor."""
    rec = OpRecord(1, "all_reduce", "float32", (4,), -1, 0.0)
    SUM, MAX = int(torch.distributed.ReduceOp.SUM), int(torch.distributed.ReduceOp.MAX)
    x = torch.ones(4)

    def row(*args, **kw):
        return tuple(desync.describe(rec, desync.Call("all_reduce", *args, **kw)))

    base = row(x, -1, SUM)
    assert base == desync.hot_vector(1, "all_reduce", torch.float32, 4, -1, SUM)
    assert base == row(x, -1, SUM, tensors=[x])  # a list of one tensor is the same call
    assert row(x, -1, MAX) != base and "op=MAX" in desync.explain_row(row(x, -1, MAX))
    assert row(x.to_sparse(), -1, SUM) != base
    assert row(x, -1, SUM, tensors=[x, torch.ones(4)]) != row(x, -1, SUM, tensors=[x, torch.ones(5)])
    assert row(x, -1, SUM, tensors=[x, torch.ones(4)]) != row(x, -1, SUM, tensors=[x, torch.ones(4, dtype=torch.int32)])
    bad = row(x, -1, SUM, invalid=ValueError("no"))
    assert bad != base and "invalid arguments" in desync.explain_row(bad)
    assert desync.redop_id(torch.distributed.ReduceOp.MAX) == MAX


def test_integer_average_is_exact_at_the_type_limits():
    for dtype in (torch.int8, torch.uint8, torch.int32, torch.int64):
        info = torch.iinfo(dtype)
        for n, values in ((2, (info.max, info.max)), (3, (info.min, info.min, info.min)), (2, (info.min, info.max)),
                          (2, (-3, 0)), (4, (info.max, 1, info.max, 2))):
            if info.min == 0 and min(values) < 0:
                continue
            xs = [torch.tensor([v], dtype=dtype) for v in values]
            got = buffers.avg_result(sum(buffers.avg_parts(x, n) for x in xs), dtype, n).item()
            total = sum(values)
            assert got == abs(total) // n * (1 if total >= 0 else -1), (dtype, values, got)  # trunc toward 0


def test_overlap_detects_shared_bytes_only():
    base = torch.arange(10.0)
    assert buffers.overlap(base[:6], base[4:])
    assert not buffers.overlap(base[:5], base[5:])
    assert not buffers.overlap(base, torch.arange(10.0))
    assert buffers.overlap(base[::2], base[1::2])  # strided views of one storage: treated as aliased
    assert not buffers.overlap(base[:0], base)


def test_chunks_cover_every_element_within_c_int_counts(monkeypatch):
    monkeypatch.setattr(buffers, "CHUNK_ELEMS", 4)
    assert buffers.chunk_spans(10) == [(0, 4), (4, 4), (8, 2)]
    assert buffers.chunk_spans(0) == [(0, 0)]  # one empty call: every rank still takes part


def test_staged_half_precision_reduces_in_float32_and_writes_back():
    t = torch.tensor([1.5, 2.25], dtype=torch.bfloat16)
    s = buffers.Staged(t, reduce=True)
    assert s.t.dtype == torch.float32 and s.copied
    s.t.mul_(2)
    s.finish()
    assert t.tolist() == [3.0, 4.5]
    c = torch.arange(6.0).reshape(2, 3).t()  # not contiguous: staged, then copied back
    s = buffers.Staged(c)
    assert s.t.is_contiguous() and s.copied


def test_gather_rounds_split_the_budget_and_finish():
    rounds = list(_bigmpi.schedule([10, 0, 3, 25], round_bytes=8))
    assert all(sum(r) <= 8 for r in rounds)
    assert [sum(r[i] for r in rounds) for i in range(4)] == [10, 0, 3, 25]
    assert len(rounds) == 5  # ceil(38 / 8): unused shares are handed to the ranks with data left
    assert list(_bigmpi.schedule([0, 0])) == []


def test_one_name_per_concept():
    """hpcsync.topology / preemption / requeue / monitor are each a function, whatever was imported
    first (their modules live in their packages); a module has one import path, its own (the old
    names before the packages are gone, no finder rewrites a spec); ``comm`` and ``h5`` are the
    package's attributes the docs show; group= is the name of "the ranks taking part" everywhere."""
    import importlib
    import inspect
    import sys
    import types

    import hpcsync
    import hpcsync.core.comm
    import hpcsync.core.topology
    import hpcsync.data.filesync
    import hpcsync.observe.monitor
    import hpcsync.resilience.preemption as p
    import hpcsync.resilience.requeue

    for name, module in (("topology", "core"), ("preemption", "resilience"), ("requeue", "resilience"),
                         ("monitor", "observe")):
        fn = getattr(hpcsync, name)
        assert isinstance(fn, types.FunctionType), name
        assert fn is getattr(importlib.import_module(f"hpcsync.{module}.{name}"), name), name
    assert p.PreemptionGuard is hpcsync.PreemptionGuard and hpcsync.resilience.requeue.EXIT_RESTARTS_SPENT == 75
    assert hpcsync.topology().world_size == 1
    assert hpcsync.comm is hpcsync.core.comm and hpcsync.h5 is importlib.import_module("hpcsync.data.h5")
    assert not any(type(f).__module__.startswith("hpcsync") for f in sys.meta_path), sys.meta_path
    for old in ("errors", "bounded", "filesync", "staging", "checkpoint", "lightning", "supervisor", "settings"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"hpcsync.{old}")
        assert not hasattr(hpcsync, old), old
    for name in ("topology", "preemption", "requeue", "monitor"):  # still functions after all those imports
        assert isinstance(getattr(hpcsync, name), types.FunctionType), name
    from hpcsync import h5

    for fn in (hpcsync.PreemptionGuard, hpcsync.Checkpoints, hpcsync.resilience.requeue.requeue, hpcsync.stage,
               hpcsync.data.filesync.merge_parts, h5.CollectiveWriter, hpcsync.core.comm.all_gather):
        params = inspect.signature(fn).parameters
        assert "group" in params and "comm" not in params, fn


def test_a_module_reloads_under_its_own_name():
    """``importlib.reload`` (a notebook's ``%autoreload``) of any hpcsync module keeps its name and
    its relative imports: the old-path finder renamed a module's spec, and a reload of
    hpcsync.core.bounded after ``import hpcsync.bounded`` raised ModuleNotFoundError."""
    import subprocess
    import sys

    code = """
import importlib, pkgutil, hpcsync
names = sorted(m.name for m in pkgutil.walk_packages(hpcsync.__path__, "hpcsync."))
skip = {"hpcsync.resilience.lightning", "hpcsync.__main__"}  # needs Lightning; runs the command line
for name in names:
    if name in skip:
        continue
    module = importlib.import_module(name)
    assert module.__spec__.name == name, (name, module.__spec__.name)
    again = importlib.reload(module)
    assert again is module and again.__name__ == name and again.__spec__.name == name, name
print(len(names))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) > 60, out.stdout


def test_a_stuck_background_call_is_named_and_does_not_hold_the_exit():
    """A pipeline's reader or writer thread stuck in a call (a hung disk): the wait for it ends
    after its deadline with Stalled naming what it did, and the process still exits at once (a
    concurrent.futures worker would be joined at exit: the process would hang for ever)."""
    code = (
        "import threading, time\n"
        "from hpcsync.core.worker import Stalled, Worker, result\n"
        "w = Worker('stuck')\n"
        "fut = w.submit(threading.Event().wait)\n"
        "t0 = time.monotonic()\n"
        "try:\n"
        "    result(fut, 0.5, lambda: 'writing /x/f.bin')\n"
        "except Stalled as exc:\n"
        "    print('stalled after', round(time.monotonic() - t0, 1), exc)\n"
        "w.shutdown()\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "writing /x/f.bin: no progress for 0.5 s" in proc.stdout, proc.stdout
    assert time.monotonic() - t0 < 20


def test_an_owned_duplicate_is_freed_when_its_block_ends(tmp_path):
    """``bounded.owned`` frees the private duplicate it made when the ``with`` block ends, by an
    exception too; a communicator it was given back as it is stays; after a timeout the duplicate
    is kept (its barrier is still in flight) and the process says so (2 ranks, Open MPI)."""
    from launch import openmpi, run

    res = run(openmpi(), 2, "owned.py", tmp_path=tmp_path, timeout=60, expect_ok=False)
    for d in res.ranks:
        assert d is not None and d["gathered"] == [0, 1], res
        assert d["freed_after_block"] and d["freed_after_exception"] and d["world_kept"], d
        assert d["self_given_back"] and d["self_kept"], d
    assert res.ranks[0]["timed_out"] and res.ranks[0]["kept_after_timeout"], res.ranks[0]


def test_a_checkpoint_root_owner_that_has_ended_or_is_ending_holds_nothing():
    """A job's rank 0 that is a zombie (its launcher has not reaped it) or still dying when its
    launcher returns is not a job that still runs: a rerun right after a failed job must get the
    root (found by tests/test_everyday.py: 'in use by process N, which is still running')."""
    import os
    import signal

    from hpcsync.resilience import root_owner

    def record(pid):
        return {"slurm_job": None, "host": __import__("socket").gethostname(), "pid": pid,
                "start": root_owner.start_ticks(pid)}

    zombie = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    job = record(zombie.pid)  # while it runs
    assert job["start"] is not None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and open(f"/proc/{zombie.pid}/stat").read().split(") ")[1][0] != "Z":
        time.sleep(0.01)
    try:
        assert root_owner.job_running(job) is False
    finally:
        zombie.wait()
    ending = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                               "time.sleep(0.8)"])
    try:
        time.sleep(0.3)
        job = record(ending.pid)
        os.kill(ending.pid, signal.SIGTERM)  # ignored: it ends on its own 0.5 s later
        t0 = time.monotonic()
        assert root_owner.job_running(job) is False and time.monotonic() - t0 < root_owner.ENDING_WAIT_S + 1
    finally:
        ending.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.2)
        assert root_owner.job_running(record(alive.pid)) is True
    finally:
        alive.kill()
        alive.wait()


def test_what_runs_before_an_abort_is_bounded_and_one_stuck_flush_holds_back_no_other(monkeypatch):
    """A flush to a disk that stopped answering must not keep a rank from aborting (nothing would
    end the job), nor keep the held-back warnings from being printed."""
    import threading
    import time

    from hpcsync.core import jobend

    stuck, done = threading.Event(), threading.Event()
    monkeypatch.setattr(jobend, "_before_abort", [])
    jobend.before_abort(stuck.wait)  # never set: the hung disk
    jobend.before_abort(done.set)
    caller = threading.Thread(target=jobend.run_before_abort, args=(0.5,), daemon=True)
    t0 = time.monotonic()
    caller.start()
    caller.join(10)
    took = time.monotonic() - t0
    stuck.set()
    assert not caller.is_alive() and took < 3, f"run_before_abort still waiting after {took:.1f} s"
    assert done.is_set(), "the second function was held back by the first"


def test_the_programs_line_is_not_a_library_frame_nor_pythons_own():
    """An error raised in hpcsync's code below a ``contextlib`` context manager: the report's line
    is the program's, not ``contextlib.py`` (a stage said ``contextlib.py:81``)."""
    import os
    import sys

    from hpcsync.observe import digest, watchdog

    library = os.path.join(watchdog.LIBRARY_DIRS[0], "_fake_stage.py")
    code = compile("import contextlib\n@contextlib.contextmanager\ndef held():\n    yield\n"
                   "    raise RuntimeError('stage failed')\n", library, "exec")
    space: dict = {}
    exec(code, space)
    try:
        with space["held"]():
            pass
    except RuntimeError:
        tb = sys.exc_info()[2]
    where = digest._where(tb)
    assert where.startswith(__file__ + ":"), where
