"""Sharded checkpoints on node-local disks with copies on peer nodes (``Checkpoints(root,
local_dir=, replicas=, shared_every=)``): an FSDP2 model on 4 real MPI ranks, two "nodes" of two
ranks on this host (each its own hostname to hpcsync and its own local folder), one node's folder
lost after the save: the resumed run reads its shards from the other node's copies, nothing from
the root, and ends bit for bit as the uninterrupted one. Across namespace nodes, with ``hpcsync
run`` relaunching without a killed node: test_supervisor.py."""
import os
import shutil
import zlib
from pathlib import Path

import pytest

from hpcsync.resilience.node_copies import Layout
from launch import openmpi, run
from test_checkpoint import ckpt_op, killed_at_every_change, load_sharded_here


def train(tmp_path, root, local, steps, mode, shared_every=0, replicas=1, n=4, expect_ok=True, logs=None):
    env = {"HPCSYNC_TEST_LOCAL_DIR": str(local), "HPCSYNC_TEST_FAKE_NODES": "2", "HPCSYNC_TEST_REPLICAS": str(replicas),
           "HPCSYNC_TEST_SHARED_EVERY": str(shared_every), **({"HPCSYNC_LOG_DIR": str(logs)} if logs else {})}
    return run(openmpi(), n, "sharded_ckpt.py", "gloo", str(root), str(steps), "5", mode, tmp_path=tmp_path,
               timeout=240, env=env, expect_ok=expect_ok)


def copies(local, node):
    """The complete node-local checkpoints of fake node ``node``: ``step-<N>.<seq>`` (their
    folders' names without the save's token)."""
    return sorted(p.name.rsplit(".", 1)[0] for p in (local / f"fake{node}").glob("hpcsync-*/step-*"))


def test_a_lost_nodes_ranks_restore_from_the_copies_and_read_nothing_from_the_root(tmp_path):
    """12 steps saved at 5 and 10 (node-local only: shared_every=0), node 1's folder removed (its
    disk lost); a fresh job resumes from step 10 on the same ranks: ranks 2 and 3 fetch their
    shards and local states from node 0's copies (and nothing else), the root holds no checkpoint
    at all, and the parameters after 12 steps equal the uninterrupted run's, bit for bit."""
    root, local = tmp_path / "root", tmp_path / "local"
    whole = train(tmp_path, root, local, 12, "sync")
    assert copies(local, 0) == copies(local, 1) == ["step-00000005.0", "step-00000010.1"]
    shutil.rmtree(local / "fake1")
    resumed = train(tmp_path, root, local, 12, "resume")
    for r, (a, b) in enumerate(zip(whole.ranks, resumed.ranks)):
        read = b["loaded"].pop("read")
        assert b["loaded"] == {"step": 10, "shared": {"every": 5}, "local": {"rank": r, "step": 10}}, b
        assert read["from"] == "nodes" and read["root"] == 0, read
        if r >= 2:  # node 1: everything from peers
            assert read["node"] == 0 and read["peers"] > 0, (r, read)
        assert a["params"] == b["params"], f"rank {r}: the resumed run differs from the uninterrupted one"
    assert not list(root.glob("step-*")), "a node-local save wrote into the shared root"


def test_the_root_every_kth_save_and_when_no_copy_survived(tmp_path):
    """shared_every=2, no copies on other nodes (replicas=0): save 0 (step 5) goes to the root
    too, save 1 (step 10) stays on the nodes. With node 1's folder gone, step 10 is incomplete on
    the nodes: the root's step 5 is loaded (and says so), with a warning that names the lost step
    (node 0 holds 6 of its 10 files: ranks 0 and 1's, the metadata, the shared state); with every
    node's folder gone, the root's step 5 again. (The nodes' newer step wins when whole: the
    other tests.)"""
    root, local = tmp_path / "root", tmp_path / "local"
    train(tmp_path, root, local, 10, "sync", shared_every=2, replicas=0)
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000005"]
    assert copies(local, 0) == copies(local, 1) == ["step-00000005.0", "step-00000010.1"]
    shutil.rmtree(local / "fake1")
    res = train(tmp_path, root, local, 10, "full", replicas=0, logs=tmp_path / "logs")
    assert {r["loaded"]["step"] for r in res.ranks} == {5}, res.ranks[0]
    assert res.ranks[0]["loaded"]["read"] == {"from": "root"}, res.ranks[0]
    assert "step 10 (saved as number 1) cannot be restored: this job's nodes hold 6 of its 10 files" in res.stderr, \
        res.stderr[-3000:]
    shutil.rmtree(local)
    got = train(tmp_path, root, local, 10, "full", replicas=0).ranks
    assert {r["loaded"]["step"] for r in got} == {5} and got[0]["loaded"]["read"] == {"from": "root"}, got[0]


