"""The everyday path, pattern by pattern: every pattern the README and the docs show
(``tests/programs/everyday.py``), with one fault on one rank of 2-4 (an exception out of the
program's own code, a SIGKILL, a clean exit mid-run, a rank that leaves out one call), on both MPI
libraries: every run takes each pattern and fault on one of them (alternating over the table, so
each pattern and each fault meets both), the long runs the other. Where, when and on which rank each fault strikes is drawn (seeded by the case's name,
so a failure reruns as it failed).

Each job must end non-zero: an exception or a death within ``BOUND`` seconds under the default
settings (an exception is not a hang: the default timeout of 1,800 s must not be what ends it), a
rank that is missing or exits within ``HPCSYNC_TIMEOUT`` + ``BOUND``. The cause comes first, before
any other rank's hang report; what the pattern writes is complete or absent (never half-written),
every rank's part is kept for ``hpcsync merge``, and a rerun without the fault completes with the
right contents."""
import filecmp
import json
import os
import random
import re
import shlex
import subprocess
import time

import pytest

from launch import PY, clean_env, long_run, mpich, openmpi, run

pytestmark = pytest.mark.alone  # bounds of wall time

PATTERNS = ("synced_file", "sync_file", "stage", "checkpoints", "checkpoints_background", "h5", "preemption",
            "monitor", "comm")
FAULTS = ("raise", "kill", "exit", "skip")
LIBRARIES = {"openmpi": openmpi, "mpich": mpich}
STEPS = 3  # as in the program
BOUND = 45.0
TIMEOUT = 3  # HPCSYNC_TIMEOUT for the faults that leave ranks waiting (exit, skip)
WRITES = {"synced_file", "sync_file", "stage", "checkpoints", "checkpoints_background", "h5"}  # what leaves files to check and rerun
# a rank may leave out monitor.step() calls: ranks close after different numbers of steps by design
TOLERATED = {("monitor", "skip")}


def draw(pattern, fault, library):
    rng = random.Random(f"{pattern}-{fault}-{library}")
    n = rng.choice((2, 3, 4))
    cfg = {"pattern": pattern, "fault": fault, "rank": rng.randrange(n),
           "step": rng.randrange(STEPS + (pattern == "sync_file")), "where": rng.choice(("before", "after"))}
    if fault == "skip":  # the call left out: sync_file's is the join, after the steps
        cfg.update(where="before", step=STEPS if pattern == "sync_file" else cfg["step"])
    if fault == "exit" and cfg["step"] >= STEPS - 1:  # (an exit after the last call is the program's normal end)
        cfg.update(where="before")
    if pattern == "sync_file" and cfg["step"] == STEPS:  # (the join's point: before it, or it is the program's end)
        cfg.update(where="before")
    return cfg, n


def prepare(folder, pattern):
    if pattern == "stage":
        src = folder / "src"
        (src / "sub").mkdir(parents=True)
        rng = random.Random(7)
        for i in range(6):
            (src / ("sub" if i % 2 else "") / f"f{i}.bin").write_bytes(rng.randbytes(rng.randrange(1, 200_000)))


def check_files(folder, pattern, n, complete):
    """What the pattern wrote: complete, or absent (``complete``: it must be there, whole)."""
    if pattern in ("synced_file", "sync_file"):
        target = folder / "metrics.csv"
        want = "rank,step\n" + "".join(f"{r},{s}\n" for r in range(n) for s in range(STEPS))
        if complete or target.exists():
            assert target.read_text() == want, target.read_text()
    elif pattern == "stage":
        dst = folder / "dst"
        if complete:
            cmp = filecmp.dircmp(folder / "src", dst, ignore=[".hpcsync-stage.json", ".hpcsync-stage.journal"])  # (stage's journal)
            assert not cmp.left_only and not cmp.right_only and not cmp.diff_files, cmp.report()
            for sub in cmp.subdirs.values():
                assert not sub.left_only and not sub.right_only and not sub.diff_files, sub.report()
    elif pattern == "h5" and complete:  # (after a fault the file is as far as the job got: not checked)
        import h5py
        import numpy as np

        with h5py.File(folder / "rows.h5", "r") as f:
            got = f["x"][...]
        want = np.concatenate([np.full((r + 1, 2), r * 100 + s) for s in range(STEPS) for r in range(n)])
        assert got.tolist() == want.tolist(), got
    elif pattern.startswith("checkpoints"):  # the rerun loads the latest complete one (the program checks its contents)
        pass


