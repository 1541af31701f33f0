"""A job of many ranks read as one, under real launchers: rank-aware logs (a file per rank, rank 0
and every rank's warnings once on the console), one report for the first failure, and a stalled
gloo collective reported like the hpcsync backend's (which ranks never entered it, their nodes
and lines)."""
import json
import logging
import os
import re
import socket
import subprocess
import threading
import time

import pytest

from launch import LAUNCHERS, PROGRAMS, PY, clean_env, openmpi, run

HOST = socket.gethostname()


def check_files(logs, n):
    files = sorted(p.name for p in logs.iterdir())
    assert files == [f"rank-{r:05d}.log" for r in range(n)], files
    for r in range(n):
        text = (logs / f"rank-{r:05d}.log").read_text()
        assert f"r{r}/{n} {HOST} INFO app: rank {r} of {n} here" in text, text
        assert f"r{r}/{n} {HOST} WARNING app: the same warning from every rank" in text, text
        others = [k for k in range(n) if k != r and f"rank {k} of {n} here" in text]
        assert not others, f"rank {r}'s file holds records of ranks {others}"
        assert ("only rank 2 warns" in text) == (r == 2), text
    return [(logs / f"rank-{r:05d}.log").read_text() for r in range(n)]


def check_console(stderr, n):
    # rank 0's records at INFO; the others' INFO lines only in their files
    assert stderr.count("INFO app: the same info line from every rank") == 1, stderr
    assert "INFO app: rank 0 of" in stderr and not re.search(r"rank [1-9]\d* of \d+ here", stderr), stderr
    # a warning every rank logged: once, with how many ranks and which; one rank's: marked with it
    assert stderr.count("WARNING app: the same warning from every rank") == 1, stderr
    assert f"[{n} ranks 0-{n - 1} on {HOST}] WARNING app: the same warning from every rank" in stderr, stderr
    assert stderr.count("only rank 2 warns about this") == 1, stderr
    assert f"[rank 2 on {HOST}] WARNING app: only rank 2 warns about this" in stderr, stderr


def test_logs_under_mpirun_read_as_one(tmp_path):
    """8 ranks, init(log_dir=): a file per rank with that rank's records only; on the console rank
    0's lines, and each warning once; the application's own handler still sees its records."""
    logs = tmp_path / "logs"
    res = run(openmpi(), 8, "many_ranks.py", "logs", "hpcsync", str(logs), tmp_path=tmp_path)
    check_files(logs, 8)
    check_console(res.stderr, 8)
    assert all(r["own_kept"] and "the same warning from every rank" in r["own"] for r in res.ranks), res.ranks
    assert sorted(re.findall(r"a print from rank (\d+)", res.stdout)) == sorted(map(str, range(8)))  # not captured


