"""In process, no MPI: rank ranges, the node map, how a hang report groups ranks, and how reports
are written."""
import os
import subprocess
import sys

from hpcsync.core import nodemap
from hpcsync.core.nodemap import NodeMap

from hpcsync.observe import watchdog
from launch import ROOT


def test_ranges():
    assert nodemap.ranges([]) == "none"
    assert nodemap.ranges([5]) == "5"
    assert nodemap.ranges([7, 0, 1, 2, 4, 6, 2]) == "0-2, 4, 6-7"
    assert nodemap.ranges(range(10_000)) == "0-9999"


def test_node_map_describes_ranks_with_their_nodes():
    nodes = nodemap.NodeMap(node_of=[0, 0, 1, 1, 2, 2], names=["n0", "n1", "n2"])
    assert nodes.host(3) == "n1" and nodes.host(99) == "?"
    assert nodes.describe([2, 3]) == "2-3 on n1"
    assert nodes.describe([0, 5, 1]) == "0-1, 5 on n0, n2"
    assert nodes.by_node([5, 0, 4]) == {"n0": [0], "n2": [4, 5]}
    many = nodemap.NodeMap(node_of=list(range(20)), names=[f"n{i}" for i in range(20)])
    assert many.describe(range(20), max_nodes=3) == "0-19 on n0, n1, n2 and 17 more node(s)"


def digest(rank, state, last_seq, finished, frames):
    return {"rank": rank, "pid": 100 + rank, "state": state, "timed_out": state == "inside",
            "last": {"seq": last_seq, "op": f"all_reduce #{last_seq}", "finished": finished, "age_s": 1.0},
            "frames": frames}


