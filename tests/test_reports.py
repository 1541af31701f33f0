"""In process, no MPI: rank ranges, the node map, and how a hang report groups ranks."""
import subprocess
import sys

from hpcsync import nodemap, watchdog
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


def test_submodules_are_attributes_without_loading_torch_or_mpi():
    code = ("import sys, hpcsync; hpcsync.filesync.part_path('a.csv', 1); hpcsync.nodemap.ranges([1]); "
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
