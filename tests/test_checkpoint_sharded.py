"""Sharded hpcsync.Checkpoints (``save(step, sharded=STATE)``, ``load(sharded=TEMPLATE)``): an
FSDP2 model on 4 real MPI ranks resumes bit for bit in a fresh job, loads at another world size,
and keeps the guarantees of the other form (crash safety at every filesystem change, loading runs
no code, one job per root). Across namespace nodes: tests/test_checkpoint_nodes.py."""
import json
import pickle
import shutil

import pytest

from launch import long_run, openmpi, run
from test_checkpoint import ckpt_op, killed_at_every_change, load_sharded_here

# (gloo in the background is a long run: the thread's own groups are the same code on either backend)
CASES = [("gloo", "sync"), pytest.param("gloo", "background", marks=long_run), ("hpcsync", "background")]


def train(tmp_path, backend, root, steps, mode, n=4):
    return run(openmpi(), n, "sharded_ckpt.py", backend, str(root), str(steps), "5", mode, tmp_path=tmp_path,
               timeout=240)


@pytest.mark.parametrize("backend,mode", CASES, ids=["gloo-sync", "gloo-background", "hpcsync-background"])
def test_fsdp2_resumes_bit_for_bit_from_a_sharded_checkpoint(tmp_path, backend, mode):
    """12 steps straight (saved at 5 and 10), against a fresh job that resumes from that run's
    step 10: the same parameters, bit for bit, on every rank; each rank got its own local state.
    (A background save of step 10 is written while steps 11 and 12 change the parameters: what
    it wrote must still be step 10's.)"""
    root = tmp_path / "whole"
    whole = train(tmp_path, backend, root, 12, mode)
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


# (in the background the same filesystem changes come from the checkpoint thread: a long run)
@pytest.mark.parametrize("mode", ["sharded", pytest.param("sharded-background", marks=long_run)])
def test_a_sharded_save_keeps_a_complete_checkpoint_at_every_moment(mode, tmp_path):
    """step 5 saved sharded, then again by a process that dies just before its k-th filesystem
    change -- hpcsync's and torch.distributed.checkpoint's own -- for every k: the next start
    always finds a complete step 5, the old content or the new, never nothing."""
    base = tmp_path / "base"
    ckpt_op(tmp_path, "save-sharded", base, 1, "5=old")
    k, seen = killed_at_every_change(tmp_path, mode, lambda root: shutil.copytree(base, root), load_sharded_here)
    assert k > 8 and seen == {"old", "new"}, (k, seen)


def test_a_planted_sharded_checkpoint_runs_no_code_on_load(tmp_path):
    """A newer sharded step planted in the root whose DCP metadata would run a command when
    unpickled: load(sharded=...) refuses it with the reason, nothing runs; the form that loads
    without sharded= says which form the checkpoint has. (The planter writes a marker that
    matches, its checksums too: the checksums find damage, not an author who can write the root.)"""
    import os

    from hpcsync.resilience import checksums

    root = tmp_path / "ckpt"
    ckpt_op(tmp_path, "save-sharded", root, 2, "10=mine")
    victim = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {victim}",))

    planted = root / "step-00999999"
    shutil.copytree(root / "step-00000010", planted)
    payload = pickle.dumps(Payload())
    (planted / "sharded" / ".metadata").write_bytes(payload)
    marker = json.loads((planted / "COMPLETE").read_text())
    marker.update(step=999999, seq=10**6)
    marker["files"]["sharded/.metadata"] = len(payload)
    sums = {**marker["sums"], "sharded/.metadata": checksums.hex_sum(checksums.digest(payload))}
    (planted / "COMPLETE").write_text(json.dumps(checksums.seal(marker, sums)))
    got = ckpt_op(tmp_path, "load-sharded", root).ranks[0]["loaded"]
    assert not victim.exists(), "loading the checkpoint ran the planted command"
    assert "error" in got and "posix.system is not allowed in a checkpoint's metadata" in got["error"], got
    plain = ckpt_op(tmp_path, "load", root).ranks[0]["loaded"]
    assert "was saved with sharded=: load it with load(sharded=" in plain["error"], plain



