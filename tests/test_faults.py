"""When a rank stops without an exception: timeouts, hang reports, desync detection, killed ranks."""
import json
import os
import signal
import socket
import subprocess
import time

import pytest

from launch import LAUNCHERS, PY, ROOT, clean_env, long_run, openmpi, run

pytestmark = pytest.mark.alone  # bounds of wall time: each job must end within its timeout and a margin

PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "stall.py")


@pytest.mark.parametrize("launcher", ["openmpi", "mpich"])
def test_stuck_rank_ends_the_job_with_a_report(launcher, tmp_path):
    """4 ranks, the last sleeps before its 3rd all_reduce: the job ends within timeout + 15 s and
    the report names rank 3, all_reduce #3 and the line where rank 3 sleeps."""
    timeout = 5
    reports = tmp_path / "reports"
    t0 = time.monotonic()
    res = run(LAUNCHERS[launcher](), 4, "stall.py", "hpcsync", "stuck", str(timeout), tmp_path=tmp_path,
              expect_ok=False, env={"HPCSYNC_REPORT_DIR": str(reports)}, timeout=120)
    took = time.monotonic() - t0
    assert res.returncode != 0
    assert took < timeout + 15, took
    err = res.stderr
    assert "HANG REPORT: all_reduce #3 (float32[4])" in err, res
    host = socket.gethostname()
    assert f"never entered #3: rank(s) 3 on {host}" in err and f"inside #3: rank(s) 0-2 on {host}" in err
    assert "rank 3 (" in err and "last operation all_reduce #2 (finished" in err
    assert "STUCK HERE" in err and "time.sleep(timeout + 8)" in err  # rank 3's own line
    assert err.count("HANG REPORT") == 1  # one rank prints it
    files = list(reports.glob("hpcsync-hang-*.json"))
    assert len(files) == 1
    rep = json.loads(files[0].read_text())
    assert rep["never_entered"] == [3] and rep["inside"] == [0, 1, 2] and rep["operation"]["op"] == "all_reduce"
    stuck = [g for g in rep["groups"] if g["rank_list"] == [3]]
    assert len(stuck) == 1 and stuck[0]["state"] == "never" and stuck[0]["nodes"] == [host], rep["groups"]
    assert any("STUCK HERE" in line for line in stuck[0]["stacks"]["main"])  # the full stack, for the JSON
    inside = [g for g in rep["groups"] if g["rank_list"] == [0, 1, 2]]  # one group: same state and line
    assert len(inside) == 1 and inside[0]["state"] == "inside", rep["groups"]
    # where the program is (its all_reduce in stall.py), not how hpcsync's backend waits
    assert "stall.py" in inside[0]["frames"][-1] and str(ROOT / "hpcsync") not in "".join(inside[0]["frames"]), inside


def reports_of_all(res, n):
    """With the abort hook off the ranks raise and report; the job still ends non-zero at exit
    (MPI cannot finalize with a collective in flight), and says so."""
    assert all(d is not None for d in res.ranks), res
    assert res.returncode != 0 and "exiting with a broken process group" in res.stderr, res
    assert {d["world_size"] for d in res.ranks} == {n}


def test_timeout_raises_when_the_abort_hook_is_off(tmp_path):
    timeout = 3
    res = run(openmpi(), 3, "stall.py", "hpcsync", "stuck", str(timeout), tmp_path=tmp_path, expect_ok=False,
              env={"HPCSYNC_ABORT_ON_EXCEPTION": "0", "HPCSYNC_REPORT_DIR": str(tmp_path)}, timeout=120)
    reports_of_all(res, 3)
    for d in res.ranks[:2]:
        assert d["results"] == [[3.0] * 4, [9.0] * 4], d  # two good all_reduces, then the stall
        first, again = d["errors"]
        assert first.startswith("DistBackendError") and "all_reduce #3" in first and "timed out after 3s (the group's timeout is 3s)" in first
        assert again.startswith("DistBackendError") and "group is broken" in again
        assert timeout <= d["seconds"] < timeout + 12
    # the stuck rank wakes after the others gave up: #3's fingerprint completes with the requests
    # they left posted, but its data call was never posted by them (the fingerprint is agreed before
    # the data moves): it times out alone in #3 -- never wrong data
    late = res.ranks[2]
    assert late["errors"] and "all_reduce #3" in late["errors"][0] and "timed out" in late["errors"][0]
    assert late["results"] == [[3.0] * 4, [9.0] * 4]


