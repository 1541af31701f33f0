"""torch's own distributed test suite (``DistributedTest._DistTestBase``) on the hpcsync backend.

    torch_suite.py TEMP_DIR [TEST_NAME ...]     (under mpirun; every rank runs the same tests)

As torch runs it for MPI (one process per rank, the default group created once): the suite's
skips follow ``BACKEND=$SUITE_EXPECT`` (default ``mpi``: what an MPI backend is expected to
support; ``gloo`` for gloo's), the default group is hpcsync's. Each rank reports passed / failed / skipped test names; with no names, every test.
"""
import io
import os
import sys
import unittest

temp_dir, names = sys.argv[1], sys.argv[2:]
os.environ.update(BACKEND=os.environ.get("SUITE_EXPECT", "mpi"), TEMP_DIR=temp_dir)

import torch.distributed as dist  # noqa: E402

import hpcsync  # noqa: E402
from _report import report  # noqa: E402

topo = hpcsync.init(backend="hpcsync", timeout=120, abort_on_exception=True)
os.environ["WORLD_SIZE"] = str(topo.world_size)
from torch.testing._internal.common_distributed import TEST_SKIPS  # noqa: E402
from torch.testing._internal.common_utils import TestCase  # noqa: E402
from torch.testing._internal.distributed import distributed_test as dt  # noqa: E402


class Suite(dt.DistributedTest._DistTestBase, TestCase):
    rank = topo.rank

    @property
    def world_size(self):
        return topo.world_size


loader = unittest.TestLoader()
all_names = sorted(n for n in loader.getTestCaseNames(Suite))
dt.Barrier.init() if topo.rank == 0 else None
dist.barrier()
results = {"passed": [], "failed": {}, "skipped": []}
for name in names or all_names:
    if name not in all_names:
        results["failed"][name] = "no such test in this torch"
        continue
    dt.Barrier.barrier_id = 0
    if topo.rank == 0:
        for f in os.listdir(os.path.join(temp_dir, "barrier")):
            os.unlink(os.path.join(temp_dir, "barrier", f))
    dist.barrier()
    res = unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(Suite(name))
    text = "".join(t for _, t in res.failures + res.errors)
    skip_exit = [s.message for s in TEST_SKIPS.values() if text.rstrip().endswith(f"SystemExit: {s.exit_code}")]
    if res.skipped:
        results["skipped"].append(name)
    elif skip_exit:  # torch's multi-process harness skips by exiting with a code (e.g. "needs 2 GPUs")
        results["skipped"].append(name)
        results.setdefault("skip_reasons", {})[name] = skip_exit[0]
    elif res.wasSuccessful():
        results["passed"].append(name)
    else:
        results["failed"][name] = text[-1500:]
        print(f"[rank {topo.rank}] {name} FAILED:\n{results['failed'][name]}", file=sys.stderr, flush=True)
    dist.barrier()
report(topo.rank, {"rank": topo.rank, "world_size": topo.world_size, **results, "total": len(all_names)})
hpcsync.shutdown()
