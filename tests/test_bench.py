"""The benchmarks run (short mode) and write sane JSON. Speed is judged in the README, not here."""
import json
import os
import subprocess

import pytest

from launch import PY, ROOT, clean_env, long_run

pytestmark = pytest.mark.heavy  # long jobs, checked for sane figures, not for their speed (tests/run.sh)


def run_quick(tmp_path, script, *args, timeout=900):
    """Run ``bench/<script> --quick *args`` into a JSON file; return (its path, its JSON, what it printed)."""
    out = tmp_path / script.replace(".py", ".json")
    p = subprocess.run([PY, str(ROOT / "bench" / script), "--quick", *args, "--out", str(out)],
                       env=clean_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return out, json.loads(out.read_text()), p.stdout


def check_backend_json(path):
    data = json.loads(path.read_text())["results"][0]
    assert data["world_size"] == 2
    ops = {r["op"] for r in data["collectives"]}
    assert ops == {"all_reduce", "all_gather", "broadcast", "reduce_scatter"}
    for r in data["collectives"]:
        assert r["hpcsync"] > 0 and r["mpi4py"] > 0 and r["np.add"] > 0
    assert set(data["checks"]) == {"no-op ProcessGroup (floor)", "check off", "default", "debug", "mpi4py (raw)",
                                   "flight record alone"}
    assert all(v > 0 for v in data["checks"].values())
    assert [d["model"].split()[0] for d in data["ddp"]] == ["MLP", "CNN", "CNN"]
    assert all(d[k] > 0 for d in data["ddp"] for k in ("hpcsync", "hpcsync no_sync", "gloo", "gloo no_sync"))
    assert path.with_suffix(".png").stat().st_size > 10_000


def check_filesync_json(path):
    rows = json.loads(path.read_text())["rows"]
    assert {r["method"] for r in rows} == {"hpcsync-copy", "hpcsync-gather", "hpcsync-mpiio", "pad+allgather(gloo)",
                                           "mpi4py-gather", "cat"}
    assert all("error" not in r and r["mb_per_s"] > 0 for r in rows), rows


def check_h5_json(path):
    rows = json.loads(path.read_text())["rows"]
    assert [r["method"] for r in rows] == ["hpcsync-parallel", "hpcsync-gather-fallback", "h5py-mpio-by-hand"]
    assert all(r["mb_per_s"] > 0 and r["ranks"] == 2 for r in rows)


def test_store_benchmark_quick(tmp_path):
    _, data, stdout = run_quick(tmp_path, "bench_store.py", timeout=600)
    rows = data["rows"]
    assert [r["ranks"] for r in rows] == [2] and rows[0]["tcp_s"] > 0 and rows[0]["mpi_s"] > 0
    assert "| 2 |" in stdout


def long_backend_benchmark_across_namespace_nodes_quick(tmp_path):
    """The cross-node run: 2 namespace nodes, one rank each, TCP between them (a long run: the
    stage benchmark's quick run crosses namespace nodes in every run)."""
    _, data, _ = run_quick(tmp_path, "bench_backend.py", "--nodes", "2", "--parts", "collectives", timeout=600)
    data = data["results"][0]
    assert data["nodes"] == 2 and data["world_size"] == 2 and not data["ddp"]
    assert all(r["hpcsync"] > 0 and r["gloo"] > 0 for r in data["collectives"])


if os.environ.get("HPCSYNC_TEST_LONG") == "1":
    test_backend_benchmark_across_namespace_nodes_quick = long_backend_benchmark_across_namespace_nodes_quick


def test_preemption_benchmark_quick(tmp_path):
    """bench_preemption.py: the per-step cost of should_stop() beside a bare loop and a blocking
    per-step Allreduce, one row per step length."""
    _, data, stdout = run_quick(tmp_path, "bench_preemption.py")
    rows = data["rows"]
    assert [(r["ranks"], r["step_us"]) for r in rows] == [(2, 0.0), (2, 1000.0)], rows
    assert all(r["bare_us"] > 0 and len(r["all"]["should_stop"]) == 2 for r in rows)
    assert rows[1]["bare_us"] >= 1000 and "| ranks | step | bare step | should_stop() adds |" in stdout


def test_stage_benchmark_quick(tmp_path):
    """bench_stage.py: stage vs cp -a on one node and across two namespace nodes, three datasets, each
    staged copy checked against its source, the targets judged."""
    _, data, stdout = run_quick(tmp_path, "bench_stage.py", timeout=600)
    rows = data["rows"]
    assert {(r["nodes"], r["method"]) for r in rows} == {(n, m) for n in (1, 2) for m in
                                                        ("hpcsync.stage", "cp -a per node", "cp -a per rank")}
    assert all(r["seconds"] > 0 and r["bytes"] > 0 and len(r["ratios"]) == 1 for r in rows)
    stage = [r for r in rows if r["method"] == "hpcsync.stage"]
    assert len(stage) == 6 and all(r["source_reads"] == 1 for r in stage)  # read once, whatever the nodes
    assert {r["source_reads"] for r in rows if r["method"] == "cp -a per node"} == {1, 2}
    assert [t["target"].split(" (")[0] for t in data["targets"]] == ["small", "tiny"] and data["anchor"] == "cp -a per node"
    assert "| hpcsync.stage |" in stdout and "target: small" in stdout


def test_generated_programs_never_hang_and_never_return_wrong_data(tmp_path):
    """bench_fuzz --quick: 6 generated programs per MPI library on 3 ranks equal numpy's results;
    6 with a mismatch fault (op, dtype, count, reduce op, root) end with the same error on every
    rank and the job goes on; a raise (Open MPI) and a skipped collective (MPICH) end the same way
    or with a report (the full run: all four job-ending faults on both). The script exits non-zero
    with a replay command for any bad seed."""
    _, data, printed = run_quick(tmp_path, "bench_fuzz.py", timeout=1200)
    rows = {(r["mpi"], r["fault"]): r for r in data["rows"]}
    ending = {"openmpi": ("raise",), "mpich": ("skip",)}  # one each in the quick run
    assert set(rows) == {(m, f) for m in ending for f in ("none", "mix", *ending[m])}
    assert data["problems"] == [] and all(r["bad"] == 0 for r in rows.values()), printed
    for mpi in ending:
        assert rows[(mpi, "none")]["seeds"] == 6 and rows[(mpi, "mix")]["seeds"] == 6
        assert rows[(mpi, "mix")]["same_error"] == 6  # every mismatch seen, the same error on every rank
        for fault in ending[mpi]:
            r = rows[(mpi, fault)]
            assert r["same_error"] + r["ended_by_report"] == 1 and r["max_job_s"] < 60, r
    assert rows[("openmpi", "raise")]["ended_by_report"] == 1


def test_recovery_benchmark_quick(tmp_path):
    """bench_recovery --quick: the checkpoint stall written before going on and in the background
    (the time lost per failure needs namespace nodes: --failures, measured by hand)."""
    _, data, stdout = run_quick(tmp_path, "bench_recovery.py", timeout=600)
    stall = data["stall"]
    assert stall["ranks"] == 2 and stall["state_mib"] > 16, stall
    for mode in ("sync", "background"):
        assert stall[mode]["stall_s"] > 0 and stall[mode]["complete_s"] > 0, stall
    assert stall["background"]["complete_s"] >= stall["background"]["stall_s"], stall
    assert "background stall / synchronous stall" in stdout


@pytest.mark.solo  # a ratio of two timings
def test_logs_benchmark_quick(tmp_path):
    """bench_logs --quick: a record's cost in the three places, each measured and above the floor."""
    _, data, stdout = run_quick(tmp_path, "bench_logs.py", "--shared", str(tmp_path / "logs"), timeout=120)
    rows = {r["target"]: r for r in data["rows"]}
    assert len(rows) == 3 and all(r["us_per_record"] > 0 for r in rows.values()), data
    assert rows["file in the log folder"]["vs_no_handler"] > 1, data
    assert (tmp_path / "logs" / "rank-00000.log").stat().st_size > 0


def test_checkpoint_benchmark_quick(tmp_path):
    """bench_checkpoint --quick: the three forms of Checkpoints at 2 and 4 ranks, every time
    measured; on load, a sharded rank gets less than the rank-0 form's rank 0 reads, and the rank-0
    form's rank 0 reads the shared state and every rank's local; with node-local copies, the lost
    node's ranks (2 and 3 at 4 ranks) read nothing themselves and get their part from peers."""
    _, data, stdout = run_quick(tmp_path, "bench_checkpoint.py", timeout=300)
    rows = {(r["ranks"], r["form"]): r for r in data["rows"]}
    assert set(rows) == {(n, f) for n in (2, 4) for f in ("rank0", "sharded", "nodes")}, rows
    state, local, nodes = rows[(4, "rank0")]["state_mib"] * 2**20, data["local_kib"] * 1024, rows[(4, "nodes")]
    assert nodes["load_read_bytes"][2:] == [0, 0] and min(nodes["load_mpi_bytes"][2:]) >= local, nodes
    assert nodes["load_bytes_max"] < state / 4 + local + 2**20, nodes
    times = ("save_s", "stall_s", "complete_s", "load_s")
    assert all(r[k] > 0 and len(r[k + "_rounds"]) == 2 for r in rows.values() for k in times), rows
    rank0, sharded = rows[(4, "rank0")], rows[(4, "sharded")]
    state, local = rank0["state_mib"] * 2**20, data["local_kib"] * 1024
    assert rank0["load_bytes_rank0"] >= state + 4 * local, rank0  # shared.pt and the 4 locals
    assert min(rank0["load_mpi_bytes"][1:]) >= state + local, rank0  # the others: the shared state and their own
    assert sharded["load_bytes_max"] < rank0["load_bytes_rank0"], (sharded, rank0)
    assert sharded["load_bytes_max"] < state / 4 + local + 2**20, sharded  # its quarter, its local, a little more
    assert "| 4 | sharded |" in stdout


# A failure at the largest job this machine holds, across four namespace nodes: every failure
# case at 64 ranks on hpcsync's backend and 32 on gloo (long runs: 1-2 min each), and one case in
# every run (32 ranks: rank 0 away while another rank freezes).
SCALE = ([pytest.param(case, backend, n, id=f"{case}-{backend}-{n}", marks=long_run) for backend, n in
          (("hpcsync", 64), ("gloo", 32)) for case in ("stall", "frozen", "link", "late0")]
         + [pytest.param("late0", "hpcsync", 32, id="late0-hpcsync-32")])


@pytest.mark.parametrize("case,backend,ranks", SCALE)
def test_a_failure_at_scale_is_one_report_that_blames_the_failed_node(tmp_path, case, backend, ranks):
    """bench_failures across four namespace nodes (Open MPI, group timeout 10 s): one report, on
    time (the timeout + 45 s at most, the job ended too), naming exactly the failed ranks silent
    (none for a stall: it answers, and never entered), the records blaming exactly the failed
    node; with rank 0 away (``late0``) the report is another rank's and names rank 0 as never
    entered."""
    out = tmp_path / "failures.json"
    p = subprocess.run([PY, str(ROOT / "bench" / "bench_failures.py"), "--ranks", str(ranks), "--backends", backend,
                        "--cases", case, "--out", str(out)], env=clean_env(), capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    [row] = json.loads(out.read_text())["failures"]
    brief = {k: v for k, v in row.items() if k not in ("report_text", "stderr_tail")}
    assert row["correct"] and row["report_count"] == 1, (brief, row["report_text"], row["stderr_tail"])
    assert row["report_s"] <= row["timeout_s"] + 45 and row["end_s"] <= row["timeout_s"] + 45, brief
    assert row["silent_called"] == row["expect_silent"] and row["blamed_nodes"] == row["expect_blame"], brief


def test_failures_benchmark_responder_quick(tmp_path):
    """bench_failures --responder --quick: one responder answers every question asked at once (a
    gloo group with its flight recorder read for every question and once per operation, and
    hpcsync's backend), and the report's model to 8,192 ranks follows from those rates."""
    _, data, stdout = run_quick(tmp_path, "bench_failures.py", "--responder", timeout=600)
    rows = data["responder"]["responder"]
    assert [(r["group"], r["flight_read"]) for r in rows] == [("gloo", "every question"), ("gloo", "once per operation"),
                                                             ("hpcsync", "once per operation")], rows
    assert all(r["answered"] == r["questions"] and r["per_s"] > 0 for r in rows), rows
    model = data["responder"]["model"]
    assert [m["ranks"] for m in model] == [32, 128, 512, 1024, 8192] * 3
    assert all(m["defer"] + m["gather"] == m["ranks"] and 0 < m["heard"] <= 1 for m in model), model
    assert "answers/s" in stdout