def job(folder, lib, n, cfg, env, limit=None):
    t0 = time.monotonic()
    res = run(LIBRARIES[lib](), n, "everyday.py", json.dumps({**cfg, "dir": str(folder)}), tmp_path=folder,
              timeout=limit or BOUND + float(env.get("HPCSYNC_TIMEOUT", 0)) + 15, env=env, expect_ok=False)
    return res, time.monotonic() - t0


def cause_first(res, cfg):
    """The fault's own words before any other rank's report of a wait."""
    text = res.stderr + res.stdout
    waits = [m.start() for m in re.finditer(r"did not arrive|timed out|hang|stall|silent", text)]
    first_wait = min(waits) if waits else len(text)
    bad = cfg["rank"]
    if cfg["fault"] == "raise":
        at = text.find(f"injected fault on rank {bad}")
        assert 0 <= at < first_wait, f"the exception is not the first thing said:\n{text[-6000:]}"
    elif cfg["fault"] == "kill":
        at = min((i for i in (text.find("signal 9"), text.find("Killed")) if i >= 0), default=-1)
        assert 0 <= at < first_wait, f"the killed rank is not the first thing said:\n{text[-6000:]}"
    else:  # a rank missing: the first report names it
        at = text.find("[hpcsync]")
        assert at >= 0 and f"rank {bad}" in text[at:at + 3000], f"the first report does not name rank {bad}:\n{text[-6000:]}"


def every_run(pattern, fault):
    """The library a pattern and fault are run on in every run: the two alternate over the
    table, so each pattern and each fault meets both (the other half is a long run)."""
    return list(LIBRARIES)[(PATTERNS.index(pattern) + FAULTS.index(fault)) % 2]


CASES = [pytest.param(p, f, lib, id=f"{p}-{f}-{lib}", marks=() if lib == every_run(p, f) else long_run)
         for lib in LIBRARIES for p in PATTERNS for f in FAULTS]


@pytest.mark.parametrize("pattern,fault,lib", CASES)
def test_one_fault_ends_the_job_cause_first_and_loses_nothing(tmp_path, pattern, fault, lib):
    cfg, n = draw(pattern, fault, lib)
    prepare(tmp_path, pattern)
    env = {"HPCSYNC_TIMEOUT": str(TIMEOUT)} if fault in ("exit", "skip") else {}
    res, took = job(tmp_path, lib, n, cfg, env)
    started = {p.name: p.read_text() for p in tmp_path.glob(".started.*")}
    assert started == {f".started.{r}": str(n) for r in range(n)}, f"not one world of {n} ranks: {started} {res}"
    if (pattern, fault) in TOLERATED:
        assert res.returncode == 0 and all(res.ranks), res
        return
    assert res.returncode != 0, f"the job ended well despite the fault ({cfg}): {res}"
    limit = BOUND + (TIMEOUT if env else 0)
    if os.environ.get("HPCSYNC_TEST_TABLE"):  # the table of the docs: case, seconds, the first line said
        said = next((ln for ln in (res.stderr + res.stdout).splitlines() if ln.strip()), "")
        with open(os.environ["HPCSYNC_TEST_TABLE"], "a") as f:
            f.write(json.dumps({"case": f"{pattern}-{fault}-{lib}", **cfg, "n": n, "s": round(took, 1),
                                "first": said[:160]}) + "\n")
    assert took < limit, f"{cfg}: took {took:.1f} s (bound {limit:.0f} s): {res}"
    cause_first(res, cfg)
    litter = [p.name for p in tmp_path.glob("hpcsync-*")]  # (the jobs' working directory)
    assert not litter, f"files left in the working directory unasked: {litter}"
    check_files(tmp_path, pattern, n, complete=False)
    if pattern == "synced_file" and fault in ("raise", "kill"):  # every rank's part kept, with its rows so far
        parts = sorted((tmp_path / ".metrics.csv.parts").glob("rank*"))
        assert len(parts) == n and all(p.read_text().startswith("rank,step\n") for p in parts), parts
    if pattern in WRITES:  # the rerun, without the fault, on the same files
        again, _ = job(tmp_path, lib, n, {**cfg, "fault": "none"}, {}, limit=180)  # (no bound: it must work)
        assert again.returncode == 0 and all(again.ranks), f"the rerun failed: {again}"
        check_files(tmp_path, pattern, n, complete=True)


