"""Shared fixtures, and the marks `tests/run.sh` runs the suite by. Most tests wait on jobs
(timeouts, schedulers, launchers), so two pytest runs go side by side: one with the tests marked
``cluster`` -- every test of a module that builds namespace nodes or a Slurm of its own, and every
test of the shared Slurm: machine-global names, so one at a time -- and those marked ``heavy``;
the other with all the rest. The tests marked ``alone`` bound wall time: they run afterwards,
in two streams of such light jobs (``HPCSYNC_TEST_SHARD``); those marked ``solo`` (a measured
ratio or factor, a sub-second bound) run last, with nothing beside them. The tests marked
``quick`` (the table ``QUICK``) are the loop for development."""
import functools
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


import pytest  # noqa: E402

import slurm_cluster  # noqa: E402

_MACHINE_WORDS = ("netns", "slurm_cluster")  # what a module that builds nodes or its own Slurm says

# The quick loop, for use while developing (`bash tests/run.sh -m quick`, docs/harness.md): real
# jobs, a few per package, on both MPI libraries, one node and namespace nodes, in minutes; the
# whole suite stays the judge. Test ids relative to tests/, matched as prefixes of the node ids.
# tests/test_layout.py checks that every package has its entry and that each entry selects a test.
QUICK = {
    "core": ["test_topology.py", "test_environments.py", "test_units.py", "test_layout.py", "test_jobend.py",
             "test_types.py",
             "test_comm.py::test_helpers_single_process", "test_comm.py::test_helpers_over_mpi[mpich-3]",
             "test_comm.py::test_ranks_disagreeing_on_the_root_raise_everywhere[openmpi]"],
    "observe": ["test_reports.py", "test_progress.py",
                "test_logs.py::test_the_report_names_the_earliest_raise_whoever_won_the_claim",
                "test_logs.py::test_a_stalled_gloo_collective_is_one_report_naming_the_rank[mpich-loop]",
                "test_faults.py::test_stuck_rank_ends_the_job_with_a_report",
                "test_multinode.py::test_stuck_rank_on_second_node_is_reported[mpich]"],
    "backend": ["test_backend.py::test_conformance_matrix[openmpi-2]",
                "test_backend.py::test_point_to_point_completes_at_every_thread_level[multiple-mpich]",
                "test_faults.py::test_mismatched_collectives_raise_on_every_rank"],
    "data": ["test_filesync.py::test_csv_with_headers[gather-openmpi-2]",
             "test_filesync.py::test_csv_with_headers[mpiio-mpich-4]",
             "test_filesync.py::test_missing_part_is_an_error_on_every_rank", "test_h5.py::test_ragged_rows[openmpi-2-auto]",
             "test_staging_small_files.py",
             "test_everyday.py::test_one_fault_ends_the_job_cause_first_and_loses_nothing[synced_file-raise-openmpi]",
             "test_everyday.py::test_one_fault_ends_the_job_cause_first_and_loses_nothing[sync_file-exit-mpich]", "test_staging.py::test_one_node_several_ranks_one_copy[mpich-2]",
             "test_staging.py::test_across_nodes[rank0-node-openmpi]"],
    "start": ["test_bootstrap.py::test_single_process", "test_bootstrap.py::test_init_gloo_allreduce[openmpi-4]",
              "test_bootstrap.py::test_uncaught_exception_under_mpich_ends_the_job", "test_network.py",
              "test_doctor.py::test_silent_singletons_fail_with_the_fix",
              "test_multinode.py::test_dual_homed_rank0_node_finds_an_address_every_node_reaches",
              "test_interfaces.py::test_each_node_gives_gloo_its_own_interface[mpich-gloo]"],
    "resilience": ["test_checkpoint.py::test_requeue_decision", "test_checkpoint.py::test_a_planted_checkpoint_runs_no_code_on_load",
                   "test_checkpoint_damage.py::test_a_damaged_checkpoint_is_never_loaded[rank0-quick]",
                   "test_preemption.py::test_a_signal_to_the_launcher_reaches_every_rank_and_stops_them_together[mpich]",
                   "test_everyday.py::test_one_fault_ends_the_job_cause_first_and_loses_nothing[checkpoints-skip-openmpi]",
                   "test_supervisor.py::test_launcher_words_blame_the_node_whose_ranks_died",
                   "test_supervisor.py::test_judge_never_relaunches_the_programs_own_exception",
                   "test_supervisor.py::test_the_programs_own_exception_is_not_relaunched",
                   "test_verdict.py", "test_launcher_parsers.py", "test_schedulers.py",
                   "test_verdict_simulator.py::test_verdicts_match_the_truth_quick",
                   "test_slurm.py::test_failing_job_ends_failed", "test_example.py::test_example_trains[None-1-auto]"],
    "the command line and the docs": ["test_docs.py", "test_packaging.py", "test_example.py::test_sync_file_example"],
}


class _Shard:
    """``HPCSYNC_TEST_SHARD=I/N``: of the tests selected, every N-th from the I-th (tests/run.sh
    runs the timed tests in two such streams)."""

    def __init__(self, index: int, count: int) -> None:
        self.index, self.count = index, count

    @pytest.hookimpl(trylast=True)  # after -m and -k have selected
    def pytest_collection_modifyitems(self, config, items):
        kept = [item for k, item in enumerate(items) if k % self.count == self.index]
        dropped = [item for k, item in enumerate(items) if k % self.count != self.index]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_configure(config):
    spec = os.environ.get("HPCSYNC_TEST_SHARD")
    if spec:
        index, count = (int(x) for x in spec.split("/"))
        config.pluginmanager.register(_Shard(index, count), "hpcsync-shard")


def _quick(nodeid: str) -> bool:
    test = nodeid.split("/", 1)[-1]
    return any(test.startswith(prefix) for prefixes in QUICK.values() for prefix in prefixes)


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
        if _quick(item.nodeid):
            item.add_marker(pytest.mark.quick)


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
