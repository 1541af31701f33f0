"""tests/gpu/gpu_check.py stays runnable: its "cpu" mode (hpcsync backend, CPU tensors) on 2 ranks.

The GPU modes need CUDA (tests/gpu/run.sh on a GPU machine); this keeps the collectives, DDP and
sync_file checks of that script honest on machines without one.
"""
import re

import launch


def test_gpu_check_script_cpu_mode(tmp_path):
    res = launch.run(launch.mpich(), 2, str(launch.ROOT / "tests/gpu/gpu_check.py"), "cpu", tmp_path=tmp_path,
                     env={"HPCSYNC_GPU_OUT": str(tmp_path)}, expect_ok=False, timeout=240)
    assert res.returncode == 0, str(res)
    ok = re.findall(r"GPU-OK rank=(\d) world=2 backend=hpcsync device=cpu", res.stdout)
    assert sorted(ok) == ["0", "1"], str(res)
    assert (tmp_path / "gpu-cpu-tcp.csv").read_text().splitlines() == ["rank,value", "0,3", "1,3"]
