"""torch's own distributed test suite (``DistributedTest._DistTestBase``, torch 2.13) on hpcsync.

Run as torch runs it for MPI: 3 ranks under mpirun, one process per rank, the default group
created once (hpcsync's), with the suite's expectations for an MPI backend; with
``HPCSYNC_TEST_LONG=1`` also with gloo's (which enables more tests: sparse all_reduce, barrier
timeouts, monitored_barrier, ...; those have their own tests in test_backend and test_faults).
"""
import os

import pytest

from launch import openmpi, run

# Different on purpose, not bugs: the backend's name, and torch allowing monitored_barrier on
# gloo alone by name (hpcsync.monitored_barrier is the MPI one).
EXPECTED = {"mpi": {"test_get_backend"},
            "gloo": {"test_get_backend", "test_monitored_barrier_gloo", "test_monitored_barrier_gloo_subgroup",
                     "test_monitored_barrier_gloo_rank_0_timeout"}}


@pytest.mark.parametrize("expect", ["mpi"] + (["gloo"] if os.environ.get("HPCSYNC_TEST_LONG") == "1" else []))
def test_torch_distributed_suite(expect, tmp_path):
    temp = tmp_path / "suite"
    (temp / "barrier").mkdir(parents=True)
    (temp / "test_dir").mkdir()
    # gloo's expectations include timeout tests that break a subgroup on purpose: the ranks raise
    # (abort hook off) and the job ends non-zero at exit, after every rank has reported
    res = run(openmpi(), 3, "torch_suite.py", str(temp), tmp_path=tmp_path, timeout=900, expect_ok=False,
              env={"SUITE_EXPECT": expect, "HPCSYNC_ABORT_ON_EXCEPTION": "0"})
    assert all(d is not None and d["world_size"] == 3 for d in res.ranks), res
    for d in res.ranks:
        assert "test_get_backend" in d["failed"]
        assert set(d["failed"]) <= EXPECTED[expect], {k: v[-800:] for k, v in d["failed"].items()}
        assert len(d["passed"]) >= (90 if expect == "mpi" else 86), len(d["passed"])
        assert d["total"] == len(d["passed"]) + len(d["skipped"]) + len(d["failed"])
    if expect == "gloo":
        passed = set(res.ranks[0]["passed"])
        assert {"test_sparse_all_reduce_sum", "test_barrier_timeout_full_group",
                "test_all_reduce_sum", "test_DistributedDataParallelCPU"} <= passed, sorted(passed)
    print(f"[torch suite, {expect} expectations] " + ", ".join(
        f"{k}: {len(res.ranks[0][k])}" for k in ("passed", "skipped", "failed")) + f" of {res.ranks[0]['total']}")