def test_bad_node_local_options_are_refused_on_every_rank(tmp_path):
    """The root's node-local folder made first as a symbolic link (another user's trap in a shared
    /tmp), and a local_dir of another user where anyone may create names: the same error on every
    rank, nothing written through the link; background=True with local_dir: a ValueError that says
    why, on every rank."""
    root = tmp_path / "root"
    target, trap = tmp_path / "elsewhere", tmp_path / "trap"
    target.mkdir()
    trap.mkdir()
    os.symlink(target, trap / f"hpcsync-root-{zlib.crc32(str(root).encode()):08x}")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    os.chmod(theirs, 0o777)
    os.chown(theirs, 12345, 12345)
    for local, why in ((trap, "is a symbolic link"), (theirs, "is a directory of another user (uid 12345)")):
        res = run(openmpi(), 2, "sharded_ckpt.py", "gloo", str(root), "5", "5", "sync", tmp_path=tmp_path,
                  timeout=180, env={"HPCSYNC_TEST_LOCAL_DIR": str(local), "HPCSYNC_TEST_SHARED_EVERY": "0"})
        errors = {r.get("error") for r in res.ranks}
        assert len(errors) == 1, errors
        [error] = errors
        assert error and error.startswith("hpcsync.checkpoint: step 5 not saved: rank 0: local_dir: ") and why in error, \
            error
    assert not list(target.iterdir()) and not list(theirs.iterdir()), "something was written through the link"
    (target / "step-99999999.9.planted").mkdir()  # what a load would find through the link: never read
    res = run(openmpi(), 2, "sharded_ckpt.py", "gloo", str(root), "5", "5", "full", tmp_path=tmp_path, timeout=180,
              env={"HPCSYNC_TEST_LOCAL_DIR": str(trap)})
    errors = {r.get("error") for r in res.ranks}
    assert len(errors) == 1 and "local_dir: " in next(iter(errors)) and "is a symbolic link" in next(iter(errors)), \
        errors
    res = run(openmpi(), 2, "sharded_ckpt.py", "gloo", str(root), "5", "5", "background",
              tmp_path=tmp_path, timeout=180, env={"HPCSYNC_TEST_LOCAL_DIR": str(tmp_path / "ok")}, expect_ok=False)
    assert res.returncode != 0 and "ValueError: Checkpoints(local_dir=...) takes sharded saves" in res.stderr, \
        res.stderr[-3000:]


@pytest.mark.parametrize("hosts,replicas", [("aabbc", 1), ("aabbc", 2), ("abc", 5), ("aaaa", 1)])
def test_every_rank_is_copied_to_other_nodes_on_paper(hosts, replicas):
    """Each rank's copies go to min(replicas, nodes - 1) distinct other nodes; the incoming lists
    are the inverse of the outgoing ones (every copy sent is received once)."""
    lay = Layout.of(list(hosts))
    nodes = len(set(hosts))
    sent = set()
    for r in range(len(hosts)):
        peers = lay.peers(r, replicas)
        assert len(peers) == min(replicas, nodes - 1), (r, peers)
        assert len({lay.node_of[p] for p in peers} | {lay.node_of[r]}) == len(peers) + 1, (r, peers)
        sent |= {(r, p) for p in peers}
    assert sent == {(s, r) for r in range(len(hosts)) for s in lay.incoming(r, replicas)}