@pytest.mark.parametrize("mode,words", [
    ("perrank", "its 'mine' differs from rank 0's: a sharded state may hold values that differ between ranks "
                "only in DTensors"),
    ("partial", "entries the template lacks"),
    ("stateful", "rank 1: cannot read its sharded state: RuntimeError('injected on rank 1')"),
])
def test_bad_sharded_input_is_one_error_on_every_rank(tmp_path, mode, words):
    """A per-rank value outside the DTensors (DCP would keep one rank's and load it everywhere), a
    template that lacks entries the checkpoint has (they would be dropped without a word), a
    Stateful that raises on one rank (before DCP's own exchanges): each is the same error on every
    rank, at once."""
    res = run(openmpi(), 2, "sharded_ckpt.py", "gloo", str(tmp_path / "root"), "1", "1", mode, tmp_path=tmp_path,
              timeout=120)
    errors = {d["error"] for d in res.ranks}
    assert len(errors) == 1 and words in errors.pop(), res.ranks
    assert all(d["seconds"] < 20 for d in res.ranks), res.ranks


def test_a_failed_background_save_leaves_the_next_ones_working(tmp_path):
    """Rank 1's checkpoint thread fails in the first of three sharded saves in the background
    (before DCP's first exchange: rank 0 waits in it for the checkpoint's 8 s timeout): that save
    is one error on every rank (at wait()), the groups it used are made anew, and the next two
    complete (the latest is step 3)."""
    res = run(openmpi(), 2, "sharded_ckpt.py", "gloo", str(tmp_path / "root"), "1", "1", "bgfail", tmp_path=tmp_path,
              timeout=180)
    for d in res.ranks:
        assert [e[0] for e in d["errors"]] == [1] and "injected on rank 1" in d["errors"][0][1], d
        assert d["latest"] == 3, d


def _pickle_ops(*parts):
    """A pickle (protocol 4) from raw parts: ``("g", module, name)`` is a STACK_GLOBAL, a str a
    short string, bytes themselves."""
    out = b"\x80\x04"
    for p in parts:
        if isinstance(p, tuple):
            p = _pickle_ops(p[1], p[2])[2:] + b"\x93"
        elif isinstance(p, str):
            p = b"\x8c" + bytes([len(p.encode())]) + p.encode()
        out += p
    return out


