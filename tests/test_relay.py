"""Asking every rank through relays (``hpcsync.observe.relay``): the plan on paper, and a real job
of 16 ranks on four namespace nodes, every rank answering and then with a relay silent; who prints
a failure report when rank 0 is frozen."""
from hpcsync.core import deadlines
from hpcsync.core.nodemap import NodeMap
from hpcsync.observe import relay
from launch import run
from netns_cluster import ROUTED, Cluster


def test_the_plan_asks_own_node_directly_and_other_nodes_through_few_relays(monkeypatch):
    """8 nodes of 4 ranks, 3 relays a rank: rank 0 asks ranks 1-3 itself and 3 relays for the other
    7 nodes in consecutive shares of whole nodes; a suspect node's ranks are asked one by one; the
    bound grows by one hop per factor of FANOUT in the number of nodes."""
    monkeypatch.setattr(deadlines, "FANOUT", 3)
    nodes = NodeMap([r // 4 for r in range(32)], [f"n{k}" for k in range(8)])
    plan = relay.shares(range(32), 0, nodes)
    assert plan[:3] == [(1, [1]), (2, [2]), (3, [3])]
    relays = plan[3:]
    assert [r for r, _ in relays] == [4, 12, 20]  # nodes 1-2, 3-4, 5-7
    assert [share for _, share in relays] == [list(range(4, 12)), list(range(12, 20)), list(range(20, 32))]
    assert sorted(r for _, share in plan for r in share) == list(range(1, 32))  # each rank once
    plan = relay.shares(range(32), 0, nodes, suspects={2})  # node 2's relay was silent
    assert [(r, s) for r, s in plan if len(s) == 1][3:] == [(8, [8]), (9, [9]), (10, [10]), (11, [11])]
    assert sorted(r for _, share in plan for r in share) == list(range(1, 32))
    monkeypatch.setattr(deadlines, "FANOUT", 16)
    assert [relay.hops(n) for n in (1, 2, 16, 17, 256, 1024)] == [1, 2, 2, 3, 3, 4]
    hop = deadlines.Deadlines.for_job(1024, 1024, 1).hop_s
    assert abs(relay.budget(1024) - deadlines.ROUNDS * hop * 5) < 1e-9


def test_a_question_to_every_rank_goes_through_relays_across_nodes(tmp_path):
    """16 ranks on four nodes, two relays a rank (FANOUT 2). Who prints a hang report is settled
    through the nodes' first ranks. Every rank answers; no rank asks more
    than its node's other ranks and two relays; node 3's relay is asked by node 2's relay (two
    levels of relays). With node 2's relay silent (its responder stopped, as a frozen process's),
    every other rank still answers, node 2's other ranks included, within the bound."""
    c = Cluster(tmp_path / "nodes", 4, ROUTED).start()
    try:
        res = run(c.openmpi([4, 4, 4, 4]), 16, "relay_tree.py", "2", tmp_path=tmp_path, timeout=240)
    finally:
        c.stop()
    node = [d["node"] for d in res.ranks]
    assert node == [r // 4 for r in range(16)], node
    lead = {k: node.index(k) for k in range(4)}
    # a hang report: each rank leaves it to its node's first rank, those to rank 0, which answers
    # one question per node (and its own node's ranks), not one per rank
    defers = [d["defers_to"] for d in res.ranks]
    assert defers == [None if r == 0 else 0 if r == lead[node[r]] else lead[node[r]] for r in range(16)], defers
    assert res.ranks[0]["digest_questions"] == 3 + 3 and res.ranks[lead[3]]["digest_questions"] == 3, \
        [d["digest_questions"] for d in res.ranks]  # (node 3 is past the first three: its own ranks only)
    assert res.ranks[lead[1]]["defers_to_reporting"] == 0  # rank 0 already reports a later operation's hang
    healthy = res.ranks[0]["healthy"]
    assert healthy["answered"] == list(range(1, 16)) and healthy["took"] <= healthy["bound"], healthy
    askers = {int(r): a for r, a in healthy["askers"].items()}
    want = {r: 0 if node[r] == 0 else lead[node[r]] for r in range(1, 16)}
    want.update({lead[1]: 0, lead[2]: 0, lead[3]: lead[2]})
    assert askers == want, askers
    assert max(d["widest"] for d in res.ranks) <= 2 + 3, [d["widest"] for d in res.ranks]
    silent = res.ranks[0]["relay_silent"]
    assert silent["victim"] == lead[2]
    assert silent["answered"] == [r for r in range(1, 16) if r != lead[2]], silent
    assert silent["took"] <= healthy["bound"], silent
    print(f"relays: every rank in {healthy['took']:.2f} s, a relay silent {silent['took']:.2f} s (bound {healthy['bound']:g} s)")


def test_every_rank_raises_with_rank_0_frozen_and_one_report_comes_out(tmp_path):
    """8 ranks on four nodes; rank 0 freezes (SIGSTOP) as rank 3 raises and every other rank
    raises 0.2 s later. Who prints is settled by the min-reduction along the relays, which passes
    over the silent rank 0: one block, naming rank 3 and its node, rank 0 said to give no
    answer; not one block per rank that failed."""
    c = Cluster(tmp_path / "nodes", 4, ROUTED).start()
    try:
        res = run(c.openmpi([2, 2, 2, 2]), 8, "many_ranks.py", "raise", "gloo", "3", "frozen0", tmp_path=tmp_path,
                  expect_ok=False, timeout=240)
    finally:
        c.stop()
    err = res.stderr
    assert res.returncode != 0
    assert err.count("the first to fail") == 1, err[-6000:]
    assert f"uncaught exception on rank 3 ({c.names[1]}), the first to fail, at step 40" in err, err[-6000:]
    assert err.count("ValueError: bad batch on rank 3") == 1, err[-6000:]
    assert f"rank 0 on {c.names[0]}: no answer within" in err, err[-6000:]
