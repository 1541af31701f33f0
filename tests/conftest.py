"""Shared fixtures, and the marks `tests/run.sh` runs the suite by. Most tests wait on jobs
(timeouts, schedulers, launchers), so two pytest runs go side by side: one with the tests marked
``cluster`` -- every test of a module that builds namespace nodes or a Slurm of its own, and every
test of the shared Slurm: machine-global names, so one at a time -- and those marked ``heavy``;
the other with all the rest. The tests marked ``alone`` measure time: they run afterwards, with
nothing beside them."""
import functools
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


import pytest  # noqa: E402

import slurm_cluster  # noqa: E402

_MACHINE_WORDS = ("netns", "slurm_cluster")  # what a module that builds nodes or its own Slurm says


@functools.lru_cache(maxsize=None)
def _builds_nodes(path: str) -> bool:
    """Whether the test module at ``path`` builds namespace nodes or a Slurm of its own."""
    text = Path(path).read_text()
    return any(w in text for w in _MACHINE_WORDS)


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = getattr(item, "module", None)  # (a doctest or a plugin's item has none)
        if (module is not None and _builds_nodes(module.__file__)) or item.get_closest_marker("slurm") \
                or "slurm" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)


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