def test_the_metadata_reader_builds_only_dcps_own_records(tmp_path):
    """What a planted .metadata could try, each refused before it runs: a callable reached through
    a dotted name of an allowed module (operator.methodcaller ... os.system), state set on one of
    the allowed classes (it would change that class for the whole process), a data file outside
    the checkpoint's folder; the metadata DCP writes itself still loads."""
    import io

    import torch.distributed.checkpoint.filesystem as fs

    from hpcsync.resilience.dcp_reader import MetadataUnpickler, read_metadata

    victim = tmp_path / "PWNED"
    P = "torch.distributed.checkpoint.planner"
    chain = _pickle_ops(("g", P, "operator.methodcaller"), "system", f"touch {victim}", b"\x86R",
                        ("g", P, "operator.itemgetter"), "os", b"\x85R",
                        ("g", P, "operator.attrgetter"), "__init__.__globals__", b"\x85R",
                        ("g", "torch.distributed.checkpoint.filesystem", "FileSystemReader"), b"\x85R\x85R\x85R.")
    with pytest.raises(pickle.UnpicklingError, match="operator.methodcaller is not allowed"):
        MetadataUnpickler(io.BytesIO(chain)).load()
    assert not victim.exists()
    before = dict(vars(fs._StorageInfo))
    build = _pickle_ops(("g", "torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                        b"N}", "offset", ("g", "builtins", "slice"), b"s\x86b.")
    with pytest.raises(pickle.UnpicklingError, match="may not set state on a class"):
        MetadataUnpickler(io.BytesIO(build)).load()
    assert dict(vars(fs._StorageInfo)) == before
    root = tmp_path / "ckpt"
    ckpt_op(tmp_path, "save-sharded", root, 1, "3=x")
    meta = root / "step-00000003" / "sharded" / ".metadata"
    ok = read_metadata(str(meta))
    assert ok.state_dict_metadata, "DCP's own metadata must still load"
    for info in ok.storage_data.values():
        info.relative_path = "../../elsewhere"
    bad = tmp_path / "bad.metadata"
    bad.write_bytes(pickle.dumps(ok, protocol=4))
    with pytest.raises(pickle.UnpicklingError, match="outside its folder"):
        read_metadata(str(bad))
    import pathlib  # a name as a path object: its str() (what is checked) and its parts (what DCP
    # joins) are separate slots a pickle can set apart, so only a plain str passes
    for info in ok.storage_data.values():
        info.relative_path = pathlib.PosixPath("__0_0.distcp")
    bad.write_bytes(pickle.dumps(ok, protocol=4))
    with pytest.raises(pickle.UnpicklingError, match="names a file by a PosixPath, not a name"):
        read_metadata(str(bad))


def _metadata(ranks, tensors, seed):
    """A DCP metadata as its save writes it, of ``ranks`` x ``tensors`` chunks (random shapes,
    dtypes and file offsets from ``seed``; a few non-tensor entries and a path too)."""
    import pathlib
    import random

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)

    rng = random.Random(seed)
    sdm, storage = {}, {}
    for t in range(tensors):
        fqn, rows, cols = f"model.layers.{t}.weight", rng.randint(1, 9), rng.randint(1, 300)
        chunks = [ChunkStorageMetadata(torch.Size([r * rows, 0]), torch.Size([rows, cols])) for r in range(ranks)]
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=rng.choice([torch.float32, torch.bfloat16])),
                                         torch.Size([rows * ranks, cols]), chunks)
        for r, c in enumerate(chunks):
            storage[MetadataIndex(fqn, c.offsets, r)] = _StorageInfo(f"__{r}_0.distcp", rng.randrange(1 << 30), 4 * rows * cols)
    for k in range(3):
        sdm[f"step.{k}"] = BytesStorageMetadata()
        storage[MetadataIndex(f"step.{k}")] = _StorageInfo("__0_0.distcp", k, 10)
    meta = StorageMeta(checkpoint_id=pathlib.PosixPath(f"/ckpt/{seed}"))
    return Metadata(sdm, {k: (k,) for k in sdm}, storage, meta, "1.0.0")


def test_the_metadata_parses_at_the_c_unpicklers_speed_to_the_same_records():
    """Generated metadata (random shapes, seeds): the fast unpickler builds exactly what DCP saved,
    the same records as the pure-Python reference, and runs as C code: a handful of Python calls
    a chunk (a guard making a torch.Size, a key's hash), where the reference makes one per opcode
    (hundreds a chunk), so at 1,024 ranks x 1,000 tensors a rank parses in seconds, not minutes."""
    import sys

    from hpcsync.resilience.dcp_reader import ReferenceUnpickler, parse_metadata

    for seed in range(3):
        meta = _metadata(4 + seed, 5 + 3 * seed, seed)
        data = pickle.dumps(meta)
        fast, ref = parse_metadata(data), parse_metadata(data, ReferenceUnpickler)
        assert fast == meta == ref, seed
        assert type(fast.storage_meta.checkpoint_id) is type(meta.storage_meta.checkpoint_id)
        assert all(type(k).__module__.startswith("torch.") for k in fast.storage_data), "a guard leaked into the records"
    data = pickle.dumps(_metadata(64, 20, 7))  # 1,280 chunks
    for unpickler, most in ((None, 6), (ReferenceUnpickler, None)):
        calls = [0]

        def count(frame, event, arg, calls=calls):
            calls[0] += event == "call"

        sys.setprofile(count)
        try:
            parse_metadata(data, unpickler)
        finally:
            sys.setprofile(None)
        per_chunk = calls[0] / 1280
        if most is not None:
            assert per_chunk < most, f"{per_chunk:.1f} Python calls a chunk: the metadata is not parsed by C code"
        else:
            assert per_chunk > 50, per_chunk  # (the reference: what the bound above tells apart)


