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
