"""The socket-free hpcsync backend on real MPI jobs: conformance vs gloo, DDP/FSDP/DCP, no listeners."""
import pytest
import torch

from launch import LAUNCHERS, LONG, mpich, openmpi, run


@pytest.mark.parametrize("launcher,n", [(openmpi, 1), (openmpi, 2), (openmpi, 3), (openmpi, 4), (mpich, 3)])
def test_conformance_matrix(launcher, n, tmp_path, capsys):
    res = run(launcher(), n, "conformance.py", tmp_path=tmp_path, timeout=600)
    total = passed = same_as_gloo = 0
    failures = []
    for d in res.ranks:
        for c in d["results"]:
            total += 1
            passed += c["ok"]
            same_as_gloo += c["gloo"] == "same"
            if not c["ok"]:
                failures.append((d["rank"], c["case"], c["detail"][:300]))
    with capsys.disabled():
        print(f"\n[conformance] world={n} {launcher.__name__}: {passed}/{total} checks passed on all ranks, "
              f"{same_as_gloo} identical to gloo")
    assert not failures, failures[:10]
    assert total >= 280 * n
    cases = {c["case"] for c in res.ranks[0]["results"]}
    for needed in ("all_reduce/PREMUL_SUM/bfloat16", "all_reduce/BXOR/int64", "reduce_scatter_tensor/AVG/in-place/float16",
                   "all_to_all_single/splits/bfloat16", "all_reduce/zero-size/bool", "all_reduce/noncontiguous/float16",
                   "batch_isend_irecv/ring/float32", "send/recv_anysource/int64", "new_group/even-odd/float32",
                   "objects/all_gather,broadcast,gather,scatter", "all_reduce/async_op+futures/float32"):
        assert needed in cases


def test_ddp_fsdp_checkpoint_match_gloo(tmp_path):
    results = {}
    for backend in ("gloo", "hpcsync"):
        res = run(openmpi(), 2, "train_compare.py", backend, str(tmp_path / f"ckpt-{backend}"), tmp_path=tmp_path,
                  timeout=300)
        results[backend] = res.ranks
        assert all(d["backend"] == backend for d in res.ranks)
    for gl, ours in zip(results["gloo"], results["hpcsync"]):
        for key in ("ddp_default", "ddp_bucket_view", "ddp_static_graph", "ddp_small_buckets", "ddp_no_sync", "fsdp"):
            a, b = torch.tensor(gl[key]), torch.tensor(ours[key])
            assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-6, atol=1e-7), key
        assert ours["dcp_roundtrip"] is True and gl["dcp_roundtrip"] is True
        assert ours["dcp_async"] is True and gl["dcp_async"] is True  # async_save, thread mode
    # DDP really synchronised: both ranks end with the same weights
    assert results["hpcsync"][0]["ddp_default"] == results["hpcsync"][1]["ddp_default"]


@pytest.mark.solo  # an issue within 0.5 s
def test_plain_init_process_group_async_and_errors(tmp_path):
    res = run(openmpi(), 3, "backend_behaviour.py", tmp_path=tmp_path)
    r0 = res.ranks[0]
    assert r0["issue_seconds"] < 0.5 and r0["completed_right_after_issue"] is False, r0
    for d in res.ranks:
        assert d["backend"] == "hpcsync" and d["async_result_ok"] is True
        assert d["future_chain"] == [60.0] * 4
        assert d["error"] and "all_gather" in d["error"]
        assert d["after_error"] == 3.0


def test_no_listening_socket_with_hpcsync_but_found_with_gloo(tmp_path):
    ours = run(openmpi(), 2, "sockets.py", "hpcsync", tmp_path=tmp_path)
    for d in ours.ranks:
        assert d["mpi_runtime"] == [], "Open MPI with btl=self,vader opens no listener"
        assert d["during_training"] == [], f"rank {d['rank']} listens on {d['during_training']}"
    gloo = run(openmpi(), 2, "sockets.py", "gloo", tmp_path=tmp_path)
    r0 = gloo.ranks[0]
    assert int(r0["master_port"]) in r0["during_training"], "the check must see gloo's TCP store listener"
    assert all(d["during_training"] for d in gloo.ranks)