@pytest.mark.parametrize("lib,n,stops,how", [("openmpi", 3, 2, "break"), ("mpich", 2, 1, "break"),
                                             ("openmpi", 2, 1, "exit"), ("mpich", 3, 2, "exit")])
def test_a_resumed_run_continues_the_joined_csv(tmp_path, lib, n, stops, how):
    """Stopped by SIGUSR1 on a drawn rank at a drawn step (a real signal, the guard's agreed stop,
    a checkpoint), run again from the checkpoint ``stops`` times: ``SyncedFile(append=True)``
    keeps every row the earlier runs joined, adds each run's own after them, one header, each
    (rank, step) exactly once, and the file between two runs is what the first left. The stop
    leaves the block by ``break``, or by the README's ``raise SystemExit(...)`` inside it."""
    rng = random.Random(f"resume-{lib}-{n}-{stops}")
    steps, runs, joined = 12, [], []
    for k in range(stops + 1):
        stop = [str(rng.randrange(n)), str(rng.randrange(4 * k + 1, 4 * k + 4)), how] if k < stops else []
        res = run(LIBRARIES[lib](), n, "resume_rows.py", str(tmp_path), str(steps), *stop, tmp_path=tmp_path,
                  timeout=120, expect_ok=False)
        assert all(res.ranks) and {r["world_size"] for r in res.ranks} == {n}, res
        assert res.returncode == 0, res  # (the guard's code outside Slurm after SIGUSR1: 0)
        text = (tmp_path / "metrics.csv").read_text()
        if joined:
            assert text.startswith(joined[-1]), f"run {k} lost rows the run before joined:\n{text}"
        joined.append(text)
        runs.append(res.ranks)
    lines = joined[-1].splitlines()
    assert lines[0] == "rank,step,value" and lines.count("rank,step,value") == 1, lines
    seen = [tuple(int(x) for x in line.split(",")[:2]) for line in lines[1:]]
    assert sorted(seen) == [(r, s) for r in range(n) for s in range(steps)], seen
    starts = [ranks[0]["start"] for ranks in runs]
    assert starts[0] == 0 and all(b == ranks[0]["stopped"] + 1 for b, ranks in zip(starts[1:], runs)), runs
    assert all(len(set(p)) == 1 for p in ([r["stopped"] for r in ranks] for ranks in runs)), runs  # one agreed step


