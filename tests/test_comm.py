"""detectron2-style helpers over MPI, over torch.distributed (torchrun), and in one process."""
import os

import pytest

from launch import LAUNCHERS, openmpi, run


def check(res, n):
    for r, d in enumerate(res.ranks):
        assert d["rank"] == r and d["main"] == (r == 0)
        assert d["all_gather_ranks"] == list(range(n)) and d["all_gather_ok"]
        assert d["gather_ranks"] == (list(range(n)) if r == n - 1 else [])
        assert d["seed_same"] and 0 <= d["seed"] < 2**31
        assert d["bcast"] == {"from": 0, "big": list(range(10))}
        mean = (n - 1) / 2
        assert d["reduced"]["loss"] == pytest.approx(mean)
        assert d["reduced"]["acc"] == pytest.approx([mean, 2 * mean])
        if n > 1:
            assert "keys differ between ranks" in d["key_error"]
    assert len({d["seed"] for d in res.ranks}) == 1


@pytest.mark.parametrize("launcher,n", [("openmpi", 4), ("mpich", 3), ("openmpi", 16)])
def test_helpers_over_mpi(launcher, n, tmp_path):
    res = run(LAUNCHERS[launcher](), n, "comm_helpers.py", tmp_path=tmp_path)
    check(res, n)
    assert all((d["local_rank"], d["local_size"]) == (r, n) for r, d in enumerate(res.ranks))


def test_helpers_with_torch_initialised(tmp_path):
    res = run(openmpi(), 4, "comm_helpers.py", "torch", tmp_path=tmp_path)
    check(res, 4)
    assert all(d["reduced"]["t"] == pytest.approx(2.5) and d["reduced_t_is_tensor"] == "Tensor" for d in res.ranks)


def test_helpers_under_torchrun_without_mpi(tmp_path):
    res = run(LAUNCHERS["torchrun"](), 2, "comm_helpers.py", "torch", tmp_path=tmp_path)
    check(res, 2)


def test_helpers_single_process(tmp_path):
    res = run(None, 1, "comm_helpers.py", tmp_path=tmp_path)
    check(res, 1)


def test_every_collective_feature_in_one_process_without_mpi(tmp_path):
    """File sync, SyncedFile, the local group, HDF5 and stage-in through the one-process
    communicator (no MPI, no torch.distributed)."""
    res = run(None, 1, "one_process.py", str(tmp_path), tmp_path=tmp_path, env={"HPCSYNC_MPI": "0"})
    d = res.ranks[0]
    assert d["transport"] == "SelfComm()" and d["uses_mpi"] is False
    assert d["merged"] == "step,loss\n0,1.5\n1,0.5"
    assert not any(n.startswith(".m.csv") for n in d["parts_left"]), d["parts_left"]
    assert d["own_exception"] == "KeyError('boom')" and d["bad_part_kept"]
    assert "rank 0: " in d["missing_error"] and "missing.csv" in d["missing_error"]
    assert d["local_group_size"] == 1 and d["gathered"] == [{"r": 0}]
    assert d["h5_parallel"] is False and d["h5_why"] == "no MPI in use"
    assert d["h5_rows"] == [[0, 1], [2, 3], [4, 5]] and d["h5_epoch"] == 3
    assert d["staged_files"] == 1 and d["staged_same"]


@pytest.mark.bigmem
@pytest.mark.parametrize("mode", ["gather"] + (["all_gather"] if os.environ.get("HPCSYNC_TEST_LONG") == "1" else []))
def test_object_gather_past_2gib(mode, tmp_path):
    """One rank's object past 2 GiB reaches rank 0 (gather; all_gather's rounds, the same
    _bigmpi code with a broadcast after, are a long run: 75 s here)."""
    per_rank = 2**31 + 12345  # one rank alone sends more than an MPI int count can say
    res = run(openmpi(), 2, "big_gather.py", str(per_rank), mode, tmp_path=tmp_path, timeout=600)
    for d in res.ranks:
        if mode == "gather" and d["rank"] != 0:
            assert d["received"] == []
            continue
        assert [list(x) for x in d["received"]] == [list(x) for x in d["expected"]]
        assert d["received"][1][0] == per_rank


@pytest.mark.parametrize("launcher", ["openmpi", "mpich"])
def test_ranks_disagreeing_on_the_root_raise_everywhere(launcher, tmp_path):
    res = run(LAUNCHERS[launcher](), 3, "comm_desync.py", tmp_path=tmp_path)
    for d in res.ranks:
        for name in ("gather", "broadcast_object"):
            assert d[name] == res.ranks[0][name], (name, [x[name] for x in res.ranks])
            assert d[name].startswith("ValueError: ranks disagree on the root") and "rank(s) [0, 2] say root 0" in d[name]