def test_copies_of_two_saves_with_one_number_never_pass_for_one_checkpoint(tmp_path):
    """Node 0 holds half of save 3 of one job, node 1 half of another job's save 3 (nodes that met
    again after a restore from the root): on paper, rank 0's choice finds no whole checkpoint on
    the nodes (the saves' tokens differ); the same halves of one save are one checkpoint."""
    from hpcsync.resilience.checkpoint import Checkpoints
    from hpcsync.resilience.node_copies import _choose

    from hpcsync.resilience.root_owner import claim, this_job

    ckpts, lay = Checkpoints(str(tmp_path / "root")), Layout.of(["a", "b"])
    run = claim(ckpts.root, this_job()).id

    def half(token, names):
        return {(3, token): {"step": 30, "seq": 3, "token": token, "count": 4, "world_size": 2, "run": run,
                             "files": {n: 10 for n in names}}}

    mixed = [half("one", ["rank-00000.pt", "sharded/__0_0.distcp"]), half("two", ["rank-00001.pt", "sharded/__1_0.distcp"])]
    assert _choose(ckpts, None, mixed, lay) is None
    whole = [half("one", ["rank-00000.pt", "sharded/__0_0.distcp"]), half("one", ["rank-00001.pt", "sharded/__1_0.distcp"])]
    chosen = _choose(ckpts, None, whole, lay)
    assert chosen[0] == "local" and (chosen[1].step, chosen[1].key, chosen[1].world) == (30, (3, "one"), 2) \
        and chosen[1].holders["rank-00001.pt"] == [1], chosen


@pytest.mark.heavy  # (one process, but a dozen starts of it: beside the tests that build nodes)
def test_a_node_local_save_keeps_a_complete_checkpoint_at_every_moment(tmp_path):
    """One process, node-local copies only (``keep=1``): step 5 saved, then again by a process
    that dies just before its k-th filesystem change -- hpcsync's and torch.distributed.checkpoint's
    own -- for every k: the next start always finds a complete step 5, the old content or the new,
    never nothing and never a mix."""
    from hpcsync.resilience.checkpoint import Checkpoints
    from hpcsync.resilience.node_copies import base

    ckpt_op(tmp_path, "save-local", tmp_path / "base", 1, "5=old")

    def prepare(root):  # the node-local copies, the root's OWNER (its run); their folder is named after its root
        os.makedirs(root)
        shutil.copy(tmp_path / "base" / "OWNER", root / "OWNER")
        shutil.copytree(f"{tmp_path}/base-local", f"{root}-local")
        [inner] = Path(f"{root}-local").glob("hpcsync-*")
        inner.rename(base(Checkpoints(str(root), local_dir=f"{root}-local")))

    k, seen = killed_at_every_change(tmp_path, "sharded-local", prepare, lambda root: load_sharded_here(root, True))
    assert k > 6 and seen == {"old", "new"}, (k, seen)
    assert not list((tmp_path / f"crash{k}").glob("step-*")), "a node-local save wrote into the root"


@pytest.mark.parametrize("seed", range(4))
def test_the_reads_of_a_lost_node_spread_over_every_holder_rank(seed):
    """Generated layouts (nodes of 2-8 ranks, 1-3 holder nodes): the ranks that serve the files
    of the nodes that lack them are spread over every rank of every node holding them. The check
    of each file (``sources``): no two files share a server while there are more holder ranks
    than files, every holder rank serves once there are as many, and a rank whose own node holds
    a copy reads its own; a fetch (``server``): the same for consecutive requesters. (The first
    holder's ``ranks[me % ppn]``, or ``nodes[me % n]`` then ``ranks[me % ppn]``, leaves half of
    them idle or more.)"""
    import random

    from hpcsync.resilience.node_verify import server, sources

    rng = random.Random(seed)
    for _ in range(20):
        per, nodes = rng.randint(2, 8), rng.randint(2, 6)
        hosts = [f"n{k}" for k in range(nodes) for _ in range(per)]
        lay = Layout.of(hosts)
        holders = rng.sample(range(nodes), rng.randint(1, min(3, nodes - 1)))
        serving = [r for k in holders for r in lay.ranks[k]]
        lost = [r for r in range(len(hosts)) if lay.node_of[r] not in holders]
        for count in (1, len(serving) // 2 + 1, len(serving), len(serving) + 3):
            asking = list(range(lost[0], lost[0] + count))  # consecutive ranks (the numbers alone matter here)
            got = [server(me, holders, lay.ranks) for me in asking]
            assert set(got) <= set(serving), (holders, got)
            assert len(set(got)) == min(count, len(serving)), (per, nodes, holders, count, got)
        names = [f"rank-{r:05d}.pt" for r in range(len(hosts))]
        left = {n: list(holders) for n in names}
        chosen = sources(names, len(hosts), len(hosts), left, lay.node_of, lay.ranks)
        for r, n in enumerate(names):
            assert chosen[n] == r if lay.node_of[r] in holders else chosen[n] in serving, (r, chosen[n])
        outside = [chosen[f"rank-{r:05d}.pt"] for r in lost]
        assert len(set(outside)) == min(len(lost), len(serving)), (holders, outside)
