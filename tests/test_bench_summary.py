"""bench_all.py's quick mode: every headline ratio in one run of 2 ranks, whose JSON is checked.
Not marked ``heavy``: about 40 s of 2-rank jobs, so it goes beside the other tests rather than
lengthen the stream of the tests that build nodes (tests/run.sh)."""
import json

from test_bench import check_backend_json, check_filesync_json, check_h5_json, run_quick


def test_all_benchmarks_summary_quick(tmp_path):
    """bench_all.py: every headline performance ratio in one run, with its target; it runs the
    backend, file sync and HDF5 benchmarks' quick modes, whose own JSON is checked here too."""
    out, rows, stdout = run_quick(tmp_path, "bench_all.py", "--ranks", "2")
    check_backend_json(out.with_name("all-backend-2.json"))
    check_filesync_json(out.with_name("all-filesync-2.json"))
    check_h5_json(out.with_name("all-h5-2.json"))
    mpich = json.loads(out.with_name("all-backend-mpich-2.json").read_text())["results"][0]
    assert mpich["mpi"] == "mpich" and "MPICH" in mpich["mpi_library"] and not mpich["ddp"]
    assert {r["bytes"] for r in mpich["collectives"]} == {4096, 1 << 20}
    # its run has the anchors
    floors = ("raw on torch", "raw + agreement", "raw + agreement beside", "thin backend", "thin + agreement")
    assert all(r[k] > 0 for r in mpich["collectives"] for k in floors), mpich["collectives"]
    assert all(mpich["checks"][k] > 0 for k in floors), mpich["checks"]
    targets = json.loads(out.with_name("all-backend-mpich-2.json").read_text())["targets"]
    assert len(targets) == 4 and all(t["thin + agreement"] > 0 for t in targets), targets
    measures = {r["measure"] for r in rows}
    assert {"Open MPI: 4 KiB all_reduce, times raw", "MPICH: 4 KiB all_reduce, times raw"} <= measures
    assert {"sync_file hpcsync-copy vs cat", "HDF5 parallel vs gather fallback"} <= measures
    assert {f"{lib}: {op} 1 MiB vs raw mpi4py" for lib in ("Open MPI", "MPICH")
            for op in ("all_reduce", "all_gather", "broadcast", "reduce_scatter")} <= measures
    assert any(m.startswith("DDP MLP") for m in measures) and all(r["ratio"] > 0 for r in rows)
    assert "| ranks | measure | ratio | target | met |" in stdout