@pytest.mark.alone  # a bound of wall time
@pytest.mark.parametrize("wait_all", [False, True])
def test_monitored_barrier_names_missing_ranks(wait_all, tmp_path):
    """torch allows monitored_barrier on gloo only; ours works over MPI with any backend."""
    res = run(openmpi(), 4, "monitored.py", "all" if wait_all else "first", "2,3", tmp_path=tmp_path)
    want = "rank(s) [2, 3]" if wait_all else "rank(s) [2]"
    for r in (0, 1):
        assert want in res.ranks[r]["error"] and "did not reach the barrier within 1.5s" in res.ranks[r]["error"]
        assert res.ranks[r]["seconds"] < 4
    for r in (2, 3):  # the late ranks find nobody answering them
        assert "no answer from rank 0" in res.ranks[r]["error"]


@pytest.mark.parametrize("launcher,backend", [("openmpi", "gloo"), ("openmpi", "hpcsync"), ("mpich", "hpcsync"),
                                              ("torchrun", "gloo")])
def test_detectron2_semantics_with_groups(launcher, backend, tmp_path):
    """One program through detectron2's semantics, under MPI and under torchrun: a torch group
    passed as ``group=`` is honoured (it used to be ignored under MPI: 4 items instead of 2)."""
    n = 4
    res = run(LAUNCHERS[launcher](), n, "d2_parity.py", backend, tmp_path=tmp_path)
    for r, d in enumerate(res.ranks):
        half = list(range(0, 2)) if r < 2 else list(range(2, 4))
        assert d["all_gather_world"] == list(range(n))
        assert d["all_gather_half"] == half
        assert d["gather_half"] == ([10 * x for x in half] if r == half[1] else [])  # dst = group rank 1
        assert d["bcast_half"] == f"from {half[1]}"
        assert d["all_gather_local"] == list(range(n))  # one machine: every rank is local
        assert d["local_pg_is_module_attr"] and d["gloo_group_is_world"] and d["seed_same"]
        assert d["reduced"] == sum(range(n)) and d["main"] == (r == 0)
        assert "already called" in d["second_create"]


def test_torchrun_without_init_is_a_clear_error(tmp_path):
    res = run(LAUNCHERS["torchrun"](), 2, "d2_parity.py", "noinit", tmp_path=tmp_path)
    for d in res.ranks:
        assert d["world_size"] == 2
        for name in ("all_gather", "gather", "shared_random_seed", "synchronize"):
            assert d[name].startswith("LaunchError") and "hpcsync.init()" in d[name], (name, d[name])


@pytest.mark.parametrize("round_bytes", [1000, 1 << 20])
def test_bounded_scatter_in_rounds(tmp_path, round_bytes):
    """Rank 0 scatters objects of 2,500, 10, 0 and 1,500 bytes (pickled) to 4 ranks in rounds of
    1,000 bytes (an object across three rounds, rounds that carry several ranks' bytes) and in
    one round: every rank gets exactly its own (the rounds keep MPI's counts and offsets within
    a C int however much is scattered in all)."""
    res = run(openmpi(), 4, "scatter_rounds.py", str(round_bytes), tmp_path=tmp_path, timeout=120)
    assert [d["ok"] for d in res.ranks] == [True] * 4, res.ranks


def _desync_groups(calls):
    """``{helper: [ranks]}`` in first-seen order, as the error names them."""
    out = {}
    for r, (h, _) in enumerate(calls):
        out.setdefault(h, []).append(r)
    return out


