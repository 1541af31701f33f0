"""One output parser per launcher (hpcsync.resilience.launchers): each reads its own launcher's
lines (the lines below are the ones tests/test_supervisor.py, tests/test_verdict.py and the
failure simulator feed ``LauncherWords``) and nothing of the others'; in output that mixes them
(mpirun or mpiexec starting their daemons with srun), each parser's evidence is what its own
lines alone give, and ``LauncherWords`` holds all of it."""
import random

import pytest

from hpcsync.resilience import launchers
from hpcsync.resilience.launchers import Evidence, HydraOutput, OpenMPIOutput, SrunOutput, WatchdogOutput

BANNER = "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES"


def mpich5(code):
    """MPICH 5's hydra ending a rank with the raw status ``code``, then cleaning up another."""
    return [BANNER, "=   PID 23854 RUNNING AT n3", f"=   EXIT CODE: {code}", BANNER, "=   PID 11 RUNNING AT n0",
            "=   EXIT CODE: 15", "YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Segmentation fault (signal 11)"]


# each launcher's outputs, one list per step, with what its parser must find in it
SRUN = [
    (["srun: error: n1: task 1: Killed", "srun: launch/slurm: _step_signal: Terminating StepId=1.0",
      "srun: error: n0: task 0: Terminated", "srun: error: n2: task 2: Exited with exit code 1",
      "srun: error: n3: task 3: Killed"], {"nodes": ["n1"], "deaths": {"n1": {"1"}}, "alive": {"n0", "n2"}}),
    (["srun: error: n0: task 0: User defined signal 1", "srun: launch/slurm: _step_signal: Terminating StepId=7.0",
      "srun: error: n1: task 1: User defined signal 1"], {"nodes": [], "warning": "SIGUSR1"}),
    (["srun: error: Node failure on n2", "srun: error: n0: task 0: User defined signal 1"],
     {"nodes": ["n2"], "failed": ["n2"], "warning": "SIGUSR1"}),
    (["srun: error: Task launch for job 12 step 3 failed on node n1: Communication connection failure"],
     {"nodes": ["n1"], "failed": ["n1"]}),
    (["srun: error: Node failure on n5", "srun: error: n5: tasks 10-11: Killed"],
     {"nodes": ["n5"], "failed": ["n5"], "deaths": {"n5": {"10", "11"}}}),
    (["srun: error: n2: task 5: Out Of Memory"], {"nodes": [], "crash_first": True}),
    (["srun: error: n2: task 5: Segmentation fault (core dumped)"], {"nodes": [], "crash_first": True}),
    (["srun: error: ioctl(TIOCGWINSZ): Inappropriate ioctl for device",
      "srun: error: spank: x11.so: unable to forward"], {"nodes": [], "trouble_at": None}),
]
OPENMPI = [
    (["mpirun noticed that process rank 1 with PID 4242 on node n7 exited on signal 9 (Killed).",
      "mpirun noticed that process rank 0 with PID 4241 on node n0 exited on signal 15 (Terminated)."],
     {"nodes": ["n7"], "deaths": {"n7": {"1"}}, "alive": {"n0"}}),
    (["ORTE has lost communication with a remote daemon.", "  HNP daemon   : [[4321,0],0] on node n0",
      "  Remote daemon: [[4321,0],1] on node n1"], {"nodes": ["n1"], "lost": ["n1"]}),
    (["mpirun noticed that process rank 1 with PID 4242 on node n7 exited on signal 10 (User defined signal 1)."],
     {"nodes": [], "warning": "SIGUSR1"}),
    (["mpirun noticed that process rank 5 with PID 4242 on node n2 exited on signal 11 (Segmentation fault)."],
     {"nodes": [], "crash_first": True}),
    (["ORTE was unable to reliably start one or more daemons."], {"nodes": [], "launch_failed": True}),
    (["None of the TCP networks specified to be included for out-of-band communications"],
     {"nodes": [], "launch_failed": True}),
    (["MPI_ABORT was invoked on rank 3 in communicator MPI_COMM_WORLD with errorcode 1"], {"nodes": [], "crashes": []}),
]
HYDRA = [
    (["=   RANK 0 PID 11 RUNNING AT n0", "=   EXIT STATUS: 15", "=   RANK 1 PID 12 RUNNING AT n3",
      "=   KILLED BY SIGNAL: 9 (Killed)"], {"nodes": ["n3"], "deaths": {"n3": {"1"}}, "alive": {"n0"}}),
    (["=   RANK 1 PID 12 RUNNING AT n3", "=   KILLED BY SIGNAL: 12 (User defined signal 2)"],
     {"nodes": [], "warning": "SIGUSR2"}),
    (["=   RANK 5 PID 12 RUNNING AT n2", "=   KILLED BY SIGNAL: 6 (Aborted)"], {"nodes": [], "crash_first": True}),
    (mpich5(9), {"nodes": ["n3"], "crashes": [], "warning": None}),
    (mpich5(11), {"nodes": [], "crash_first": True, "warning": None}),
    (mpich5(10), {"nodes": [], "crashes": [], "warning": "SIGUSR1"}),
]
WATCHDOG = [
    (["[rank1]:[E] [PG 0 Rank 1] Process group watchdog thread terminated with exception: NCCL error",
      "To avoid data inconsistency, we are taking the entire process down."], {"teardown": True}),
]
PROGRAM = ["epoch 3: loss 0.1234", "hpcsync: rank 0 of 4 on n0", "Traceback (most recent call last):"]
OUTPUTS = {SrunOutput: SRUN, OpenMPIOutput: OPENMPI, HydraOutput: HYDRA, WatchdogOutput: WATCHDOG}


