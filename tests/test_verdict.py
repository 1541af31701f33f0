"""The failure record and the verdict of ``hpcsync run``, without a job: the record's JSON is
written and read by one class (another version, a foreign key, a wrong type: skipped with a
warning), and the verdicts follow the evidence (tests/test_verdict_simulator.py draws thousands
of failures; the defects found in them, one each)."""
import json
import logging
import random

from hpcsync.core.nodemap import NodeMap
from hpcsync.observe import failure
from hpcsync.observe.record import KIND, VERSION, Cause, FailureRecord, RecordError, Reporter
from hpcsync.resilience import launchers, verdict
from hpcsync.resilience.verdict import Action
from test_supervisor import raised_in


def layout(nodes, per_node):
    """The node map of ``nodes`` nodes of ``per_node`` ranks each (block placement)."""
    return NodeMap([r // per_node for r in range(nodes * per_node)], [f"n{k}" for k in range(nodes)])


def test_every_record_reads_back_as_written_and_a_person_can_read_it(tmp_path, monkeypatch):
    """Each writer's record (an exception, a hang, a stall, a silent rank, a send's peer) saved
    to a folder and read back is the same record; its file is JSON, one key a line."""
    monkeypatch.setenv("HPCSYNC_RUN_ATTEMPT", "2")
    nodes, me = layout(3, 2), Reporter(1, "n0")
    made = [failure.exception_record(ValueError("bad sample"), me, exit_code=3),
            failure.hang_record({"no_reply": [4, 5], "never_entered": [2], "operation": {"op": "all_reduce", "seq": 9},
                                 "group": "0", "timeout_s": 6}, range(4), me, nodes),
            failure.hang_record({"no_reply": [], "never_entered": [0]}, range(6), me, nodes),
            failure.silent_record([5], range(5), "CollectiveTimeout: x", me, nodes),
            failure.p2p_record(3, False, "recv from 3", me, nodes)]
    for rec in made:
        assert failure.save(rec, str(tmp_path))
    back = sorted(failure.read(str(tmp_path)), key=lambda r: r.time)
    assert back == sorted(made, key=lambda r: r.time)
    hang = next(r for r in back if r.cause is Cause.HANG and r.silent == (4, 5))
    assert hang.silent_at == {4: "n2", 5: "n2"} and hang.reached_nodes == ("n0", "n1") and hang.attempt == "2"
    text = open(hang.path).read()
    assert text.count("\n") > 10 and json.loads(text)["version"] == VERSION and '"cause": "hang"' in text


def test_a_record_this_code_did_not_write_is_skipped_with_a_warning(tmp_path, caplog):
    """Another version, a key it does not know, a wrong type, an unknown cause, torn JSON: each
    refused by the reader, which warns and goes on (the good record is still read)."""
    good = failure.build(Cause.HANG, [3], ["n1"], "x", Reporter(0, "n0"), silent=(3,), silent_at={3: "n1"})
    base = good.to_dict()
    bad = {"v2": {**base, "version": 2}, "noversion": {k: v for k, v in base.items() if k != "version"},
           "strversion": {**base, "version": "1"}, "key": {**base, "blame_everything": True},
           "type": {**base, "blame_nodes": "n1"}, "cause": {**base, "cause": "cosmic ray"},
           "rank": {**base, "reporter": {"rank": "0", "node": "n0"}}, "at": {**base, "silent_at": {"x": "n1"}},
           "kind": {**base, "kind": "something else"}}
    for name, data in bad.items():
        try:
            FailureRecord.from_dict(data)
        except RecordError:
            pass
        else:
            raise AssertionError(f"{name}: accepted {data}")
        (tmp_path / f"{failure.PREFIX}{name}.json").write_text(json.dumps(data))
    for name, data in {"digits": {**base, "silent_at": {"\u00b2": "n1"}}, "dashes": {**base, "silent_at": {"--3": "n1"}},
                       "deep": {**base, "detail": None}}.items():  # (what once crashed the reader)
        text = json.dumps(data) if name != "deep" else json.dumps(base)[:-1] + ', "x": ' + "[" * 100000 + "]" * 100000 + "}"
        try:
            FailureRecord.from_json(text)
        except RecordError:
            pass
        else:
            raise AssertionError(f"{name}: accepted")
        (tmp_path / f"{failure.PREFIX}{name}.json").write_text(text)
        bad[name] = data
    (tmp_path / f"{failure.PREFIX}torn.json").write_text(good.to_json()[:40])
    failure.save(good, str(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert failure.read(str(tmp_path)) == [good]
    assert sum("skipped" in r.getMessage() for r in caplog.records) == len(bad) + 1, caplog.text
    assert FailureRecord.from_dict({"kind": KIND, "version": VERSION, "cause": "stall",
                                    "reporter": {"rank": 0, "node": "n0"}}).reached_ranks() == (0,)


def test_the_action_is_an_enum_with_the_words_of_the_logs():
    assert [a.value for a in Action] == ["done", "relaunch", "stop-program", "requeue"]
    v = verdict.judge(0, [], launchers.LauncherWords(), False)
    assert v.action is Action.DONE and v.action == "done"


# -- the verdicts, each on generated cases ---------------------------------------------------------
BACKEND = "/venv/lib/python3.11/site-packages/hpcsync/backend"


def test_an_mpi_error_or_a_backend_timeout_is_a_lost_peer_not_the_programs(tmp_path, monkeypatch):
    """mpi4py's MPI.Exception (a RuntimeError subclass; mpi4py sets ERRORS_RETURN) is how a
    survivor learns its peer died: a lost peer, wherever it was raised; so is a transport's
    "timed out" raised under hpcsync's backend. The program's misuse of MPI (a wrong count, a
    bad rank) and the backend's mismatch (a ValueError) stay the program's. Its record says so."""
    from mpi4py import MPI

    lost = [getattr(MPI, n) for n in ("ERR_OTHER", "ERR_INTERN", "ERR_UNKNOWN", "ERR_PROC_FAILED", "ERR_PROC_ABORTED",
                                      "ERR_REVOKED") if hasattr(MPI, n)]
    for cls in lost:
        assert failure.peer_gone(MPI.Exception(cls)), MPI.Exception(cls)
        assert failure.peer_gone(raised_in(f"{BACKEND}/engine.py", MPI.Exception(cls)))
    # every other class is a call the program got wrong (a receive too small, a bad request, a
    # window or file misused, out of memory): the same call fails again on any node
    misuse = [getattr(MPI, n) for n in dir(MPI) if n.startswith("ERR_") and isinstance(getattr(MPI, n), int)
              and getattr(MPI, n) not in lost and 0 < getattr(MPI, n) < MPI.ERR_LASTCODE]
    assert len(misuse) > 20 and MPI.ERR_TRUNCATE in misuse and MPI.ERR_NO_MEM in misuse, misuse
    for cls in misuse:
        assert not failure.peer_gone(MPI.Exception(cls)), MPI.Exception(cls)
    def timed():
        return RuntimeError("hpcsync backend: all_reduce in group '0' timed out after 6 s")
    assert failure.peer_gone(raised_in(f"{BACKEND}/work.py", timed()))
    assert not failure.peer_gone(raised_in("/home/me/train.py", timed()))  # the same words from its own code
    mismatch = ValueError("hpcsync backend: shape differs between the ranks of group '0'")
    assert not failure.peer_gone(raised_in(f"{BACKEND}/desync.py", mismatch))
    rec = failure.exception_record(raised_in(f"{BACKEND}/engine.py", MPI.Exception(MPI.ERR_OTHER)), Reporter(0, "n0"))
    assert rec.cause is Cause.TIMEOUT and not rec.program_error, rec


def hang(nodes, silent, reporter=0, never=(), stuck=None):
    """The hang record the printer ``reporter`` writes when ``silent`` ranks answer nobody and
    ``never`` never entered (``stuck``: those of them whose own wait timed out; default all)."""
    size = len(nodes.node_of)
    reached = [r for r in range(size) if r not in set(silent)]
    return failure.hang_record({"no_reply": sorted(silent), "never_entered": list(never),
                                "timed_out_ranks": sorted(never if stuck is None else stuck),
                                "operation": {"op": "all_reduce", "seq": 7}, "group": "0", "timeout_s": 6},
                               reached, Reporter(reporter, nodes.host(reporter)), nodes)


def test_one_silent_rank_whose_node_mates_answered_blames_no_node():
    """4 nodes x 8 ranks, rank 13 silent, 31 reached: n1's other ranks answered the same gathering,
    so n1 works (a frozen process, a GIL held): no node blamed. Generated: any node count and ranks
    a node, some but not all of a node's ranks silent -> none; all of them -> that node alone."""
    nodes = layout(4, 8)
    blamed, _ = verdict.weigh([hang(nodes, [13])], ranks=32)
    assert blamed == [], blamed
    v = verdict.judge(1, [hang(nodes, [13])], launchers.LauncherWords(), False, ranks=32, nodes=nodes.names)
    assert v.action is Action.RELAUNCH and v.blamed == [], v
    judged = 0
    for seed in range(300):
        rng = random.Random(seed)
        count, per = rng.randint(2, 32), rng.randint(2, 8)
        nodes = layout(count, per)
        down = rng.sample(range(1, count), rng.randint(0, min(2, count - 2)))
        frozen = [r for k in rng.sample(range(1, count), rng.randint(1, min(3, count - 1)))
                  for r in rng.sample(range(k * per, (k + 1) * per), rng.randint(1, per - 1))]
        silent = sorted({*frozen, *(r for k in down for r in range(k * per, (k + 1) * per))})
        if 2 * (count * per - len(silent)) <= count * per:  # the printer's side is no majority: not believed
            continue
        judged += 1
        blamed, _ = verdict.weigh([hang(nodes, silent)], ranks=count * per)
        assert blamed == sorted(f"n{k}" for k in down), f"seed {seed}: {count}x{per}, down {down}, silent {silent}"
    assert judged > 200, judged


def ompi_killed(rank, node):
    return f"mpirun noticed that process rank {rank} with PID 4{rank} on node {node} exited on signal 9 (Killed)."


KILLED = {"ompi": lambda r, n: [ompi_killed(r, n)], "srun": lambda r, n: [f"srun: error: {n}: task {r}: Killed"],
          "hydra": lambda r, n: [f"=   RANK {r} PID 4{r} RUNNING AT {n}", "=   KILLED BY SIGNAL: 9 (Killed)"]}


def test_a_rank_killed_while_its_node_mates_live_on_is_not_its_nodes_fault():
    """The OOM killer's SIGKILL of one rank (rank 3 of n0 + n1, two ranks each): the launcher names
    n1, but its daemon there reported the death and rank 2 on n1 lived on (it answered the
    survivors' gathering, or nothing says it died): no node blamed, the same nodes once more. A
    node whose every rank died (one rank a node) is still left out, as before."""
    for name, lines in KILLED.items():
        nodes = layout(2, 2)
        for records in ([], [hang(nodes, [3])]):
            words = launchers.LauncherWords()
            for line in lines(3, "n1"):
                words.feed(line)
            v = verdict.judge(137, records, words, False, ranks=4, nodes=["n0", "n1"])
            assert (v.action, v.blamed, v.cause) == (Action.RELAUNCH, [], "process killed"), (name, records, v)
            assert "n1" in v.detail, v
        words = launchers.LauncherWords()
        for line in lines(1, "n1"):
            words.feed(line)
        v = verdict.judge(137, [], words, False, ranks=2, nodes=["n0", "n1"])
        assert (v.action, v.blamed) == (Action.RELAUNCH, ["n1"]), (name, v)


def test_a_desync_is_the_programs_and_is_not_retried():
    """Every rank answered, some never entered the collective, waiting in another operation of
    their own (their own wait timed out), no node blamed: the program's (ranks in different
    collectives, a deadlock); retrying costs a timeout each and ends the same. Ranks merely late
    (in no wait of their own) are relaunched on the same nodes, as before."""
    for seed in range(50):
        rng = random.Random(seed)
        count, per = rng.randint(1, 16), rng.randint(1, 8)
        nodes, size = layout(count, per), count * per
        never = rng.sample(range(size), rng.randint(1, size))
        v = verdict.judge(1, [hang(nodes, [], never=never)], launchers.LauncherWords(), False, ranks=size,
                          nodes=nodes.names)
        assert v.action is Action.STOP_PROGRAM and v.blamed == [] and "desync" in v.detail, (seed, v)
        # the same ranks merely late (a slow start on a loaded machine: seen in test_supervisor.py's
        # run, all_gather #1 within 6 s), waiting in nothing of their own: not the program's
        v = verdict.judge(1, [hang(nodes, [], never=never, stuck=[])], launchers.LauncherWords(), False, ranks=size,
                          nodes=nodes.names)
        assert (v.action, v.cause, v.blamed) == (Action.RELAUNCH, "stall", []), (seed, v)


def test_one_failure_excludes_no_more_nodes_than_the_spares_without_a_second_sign():
    """One record blames three nodes (all their ranks silent) with one spare: without a second,
    independent sign (the launcher, the scheduler's node state, a probe) nobody is left out; with
    one, the nodes it confirms are -- even more than the spares."""
    nodes = layout(7, 2)
    silent = list(range(8, 14))  # n4, n5, n6
    quiet = launchers.LauncherWords()
    v = verdict.judge(1, [hang(nodes, silent)], quiet, False, ranks=14, nodes=nodes.names, spares=1)
    assert (v.action, v.blamed) == (Action.RELAUNCH, []) and "second" in v.detail, v
    v = verdict.judge(1, [hang(nodes, silent)], quiet, False, ranks=14, nodes=nodes.names, spares=3)
    assert v.blamed == ["n4", "n5", "n6"], v  # within the spares: the records suffice
    v = verdict.judge(1, [hang(nodes, silent)], quiet, False, lambda asked: ["n5", "n6"], ranks=14,
                      nodes=nodes.names, spares=1)
    assert v.blamed == ["n5", "n6"], v
    v = verdict.judge(1, [hang(nodes, silent)], quiet, False, ranks=14, nodes=nodes.names, spares=1,
                      probe=lambda asked: ["n0", "n4"])
    assert v.blamed == ["n4"], v  # a probe's failure of a node no record names is no sign for it
    one = list(range(12, 14))  # all of n6's ranks silent: one node, whatever the spares (Slurm's
    for spares in (0, 1):      # requeue leaves it out even with none): the cap is not for one node
        v = verdict.judge(1, [hang(nodes, one)], quiet, False, ranks=14, nodes=nodes.names, spares=spares)
        assert v.blamed == ["n6"], (spares, v)
    lost = launchers.LauncherWords()  # Open MPI lost three daemons at once: the launcher alone
    for k in (4, 5, 6):
        lost.feed(f"  Remote daemon: [[4321,0],{k}] on node n{k}")
    v = verdict.judge(1, [], lost, False, ranks=14, nodes=nodes.names, spares=1)
    assert (v.action, v.blamed, v.cause) == (Action.RELAUNCH, [], "lost daemon"), v
    assert verdict.judge(1, [hang(nodes, silent)], lost, False, ranks=14, nodes=nodes.names, spares=1).blamed == \
        ["n4", "n5", "n6"]  # the records and the launcher: two signs


def test_the_oom_killers_sigkill_burns_no_spare(tmp_path):
    """The measured case, with the real supervisor loop: two ranks a node on n0 + n1, n2
    spare; rank 3 is SIGKILLed on every start (a memory limit), its node-mate living on. Before,
    n1 then n2 were left out and the run ended with exit 66, both healthy. Now: the same nodes
    once more, and the same death again is the program's: stopped, the launcher's exit code, no
    node on the bad list."""


    class Oom(launchers.Launcher):
        def command(self, nodes, per_node, program):
            line = ompi_killed(2 * len(nodes) - 1, nodes[-1])
            return ["sh", "-c", f"echo '{line}' >&2; exit 137"]

    sup, code = supervise_three_nodes(Oom("sh", []), tmp_path)
    attempts = [(a.nodes, a.cause, a.blamed) for a in sup.state.attempts]
    assert (code, sup.state.bad_nodes) == (137, []), (code, attempts)
    assert attempts == [(["n0", "n1"], verdict.PROCESS_KILLED, [])] * 2, attempts


def test_the_supervisors_side_of_a_split_is_not_taken_for_the_other():
    """mpirun on a node of the side cut off (found by the failure simulator, seeds 36, 89, 165 of
    its first run): it loses the daemons of the healthy side and its probe reaches only its own
    side, while the healthy side's printer may not have written. Open MPI's lost daemon alone,
    and a probe that fails more than half of the step's nodes, are no evidence against those
    nodes: nobody is left out, the same nodes once more. A genuine lost node is confirmed by the
    probe and left out."""
    nodes = layout(6, 1)
    lost = launchers.LauncherWords()
    for line in ("ORTE has lost communication with a remote daemon.", "  HNP daemon   : [[4321,0],0] on node n5",
                 "  Remote daemon: [[4321,0],1] on node n0"):
        lost.feed(line)
    minority = hang(layout(6, 1), [0, 1, 2, 3], reporter=4)  # n4 and n5 cut off: 2 of 6 reached, not believed
    for probe in (lambda asked: ["n0", "n1", "n2", "n3"], lambda asked: []):
        v = verdict.judge(1, [minority], lost, False, ranks=6, nodes=nodes.names, spares=2, probe=probe)
        assert v.action is Action.RELAUNCH and v.blamed == [], v
    down = launchers.LauncherWords()
    for line in ("ORTE has lost communication with a remote daemon.", "  HNP daemon   : [[4321,0],0] on node n0",
                 "  Remote daemon: [[4321,0],3] on node n3"):
        down.feed(line)
    v = verdict.judge(1, [], down, False, ranks=6, nodes=nodes.names, spares=1, probe=lambda asked: ["n3"])
    assert (v.action, v.blamed) == (Action.RELAUNCH, ["n3"]), v


def test_records_only_from_where_they_should_be(tmp_path, caplog):
    """Where a report folder is shared or group-writable another user can plant a symlink (the
    job's write truncates a file of the victim's) or a record (the run excludes nodes it names).
    The attempt folder is private (0700, this user's, not a link: another is refused); a record is
    written through a new file of its own (never through a planted link at the old predictable
    temporary name); the reader skips a link, a file another user owns, and reads nothing from a
    folder that is not private -- each with a warning."""
    import os

    good = failure.build(Cause.HANG, [3], ["n1"], "x", Reporter(0, "n0"), silent=(3,), silent_at={3: "n1"},
                         reached=(0, 1, 2), reached_nodes=("n0",))
    folder = str(tmp_path / "attempt-1")
    os.makedirs(folder, mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("the victim's data\n")
    report = os.path.join(folder, "hpcsync-hang-7-r0.json")  # a link at the temporary name it used to take
    os.symlink(victim, f"{report}.{os.getpid()}.tmp")
    failure.write_whole(report, {"kind": "hpcsync hang report"})
    assert failure.save(good, folder)
    assert victim.read_text() == "the victim's data\n" and json.loads(open(report).read())["kind"]
    planted = failure.build(Cause.HANG, [0], ["n0"], "planted", Reporter(1, "n1"), silent=(0,), silent_at={0: "n0"})
    other = os.path.join(folder, f"{failure.PREFIX}planted.json")
    with open(other, "w") as f:
        f.write(planted.to_json())
    os.chown(other, 12345, 12345)  # (the tests run as root: another user's file)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(planted.to_json())
    os.symlink(elsewhere, os.path.join(folder, f"{failure.PREFIX}link.json"))
    with caplog.at_level(logging.WARNING):
        assert [r.detail for r in failure.read(folder)] == ["x"], caplog.text
    assert "owned by uid 12345" in caplog.text and "a link" in caplog.text, caplog.text
    for bad, why in ((0o770, "writable by others"), (0o707, "writable by others")):
        shared = tmp_path / f"shared-{bad:o}"
        shared.mkdir()
        failure.save(good, str(shared))
        shared.chmod(bad)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert failure.read(str(shared)) == []
        assert why in caplog.text, caplog.text
        try:
            failure.private_folder(str(shared))
        except OSError as exc:
            assert why in str(exc)
        else:
            raise AssertionError(f"{shared} accepted")
    made = failure.private_folder(str(tmp_path / "state" / "attempt-1"))
    assert os.stat(made).st_mode & 0o777 == 0o700 and failure.private_folder(made) == made
    link = tmp_path / "link"
    os.symlink(folder, link)
    try:
        failure.private_folder(str(link))
    except OSError as exc:
        assert "a link" in str(exc)
    else:
        raise AssertionError("a link accepted")


def test_a_real_desync_is_judged_the_programs_from_the_records_it_writes(tmp_path):
    """Not hand-made records: a real 3-rank job on the hpcsync backend where rank 2 enters another
    group's all_reduce than ranks 0 and 1. Every rank answers the reports' gatherings and each
    waits in a collective of its own that timed out: the records say so (``elsewhere``), and the
    verdict is the program's (stop, not relaunched to the cap)."""
    import os
    import subprocess

    from launch import PY, ROOT, clean_env, mpich

    reports = tmp_path / "reports"
    reports.mkdir(mode=0o700)
    env = {**clean_env(), **mpich().env, "HPCSYNC_TIMEOUT": "3", "HPCSYNC_REPORT_DIR": str(reports)}
    launcher = mpich()
    proc = subprocess.run([*launcher.command(3), PY, str(ROOT / "tests" / "programs" / "desync.py")], env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0, proc
    records = failure.read(str(reports))
    assert records and all(r.elsewhere for r in records if r.never_entered), [r.to_dict() for r in records]
    v = verdict.judge(proc.returncode, records, launchers.LauncherWords(), False, ranks=3, nodes=[os.uname().nodename],
                      spares=0)
    assert (v.action, v.cause) == (Action.STOP_PROGRAM, "desync"), v


def test_no_one_source_leaves_out_more_nodes_than_the_spares():
    """Every verdict that names nodes is capped by the spares: GPU faults reported on three nodes
    at once (a fabric's or a driver's failure as likely as three GPUs') and a warning signal's
    requeue that the launcher blamed three nodes in leave out only the nodes a second sign (the
    scheduler's state) confirms; one node is always believed."""
    rng = random.Random(11)
    for _ in range(6):
        size = rng.randrange(4, 9)
        faulty = sorted(rng.sample([f"n{k}" for k in range(size)], rng.randrange(1, size)))
        spares = rng.randrange(0, 3)
        down = sorted(rng.sample(faulty, rng.randrange(0, len(faulty) + 1)))
        gpu = [failure.build(Cause.HARDWARE, [k], [n], "NVRM: Xid 79, GPU has fallen off the bus", Reporter(k, n),
                             blame_nodes=[n]) for k, n in enumerate(faulty)]
        quiet = launchers.LauncherWords()
        state = lambda asked, down=down: [n for n in asked if n in down]  # noqa: E731
        v = verdict.judge(1, gpu, quiet, False, state, ranks=size, nodes=[f"n{k}" for k in range(size)], spares=spares)
        want = faulty if len(faulty) <= max(spares, 1) else down
        assert (v.action, v.cause, v.blamed) == (Action.RELAUNCH, "hardware", want), (faulty, spares, down, v)
        warned = launchers.LauncherWords()
        for n in faulty:
            warned.feed(f"srun: error: Node failure on {n}")
        warned.feed("srun: error: n0: task 0: User defined signal 1")
        v = verdict.judge(138, [], warned, False, state, ranks=size, nodes=[f"n{k}" for k in range(size)],
                          spares=spares)
        assert (v.action, v.blamed) == (Action.REQUEUE, want), (faulty, spares, down, v)


def test_a_probe_failing_most_nodes_still_names_those_the_scheduler_calls_down():
    """A probe that fails more than half of the step's nodes is no evidence by itself (the
    supervisor's side may be the one cut off); the nodes among them the scheduler calls down are
    (a rack's power lost: most nodes down, the scheduler says so)."""
    nodes = layout(6, 1)
    lost = launchers.LauncherWords()
    lost.feed("ORTE was unable to reliably start one or more daemons.")
    gone = ["n1", "n2", "n3", "n4"]
    for said, want in (([], []), (["n2", "n3"], ["n2", "n3"])):
        v = verdict.judge(1, [], lost, False, lambda asked, said=said: [n for n in asked if n in said], ranks=6,
                          nodes=nodes.names, spares=4, probe=lambda asked: gone)
        assert v.blamed == want, v


def test_killed_twice_is_the_programs_only_when_the_same_rank_is_killed_again(tmp_path):
    """The OOM killer's rule stops the run when a rank is killed while its node runs on twice in
    a row: that is the same rank again. Ranks killed on different nodes (rank 3 on n1, then rank
    1 on n0) are not the same kill coming back: the same nodes once more, then the third kill,
    rank 1 on n0 again, stops it."""


    kills = iter([(3, "n1"), (1, "n0"), (1, "n0")])

    class Oom(launchers.Launcher):
        def command(self, nodes, per_node, program):
            rank, node = next(kills)
            return ["sh", "-c", f"echo '{ompi_killed(rank, node)}' >&2; exit 137"]

        def probe(self, node):  # every node answers
            return ["true"]

    sup, code = supervise_three_nodes(Oom("sh", []), tmp_path)
    attempts = [(a.nodes, a.cause, a.killed) for a in sup.state.attempts]
    assert code == 137 and sup.state.bad_nodes == [], (code, attempts)
    assert attempts == [(["n0", "n1"], verdict.PROCESS_KILLED, ["n1/3"]), (["n0", "n1"], verdict.PROCESS_KILLED, ["n0/1"]),
                        (["n0", "n1"], verdict.PROCESS_KILLED, ["n0/1"])], attempts


def supervise_three_nodes(launcher, tmp_path):
    """A Supervisor of ``launcher`` on n0, n1 (n2 spare), 2 nodes, 3 attempts at most, run to
    its end; the signal handlers it set are given back. ``(supervisor, exit code)``."""
    import signal

    from hpcsync.resilience import supervisor

    try:
        sup = supervisor.Supervisor(launcher, ["n0", "n1", "n2"], 2, 1, 3, str(tmp_path / "s"), ["prog"])
        return sup, sup.run()
    finally:
        for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_DFL if s != signal.SIGINT else signal.default_int_handler)