@pytest.mark.parametrize("launcher,n,seed", [("openmpi", 3, 1), ("mpich", 2, 2), ("torchrun", 2, 3)])
def test_ranks_in_different_helpers_raise_the_same_error_everywhere(launcher, n, seed, tmp_path):
    """60 drawn cases, each rank a helper call (synchronize, all_gather, gather, broadcast_object,
    shared_random_seed, reduce_dict; roots drawn, sometimes out of range): the same helper and root on every rank
    gives the right result; different helpers the same ValueError on every rank naming which
    ranks are in which helper; the same helper with different roots, or a root that is not a
    rank, a ValueError too -- at once (HPCSYNC_TIMEOUT is 20 s: a rank that waited for a peer
    that is elsewhere would be a timeout). Every case after an error works again: each helper's
    first collective is the same header, so a mismatch is found there and nothing is left in
    flight. Before, the helpers paired up across ranks (rank 1's all_gather returned rank 0's
    reduce_dict keys; synchronize passed a rank in all_gather) and a root past the world was
    MPI's own error."""
    res = run(LAUNCHERS[launcher](), n, "comm_pairs.py", str(seed), "60",
              *(["torch"] if launcher == "torchrun" else []), tmp_path=tmp_path, env={"HPCSYNC_TIMEOUT": "20"},
              timeout=240, expect_ok=False)
    assert all(d is not None for d in res.ranks), str(res)  # the cases first, then how the job ended
    kinds = set()
    for case, first in enumerate(res.ranks[0]["cases"]):
        calls = first["calls"]
        outcomes = [d["cases"][case]["outcome"] for d in res.ranks]
        helpers = _desync_groups(calls)
        roots = {root for _, root in calls}
        where = f"case {case}: {calls} -> {outcomes}"
        assert all(d["cases"][case]["took"] < 10 for d in res.ranks), where
        if len(helpers) > 1:
            kinds.add("desync")
            assert outcomes == [outcomes[0]] * n, where
            assert outcomes[0].startswith("ValueError: ranks are in different calls (desync): "), where
            for h, ranks in helpers.items():
                assert f"rank(s) {ranks} in hpcsync.comm.{h}" in outcomes[0], where
        elif len(roots) > 1:
            kinds.add("roots")
            assert outcomes == [outcomes[0]] * n, where
            assert outcomes[0].startswith("ValueError: ranks disagree on the root"), where
        elif not (None in roots or 0 <= calls[0][1] < n):
            kinds.add("range")
            assert outcomes == [outcomes[0]] * n, where
            assert outcomes[0].startswith(f"ValueError: root {calls[0][1]} is not a rank of the communicator"), where
            assert f"({n} ranks" in outcomes[0], where
        else:
            kinds.add("ok")
            assert outcomes == ["ok"] * n, where
            assert len({d["cases"][case]["seed"] for d in res.ranks}) == 1, where
    assert kinds == {"desync", "roots", "range", "ok"}, kinds  # the draw covers every kind of case
    assert res.returncode == 0, str(res)


@pytest.mark.parametrize("launcher,n,seed", [("openmpi", 2, 11), ("mpich", 3, 12), ("torchrun", 2, 13)])
def test_reduce_dict_against_a_numpy_ground_truth(launcher, n, seed, tmp_path):
    """40 drawn cases of reduce_dict (tests/programs/reduce_cases.py: python, numpy and torch
    values, integer, float and bool, some shapes different on some ranks, sums and means) against
    the truth every rank computes from the same draws: integer sums exact and integers, a mean of
    integers the true mean in floating point, shapes that differ between ranks the same
    ValueError on every rank naming the key, the ranks and the shapes. Before, a mean of int
    tensors 2 and 3 was tensor(2), and values of shapes (1,) and (2,), or (2, 1) and (1, 2),
    were reduced anyway (wrong numbers, or MPI's own error on some ranks)."""
    res = run(LAUNCHERS[launcher](), n, "reduce_cases.py", str(seed), "40",
              *(["torch"] if launcher == "torchrun" else []), tmp_path=tmp_path, env={"HPCSYNC_TIMEOUT": "20"},
              timeout=240, expect_ok=False)
    assert all(d is not None for d in res.ranks), str(res)  # the cases first, then how the job ended
    errors, wrong = 0, []  # every case's findings at once (what is wrong, not only the first)
    for case, first in enumerate(res.ranks[0]["cases"]):
        where = f"case {case} (average={first['average']}): {first['keys']}"
        wrong += [f"{where}: rank {d['rank']}: {p}" for d in res.ranks for p in d["cases"][case]["problems"]]
        err = [d["cases"][case]["error"] for d in res.ranks]
        mismatched = {k: per for k, per in first["keys"].items() if len({tuple(s) for s, _ in per}) > 1}
        if not mismatched:
            if err != [None] * n:
                wrong.append(f"{where}: {err}")
            continue
        errors += 1
        if err != [err[0]] * n or not str(err[0]).startswith("ValueError: reduce_dict: "):
            wrong.append(f"{where}: not the same ValueError on every rank: {err}")
            continue
        for k, per in mismatched.items():
            shapes = {}
            for r, (s, _) in enumerate(per):
                shapes.setdefault(tuple(s), []).append(r)
            if f"{k!r}: " not in err[0] or any(f"rank(s) {ranks} have shape {s}" not in err[0]
                                               for s, ranks in shapes.items()):
                wrong.append(f"{where}: {k!r} {shapes} not named: {err[0]}")
    assert not wrong, f"{len(wrong)} findings:\n" + "\n".join(w[:400] for w in wrong[:12])
    assert 0 < errors < len(res.ranks[0]["cases"]), errors  # the draw has both
    assert res.returncode == 0, str(res)
