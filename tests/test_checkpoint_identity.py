"""A run's identity ties node-local copies to their root (``Checkpoints(root, local_dir=...)``):
real 2-rank MPI jobs on this host, each rank a node of its own (``programs/ckpt_runs.py``). A
root removed or replaced between runs never resumes the node copies left behind (a new run
starts fresh, or from the root's own checkpoints, with a warning on the console); saves of every
form are numbered from one counter in the root, so root-only saves between node-local ones are
the newest work when they are."""
import shutil

from launch import openmpi, run

FOREIGN = "node-local cop"  # ... of another run: the warning's words


def job(tmp_path, root, *ops, local=None):
    res = run(openmpi(), 2, "ckpt_runs.py", str(root), str(local or tmp_path / "local"), *ops, tmp_path=tmp_path,
              timeout=180)
    for d in res.ranks:
        assert not any("error" in (r or {}) for r in d["results"]), d
    return res


def loaded(res, i):
    """What op ``i`` loaded, the same on every rank: ``(step, v, from)`` or None."""
    got = [r["results"][i] and (r["results"][i]["step"], r["results"][i]["v"], r["results"][i]["from"])
           for r in res.ranks]
    assert len(set(got)) == 1, got
    return got[0]


def test_a_removed_root_is_a_new_run_that_starts_fresh_and_clears_the_old_copies(tmp_path):
    """Step 5 saved on the nodes only ("OLD"), the root removed: the next job's load() finds
    nothing (not the old copies) and says so on the console; its save of step 7 removes the old
    copies from every node; the job after it resumes step 7."""
    root = tmp_path / "root"
    first = job(tmp_path, root, "local:5=OLD")
    assert all(len(d["copies"]) == 1 and d["copies"][0].startswith("step-00000005.") for d in first.ranks), first.ranks
    shutil.rmtree(root)
    second = job(tmp_path, root, "load", "local:7=NEW")
    assert loaded(second, 0) is None, second.ranks
    assert f"not loading 2 {FOREIGN}ies of another run (fake0: step 5; fake1: step 5)" in second.stderr, \
        second.stderr[-3000:]
    assert all([c.split(".")[0] for c in d["copies"]] == ["step-00000007"] for d in second.ranks), second.ranks
    assert loaded(job(tmp_path, root, "load"), 0) == (7, "NEW", "nodes")


def test_a_root_moved_away_and_another_moved_in_loads_the_roots_own(tmp_path):
    """Run A saves step 5 on the nodes; run B saves step 3 into its root (no node copies); A's
    root moved away and B's renamed to A's path: a job there loads B's step 3 from the root, not
    A's copies (numbered the same), with the warning; a job at the moved root starts fresh (its
    copies are named after the old path)."""
    a, b = tmp_path / "a", tmp_path / "b"
    job(tmp_path, a, "local:5=A")
    job(tmp_path, b, "root:3=B")
    a.rename(tmp_path / "a-moved")
    b.rename(a)
    res = job(tmp_path, a, "load")
    assert loaded(res, 0) == (3, "B", "root"), res.ranks
    assert f"{FOREIGN}ies of another run" in res.stderr, res.stderr[-3000:]
    assert loaded(job(tmp_path, tmp_path / "a-moved", "load"), 0) is None


def test_root_only_saves_between_node_local_ones_resume_the_newest_work(tmp_path):
    """Steps 5 and 10 on the nodes, then 15 and 20 into the root only (another Checkpoints
    without local_dir: numbered on from the root's counter, not from 0): the next job resumes
    step 20 from the root, not the nodes' higher-numbered 10; it saves 25 on the nodes, which the
    job after it resumes; the rank-0 form shares the counter too (a plain save after them is
    numbered after 25)."""
    root = tmp_path / "root"
    job(tmp_path, root, "local:5=a", "local:10=b", "root:15=c", "root:20=d")
    res = job(tmp_path, root, "load", "local:25=e")
    assert loaded(res, 0) == (20, "d", "root"), res.ranks
    assert FOREIGN not in res.stderr, res.stderr[-3000:]
    res = job(tmp_path, root, "load", "plain:30=f")
    assert loaded(res, 0) == (25, "e", "nodes"), res.ranks
    import json

    seqs = sorted(json.loads((p / "COMPLETE").read_text())["seq"] for p in root.glob("step-*"))
    assert seqs == [3, 5], seqs  # keep=2: 20's (number 3) and the plain 30's (number 5, after 25's 4)


def test_a_damaged_owner_keeps_the_run_its_checkpoints_name(tmp_path):
    """Step 5 saved into the root, step 6 on the nodes only; then ``OWNER`` damaged (garbage, or
    a job record whose run is of the wrong shape): the root's checkpoints still name its run, so
    the next job resumes the newest work, step 6 from the nodes -- not step 5, the node copies
    taken for another run's and removed at the next save."""
    for i, damage in enumerate((b"\x00garbage{", b'{"slurm_job": null, "host": "h", "pid": 1, "start": null, '
                                                 b'"run": {"version": 1, "id": "x", "next_seq": "7"}}')):
        root, local = tmp_path / f"root{i}", tmp_path / f"local{i}"
        job(tmp_path, root, "root:5=A", "local:6=B", local=local)
        (root / "OWNER").write_bytes(damage)
        res = job(tmp_path, root, "load", "local:7=C", "load", local=local)
        assert loaded(res, 0) == (6, "B", "nodes"), (damage, res.ranks, res.stderr[-3000:])
        assert loaded(res, 2) == (7, "C", "nodes"), res.ranks
        assert "OWNER" in res.stderr and FOREIGN not in res.stderr, res.stderr[-3000:]