def test_queued_async_work_fails_fast_after_a_timeout(tmp_path):
    """Two async 1 MiB all_reduces (the worker thread's path, like DDP buckets), one rank absent:
    the first wait times out at the deadline, the queued second one fails at once (broken group)."""
    res = run(openmpi(), 2, "stall.py", "hpcsync", "async", "3", tmp_path=tmp_path, expect_ok=False,
              env={"HPCSYNC_ABORT_ON_EXCEPTION": "0", "HPCSYNC_REPORT_DIR": str(tmp_path)}, timeout=120)
    reports_of_all(res, 2)
    d = res.ranks[0]
    assert len(d["errors"]) >= 2, d
    assert "all_reduce #1" in d["errors"][0] and "timed out after 3s" in d["errors"][0]
    assert "group is broken" in d["errors"][1]
    assert d["seconds"] < 3 + 8


def test_barrier_timeout_full_group(tmp_path):
    """torch's test_barrier_timeout_full_group: new_group(timeout=1s), only rank 0 enters the barrier."""
    res = run(openmpi(), 2, "stall.py", "hpcsync", "barrier", "5", tmp_path=tmp_path, expect_ok=False,
              env={"HPCSYNC_ABORT_ON_EXCEPTION": "0", "HPCSYNC_REPORT_DIR": str(tmp_path)}, timeout=120)
    reports_of_all(res, 2)
    err = res.ranks[0]["errors"][0]
    assert err.startswith("DistBackendError") and "barrier #1" in err and "timed out after 1s (the group's timeout is 1s)" in err
    assert res.ranks[0]["seconds"] < 8
    assert res.ranks[1]["errors"] == []


@pytest.mark.parametrize("debug", ["0", "1"])
@pytest.mark.parametrize("case,differs", [("count", "count=5"), ("dtype", "dtype=float64")])
@pytest.mark.parametrize("launcher", ["openmpi", "mpich"])
def test_mismatched_collectives_raise_on_every_rank(launcher, case, differs, debug, tmp_path):
    """Rank 1 all_reduces 5 elements (or float64) where rank 0 has 4 float32: never wrong data."""
    res = run(LAUNCHERS[launcher](), 2, "stall.py", "hpcsync", case, "30", tmp_path=tmp_path, expect_ok=False,
              env={"HPCSYNC_DEBUG": debug, "HPCSYNC_ABORT_ON_EXCEPTION": "0"}, timeout=120)
    assert all(d is not None for d in res.ranks), res
    for d in res.ranks:
        assert d["results"] == [], d  # no rank returned data
        first = d["errors"][0]
        assert first.startswith("DistBackendError") and "collective mismatch (desync) at operation #1" in first
        assert f"rank(s) 0 on {socket.gethostname()}: #1 all_reduce dtype=float32 count=4" in first and differs in first
        assert d["seconds"] < 10  # found at once, not at the timeout
    assert res.ranks[0]["errors"][0] == res.ranks[1]["errors"][0]  # the same error everywhere


@pytest.mark.parametrize("launcher,case,differs", [("openmpi", "count", "count=5"), ("mpich", "dtype", "dtype=float64")])
def test_mismatched_collectives_raise_before_they_start_in_the_default_mode(launcher, case, differs, tmp_path):
    """Default mode (a timeout aborts the job; operations block inside MPI): the fingerprint is
    agreed before the operation starts, so a mismatch raises on every rank, MPI never sees the
    mismatched buffers, and the group stays usable (the next matching all_reduce works)."""
    res = run(LAUNCHERS[launcher](), 2, "stall.py", "hpcsync", case, "30", tmp_path=tmp_path, timeout=120)
    for d in res.ranks:
        assert d["results"] == [] and len(d["errors"]) == 1, d  # no data returned; the next call worked
        first = d["errors"][0]
        assert first.startswith("DistBackendError") and "collective mismatch (desync) at operation #1" in first
        assert f"rank(s) 0 on {socket.gethostname()}: #1 all_reduce dtype=float32 count=4" in first and differs in first
        assert d["seconds"] < 10
    assert res.ranks[0]["errors"][0] == res.ranks[1]["errors"][0]


