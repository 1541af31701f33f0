"""The benchmarks run (short mode) and write sane JSON. Speed is judged in the README, not here."""
import json
import subprocess

from launch import PY, ROOT, clean_env


def test_backend_benchmark_quick(tmp_path):
    out = tmp_path / "backend.json"
    p = subprocess.run([PY, str(ROOT / "bench" / "bench_backend.py"), "--quick", "--out", str(out)],
                       env=clean_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads(out.read_text())["results"][0]
    assert data["world_size"] == 2
    ops = {r["op"] for r in data["collectives"]}
    assert ops == {"all_reduce", "all_gather", "broadcast", "reduce_scatter"}
    for r in data["collectives"]:
        assert r["hpcsync"] > 0 and r["mpi4py"] > 0 and r["np.add"] > 0
    assert {d["model"].split()[0] for d in data["ddp"]} == {"MLP", "CNN"}
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert "| all_reduce |" in p.stdout


def test_filesync_benchmark_quick(tmp_path):
    out = tmp_path / "filesync.json"
    p = subprocess.run([PY, str(ROOT / "bench" / "bench_filesync.py"), "--quick", "--out", str(out)],
                       env=clean_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["method"] for r in rows} == {"hpcsync-gather", "hpcsync-mpiio", "pad+allgather(gloo)", "mpi4py-gather", "cat"}
    assert all("error" not in r and r["mb_per_s"] > 0 for r in rows), rows
