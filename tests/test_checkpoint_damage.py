"""Damaged checkpoints: seeded corruption fuzz over the forms this machine reaches without
namespace nodes (rank 0's form, the sharded form, and the node-local form with each rank a fake node
of its own; 2 real MPI ranks each). For a drawn file of a
drawn checkpoint, a drawn damage (bytes flipped, truncated, same-size garbage, deleted, swapped with
the same file of another step, replaced by another run's): ``load()`` returns a checkpoint bitwise
equal to the newest one left whole, or a CheckpointError on every rank; never another state, never
a hang. The counts by form and damage kind are printed (``-s``), with the seed."""
import collections
import os

import pytest

from launch import openmpi, run

SEED = int(os.environ.get("HPCSYNC_TEST_SEED", "56"))


def fuzz(tmp_path, form, cases, seed=SEED):
    res = run(openmpi(), 2, "ckpt_damage.py", form, str(seed), str(cases), str(tmp_path / "roots"),
              tmp_path=tmp_path, timeout=240)
    counts = collections.Counter()
    wrong = []
    for case in zip(*(r["cases"] for r in res.ranks)):
        kind = case[0]["damage"].split()[0]
        outcomes = {c["outcome"] for c in case}
        got = {repr(c["got"]) if c["got"][0] != "loaded" else repr(c["got"][:2]) for c in case}
        outcome = outcomes.pop() if len(outcomes) == 1 and len(got) == 1 else "wrong"  # the ranks agree
        counts[(kind, outcome)] += 1
        if outcome != "right":
            wrong.append((outcome, case[0]["case"], case[0]["damage"], case[0]["changed"], case[0]["expected"],
                          [c["got"] for c in case]))
    print(f"\ncorruption fuzz, form {form}, seed {seed} (HPCSYNC_TEST_SEED), {cases} cases, "
          f"{res.ranks[0]['cases_s']:.1f} s of cases:")
    for kind in sorted({k for k, _ in counts}):
        print(f"  {form:8s} {kind:10s} " + "  ".join(f"{o} {counts[(kind, o)]}" for o in ("right", "error", "wrong")))
    return res, wrong


@pytest.mark.parametrize("form,cases", [("rank0", 12), ("rank0", 120), ("sharded", 72)],
                         ids=["rank0-quick", "rank0", "sharded"])
def test_a_damaged_checkpoint_is_never_loaded(tmp_path, form, cases):
    """Every case: the newest checkpoint left whole, bitwise, on every rank (a CheckpointError
    on every rank would be allowed, but with a whole one left it is counted, and none is
    expected); the warning that skips a damaged one names its folder and file, on the console
    (stderr) by default. Every checkpoint damaged: a CheckpointError on every rank that says
    "damaged" and names the file (not the weights_only hint); ``load(step=3)`` of a damaged step
    3: the same, and step 2 still loads."""
    res, wrong = fuzz(tmp_path, form, cases)
    assert not wrong, f"seed {SEED}: {len(wrong)} cases not right, e.g. {wrong[:5]}"
    lines = res.stderr.splitlines()
    newest = [c for c in res.ranks[0]["cases"] if c["changed"] == [3]]  # the newest damaged, one file
    for c in newest:  # its warning: on the console (stderr: the program sets no logging up), naming both
        folder, name = c["damage"].split()[1].split("/", 1)
        said = [ln for ln in lines if f"case{c['case']}/{folder}: damaged" in ln]
        assert said and (name in said[0] or "its marker" in said[0]), (c, said, res.stderr[-3000:])
    assert newest, "no case damaged the newest checkpoint: more cases"
    for r in res.ranks:
        special = r["special"]
        everything = special["all"]["got"]
        assert everything[0] == "error" and "damaged" in everything[1] and special["all"]["file"] in everything[1] \
            and "weights_only" not in everything[1], special
        assert special["step3"][0] == "error" and "damaged" in special["step3"][1], special
        assert special["step2"][:3] == ["loaded", 2, True], special
    assert res.ranks[0]["special"]["all"]["got"] == res.ranks[1]["special"]["all"]["got"]
    assert res.ranks[0]["special"]["step3"] == res.ranks[1]["special"]["step3"]