def _kill_one_rank(cmd, env, marker, victim_pid_file, timeout=90):
    """Start ``cmd``; when ``victim_pid_file`` exists, SIGKILL that pid; return (rc, seconds after kill)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(victim_pid_file):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the victim never got ready"
        time.sleep(0.05)
    time.sleep(0.5)
    os.kill(int(open(victim_pid_file).read()), signal.SIGKILL)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, time.monotonic() - t0, out + err


def _victim_cmd(launcher, slurm, n, mode, work):
    prog = [PY, os.path.join(os.path.dirname(__file__), "programs", "victim.py"), mode, str(work)]
    if launcher == "srun":
        return ["srun", "--mpi=pmix", "-n", str(n), *prog], clean_env({**slurm, "MPI4PY_MPIABI": "openmpi",
                                                                        "OMPI_MCA_btl": "self,vader"})
    lau = LAUNCHERS[launcher]()
    return [*lau.command(n), *prog], clean_env(lau.env)


@pytest.mark.slurm
@pytest.mark.parametrize("mode", ["collective", "sync"])
@pytest.mark.parametrize("launcher", ["openmpi", "mpich", "srun"])
def test_sigkilled_rank_ends_the_job(launcher, mode, tmp_path, request):
    """SIGKILL one rank inside collectives / during a sync: the job ends non-zero, quickly; a sync
    leaves no target and every part intact."""
    slurm = request.getfixturevalue("slurm") if launcher == "srun" else None
    work = tmp_path / "work"
    work.mkdir()
    cmd, env = _victim_cmd(launcher, slurm, 3, mode, work)
    rc, after_kill, output = _kill_one_rank(cmd, env, mode, str(work / "victim.pid"))
    assert rc != 0, output
    assert after_kill < 30, after_kill
    if mode == "sync":
        assert not (work / "merged.bin").exists()
        parts = sorted((work / ".merged.bin.parts").iterdir())
        assert [p.name for p in parts] == ["rank00000.bin", "rank00001.bin", "rank00002.bin"]
        assert all(p.stat().st_size == 8 << 20 for p in parts)


@long_run
def test_hang_report_of_32_ranks_stays_small(tmp_path):
    """32 ranks, the last stuck: one report of two groups of ranks (ranges, with the node), a few
    lines and a small JSON, not a stack per rank; printed once; the job ends."""
    n, timeout = 32, 2
    host = socket.gethostname()
    t0 = time.monotonic()
    res = run(openmpi(), n, "wide_hang.py", str(timeout), tmp_path=tmp_path, expect_ok=False,
              env={"HPCSYNC_REPORT_DIR": str(tmp_path)}, timeout=180)
    assert res.returncode != 0 and time.monotonic() - t0 < 90, res
    err = res.stderr
    assert err.count("HANG REPORT") == 1, res
    report = err[err.index("[hpcsync] HANG REPORT"):].split("\n[hpcsync] report written")[0].splitlines()
    assert report[1:3] == [f"  never entered #3: rank(s) 31 on {host}", f"  inside #3: rank(s) 0-30 on {host}"], report
    assert f"  rank 31 ({host}): last operation all_reduce #2 (finished" in err and "STUCK HERE" in err
    assert f"  ranks 0-30 ({host}): last operation all_reduce #3 (running" in err
    assert len(report) <= 10, report  # a stack per rank would be ~100 lines
    files = list(tmp_path.glob("hpcsync-hang-*.json"))
    assert len(files) == 1 and files[0].stat().st_size < 40_000, [f.stat().st_size for f in files]
    rep = json.loads(files[0].read_text())
    assert [g["ranks"] for g in rep["groups"]] == ["31", "0-30"] and rep["never_entered_nodes"] == {host: "31"}
    assert rep["timed_out_ranks"] and set(rep["timed_out_ranks"]) <= set(range(31))


_DESYNCS = {  # case -> what the error must say about the two ranks
    "redop_small": ("op=SUM", "op=MAX"), "redop_async": ("op=SUM", "op=MAX"), "avg_vs_sum": ("op=AVG", "op=SUM"),
    "reduce_redop": ("#1 reduce", "op=MAX"), "rs_redop": ("#1 reduce_scatter", "op=MAX"),
    "coalesced_second_tensor": ("tensors=2", "sizes="), "gather_coalesced_second": ("#1 all_gather_coalesced", "sizes="),
    "sparse_vs_dense": ("#1 all_reduce", " sparse"),
}
_INVALID = {"a2a_bad_splits": "split sizes [2, 1] do not add up to its dim 0 (4)",
            "gather_bad_size": "all_gather: the output has 5 elements, expected 6"}


@pytest.mark.parametrize("mode", ["default", "debug", "polled"])
@pytest.mark.parametrize("launcher", ["openmpi", "mpich"])
def test_disagreeing_ranks_get_one_error_never_wrong_data(launcher, mode, tmp_path):
    """Reduce op, multi-tensor, sparse-vs-dense mismatches and one rank's invalid arguments: every
    rank raises at once (no timeout), never returns data; two forms of one operation are no
    mismatch; integer AVG is exact. In each wait mode (default, HPCSYNC_DEBUG=1, polled)."""
    env = {"default": {}, "debug": {"HPCSYNC_DEBUG": "1"}, "polled": {"HPCSYNC_ABORT_ON_EXCEPTION": "0"}}[mode]
    res = run(LAUNCHERS[launcher](), 2, "mismatch.py", tmp_path=tmp_path, env=env, timeout=240,
              expect_ok=mode != "polled")  # polled: a mismatch in flight breaks its group; exit then aborts
    assert all(d is not None for d in res.ranks), res
    r0, r1 = (d["cases"] for d in res.ranks)
    host = socket.gethostname()
    for case, (a, b) in _DESYNCS.items():
        e0, e1 = r0[case]["error"], r1[case]["error"]
        assert e0 == e1 and e0 and e0.startswith("DistBackendError") and "collective mismatch (desync)" in e0, (case, e0, e1)
        assert a in e0 and b in e0 and f"rank(s) 1 on {host}" in e0, (case, e0)
        assert r0[case]["result"] is None and r1[case]["result"] is None
        assert r0[case]["seconds"] < 10 and r1[case]["seconds"] < 10, case  # at once, not at the timeout
    for case, why in _INVALID.items():
        assert r1[case]["error"].startswith("ValueError") and why in r1[case]["error"], (case, r1[case])
        e0 = r0[case]["error"]
        assert e0.startswith("DistBackendError") and f"rank(s) 1 on {host}" in e0 and "invalid arguments" in e0, e0
        assert r0[case]["seconds"] < 10 and r1[case]["seconds"] < 10, case
    assert r0["rs_forms"] == {**r0["rs_forms"], "result": [10.0, 12.0], "error": None}
    assert r1["rs_forms"]["result"] == [14.0, 16.0] and r1["rs_forms"]["error"] is None
    assert r0["ag_forms"]["result"] == r1["ag_forms"]["result"] == [0.0, 0.5, 1.0, 1.5]
    # one address and count, another layout, dtype, count or root each time: the right data, no false desync
    total = [2.0 * k + 1 for k in range(16)]
    transposed = [total[j * 4 + i] for i in range(4) for j in range(4)]
    for d in (r0, r1):
        assert d["same_buffer_other_layout"]["error"] is None, d["same_buffer_other_layout"]
        assert d["same_buffer_other_layout"]["result"] == [total, transposed, list(range(1, -15, -1)), [1.0] * 8,
                                                           [2.0] * 8], d["same_buffer_other_layout"]
        assert d["hot_vs_general"] == {**d["hot_vs_general"], "error": None,
                                       "result": [[2.0 * k + 1 for k in range(8)], [0.0, 0.5, 1.0, 1.5]]}
        assert d["kept_works"]["result"] == [True, True, [2.0] * 3, [4.0] * 3, True, True], d["kept_works"]
    # a rank with nothing to send or receive: Open MPI's non-blocking all_to_all took its two empty
    # buffers (one address) for MPI_IN_PLACE and the next collective hung (polled mode)
    assert r0["a2a_one_rank_empty"]["result"] == [[0.0, 1.0, 2.0, 3.0], [2.0] * 3], r0["a2a_one_rank_empty"]
    assert r1["a2a_one_rank_empty"]["result"] == [[], [2.0] * 3], r1["a2a_one_rank_empty"]
    for d in (r0, r1):
        got = d["avg_ints"]
        assert got["error"] is None, got
        avg = got["result"]
        assert avg["int8"] == [100] * 3 and avg["uint8"] == [225] * 3 and avg["int32"] == [-1] * 3  # trunc(-1.5)
        assert avg["int64"] == [2**62 + 2] * 3 and avg["int64_min"] == [-2**63 + 1] * 3  # sums past int64
        assert avg["int8_async"] == [100] and avg["int64_async"] == [2**62 + 2]
        assert avg["rs_int8"] == [105, 105]
        assert d["avg_uint64"]["error"].startswith("ValueError") and "AVG of uint64" in d["avg_uint64"]["error"]
    assert r0["avg_ints"]["result"]["reduce_int16_root"] == [7]
    assert res.ranks[0]["world_after"] == res.ranks[1]["world_after"] == [2.0, 2.0]


_POLLED = {"HPCSYNC_ABORT_ON_EXCEPTION": "0"}


@pytest.mark.parametrize("launcher", ["openmpi", "mpich"])
def test_groups_made_without_a_timeout_follow_inits(launcher, tmp_path):
    """init(timeout=3), then new_group() without timeout=: its collective times out after 3 s,
    not after torch's default of 30 minutes."""
    res = run(LAUNCHERS[launcher](), 2, "stall.py", "hpcsync", "newgroup", "3", tmp_path=tmp_path, expect_ok=False,
              env={**_POLLED, "HPCSYNC_REPORT_DIR": str(tmp_path)}, timeout=120)
    reports_of_all(res, 2)
    err = res.ranks[0]["errors"][0]
    assert err.startswith("DistBackendError") and "timed out after 3s (the group's timeout is 3s)" in err, err
    assert res.ranks[0]["seconds"] < 3 + 8