@pytest.mark.parametrize("launcher", ["openmpi"] + (["mpich"] if LONG else []))
def test_gloo_with_the_mpi_store_has_no_store_listener(launcher, tmp_path):
    """hpcsync.init(backend="gloo", store="mpi"): the rendezvous goes over MPI to rank 0's table;
    rank 0 listens only on gloo's own data port (one fewer than with the TCP store)."""
    lau = openmpi() if launcher == "openmpi" else mpich()
    tcp = run(lau, 3, "sockets.py", "gloo", "tcp", tmp_path=tmp_path)
    mpi = run(lau, 3, "sockets.py", "gloo", "mpi", tmp_path=tmp_path)
    assert all(d["backend"] == "gloo" for d in mpi.ranks)
    r0_tcp, r0_mpi = tcp.ranks[0], mpi.ranks[0]
    assert int(r0_tcp["master_port"]) in r0_tcp["during_training"]
    assert r0_mpi["master_port"] is None
    assert len(r0_mpi["during_training"]) == len(r0_tcp["during_training"]) - 1, (r0_mpi, r0_tcp)


def test_sparse_all_reduce_sum(tmp_path):
    """Sparse COO all_reduce (SUM, as gloo supports): equal to the dense sum, still sparse."""
    res = run(openmpi(), 3, "sparse.py", tmp_path=tmp_path)
    for d in res.ranks:
        assert d["ok"] == [True, True, True]
        assert "supports ReduceOp.SUM only" in d["max"]


@pytest.mark.parametrize("launcher,level", [("mpich", "serialized"), ("openmpi", "serialized"), ("mpich", "multiple"),
                                            ("openmpi", "funneled")])
def test_helpers_and_control_exchanges_hold_the_process_mpi_lock_below_multiple(launcher, level, tmp_path):
    """Below THREAD_MULTIPLE the comm helpers, the bounded control exchanges and the preemption
    guard's flags and the MPI store (client and server) call MPI only while holding the lock the
    backend's operations hold (one MPI call at a time in the process): with another thread
    holding it 1.5 s, each waits, then gives the right result; at THREAD_MULTIPLE none waits (but
    rank 0's own 1.6 s beside the store's client). Under THREAD_FUNNELED, where the store's server
    thread may not call MPI at all, the MPI store is refused with the reason."""
    res = run(LAUNCHERS[launcher](), 2, "serial_helper.py", tmp_path=tmp_path, timeout=120,
              env={"MPI4PY_RC_THREAD_LEVEL": level})
    for d in res.ranks:
        assert d["level"] == level, d
        if level == "funneled":
            assert "store='mpi' needs MPI_THREAD_SERIALIZED" in d["refused"], d
            continue
        assert d["results"] == {"helper": [0, 1], "control": [0, 1], "guard": True, "store": "v",
                                "store-server": "v"}, d
        for name, took in d["took"].items():
            if name.startswith("store") and d["rank"] == 0:
                continue
            assert (took >= 1.3) if level != "multiple" else (took < 1.0), (name, d)


@pytest.mark.parametrize("launcher", ["openmpi", "mpich"])
@pytest.mark.parametrize("level", ["serialized", "funneled", "multiple"])
def test_point_to_point_completes_at_every_thread_level(launcher, level, tmp_path):
    """3 ranks in a ring post a receive and a send before waiting (either order, a
    batch_isend_irecv ring, is_completed() polled), 16 floats and 4 MiB: right data, no wait
    anywhere near the 10 s timeout, at the thread level the job asked for; under FUNNELED an
    operation from another thread is refused with the reason."""
    res = run(LAUNCHERS[launcher](), 3, "p2p_levels.py", tmp_path=tmp_path, timeout=180,
              env={"MPI4PY_RC_THREAD_LEVEL": level})
    for d in res.ranks:
        assert d["level"] == level, d
        assert len(d["cases"]) == 8 and all(ok is True and s < 2.0 for ok, s in d["cases"].values()), d["cases"]
        if level == "funneled":  # MPI from another thread would be undefined: a clear error instead
            assert "THREAD_FUNNELED" in d["thread_error"] and "'worker'" in d["thread_error"], d