def test_a_damaged_node_local_copy_is_replaced_or_skipped(tmp_path):
    """The node-local form (``local_dir=``, two fake nodes of one rank each, ``replicas=1``, each
    save also in the root): a drawn file of a drawn checkpoint damaged in one node's copy, in every
    node's copy, or (node copies removed) in the root. Every case: the newest checkpoint left
    whole, bitwise, on every rank -- from the other node's copy of a damaged file, else the
    previous checkpoint -- and never another state, nor a hang; a damaged copy's warning names the
    folder, the file and the node, on the console. ``latest()`` (markers and sizes only) names
    what load() loads when the damage changed a size, and never a step older than it loads.
    Every step's biggest file damaged on every
    node, and the root's gone: a CheckpointError on every rank that says "damaged" and names it."""
    cases = 60
    res = run(openmpi(), 2, "ckpt_damage_nodes.py", str(SEED), str(cases), str(tmp_path / "roots"),
              tmp_path=tmp_path, timeout=240)
    counts = collections.Counter()
    wrong = []
    for case in zip(*(r["cases"] for r in res.ranks)):
        kind, where = case[0]["damage"].split()[:2]
        got = {repr(c["got"][:3]) for c in case}
        outcome = case[0]["outcome"] if len({c["outcome"] for c in case}) == 1 and len(got) == 1 else "wrong"
        counts[(kind, where, outcome)] += 1
        if outcome != "right":
            wrong.append((outcome, case[0]["case"], case[0]["damage"], case[0]["expected"], [c["got"] for c in case]))
    print(f"\ncorruption fuzz, form nodelocal, seed {SEED} (HPCSYNC_TEST_SEED), {cases} cases, "
          f"{res.ranks[0]['cases_s']:.1f} s of cases (saves {res.ranks[0]['save_s']:.1f} s):")
    for kind, where in sorted({k[:2] for k in counts}):
        print(f"  nodelocal {kind:10s} {where:5s} " + "  ".join(f"{o} {counts[(kind, where, o)]}"
                                                             for o in ("right", "error", "wrong")))
    assert not wrong, f"seed {SEED}: {len(wrong)} cases not right, e.g. {wrong[:5]}"
    assert {w for _, w, _ in counts} == {"one", "both", "root"}, counts
    # latest() reads the markers, not the bytes: a file of another size (truncated, deleted) is
    # seen there, and it names what load() loads; a same-size damage is found by load(), which may
    # then take an older step than latest() named, never a newer one
    for c in res.ranks[0]["cases"]:
        step = c["got"][1] if c["got"][0] == "loaded" else None
        if c["damage"].split()[0] in ("truncate", "delete"):
            assert c["latest"] == step or (step is None and c["expected"] is None), c
        else:
            assert step is None or (isinstance(c["latest"], int) and c["latest"] >= step), c
    named = collections.Counter((c["latest"] == (c["got"][1] if c["got"][0] == "loaded" else None))
                                for c in res.ranks[0]["cases"])
    print(f"  latest() named the step load() loaded in {named[True]} of {cases} cases")
    one = [c for c in res.ranks[0]["cases"] if c["damage"].split()[1] == "one" and c["got"][0] == "loaded"]
    assert any(c["got"][1] == 3 and c["got"][3] == "nodes" for c in one), one  # restored from the copies
    said = [ln for ln in res.stderr.splitlines() if ": damaged: the copy of " in ln]
    assert said and all(" on fake" in ln for ln in said), res.stderr[-3000:]
    for r in res.ranks:
        special = r["special"]["all"]
        assert special["got"][0] == "error" and "damaged" in special["got"][1] and \
            special["file"] in special["got"][1], special
    assert res.ranks[0]["special"] == res.ranks[1]["special"]