def test_a_per_call_barrier_timeout_bounds_the_barrier(tmp_path):
    """BarrierOptions.timeout = 1 s on a group whose timeout is 5 s: the barrier gives up after
    1 s, and says so."""
    res = run(openmpi(), 2, "stall.py", "hpcsync", "barrier_opts", "5", tmp_path=tmp_path, expect_ok=False,
              env={**_POLLED, "HPCSYNC_REPORT_DIR": str(tmp_path)}, timeout=120)
    reports_of_all(res, 2)
    err = res.ranks[0]["errors"][0]
    assert err.startswith("DistBackendError") and "barrier #1" in err and "timed out after 1s" in err, err
    assert res.ranks[0]["seconds"] < 4, res.ranks[0]


@pytest.mark.parametrize("case,call", [("allreduce", "all_reduce #1 (float32[1024])"),
                                       ("broadcast", "broadcast #1 (float32[1024] root=0)"),
                                       ("allgather", "all_gather #1 (float32[1024])"),
                                       ("reducescatter", "reduce_scatter #1 (float32[2048])")])
def test_a_per_call_timeout_bounds_a_blocking_small_collective(case, call, tmp_path):
    """The same for each blocking 4 KiB collective the fast path takes, in a watched group (the
    abort hook on): the job ends with the report after the call's 1 s, not the group's 60 s."""
    t0 = time.monotonic()
    res = run(openmpi(), 2, "stall.py", "hpcsync", f"{case}_opts", "60", tmp_path=tmp_path, expect_ok=False,
              env={"HPCSYNC_REPORT_DIR": str(tmp_path)}, timeout=120)
    assert res.returncode != 0 and time.monotonic() - t0 < 40, res
    assert f"HANG REPORT: {call} in group '0' (ranks 0-1) did not complete within 1 s" in res.stderr, res.stderr[-3000:]