@pytest.mark.slurm
def test_logs_under_srun_from_the_environment_with_prints(slurm, tmp_path):
    """srun --mpi=pmix, 4 tasks: HPCSYNC_LOG_DIR alone turns it on; HPCSYNC_LOG_PRINT=1 puts every
    rank's prints in its file, and only rank 0's reach stdout."""
    logs, out = tmp_path / "logs", tmp_path / "out"
    out.mkdir()
    env = clean_env({**slurm, "HPCSYNC_TEST_OUT": str(out), "MPI4PY_MPIABI": "openmpi", "OMPI_MCA_btl": "self,vader",
                     "HPCSYNC_LOG_DIR": str(logs), "HPCSYNC_LOG_PRINT": "1"})
    proc = subprocess.run(["srun", "--mpi=pmix", "-n", "4", PY, str(PROGRAMS / "many_ranks.py"), "logs", "gloo", "-"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(out.glob("rank*.json"))) == 4
    texts = check_files(logs, 4)
    check_console(proc.stderr, 4)
    assert re.findall(r"a print from rank (\d+)", proc.stdout) == ["0"], proc.stdout
    assert all(f"INFO hpcsync.print: a print from rank {r}" in t for r, t in enumerate(texts)), texts


def test_logging_is_left_alone_when_not_asked(tmp_path):
    res = run(LAUNCHERS["mpich"](), 2, "many_ranks.py", "plain", "hpcsync", tmp_path=tmp_path)
    assert all(r["root_kept"] for r in res.ranks), res.ranks
    assert "not shown" not in res.stdout + res.stderr


def test_the_first_failure_is_one_block_naming_its_rank(tmp_path):
    """16 ranks; rank 7 raises at step 40, every other rank 0.2 s later: one block, first, names
    rank 7, its node and step, with its traceback once; the 15 others are one line. Who prints
    is settled by the min-reduction along the relays; the JSON report carries one whole traceback
    per distinct error (two), not one per rank, and names the ranks in ranges."""
    reports = tmp_path / "reports"
    res = run(openmpi(), 16, "many_ranks.py", "raise", "gloo", "7", "others", tmp_path=tmp_path, expect_ok=False,
              env={"HPCSYNC_REPORT_DIR": str(reports)}, timeout=240)
    err = res.stderr
    assert res.returncode != 0
    head = f"[hpcsync] ===== uncaught exception on rank 7 ({HOST}), the first to fail, at step 40 ====="
    assert head in err, err[-4000:]
    assert err.count("Traceback (most recent call last)") == 1, err[-6000:]
    assert err.count("ValueError: bad batch on rank 7") == 1, err[-4000:]
    assert err.index(head) < err.index("ValueError: bad batch on rank 7")
    assert "[hpcsync]" not in err[:err.index(head)], err[:err.index(head)]  # the block comes first
    consequence = re.findall(r"ranks 0-6, 8-15 on \S+: raised too, \+\d+\.\d s: RuntimeError: a consequence elsewhere "
                             r"\(.*many_ranks.py:\d+\)", err)
    assert len(consequence) == 1 and err.count("a consequence elsewhere") == 1, err[-4000:]
    assert err.count("calling MPI_Abort") == 1, err[-4000:]
    files = list(reports.glob("hpcsync-first-failure-*.json"))
    assert len(files) == 1, files
    rep = json.loads(files[0].read_text())
    texts = sorted(t["text"].strip().splitlines()[-1] for t in rep["tracebacks"].values())
    assert texts == ["RuntimeError: a consequence elsewhere", "ValueError: bad batch on rank 7"], rep["tracebacks"]
    assert [(g["ranks"], g["count"]) for g in rep["others"]] == [("0-6, 8-15", 15)], rep["others"]
    assert files[0].stat().st_size < 8000, files[0].stat().st_size


def test_the_programs_own_timed_out_error_is_its_own_report_after_the_warnings(tmp_path):
    """gloo, 3 ranks, HPCSYNC_LOG_DIR: every rank warns, then rank 1's own code raises a RuntimeError
    that says "timed out" (a data loader's): the failure report with its traceback, not a hang
    report of a collective that had finished; the warnings held back on rank 0 reach the console
    before the job is aborted, and rank 1's file holds its traceback."""
    logs = tmp_path / "logs"
    res = run(openmpi(), 3, "many_ranks.py", "raise", "gloo", "1", "timeout", tmp_path=tmp_path, expect_ok=False,
              env={"HPCSYNC_LOG_DIR": str(logs)}, timeout=180)
    err = res.stderr
    assert "HANG REPORT" not in err, err[-4000:]
    assert f"uncaught exception on rank 1 ({HOST}), the first to fail, at step 40" in err, err[-4000:]
    assert err.count("RuntimeError: DataLoader worker timed out after 60 seconds") == 1, err[-4000:]
    assert f"[3 ranks 0-2 on {HOST}] WARNING app: loss is NaN at step 40" in err, err[-4000:]
    assert "Traceback" in (logs / "rank-00001.log").read_text()


def test_print_capture_needs_a_log_folder_and_the_programs_handlers_keep_their_level(tmp_path):
    """One process: capture_print without a folder is a clear error; with the program's own root
    handler, setup_logging keeps the root level and warns that it prints every rank's records."""
    code = ("import logging, hpcsync\n"
            "try:\n    hpcsync.setup_logging(capture_print=True)\nexcept ValueError as e:\n    print('refused:', e)\n"
            "logging.basicConfig(level=logging.WARNING)\n"
            f"hpcsync.setup_logging({str(tmp_path / 'logs')!r})\n"
            "print('level', logging.getLogger().level)\n")
    p = subprocess.run([PY, "-c", code], env=clean_env({"HPCSYNC_MPI": "0"}), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "refused: hpcsync.setup_logging: capture_print (HPCSYNC_LOG_PRINT) needs a log folder" in p.stdout, p.stdout
    assert f"level {30}" in p.stdout and "pass console=False" in p.stderr, (p.stdout, p.stderr)


LINES = {"sleep": "time.sleep(120)", "loop": "while True:"}


@pytest.mark.parametrize("launcher,kind", [("openmpi", "sleep"), ("openmpi", "skip"), ("mpich", "loop")])
def test_a_stalled_gloo_collective_is_one_report_naming_the_rank(launcher, kind, tmp_path):
    """gloo, 3 ranks, timeout 4 s: rank 2 sleeps, skips a collective or loops; the job ends within the
    timeout + 45 s with one hang report from torch's flight recorder and the ranks' stacks:
    rank 2 never entered the collective the others wait in, on this node, at its line."""
    t0 = time.monotonic()
    res = run(LAUNCHERS[launcher](), 3, "many_ranks.py", "hang", "gloo", kind, tmp_path=tmp_path, expect_ok=False,
              timeout=180, env={"HPCSYNC_REPORT_DIR": str(tmp_path)})
    took = time.monotonic() - t0
    err = res.stderr
    assert res.returncode != 0 and took < 4 + 45 + 15, (took, err[-4000:])  # + the start of 3 ranks
    assert err.count("HANG REPORT") == 1, err[-6000:]
    seq = 10 if kind == "skip" else 6  # the skipping rank ran ahead: the others wait in the last one
    assert re.search(rf"HANG REPORT: all_reduce #{seq} \(Float\[8\]\) in group '0' \(ranks 0-2\) did not complete "
                     r"within 4 s", err), err[-4000:]
    assert f"never entered #{seq}: rank(s) 2 on {HOST}" in err and f"inside #{seq}: rank(s) 0-1 on {HOST}" in err
    block = err[err.index(f"  rank 2 ({HOST}): last operation all_reduce #{seq - 1}"):]
    where = "(the program has returned" if kind == "skip" else LINES[kind]
    assert where in block.split("\n  ranks 0-1")[0], block
    assert re.search(r"ranks 0-1 \(.*\): last operation all_reduce #\d+ .*\n.*many_ranks.py\", line \d+", err), err
    reports = [p for p in os.listdir(tmp_path) if p.startswith("hpcsync-hang-")]
    assert len(reports) == 1, reports


def test_the_report_names_the_earliest_raise_whoever_won_the_claim():
    """Rank 0 won the claim (its own needs no message) though rank 2 raised 0.2 s earlier: the
    report's first failure is rank 2's, with its traceback, and rank 0 is among the others."""
    from hpcsync.observe import digest

    def failed(t, err):
        return {"failed": True, "time": t, "error": err, "where": "train.py:9", "step": 40}

    states = {0: failed(100.2, "RuntimeError: a consequence"), 1: failed(100.2, "RuntimeError: a consequence"),
              2: failed(100.0, "ValueError: bad batch")}
    rep = digest.build(0, states, 3, {2: "Traceback\nValueError: bad batch\n"})
    assert (rep["rank"], rep["reported_by"], rep["error"]) == (2, 0, "ValueError: bad batch"), rep
    assert rep["others"] == [{"state": "failed", "ranks": "0-1", "count": 2, "first": 0, "nodes": [], "hash": "",
                              "error": "RuntimeError: a consequence", "messages": 1, "where": "train.py:9",
                              "after_s": 0.2}], rep
    block = digest.format_block(rep, "rank 0's own traceback")
    assert "uncaught exception on rank 2 (?), the first to fail, at step 40" in block and "ValueError: bad batch" in block
    assert "rank 0's own traceback" not in block


def test_alike_warnings_of_ranks_a_loaded_node_slows_are_one_line(monkeypatch):
    """Rank 0's collector, fed by hand: three ranks log one warning 0.6 s apart (1.2 s from first
    to last, as on an oversubscribed node): one line naming all three once none came for a
    second; a line still arriving is held 5 s at most, and says how many times it came."""
    from hpcsync.observe import logs

    lines = []
    monkeypatch.setattr(logs, "_write", lines.append)
    monkeypatch.setattr(logs, "_line", lambda level, name, text, ranks, times: (text, ranks, times))
    c = logs._Collector.__new__(logs._Collector)  # no MPI thread: add and flush only
    c.lock, c.pending = threading.Lock(), {}
    for rank in range(3):
        c.add(logging.WARNING, "app", "alike", rank)
        time.sleep(0.6)
        c.flush()
        assert lines == [], "printed while ranks were still arriving"
    time.sleep(0.5)
    c.flush()
    assert lines == [("alike", [0, 1, 2], 3)]
    t0 = time.monotonic()
    while not lines[1:]:
        c.add(logging.WARNING, "app", "again", 0)
        c.flush()
        time.sleep(0.1)
    assert lines[1][:2] == ("again", [0]) and lines[1][2] > 1 and 4.9 < time.monotonic() - t0 < 6.0  # counted


def test_warnings_logged_to_the_end_are_printed_and_counted(tmp_path):
    """MPICH, 2 ranks: rank 0 is done while rank 1 still works and warns 1.5 s later: rank 0's
    console waits for every rank's last words (they were lost); a warning a rank repeats is one
    line that says how many times it came."""
    res = run(LAUNCHERS["mpich"](), 2, "late_warning.py", tmp_path=tmp_path, timeout=120)
    assert res.stderr.count("a late warning from rank 1") == 1, res.stderr
    assert f"[rank 1 on {HOST}] WARNING app: a late warning from rank 1" in res.stderr, res.stderr
    line = f"[2 ranks 0-1 on {HOST}] WARNING app: the same warning, three times on every rank (logged 6 times)"
    assert res.stderr.count("the same warning, three times") == 1 and line in res.stderr, res.stderr
