import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


import pytest  # noqa: E402

import slurm_cluster  # noqa: E402


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A real single-node Slurm (slurmctld + slurmd + munge), started once for the test session."""
    d = tmp_path_factory.mktemp("slurm")
    try:
        env = slurm_cluster.start(d)
    except RuntimeError as exc:
        pytest.fail(f"could not start the test Slurm cluster: {exc}")
    yield env
    slurm_cluster.stop(d)


@pytest.fixture
def mount_tmpfs():
    """``mount(path, options)``: a tmpfs mounted at ``path`` (created) for the test, unmounted after."""
    mounted = []

    def mount(path: Path, options: str) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
        mounted.append(path)
        return path

    yield mount
    for p in reversed(mounted):
        subprocess.run(["umount", "-l", str(p)])