@pytest.mark.parametrize("launcher", ["openmpi", "mpich"])
def test_group_creation_is_bounded_when_a_rank_never_joins(launcher, tmp_path):
    res = run(LAUNCHERS[launcher](), 2, "stall.py", "hpcsync", "never_joins", "3", tmp_path=tmp_path, expect_ok=False,
              env={**_POLLED, "HPCSYNC_REPORT_DIR": str(tmp_path)}, timeout=120)
    assert res.ranks[0] is not None, res
    err = res.ranks[0]["errors"][0]
    assert err.startswith("DistBackendError") and "creating" in err and "timed out after 3s" in err, err
    assert res.ranks[0]["seconds"] < 3 + 8


@pytest.mark.parametrize("launcher", ["openmpi", "mpich"])
def test_ddp_with_the_powersgd_hook_never_waits_on_itself(launcher, tmp_path):
    """PowerSGD's future callbacks issue and wait on all_reduces on the backend's worker thread:
    60 steps with several buckets end, with equal weights on every rank and a falling loss."""
    res = run(LAUNCHERS[launcher](), 2, "powersgd.py", "60", tmp_path=tmp_path, timeout=150)
    for d in res.ranks:
        assert d["same_weights"] and d["finite"] and d["last_loss"] < d["first_loss"], d


@pytest.mark.parametrize("name,value", [("HPCSYNC_DESYNC_CHECK", "0"), ("TORCH_DISTRIBUTED_DEBUG", "DETAIL")])
@pytest.mark.parametrize("launcher", ["openmpi", "mpich"])
def test_settings_that_change_the_mpi_calls_must_agree(launcher, name, value, tmp_path):
    """One rank without the desync check, or in debug mode: every rank's init raises the same
    ValueError naming the ranks, at once, instead of the ranks making different MPI calls."""
    res = run(LAUNCHERS[launcher](), 2, "odd_setting.py", name, value, "last", "catch", tmp_path=tmp_path)
    e0, e1 = res.ranks[0]["error"], res.ranks[1]["error"]
    assert e0 == e1 and e0.startswith("ValueError") and "differs between the ranks" in e0, (e0, e1)
    assert f"rank(s) 0 on {socket.gethostname()}: " in e0 and "rank(s) 1 on" in e0
    assert all(d["seconds"] < 10 for d in res.ranks)


