"""A checkpoint root's ``OWNER`` record healed in one bounded step: whatever the file holds
(generated: empty, random bytes, truncated JSON, JSON of the wrong shape, another live process's
record), ``save()``/``load()`` take the root over with a warning when the record can name no
live job, refuse it on every rank when it names one, and decide within a second (a live
process of this host is given ``ENDING_WAIT_S`` to end first: a job that just failed)."""
import json
import logging
import os
import random
import socket
import subprocess
import sys
import time

import pytest

from hpcsync.core.errors import CheckpointError
from hpcsync.resilience import root_owner
from launch import openmpi, run

SEED = int(os.environ.get("HPCSYNC_TEST_SEED", "5601"))
KEYS = ("slurm_job", "host", "pid", "start")


def _damaged(rng: random.Random, me: dict) -> list:
    """``(kind, bytes)``: OWNER contents that name no job that runs."""
    whole = json.dumps({**me, "pid": 1 << 30}).encode()  # (a record of nobody: the one truncated)
    cases = [("empty", b""), ("null", b"null"), ("list", b"[1, 2]"), ("number", str(rng.randint(-9, 9 ** 9)).encode()),
             ("string", b'"OWNER"'), ("spaces", b" \n\t"), ("nested", json.dumps({"job": me}).encode()),
             ("wrong types", json.dumps({"slurm_job": None, "host": 7, "pid": "12", "start": []}).encode())]
    for i in range(6):
        cases.append((f"random bytes #{i}", bytes(rng.randrange(256) for _ in range(rng.randint(1, 300)))))
        cases.append((f"truncated JSON #{i}", whole[:rng.randint(1, len(whole) - 1)]))
        missing = rng.sample(KEYS[1:], rng.randint(1, 3))
        cases.append((f"missing {'/'.join(missing)}", json.dumps({k: v for k, v in me.items() if k not in missing}
                                                                  ).encode()))
    return cases


def test_a_damaged_or_foreign_owner_is_taken_over_or_refused_within_a_second(tmp_path, caplog):
    """Each generated OWNER under a fresh root: claim() takes it over (OWNER then names this job,
    with a warning naming the file) within 1 s and without recursion; a live other process's
    record (this host) is refused with the CheckpointError that names it; a directory where
    OWNER should be is a clear CheckpointError, not a FileNotFoundError of a temporary."""
    rng, me = random.Random(SEED), root_owner.this_job()
    for n, (kind, data) in enumerate(_damaged(rng, me)):
        root = tmp_path / f"r{n}"
        root.mkdir()
        (root / root_owner.OWNER).write_bytes(data)
        caplog.clear()
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, "hpcsync"):
            try:
                root_owner.claim(str(root), me)
            except Exception as exc:
                pytest.fail(f"seed {SEED}, {kind} {data[:60]!r}: {type(exc).__name__}: {str(exc)[:300]}")
        took = time.monotonic() - t0
        assert took < 1, (SEED, kind, took)
        got = json.loads((root / root_owner.OWNER).read_text())
        assert {k: got[k] for k in KEYS} == me, (SEED, kind, got)
        assert any(str(root / root_owner.OWNER) in r.getMessage() for r in caplog.records), (SEED, kind, caplog.text)
        assert sorted(p.name for p in root.iterdir()) == [root_owner.OWNER], (SEED, kind)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        theirs = {"slurm_job": None, "host": socket.gethostname(), "pid": alive.pid,
                  "start": root_owner.start_ticks(alive.pid)}
        root = tmp_path / "live"
        root.mkdir()
        (root / root_owner.OWNER).write_text(json.dumps(theirs))
        t0 = time.monotonic()
        with pytest.raises(CheckpointError, match=f"in use by process {alive.pid} on "):
            root_owner.claim(str(root), me)
        assert time.monotonic() - t0 < root_owner.ENDING_WAIT_S + 1
        assert json.loads((root / root_owner.OWNER).read_text()) == theirs
    finally:
        alive.kill()
        alive.wait()
    root = tmp_path / "dir"
    (root / root_owner.OWNER).mkdir(parents=True)
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="OWNER"):
        root_owner.claim(str(root), me)
    assert time.monotonic() - t0 < 1


def test_a_job_saves_and_loads_over_an_empty_or_garbage_owner(tmp_path):
    """A real 2-rank job, the root's OWNER empty, then random bytes: save() and load() work on
    every rank (the first takes the root over with a warning that reaches the console)."""
    rng = random.Random(SEED)
    for data in (b"", bytes(rng.randrange(256) for _ in range(64))):
        root = tmp_path / f"root{len(data)}"
        root.mkdir()
        (root / root_owner.OWNER).write_bytes(data)
        res = run(openmpi(), 2, "ckpt_runs.py", str(root), str(tmp_path / "local"), "plain:1=a", "local:2=b", "load",
                  tmp_path=tmp_path, timeout=120)
        for d in res.ranks:
            assert d["results"][:2] == [{"saved": "step-00000001"}, {"saved": d["results"][1].get("saved")}], d
            assert d["results"][2]["step"] == 2 and d["results"][2]["v"] == "b", d
        assert f"{root / root_owner.OWNER} is damaged" in res.stderr, res.stderr[-2000:]


def test_load_takes_a_step_by_the_rule_save_does_and_the_same_on_every_rank(tmp_path):
    """``load(step=)`` holds to :data:`STEP_RULE` as ``save()`` does: a step that is none (a
    string, a bool, a float, a negative number) is one clear error on every rank, not "no complete
    checkpoint of step 8" while step 8 is there, nor a float that loads; ranks that ask for
    different steps get one error naming them (rank 0's step is not loaded for all)."""
    from launch import openmpi, run

    cases = [[8, 8], [{"np": 8}, {"np": 8}], ["8", "8"], [True, True], [8.0, 8.0], [-1, -1], [8, 9], [8, "8"], [9, 9]]
    res = run(openmpi(), 2, "ckpt_load_steps.py", str(tmp_path / "root"), json.dumps(cases), tmp_path=tmp_path,
              timeout=120)
    for i, case in enumerate(cases):
        got = [d["out"][i] for d in res.ranks]
        assert got[0][:3] == got[1][:3] or (got[0][0] == got[1][0] == "CheckpointError"), (case, got)
        kind, words = got[0][0], got[0][1]
        if json.dumps(case) in ("[8, 8]", '[{"np": 8}, {"np": 8}]'):  # (8.0 == 8 in Python: compared as written)
            assert got[0][:2] == ["loaded", 8] and got[1][3] == {"r": 1}, (case, got)
        elif case == [9, 9]:
            assert kind in ("CheckpointError", "ValueError") and "no complete checkpoint of step 9" in words, (case, got)
        else:
            assert kind == "CheckpointError", (case, got)
            assert ("step is a non-negative integer" in words) or ("different steps" in words), (case, got)


def test_a_root_that_is_a_file_is_said_to_be_one(tmp_path):
    """``Checkpoints(path)`` where ``path`` is a file: "not a directory", not a second job."""
    from hpcsync.resilience.root_owner import claim, this_job

    root = tmp_path / "file"
    root.write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        claim(str(root), this_job())