@pytest.mark.parametrize("unpickler", ["fast", "reference"])
def test_no_metadata_sets_state_on_any_name_it_may_use(unpickler):
    """For every class or function a metadata may name (generated from the allowed list), pickle's
    BUILD on it -- a dict of state, and a (None, slots) pair that would set attributes -- is
    refused with the reason (by Python itself for an immutable type: the builtins, torch.Size),
    and the real object is unchanged (it would change for the whole process); a name outside the
    list is refused before anything is built."""
    import importlib
    import io

    from hpcsync.resilience import dcp_reader

    cls = dcp_reader.MetadataUnpickler if unpickler == "fast" else dcp_reader.ReferenceUnpickler
    for module, name in sorted(dcp_reader._ALLOWED):
        real = getattr(importlib.import_module(module), name)
        before = dict(vars(real))
        immutable = isinstance(real, type) and real.__flags__ & (1 << 8)  # (Py_TPFLAGS_IMMUTABLETYPE)
        for state in (b"}\x8c\x06offset\x94K\x01s", b"N}\x8c\x06offset\x94K\x01s\x86"):
            with pytest.raises((pickle.UnpicklingError, TypeError),
                               match="may not set state on a class|does not support item assignment|immutable type"
                               if immutable and unpickler == "fast" else "may not set state on a class"):
                cls(io.BytesIO(_pickle_ops(("g", module, name), state + b"b."))).load()
        assert dict(vars(real)) == before, f"{module}.{name} changed"
    for module, name in [("os", "system"), ("builtins", "getattr"), ("torch", "load"), ("pathlib", "Path.open")]:
        with pytest.raises(pickle.UnpicklingError, match="is not allowed in a checkpoint's metadata"):
            cls(io.BytesIO(_pickle_ops(("g", module, name), b"."))).load()


@pytest.mark.parametrize("form", ["root", "nodes"])
def test_a_planted_metadata_is_one_refusal_on_every_rank(tmp_path, form):
    """A 2-rank job saves step 5 (in the root; or on two one-rank "nodes", each holding a copy of
    the other's files); then its metadata is replaced, its markers resealed to match (an author
    who can write there), by one that sets state on a class (root) or that names os.system
    (nodes). A new job's load refuses it before DCP runs, as the same CheckpointError on every
    rank, naming the file and the reason; nothing runs, no class changes."""
    import os

    from hpcsync.resilience import checksums

    victim = tmp_path / "PWNED"
    root, local = tmp_path / "root", tmp_path / "local"
    env = {"HPCSYNC_TEST_LOCAL_DIR": str(local), "HPCSYNC_TEST_FAKE_NODES": "1"} if form == "nodes" else {}
    run(openmpi(), 2, "sharded_ckpt.py", "gloo", str(root), "5", "5", "sync", tmp_path=tmp_path, timeout=240, env=env)
    if form == "root":
        payload = _pickle_ops(("g", "torch.distributed.checkpoint.filesystem", "_StorageInfo"), b"N}", "offset",
                              ("g", "builtins", "slice"), b"s\x86b.")
        why = "sharded/.metadata: UnpicklingError: a checkpoint's metadata may not set state on a class"
        folders = [root / "step-00000005"]
    else:
        class Payload:
            def __reduce__(self):
                return (os.system, (f"touch {victim}",))

        payload, why = pickle.dumps(Payload()), "sharded/.metadata: UnpicklingError: posix.system is not allowed"
        folders = sorted(local.glob("fake*/hpcsync-*/step-*"))
        assert len(folders) == 2 and not list(root.glob("step-*")), folders
    for folder in folders:
        (folder / "sharded" / ".metadata").write_bytes(payload)
        marker = json.loads((folder / "COMPLETE").read_text())
        marker["files"]["sharded/.metadata"] = len(payload)
        sums = {**marker["sums"], "sharded/.metadata": checksums.hex_sum(checksums.digest(payload))}
        (folder / "COMPLETE").write_text(json.dumps(checksums.seal(marker, sums)))
    res = run(openmpi(), 2, "sharded_ckpt.py", "gloo", str(root), "6", "5", "resume", tmp_path=tmp_path, timeout=240,
              env=env)
    errors = {d.get("error") for d in res.ranks}
    assert len(errors) == 1 and why in str(next(iter(errors))), res.ranks
    assert next(iter(errors)).startswith("hpcsync.checkpoint: cannot load: rank 0: "), errors
    assert not victim.exists(), "loading the checkpoint ran the planted command"