def test_malformed_settings_are_rejected_by_init(tmp_path):
    res = run(openmpi(), 2, "odd_setting.py", "HPCSYNC_ABORT_GRACE", "soon", "all", "catch", tmp_path=tmp_path)
    for d in res.ranks:
        assert d["error"].startswith("SetupError") and "HPCSYNC_ABORT_GRACE='soon'" in d["error"], d
        assert "expected a positive number of seconds" in d["error"] and d["seconds"] < 5


@pytest.mark.slurm
def test_an_error_inside_init_on_one_rank_ends_the_job(slurm, tmp_path):
    """srun without --kill-on-bad-exit does not end a job when one task exits: a malformed setting
    on one task makes every task's init raise the same error (they exchange what each found), said
    once by rank 0, and every task exits."""
    out = tmp_path / "out"
    out.mkdir()
    env = clean_env({**slurm, "HPCSYNC_TEST_OUT": str(out), "MPI4PY_MPIABI": "openmpi", "OMPI_MCA_btl": "self,vader"})
    t0 = time.monotonic()
    proc = subprocess.run(["srun", "--mpi=pmix", "-n", "3", PY, os.path.join(os.path.dirname(__file__), "programs",
                                                                            "odd_setting.py"), "HPCSYNC_TIMEOUT", "-5", "last"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=150)
    took = time.monotonic() - t0
    assert proc.returncode != 0 and took < 60, (took, proc.stderr[-3000:])
    assert "[hpcsync] hpcsync.init() cannot start as asked, on rank 2 of 3:" in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("HPCSYNC_TIMEOUT='-5'") == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not list(out.glob("rank*.json"))  # no rank got past init


@pytest.mark.parametrize("launcher", ["openmpi", "mpich"])
def test_an_unmatched_irecv_holds_up_nothing_and_times_out(launcher, tmp_path):
    """Polled mode: rank 0's unmatched irecv does not delay its later isend; the irecv raises
    DistBackendError at the timeout (it had no deadline), and the group is broken."""
    res = run(LAUNCHERS[launcher](), 2, "stall.py", "hpcsync", "p2p", "3", tmp_path=tmp_path, expect_ok=False,
              env={**_POLLED, "HPCSYNC_REPORT_DIR": str(tmp_path)}, timeout=120)
    assert all(d is not None for d in res.ranks), res
    r0 = res.ranks[0]
    assert r0["results"] == ["sent"] and res.ranks[1]["results"] == [[1.0, 1.0, 1.0]], res
    first, again = r0["errors"][:2]
    assert first.startswith("DistBackendError") and "recv #1 (peer 1)" in first and "timed out after 3s" in first
    assert "group is broken" in again
    assert 3 <= r0["seconds"] < 3 + 8


def test_an_unmatched_irecv_is_reported_and_ends_the_job(tmp_path):
    """Default mode: the stuck receive is reported (which receive, from whom, where each rank is)
    and the job ends."""
    t0 = time.monotonic()
    res = run(openmpi(), 2, "stall.py", "hpcsync", "p2p", "3", tmp_path=tmp_path, expect_ok=False,
              env={"HPCSYNC_REPORT_DIR": str(tmp_path)}, timeout=120)
    assert res.returncode != 0 and time.monotonic() - t0 < 3 + 20, res
    err = res.stderr
    assert "HANG REPORT: recv from rank 1" in err and "did not complete within 3 s" in err, res
    assert "STUCK HERE" in err  # rank 1's own line, asked through its responder
    assert list(tmp_path.glob("hpcsync-hang-*.json"))


def test_a_rank_that_failed_on_its_own_does_not_swallow_the_report(tmp_path):
    """Rank 0 fails its all_gather locally (desync check off), rank 1 waits inside it: rank 1 must
    not defer the report to rank 0, which is no longer inside; the report says rank 0 failed."""
    res = run(openmpi(), 2, "stall.py", "hpcsync", "local_error", "3", tmp_path=tmp_path, expect_ok=False,
              env={"HPCSYNC_DESYNC_CHECK": "0", "HPCSYNC_REPORT_DIR": str(tmp_path)}, timeout=120)
    assert res.returncode != 0
    assert res.stderr.count("HANG REPORT") == 1, res
    assert "failed in #1 with an error of its own: rank(s) 0" in res.stderr and "inside #1: rank(s) 1" in res.stderr


def test_futures_behind_a_stuck_operation_end_at_the_timeout(tmp_path):
    """Polled mode, as DDP's reducer waits: torch.futures.wait_all on the futures of two async
    all_reduces, the other rank stalled: the first raises at the timeout (the worker waits
    against the deadline too), the queued second at once (broken group)."""
    res = run(openmpi(), 2, "stall.py", "hpcsync", "futures", "3", tmp_path=tmp_path, expect_ok=False,
              env={**_POLLED, "HPCSYNC_REPORT_DIR": str(tmp_path)}, timeout=120)
    reports_of_all(res, 2)
    d = res.ranks[0]
    assert len(d["errors"]) >= 2 and d["results"] == [], d
    assert "timed out after 3s" in d["errors"][0] and "group is broken" in d["errors"][1], d
    assert d["seconds"] < 3 + 8, d


def test_a_failing_hang_report_still_ends_the_job(tmp_path):
    """The hang report raises (an injected fault): the rank whose all_reduce timed out still ends
    the job, bounded, and says the report failed, while the other rank sleeps on."""
    timeout = 3
    t0 = time.monotonic()
    res = run(openmpi(), 2, "stall.py", "hpcsync", "report_fails", str(timeout), tmp_path=tmp_path, expect_ok=False,
              env={"HPCSYNC_REPORT_DIR": str(tmp_path), "HPCSYNC_ABORT_GRACE": "5"}, timeout=120)
    took = time.monotonic() - t0
    assert res.returncode != 0 and took < timeout + 5 + 15, (took, res)  # + the abort's grace
    assert "the hang report of all_reduce #1" in res.stderr and "RuntimeError: injected: the hang report cannot be built" in res.stderr, res
    assert "HANG REPORT" not in res.stderr and res.ranks == [None, None], res


@pytest.mark.parametrize("launcher,env", [("openmpi", {}), ("mpich", {}), ("openmpi", _POLLED)],
                         ids=["openmpi", "mpich", "openmpi-polled"])
def test_two_threads_on_one_group_take_turns(launcher, env, tmp_path):
    """A second thread's all_reduce on the group while the main thread's is inside MPI: it waits
    for it (MPI never sees two collectives on one communicator at once); 20 rounds, right data."""
    res = run(LAUNCHERS[launcher](), 2, "stall.py", "hpcsync", "two_threads", "20", tmp_path=tmp_path, env=env,
              timeout=120)
    for d in res.ranks:
        assert d["errors"] == [] and d["results"] == [{"a": [3.0], "b": [3] * 5}] * 20, d


@pytest.mark.parametrize("env", [{}, _POLLED], ids=["default", "polled"])
def test_a_second_thread_keeps_the_first_threads_deadline(env, tmp_path):
    """The main thread's all_reduce is stuck (the last rank stalls); a second thread issues one on
    the same group half a timeout later. The first still times out at its own deadline, the report
    names it, and the second fails with the broken group instead of waiting on."""
    timeout = 4
    t0 = time.monotonic()
    res = run(openmpi(), 2, "stall.py", "hpcsync", "two_threads_stuck", str(timeout), tmp_path=tmp_path,
              expect_ok=False, env={**env, "HPCSYNC_REPORT_DIR": str(tmp_path)}, timeout=120)
    took = time.monotonic() - t0
    if not env:  # the job ends with the report of the first thread's operation
        assert res.returncode != 0 and took < timeout + 15, (took, res)
        assert "HANG REPORT: all_reduce #1 (float32[65536])" in res.stderr, res
        return
    assert res.returncode != 0 and "exiting with a broken process group" in res.stderr, res
    first = res.ranks[0]
    (got,) = first["results"]
    assert got["a_error"].startswith("DistBackendError") and "all_reduce #1" in got["a_error"], first
    assert first["seconds"] < timeout + 2, first  # not moved to the second thread's deadline (+2 s)
    assert got["error"].startswith("DistBackendError") and "group is broken" in got["error"], first


@pytest.mark.parametrize("env", [{}, _POLLED], ids=["default", "polled"])
def test_leaving_with_an_operation_in_flight_ends_the_job(env, tmp_path):
    """Rank 0 ends its program with an async all_reduce nobody joins: the exit is bounded and says
    why (the report, or the broken group at exit), instead of MPI_Finalize waiting forever."""
    timeout = 3
    t0 = time.monotonic()
    res = run(openmpi(), 2, "stall.py", "hpcsync", "exit_in_flight", str(timeout), tmp_path=tmp_path,
              expect_ok=False, env={**env, "HPCSYNC_REPORT_DIR": str(tmp_path)}, timeout=120)
    took = time.monotonic() - t0
    assert res.returncode != 0 and took < timeout + 30, (took, res)
    assert res.ranks[0] is not None and res.ranks[0]["results"] == ["left"], res
    assert "exiting with a broken process group" in res.stderr or "HANG REPORT: all_reduce #1" in res.stderr, res


@pytest.mark.parametrize("launcher,env", [("openmpi", {}), ("mpich", _POLLED)], ids=["openmpi", "mpich-polled"])
def test_a_callback_waiting_on_an_operation_behind_it_ends_at_the_timeout(launcher, env, tmp_path):
    """A future callback (run by the backend's worker) waits on the future of an all_reduce queued
    behind its own, on every rank: that one can never start. At the timeout the group breaks, the
    queued operations fail, the callback's wait raises, and the job ends at exit."""
    timeout = 3
    res = run(LAUNCHERS[launcher](), 2, "stall.py", "hpcsync", "callback_waits", str(timeout), tmp_path=tmp_path,
              expect_ok=False, env={**env, "HPCSYNC_REPORT_DIR": str(tmp_path)}, timeout=120)
    assert res.returncode != 0 and "exiting with a broken process group" in res.stderr, res
    for d in res.ranks:
        (err,) = d["errors"]
        assert "DistBackendError" in err and "ran past the group's timeout (3s) with operations queued" in err, d
        assert timeout <= d["seconds"] < timeout + 3, d


def test_a_rank_whose_printer_never_reports_leaves_a_record_of_its_own(tmp_path):
    """Rank 1 times out and leaves the report to rank 0 (inside the same operation, answering),
    whose report never comes: within the report's bound less 5 s (here 8 s), rank 1 writes a
    'timeout' record that names no node, so the job's end is never without one."""
    reports = tmp_path / "reports"
    res = run(openmpi(), 2, "unreported.py", tmp_path=tmp_path, env={"HPCSYNC_REPORT_DIR": str(reports)},
              timeout=120)
    one = res.ranks[1]
    assert one["printed"] is None and 2.5 <= one["took"] < 8, one
    [rec] = one["records"]
    assert (rec["cause"], rec["blame_nodes"], rec["reporter"]["rank"], rec["reached"]) == ("timeout", [], 1, [1]), rec
    assert "left to another rank did not come within 3 s" in rec["detail"], rec


@pytest.mark.parametrize("helper", ["all_gather", "reduce_dict", "synchronize"])
def test_a_rank_missing_from_a_comm_helper_is_a_timeout_not_a_hang(helper, tmp_path):
    """The detectron2-style helpers over MPI are bounded like every other hpcsync collective: with
    the last of 3 ranks stuck before ``comm.<helper>``, the others raise CollectiveTimeout naming
    the helper within HPCSYNC_TIMEOUT (3 s) and the job ends (they leave a collective in flight:
    MPI_Abort at exit). Before, they waited in MPI for good (a cut-off node at an epoch's
    reduce_dict hung a whole run under ``hpcsync run``)."""
    t0 = time.monotonic()
    res = run(openmpi(), 3, "helper_stall.py", helper, tmp_path=tmp_path, env={"HPCSYNC_TIMEOUT": "3"},
              expect_ok=False, timeout=120)
    assert time.monotonic() - t0 < 60, res
    for d in res.ranks[:2]:
        assert d is not None and d["error"] == "CollectiveTimeout", (d, str(res))
        assert f"hpcsync.comm.{helper}" in d["message"] and 2.5 <= d["took"] < 10, d


def test_a_crashed_rank_says_where_its_threads_were(tmp_path):
    """A segmentation fault prints every Python thread's stack (the crashing line of the program
    first), then the MPI library's own C frames; the job ends."""
    t0 = time.monotonic()
    res = run(openmpi(), 2, "crash.py", tmp_path=tmp_path, expect_ok=False, timeout=120)
    assert res.returncode != 0 and time.monotonic() - t0 < 60, res
    line = next(i for i, text in enumerate((ROOT / "tests/programs/crash.py").read_text().splitlines(), 1)
                if "CRASH HERE" in text)
    assert "Fatal Python error: Segmentation fault" in res.stderr, res.stderr
    assert f'crash.py", line {line} in <module>' in res.stderr, res.stderr
    assert "hpcsync-watchdog" in res.stderr or "Thread 0x" in res.stderr, res.stderr  # the other threads too
    assert "Signal: Segmentation fault (11)" in res.stderr, res.stderr  # then Open MPI's handler
