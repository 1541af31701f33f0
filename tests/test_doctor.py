"""`hpcsync doctor` on a healthy job and on deliberately broken ones."""
import subprocess

from launch import PY, clean_env, mpich, openmpi


def doctor(launcher, n, env=None, args=()):
    cmd = [*launcher.command(n), PY, "-m", "hpcsync", "doctor", *args]  # python -m, as users type it
    return subprocess.run(cmd, env=clean_env({**launcher.env, **(env or {})}), capture_output=True, text=True,
                          timeout=120)


def test_healthy_openmpi_job():
    p = doctor(openmpi(), 3)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "ok  launcher        openmpi: rank 0/3" in out
    assert "thread level MULTIPLE" in out
    assert "every rank connected to 127.0.0.1" in out
    assert "ok  HDF5            parallel" in out
    assert "no blocking problem found" in out


def test_silent_singletons_fail_with_the_fix():
    p = doctor(mpich(), 2, env={"MPI4PY_MPIABI": "openmpi"})
    assert p.returncode != 0
    assert p.stdout.count("FAIL  launcher / MPI  silent singletons") == 2  # every task says so
    assert "MPI4PY_MPIABI" in p.stdout


def test_missing_interface_fails():
    p = doctor(mpich(), 2, env={"HPCSYNC_IFNAME": "ib7"})
    assert p.returncode != 0
    assert "FAIL  master address  HPCSYNC_IFNAME='ib7'" in p.stdout and "lo=127.0.0.1/8" in p.stdout


def test_hdf5_mismatch_fails_with_the_fix():
    """h5py linked to Open MPI under an MPICH job: hpcsync.h5 falls back, the doctor says FAIL + fix."""
    p = doctor(mpich(), 2, args=("--no-connect",))
    assert p.returncode == 1
    assert "FAIL  HDF5            serial fallback: h5py and mpi4py use different MPI libraries" in p.stdout
    assert "rebuild h5py against this one" in p.stdout
    assert "reachability" not in p.stdout


def test_python_dash_m_is_the_console_script():
    """`python -m hpcsync` (what users type after mpirun) equals the `hpcsync` script."""
    from launch import VENV_BIN

    for args in (["--help"], ["info"]):
        a = subprocess.run([PY, "-m", "hpcsync", *args], env=clean_env(), capture_output=True, text=True, timeout=120)
        b = subprocess.run([str(VENV_BIN / "hpcsync"), *args], env=clean_env(), capture_output=True, text=True,
                           timeout=120)
        assert a.returncode == b.returncode == 0, a.stderr + b.stderr
        assert a.stdout == b.stdout and a.stdout


def test_doctor_warns_about_ranks_bound_to_one_core():
    """mpirun --bind-to core gives each rank one core, shared by torch's threads and the backend's."""
    exe = openmpi().argv[0]
    cmd = [exe, "--allow-run-as-root", "--bind-to", "core", "-n", "2", PY, "-m", "hpcsync", "doctor", "--no-connect"]
    p = subprocess.run(cmd, env=clean_env({**openmpi().env, "OMP_NUM_THREADS": "2"}), capture_output=True, text=True,
                       timeout=120)
    assert "warn  CPU binding     this rank may run on 1 core(s) but uses 2 torch thread(s)" in p.stdout, p.stdout
    assert "--map-by slot:PE=3" in p.stdout
    assert "ok  CPU binding" in doctor(openmpi(), 2, env={"OMP_NUM_THREADS": "1"}, args=("--no-connect",)).stdout


def test_doctor_reports_huge_pages_for_torch_tensors():
    """import hpcsync asks torch for huge pages (MPI moves them faster); opting out is reported."""
    mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read().split("[")[1].split("]")[0]
    env = clean_env(openmpi().env)
    env.pop("THP_MEM_ALLOC_ENABLE", None)  # this pytest process imported hpcsync, which set it
    cmd = [*openmpi().command(1), PY, "-m", "hpcsync", "doctor", "--no-connect"]
    on = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120).stdout
    off = subprocess.run(cmd, env={**env, "HPCSYNC_HUGEPAGES": "0"}, capture_output=True, text=True, timeout=120).stdout
    if mode == "never":
        assert "transparent huge pages are off on this kernel" in on and "off on this kernel" in off
    else:
        assert "ok  huge pages      torch CPU tensors >= 2 MiB use transparent huge pages" in on, on
        assert "warn  huge pages      torch CPU tensors use 4 KiB pages" in off, off


def test_lost_node_check_reads_the_launcher_settings():
    """In process: mpirun's default oob keepalive (~8 min) and srun without kill-on-bad-exit warn."""
    from types import SimpleNamespace

    from hpcsync.start.doctor import KEEPALIVE_FLAGS, OK, WARN, _lost_node_check

    def check(launcher, nodes, env):
        out = []
        _lost_node_check(SimpleNamespace(launcher=launcher, num_nodes=nodes, world_size=4), out, env)
        return out[0] if out else None

    warn = check("openmpi", 2, {})
    assert warn.status == WARN and "~480 s" in warn.detail and KEEPALIVE_FLAGS in warn.detail
    tuned = {"OMPI_MCA_oob_tcp_keepalive_time": "5", "OMPI_MCA_oob_tcp_keepalive_intvl": "2",
             "OMPI_MCA_oob_tcp_keepalive_probes": "3"}
    assert check("openmpi", 2, tuned).status == OK and "~11 s" in check("openmpi", 2, tuned).detail
    assert check("openmpi", 1, {}).status == OK
    assert check("slurm", 2, {}).status == WARN and "--kill-on-bad-exit=1" in check("slurm", 2, {}).detail
    assert check("slurm", 2, {"SLURM_KILL_BAD_EXIT": "1"}).status == OK
    assert check("hydra", 2, {}) is None  # hydra notices a lost proxy by itself (measured)