def test_report_groups_ranks_and_stays_small(monkeypatch):
    """1,000 ranks on 125 nodes, rank 999 stuck elsewhere, ranks 500-503 silent: a few groups."""
    n = 1000
    monkeypatch.setattr(nodemap, "_current", nodemap.NodeMap([r // 8 for r in range(n)], [f"n{k}" for k in range(125)]))
    group = watchdog.GroupLog("0", list(range(n)))
    rec = watchdog.OpRecord(7, "all_reduce", "float32", (4,), -1, 0.0)
    states = {r: digest(r, "inside", 7, False, ["  File \"train.py\", line 9, in <module>\n    step()"])
              for r in range(n) if r not in (500, 501, 502, 503, 999)}
    states[999] = digest(999, "never", 6, True, ["  File \"train.py\", line 5, in <module>\n    load()"])
    rep = watchdog.build_report(group, rec, 10.0, states, [500, 501, 502, 503])
    assert [(g["state"], g["ranks"]) for g in rep["groups"]] == [("never", "999"), ("inside", "0-499, 504-998")]
    assert rep["no_reply"] == [500, 501, 502, 503] and rep["no_reply_nodes"] == {"n62": "500-503"}
    text = watchdog.format_report(rep)
    assert "no reply: rank(s) 500-503 on n62" in text and "never entered #7: rank(s) 999 on n124" in text
    assert "rank 999 (n124): last operation all_reduce #6 (finished 1.0 s ago)" in text
    assert len(text.splitlines()) <= 12 and len(text) < 3000


def test_submodules_import_without_loading_torch_or_mpi():
    code = ("import sys, hpcsync.data.filesync, hpcsync.core.nodemap; hpcsync.data.filesync.part_path('a.csv', 1); "
            "hpcsync.core.nodemap.ranges([1]); "
            "print('torch' in sys.modules, 'mpi4py.MPI' in sys.modules, callable(hpcsync.topology))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.split() == ["False", "False", "True"], out.stderr


def test_functions_named_like_their_module_stay_functions():
    """``hpcsync.preemption`` (topology, requeue, monitor) is a function whose module lives in its
    package: importing the module, directly or through another name it defines, leaves the function;
    the old module path is no path at all (it would rebind the name to a module)."""
    code = ("import types, hpcsync; hpcsync.PreemptionGuard; import hpcsync.resilience.preemption, "
            "hpcsync.core.topology, hpcsync.resilience.requeue, hpcsync.observe.monitor\n"
            "try:\n    import hpcsync.requeue\nexcept ImportError:\n    print('refused')\n"
            "print(*(isinstance(getattr(hpcsync, n), types.FunctionType) "
            "for n in ('preemption', 'topology', 'requeue', 'monitor')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.split() == ["refused", "True", "True", "True", "True"], out.stdout + out.stderr


def test_two_hang_reports_in_one_second_are_two_whole_files(tmp_path, monkeypatch):
    """Each report has a name no other takes (job, second, rank, process, a count) and appears
    whole or not at all: two reports in one second neither overwrite nor tear each other."""
    monkeypatch.setenv("HPCSYNC_REPORT_DIR", str(tmp_path))
    monkeypatch.setattr(watchdog.time, "time", lambda: 1_800_000_000.0)  # the very same second
    paths = [watchdog.write_report({"kind": "hpcsync hang report", "n": n}) for n in range(2)]
    assert len(set(paths)) == 2, paths
    import json

    assert sorted(json.loads(open(p).read())["n"] for p in paths) == [0, 1]
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in paths)  # no temporary left


def test_the_resumed_note_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """`hpcsync run` reads which checkpoint an attempt resumed from: a note that fails halfway
    (a full disk) leaves the one before intact and no temporary file."""
    import json

    from hpcsync.observe import failure

    monkeypatch.setenv("HPCSYNC_REPORT_DIR", str(tmp_path))
    monkeypatch.setenv("HPCSYNC_RUN_ATTEMPT", "1")
    failure.note_resume(10, "/ckpt/step-10", 1.0)
    real_dump = json.dump

    def torn(obj, f, **kw):
        f.write('{"step": 2')
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(failure.json, "dump", torn)
    failure.note_resume(20, "/ckpt/step-20", 2.0)
    monkeypatch.setattr(failure.json, "dump", real_dump)
    assert json.loads((tmp_path / failure.RESUMED).read_text())["step"] == 10
    assert os.listdir(tmp_path) == [failure.RESUMED]


def test_the_deadlines_table_in_the_docs_is_the_code_s():
    """docs/timeouts.md states every deadline of the reports, its formula and its value at 2,
    1,024 and 8,192 ranks: the table is the one hpcsync.core.deadlines computes, line for line;
    and the bounds grow with the job (a fixed 1 s or 30 s would not)."""
    from hpcsync.core import deadlines

    doc = (ROOT / "docs" / "timeouts.md").read_text().splitlines()
    table = deadlines.rows()
    start = doc.index(table[0]) if table[0] in doc else None
    assert start is not None, "docs/timeouts.md has no table of the deadlines"
    assert doc[start:start + len(table)] == table, "\n".join(table)
    small, big = (deadlines.Deadlines.for_job(r, n) for r, n in (deadlines.SIZES[0], deadlines.SIZES[-1]))
    for name in ("hop_s", "round_s", "settle_s", "gather_s", "report_s", "report_bound_s", "logs_close_s"):
        assert getattr(big, name) > getattr(small, name), name
    assert big.report_bound_s >= big.report_s and big.wait_s < big.report_bound_s


def _simulated(nodes, claimants, frozen, hop_s=1.0):
    """A pure-Python job of ``nodes`` (a NodeMap): every rank's answer to ("claimant",) by
    ``claimants`` ({rank: 0 gathering, 1 claiming}), ``frozen`` ranks answer nobody; a relay
    serves through the same code as over MPI (relay.serve). Returns a tree's sender and the
    questions each rank received and the widest send."""
    from hpcsync.observe import relay

    received, widest = {}, [0]

    def sender(me):
        def send(questions, wait_s):
            widest[0] = max(widest[0], len(questions))
            out = {}
            for r, q in questions.items():
                received[r] = received.get(r, 0) + 1
                if r in frozen:
                    continue
                if q[0] == "relay":
                    _, inner, share, left, suspects, keep = q
                    out[r] = relay.serve(relay.Tree(r, nodes, hop_s, sender(r)), inner, share, left, suspects, keep,
                                         lambda r=r: claimants.get(r))
                else:
                    out[r] = claimants.get(r)
            return out
        return send
    return sender, received, widest


def test_the_min_reduction_along_the_relays_picks_the_rule_s_printer():
    """Who prints a failure report, settled by a min-reduction along the relay tree: 3,000 seeded
    jobs of 2-40 ranks on 1-12 nodes (FANOUT 2 or 3: trees 2-5 hops deep), random claimants (some
    already gathering), up to two frozen ranks (relays among them), every claimant settling at
    once. Each must pick the rule's printer (the least claim among the ranks that answer: one
    gathering before one claiming, then the lowest rank), so exactly one rank gathers; every live
    rank is heard; no rank asks more than FANOUT + its node's ranks at once, and each rank is
    asked at most once per settling claimant and round. At 1,000 ranks on 125 nodes of 8 with
    every node's first rank claiming: 125 questions to each rank, of a few dozen bytes, 3 hops,
    no answer larger than one claim and the ranks heard as ranges."""
    import random

    from hpcsync.core import deadlines
    from hpcsync.observe import digest, relay

    real = deadlines.FANOUT
    try:
        for seed in range(3000):
            rng = random.Random(seed)
            deadlines.FANOUT = rng.choice([2, 3])
            n_nodes = rng.randint(1, 12)
            per = [rng.randint(1, 4) for _ in range(n_nodes)]
            node_of = [k for k, c in enumerate(per) for _ in range(c)]
            n = len(node_of)
            if n < 2:
                continue
            nodes = NodeMap(node_of, [f"n{k}" for k in range(n_nodes)])
            frozen = set(rng.sample(range(n), min(rng.choice([0, 0, 1, 2]), n - 1)))
            live = [r for r in range(n) if r not in frozen]
            claimants = {r: 1 for r in rng.sample(live, rng.randint(1, len(live)))}
            if rng.random() < 0.2:
                claimants[rng.choice(sorted(claimants))] = 0
            want = min((k, r) for r, k in claimants.items())[1]
            hops = relay.hops(n_nodes)
            each = 1.0 * (hops + 1)
            for asker in sorted(claimants):
                sender, received, widest = _simulated(nodes, {r: k for r, k in claimants.items()}, frozen)
                got = relay.walk(relay.Tree(asker, nodes, 1.0, sender(asker)), range(n), ("claimant",),
                                 deadlines.SETTLE_ROUNDS * each, each, deadlines.SETTLE_ROUNDS, keep="claim")
                assert len(got.answers) <= 1, (seed, got.answers)
                picked = digest.pick(asker, got.answers, claimants[asker] == 0)
                assert picked == want, (seed, asker, picked, want, sorted(frozen))
                assert set(got.heard) == set(live) - {asker} and not got.unreached, (seed, asker)
                assert widest[0] <= deadlines.FANOUT + max(per) + n, seed  # a flat last round asks a share at once
                assert max(received.values()) <= deadlines.SETTLE_ROUNDS, (seed, received)
    finally:
        deadlines.FANOUT = real


def _raise(kind, rank):
    """A real traceback of one of three distinct errors (the message names the rank)."""
    def load(i):
        raise FileNotFoundError(f"shard {i} of rank {rank} is missing")

    def step(i):
        if kind == 1:
            raise ValueError(f"bad batch on rank {rank}")
        if kind == 2:
            raise RuntimeError(f"loss is NaN on rank {rank} at step {i}")
        load(i)

    try:
        step(40)
    except Exception:
        return sys.exc_info()


def test_a_report_of_generated_failures_names_every_rank_once_with_one_traceback_per_error(monkeypatch):
    """300 seeded jobs of 4-8 ranks on 1-4 nodes: random ranks raise one of three distinct errors
    (real tracebacks, the message naming the rank), the others are still running, some silent.
    The report names every rank in ranges (each once, with its node), carries exactly one whole
    traceback per distinct error (its hash), the head's its own, and stays small: the states
    carry no traceback (under 700 bytes a rank) and the report stays under 2 KB plus its
    tracebacks. At 1,000 ranks: 1,000 states of ~300 bytes (300 KB gathered, not 5-20 MB of
    tracebacks), and a report of a few groups and at most 13 tracebacks."""
    import json
    import random
    import traceback

    from hpcsync.observe import digest, failure

    for seed in range(300):
        rng = random.Random(seed)
        n = rng.randint(4, 8)
        n_nodes = rng.randint(1, 4)
        monkeypatch.setattr(nodemap, "_current", NodeMap([r * n_nodes // n for r in range(n)],
                                                          [f"n{k}" for k in range(n_nodes)]))
        failed = rng.sample(range(n), rng.randint(1, n))
        silent = set(rng.sample([r for r in range(n) if r not in failed], rng.randint(0, 1))) \
            if len(failed) < n else set()
        states, texts, me = {}, {}, min(failed)
        for r in range(n):
            if r in silent:
                continue
            if r in failed:
                kind = rng.randint(0, 2)
                et, ev, tb = _raise(kind, r)
                text = "".join(traceback.format_exception(et, ev, tb))
                monkeypatch.setattr(failure, "_raised", {})
                failure.note_raised(f"{et.__name__}: {ev}", digest._where(tb), digest._frames(tb), text,
                                    digest=digest.traceback_hash(et, tb))
                state = {"rank": r, "failed": True, "step": 40, **failure.raised_state(), "time": 100.0 + rng.random()}
                texts[r] = text
            else:
                state = {"rank": r, "failed": False, "step": 40, "frames": ['  File "train.py", line 9, in <module>\n'
                                                                            '    step()']}
            assert "traceback" not in state and len(json.dumps(state)) < 700, state
            states[r] = state
        by_hash = {}
        for r in sorted(states, key=lambda r: (states[r].get("time", 0), r)):
            if states[r]["failed"]:
                by_hash.setdefault(states[r]["hash"], r)
        full = {r: texts[r] for r in by_hash.values()}
        rep = digest.build(me, states, n, full)
        distinct = {states[r]["hash"] for r in failed}
        assert sorted(rep["tracebacks"]) == sorted(distinct) and len(distinct) <= 3, seed
        assert rep["tracebacks"][rep["hash"]]["text"] == texts[rep["rank"]], seed
        named = [rep["rank"]] + [r for g in rep["others"] for r in _unranges(g["ranks"])] + rep["silent"]
        assert sorted(named) == list(range(n)), (seed, named)
        assert rep["silent"] == sorted(silent) and not rep["frozen"], seed
        size = len(json.dumps(rep)) - sum(len(json.dumps(t["text"])) for t in rep["tracebacks"].values())
        assert size < 2000, (seed, size)
        block = digest.format_block(rep, "", 6.0)
        assert block.count("Traceback (most recent call last)") == 1, block
        for g in rep["others"]:
            assert g["ranks"] in block and all(node in block for node in g["nodes"]), block


def _unranges(text):
    out = []
    for part in text.split(", "):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def test_the_rank_the_others_waited_for_heads_the_report(monkeypatch):
    """gloo, 32 ranks on 8 nodes, rank 21 on node 5 frozen: every other rank's send or receive
    timed out inside gloo (a peer's timeout). The report is headed by rank 21 and its node, "the
    other ranks failed waiting on it", not by rank 0 as the first to fail; with one rank's own
    error among them, that rank heads it (its error came first in cause, if not in time)."""
    from hpcsync.observe import digest

    monkeypatch.setattr(nodemap, "_current", NodeMap([r // 4 for r in range(32)], [f"n{k}" for k in range(8)]))

    def timed_out(r, peer=True, error="RuntimeError: [../gloo/transport/tcp/pair.cc:598] Timed out"):
        return {"rank": r, "failed": True, "time": 100.0 + r / 100, "error": error, "where": "train.py:9",
                "hash": "gloo" if peer else "own", "peer": peer, "step": 40}

    states = {r: timed_out(r) for r in range(32) if r != 21}
    rep = digest.build(0, states, 32)
    assert (rep["rank"], rep["node"], rep["frozen"]) == (21, "n5", True), rep
    block = digest.format_block(rep, "rank 0's own traceback", 9.0)
    head = block.splitlines()[0]
    assert head.startswith("[hpcsync] ===== rank 21 (n5) gave no answer within 9 s: the other ranks failed "
                           "waiting on it"), block
    assert "the first to fail" not in block and "rank 0's own traceback" not in block, block
    assert "ranks 0-20, 22-31 on n0, n1, n2, n3, n4, n5, n6, n7: raised too" in block, block
    assert "rank 21 on n5: no answer" not in block, block  # named once, at the top
    states[9] = timed_out(9, peer=False, error="ValueError: bad batch on rank 9")
    rep = digest.build(0, states, 32)
    assert (rep["rank"], rep["frozen"]) == (9, False) and rep["silent"] == [21], rep


def test_a_traceback_that_did_not_arrive_is_never_the_printers_own(monkeypatch):
    """Rank 5 raised first, rank 0 prints: when rank 5's traceback did not reach rank 0 in time,
    the block under "uncaught exception on rank 5" gives rank 5's error and place and says its
    traceback is missing -- never rank 0's own traceback under rank 5's name."""
    from hpcsync.observe import digest

    monkeypatch.setattr(nodemap, "_current", NodeMap([r // 4 for r in range(8)], ["n0", "n1"]))
    states = {r: {"rank": r, "failed": True, "time": 100.0 + (0 if r == 5 else 1 + r), "error": f"ValueError: bad {r}",
                  "where": f"train.py:{10 + r}", "hash": f"h{r}", "peer": False, "step": 3} for r in range(8)}
    rep = digest.build(0, states, 8)
    assert rep["rank"] == 5 and rep["reported_by"] == 0, rep
    rep["tracebacks"] = {}  # (none arrived)
    block = digest.format_block(rep, "Traceback of rank 0 itself", 6.0)
    assert block.splitlines()[0].startswith("[hpcsync] ===== uncaught exception on rank 5 (n1)"), block
    assert "Traceback of rank 0 itself" not in block, block
    assert "ValueError: bad 5" in block and "train.py:15" in block and "did not reach rank 0" in block, block
