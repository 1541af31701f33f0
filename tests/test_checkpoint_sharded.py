"""Sharded hpcsync.Checkpoints (``save(step, sharded=STATE)``, ``load(sharded=TEMPLATE)``): an
FSDP2 model on 4 real MPI ranks resumes bit for bit in a fresh job, loads at another world size,
and keeps the guarantees of the other form (crash safety at every filesystem change, loading runs
no code, one job per root). Across namespace nodes: tests/test_checkpoint_nodes.py."""
import json
import pickle
import shutil

import pytest

from launch import openmpi, run
from test_checkpoint import ckpt_op

CASES = [("gloo", "sync"), ("gloo", "background"), ("hpcsync", "background")]


def train(tmp_path, backend, root, steps, mode, n=4):
    return run(openmpi(), n, "sharded_ckpt.py", backend, str(root), str(steps), "5", mode, tmp_path=tmp_path,
               timeout=240)


@pytest.mark.parametrize("backend,mode", CASES, ids=[f"{b}-{m}" for b, m in CASES])
def test_fsdp2_resumes_bit_for_bit_from_a_sharded_checkpoint(tmp_path, backend, mode):
    """12 steps straight, against 10 steps (saved at 5 and 10) and a fresh job that resumes from
    step 10: the same parameters, bit for bit, on every rank; each rank got its own local state."""
    whole = train(tmp_path, backend, tmp_path / "whole", 12, mode)
    root = tmp_path / "cut"
    train(tmp_path, backend, root, 10, mode)
    resumed = train(tmp_path, backend, root, 12, "resume")
    for r, (a, b) in enumerate(zip(whole.ranks, resumed.ranks)):
        assert b["loaded"] == {"step": 10, "shared": {"every": 5}, "local": {"rank": r, "step": 10}}, b
        assert b["trained"] == [11, 12] and a["trained"] == [1, 12], (a, b)
        assert a["params"] == b["params"], f"rank {r}: the resumed run differs from the uninterrupted one"
    assert whole.ranks[0]["listing"] == ["OWNER", "step-00000005", "step-00000010"], whole.ranks[0]
    files = json.loads((root / "step-00000010" / "COMPLETE").read_text())["files"]
    assert {f"rank-{r:05d}.pt" for r in range(4)} <= set(files) and "sharded/.metadata" in files, files
    assert all(f"sharded/__{r}_0.distcp" in files for r in range(4)), "a rank wrote no shard of its own"
    if mode == "sync" and backend == "gloo":  # the same checkpoint at another world size: resharded
        two = run(openmpi(), 2, "sharded_ckpt.py", backend, str(root), "12", "5", "full", tmp_path=tmp_path,
                  timeout=240)
        four = train(tmp_path, backend, root, 12, "full")
        assert two.ranks[0]["params"] == four.ranks[0]["params"] == four.ranks[3]["params"]
        assert two.ranks[0]["loaded"]["local"] is False and four.ranks[2]["loaded"]["local"] == {"rank": 2, "step": 10}


@pytest.mark.parametrize("mode", ["sharded", "sharded-background"])
def test_a_sharded_save_keeps_a_complete_checkpoint_at_every_moment(mode, tmp_path):
    """step 5 saved sharded, then again by a process that dies just before its k-th filesystem
    change -- hpcsync's and torch.distributed.checkpoint's own -- for every k: the next start
    always finds a complete step 5, the old content or the new, never nothing."""
    base = tmp_path / "base"
    ckpt_op(tmp_path, "save-sharded", base, 1, "5=old")
    seen, k = set(), 1
    while True:
        root = tmp_path / f"crash{k}"
        shutil.copytree(base, root)
        res = ckpt_op(tmp_path, "crash", root, k, 5, "new", mode, expect_ok=False)
        got = ckpt_op(tmp_path, "load-sharded", root).ranks[0]["loaded"]
        assert got and (got["step"], got["v"]) in {(5, "old"), (5, "new")}, f"killed before change {k}: {got}\n{res}"
        seen.add(got["v"])
        if res.returncode == 0:  # no k-th change: the save ran to its end
            assert res.ranks[0]["points"] == k - 1 and got["v"] == "new", res
            break
        assert res.returncode == 9, res
        k += 1
    assert k > 8 and seen == {"old", "new"}, (k, seen)


def test_a_planted_sharded_checkpoint_runs_no_code_on_load(tmp_path):
    """A newer sharded step planted in the root whose DCP metadata would run a command when
    unpickled: load(sharded=...) refuses it with the reason, nothing runs; the form that loads
    without sharded= says which form the checkpoint has."""
    import os

    root = tmp_path / "ckpt"
    ckpt_op(tmp_path, "save-sharded", root, 2, "10=mine")
    victim = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {victim}",))

    planted = root / "step-00999999"
    shutil.copytree(root / "step-00000010", planted)
    (planted / "sharded" / ".metadata").write_bytes(pickle.dumps(Payload()))
    marker = json.loads((planted / "COMPLETE").read_text())
    marker.update(step=999999, seq=10**6)
    marker["files"]["sharded/.metadata"] = (planted / "sharded" / ".metadata").stat().st_size
    (planted / "COMPLETE").write_text(json.dumps(marker))
    got = ckpt_op(tmp_path, "load-sharded", root).ranks[0]["loaded"]
    assert not victim.exists(), "loading the checkpoint ran the planted command"
    assert "error" in got and "posix.system is not allowed in a checkpoint's metadata" in got["error"], got
    plain = ckpt_op(tmp_path, "load", root).ranks[0]["loaded"]
    assert "was saved with sharded=: load it with load(sharded=" in plain["error"], plain
