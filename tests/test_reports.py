"""In process, no MPI: rank ranges, the node map, how a hang report groups ranks, and how reports
are written."""
import os
import subprocess
import sys

from hpcsync.core import nodemap

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