@pytest.mark.parametrize("lib", ["openmpi", "mpich"])
def test_append_after_a_crash_refuses_to_erase_the_unjoined_rows_and_says_how_to_keep_them(tmp_path, lib):
    """A run joins its rows at a stop; the next crashes inside the block (its rows only in the
    parts). The rerun with ``append=True`` must not start its parts anew over them: the same
    SyncError on every rank, the parts byte for byte as they were, the message's ``hpcsync merge
    --append`` command adds them after the file's rows (one header), and the run after it works."""
    n, steps = 2, 10
    run(LIBRARIES[lib](), n, "resume_rows.py", str(tmp_path), str(steps), "1", "3", "break",
        tmp_path=tmp_path, timeout=120)
    first = (tmp_path / "metrics.csv").read_text()
    crash = run(LIBRARIES[lib](), n, "resume_rows.py", str(tmp_path), str(steps), "0", "6", "crash",
                tmp_path=tmp_path, timeout=120, expect_ok=False)
    assert crash.returncode != 0 and (tmp_path / "metrics.csv").read_text() == first, crash
    parts = tmp_path / ".metrics.csv.parts"
    kept = {p.name: p.read_bytes() for p in parts.iterdir()}
    assert len(kept) == n and all(kept.values()), kept
    again = run(LIBRARIES[lib](), n, "resume_rows.py", str(tmp_path), str(steps), tmp_path=tmp_path,
                timeout=120, expect_ok=False)
    text = again.stderr + again.stdout
    assert again.returncode != 0 and not any(again.ranks), again
    assert {p.name: p.read_bytes() for p in parts.iterdir()} == kept, "the unjoined parts were touched"
    assert (tmp_path / "metrics.csv").read_text() == first
    command = re.search(r"Keep them: (hpcsync merge --append .*?); or drop them", text)
    assert command and "SyncError" in text, text[-4000:]
    merged = subprocess.run(command.group(1).replace("hpcsync merge", f"{shlex.quote(PY)} -m hpcsync merge", 1),
                            shell=True, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=clean_env())
    assert merged.returncode == 0, merged
    rows = (tmp_path / "metrics.csv").read_text()
    want = first + "".join(b.decode().split("\n", 1)[1] for _, b in sorted(kept.items()))
    assert rows == want, rows
    last = run(LIBRARIES[lib](), n, "resume_rows.py", str(tmp_path), str(steps), tmp_path=tmp_path, timeout=120)
    assert all(last.ranks) and (tmp_path / "metrics.csv").read_text().startswith(rows)


def test_a_synced_file_made_on_one_rank_is_local(tmp_path):
    """Made, not entered: nothing collective, so the job goes on (it waited for the others and
    timed out, with the world's control communicator broken for good)."""
    res = run(openmpi(), 2, "synced_local.py", str(tmp_path), tmp_path=tmp_path, timeout=120,
              env={"HPCSYNC_TIMEOUT": "5"}, expect_ok=False)
    assert res.returncode == 0 and all(res.ranks) and {r["world_size"] for r in res.ranks} == {2}, res


KEEP = "set HPCSYNC_REPORT_DIR"  # the words that say where a folder would keep the reports
WRITERS = {"hang": "hpcsync-*failure-*.json", "straggler": "hpcsync-straggler-*.json"}  # (a failure report's, or a hang's record)
FOLDER_CASES = [(w, f) for w in WRITERS for f in ("", "HPCSYNC_REPORT_DIR", "HPCSYNC_LOG_DIR")] + [("hang", "log_dir=")]


@pytest.mark.parametrize("writer,folder", FOLDER_CASES, ids=[f"{w}-{f or 'nofolder'}" for w, f in FOLDER_CASES])
def test_report_files_go_only_where_a_folder_is_set(tmp_path, writer, folder):
    """A hang (a rank leaves out a comm helper) and a straggler verdict: their files go to
    HPCSYNC_REPORT_DIR, else HPCSYNC_LOG_DIR (the job's log folder); with neither, nowhere, and
    the console says where to set a folder to keep them, once a process that left one unwritten.
    Never the working directory. ``init(log_dir=...)`` is a log folder as ``HPCSYNC_LOG_DIR`` is."""
    kept = tmp_path / "kept"
    env = {folder: str(kept)} if folder and folder != "log_dir=" else {}
    if writer == "hang":
        cfg = {"pattern": "comm", "fault": "skip", "rank": 1, "step": 1, "where": "before"}
        if folder == "log_dir=":  # init(log_dir=...): the job's log folder as HPCSYNC_LOG_DIR makes it
            cfg["log_dir"] = str(kept)
        res, _ = job(tmp_path, "openmpi", 2, cfg, {"HPCSYNC_TIMEOUT": str(TIMEOUT), **env})
        assert res.returncode != 0, res
    else:
        res = run(openmpi(), 3, "warn_default.py", "none", str(tmp_path), tmp_path=tmp_path, env=env, timeout=120)
        assert res.ranks[0]["stragglers"] == [2], res.ranks[0]
    said = res.stderr + res.stdout
    assert not list(tmp_path.glob("hpcsync-*")), list(tmp_path.iterdir())
    if folder:
        assert list(kept.glob(WRITERS[writer])), list(kept.iterdir())
        assert KEEP not in said, said[-4000:]
    else:
        assert not kept.exists(), list(kept.iterdir())
        # once a process: the straggler's one rank 0; a hang's each rank that printed a report
        # (here a failure report and a hang report, from the two ranks)
        assert said.count(KEEP) == 1 if writer == "straggler" else 1 <= said.count(KEEP) <= 2, said[-4000:]