def said(evidence):
    """The evidence as comparable values (``trouble_at``: whether a line said the step is failing)."""
    return {**vars(evidence), "trouble_at": evidence.trouble_at is not None}


def read(parser, lines):
    evidence = Evidence()
    p = parser(evidence)
    for line in lines:
        p.feed(line)
    return evidence


@pytest.mark.parametrize("parser", list(OUTPUTS), ids=lambda p: p.__name__)
def test_each_parser_reads_its_own_launchers_lines(parser):
    for lines, expected in OUTPUTS[parser]:
        got = vars(read(parser, lines))
        assert {k: got[k] for k in expected} == expected, (parser.__name__, lines, got)


@pytest.mark.parametrize("parser", list(OUTPUTS), ids=lambda p: p.__name__)
def test_each_parser_ignores_the_other_launchers_lines(parser):
    """Every line of the other launchers (and the program's own) read in one stream: no evidence."""
    others = [line for other, outputs in OUTPUTS.items() if other is not parser
              for lines, _ in outputs for line in lines] + PROGRAM
    assert said(read(parser, others)) == said(Evidence()), parser.__name__


# lines that say the step is failing: from the first, the launcher has a bounded time to end
TROUBLE = {SrunOutput: ["srun: error: n1: task 1: Killed", "srun: error: Node failure on n2"],
           OpenMPIOutput: ["ORTE has lost communication with a remote daemon.",
                           "MPI_ABORT was invoked on rank 3 in communicator MPI_COMM_WORLD with errorcode 1",
                           "prterun noticed that process rank 1 with PID 4242 on node n7 exited on signal 9 (Killed)."],
           HydraOutput: [BANNER]}


def test_a_launchers_word_of_failure_starts_its_parsers_clock_only():
    for mine, lines in TROUBLE.items():
        for line in lines:
            for parser in OUTPUTS:
                assert (read(parser, [line]).trouble_at is not None) == (parser is mine), (parser.__name__, line)


def mixed(rng):
    """Each parser's own stream (a few of its launcher's outputs, one after the other) and one
    output that interleaves them all, each stream's lines in their order."""
    own = {parser: [line for lines, _ in rng.sample(outputs, rng.randint(0, len(outputs))) for line in lines]
           for parser, outputs in OUTPUTS.items()}
    queues = [list(lines) for lines in own.values()] + [rng.sample(PROGRAM, rng.randint(0, len(PROGRAM)))]
    out = []
    while any(queues):
        out.append(rng.choice([q for q in queues if q]).pop(0))
    return own, out


def test_in_mixed_output_each_parser_finds_what_its_own_lines_give():
    for seed in range(300):
        own, out = mixed(random.Random(seed))
        for parser, lines in own.items():
            assert said(read(parser, out)) == said(read(parser, lines)), (seed, parser.__name__, out)


def test_launcher_words_hold_what_every_parser_found():
    """``LauncherWords`` fed the mixed output: the nodes, deaths, survivors, crashes and failures of
    each launcher's own lines, all of them (without the watchdog's lines, which make later aborts
    no crashes, whichever launcher reports them)."""
    for seed in range(300):
        rng = random.Random(seed)
        own, out = mixed(rng)
        watchdog = set(own.pop(WatchdogOutput))
        out = [line for line in out if line not in watchdog]
        words = launchers.LauncherWords()
        for line in out:
            words.feed(line)
        parts = [read(parser, lines) for parser, lines in own.items()]
        assert set(words.nodes) == {n for p in parts for n in p.nodes}, (seed, out)
        assert sorted(words.failed) == sorted(n for p in parts for n in p.failed), (seed, out)
        assert sorted(words.lost) == sorted(n for p in parts for n in p.lost), (seed, out)
        assert words.alive == {n for p in parts for n in p.alive}, (seed, out)
        deaths = {}
        for p in parts:
            for node, ranks in p.deaths.items():
                deaths.setdefault(node, set()).update(ranks)
        assert words.deaths == deaths, (seed, out)
        assert sorted(words.crashes) == sorted(c for p in parts for c in p.crashes), (seed, out)
        assert words.warning in ({p.warning for p in parts if p.warning} or {None}), (seed, out)
        assert (words.trouble_at is not None) == any(p.trouble_at is not None for p in parts), (seed, out)
        assert words.launch_failed == any(p.launch_failed for p in parts), (seed, out)