# hpcsync's warnings, each source's words and on how many of 3 ranks it logs them
SOURCES = {"alike": ("checkpoint step-7 skipped: incomplete", 3), "own": ("only rank one says this", 1),
           "checkpoint": ("hpcsync.checkpoint: skipping ", 1), "straggler": ("hpcsync: straggler: rank 2 ", 1),
           "requeue": ("stopped on SIGTERM, which ends a job", 1)}
LOGGING = ("none", "before", "after", "ours", "errors")  # the program's logging (tests/programs/warn_default.py)
WARN_CASES = [(mode, setting) for mode in LOGGING for setting in ("1", "0")]


@pytest.mark.parametrize("mode,setting", WARN_CASES, ids=[f"{m}-warnings{s}" for m, s in WARN_CASES])
def test_hpcsyncs_warnings_reach_the_console_by_default_once(tmp_path, mode, setting):
    """Warnings of several sources (the program's under ``hpcsync``, a checkpoint skipped as
    incomplete, a straggler, a requeue), 3 ranks: with no logging of the program's that takes
    them (none, or a handler at ERROR), each is one line, folded across ranks; a program's own
    handler (on the root logger, before or after init, or on the ``hpcsync`` logger) prints them
    its way, once a rank that logged it, never twice; HPCSYNC_WARNINGS=0 silences hpcsync's
    console, nothing else."""
    res = run(openmpi(), 3, "warn_default.py", mode, str(tmp_path), tmp_path=tmp_path,
              env={"HPCSYNC_WARNINGS": setting}, timeout=120)
    err = res.stderr
    assert res.ranks[0]["stragglers"] == [2], res.ranks[0]
    lines = {k: [ln for ln in err.splitlines() if words in ln] for k, (words, _) in SOURCES.items()}
    if mode in ("none", "errors"):  # nothing of the program's takes them: hpcsync's console or nothing
        if setting == "0":
            assert not any(lines.values()), err
            return
        assert all(len(v) == 1 for v in lines.values()), (lines, err)
        assert "USER" not in err, err
        assert re.match(r"\[3 ranks 0-2[^\]]*\] WARNING hpcsync.resilience.checkpoint: checkpoint step-7", lines["alike"][0])
        assert re.match(r"\[rank 1[^\]]*\] WARNING hpcsync.resilience.checkpoint: only rank one", lines["own"][0])
        assert re.match(r"\[rank 0[^\]]*\] WARNING hpcsync.observe.monitor: hpcsync: straggler", lines["straggler"][0])
    else:  # the program's own handler: every rank's records, as the program asked, once each
        assert {k: len(v) for k, v in lines.items()} == {k: n for k, (_, n) in SOURCES.items()}, (lines, err)
        assert all(ln.startswith("USER WARNING hpcsync.") for v in lines.values() for ln in v), (lines, err)
    assert not list(tmp_path.glob("hpcsync-*")), list(tmp_path.iterdir())  # (no report folder: no record)


def test_an_exception_the_program_catches_outside_the_block_is_a_sync_error_at_once(tmp_path):
    """Found by a review: the failing rank that skipped the block's agreement left the others
    waiting out the default timeout when the program caught the exception and went on. Its flag
    is posted without waiting: the others raise SyncError in seconds, the job goes on."""
    res = run(openmpi(), 3, "caught.py", str(tmp_path), tmp_path=tmp_path, timeout=60)
    outs = [d["out"] for d in res.ranks]
    assert outs == ["SyncError", "ValueError", "SyncError"] and all(d["s"] < 15 and d["sum"] == 3 for d in res.ranks), \
        res.ranks
    assert not (tmp_path / "m.csv").exists() and len(list((tmp_path / ".m.csv.parts").iterdir())) == 3
