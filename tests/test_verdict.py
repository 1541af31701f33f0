"""The failure record and the verdict of ``hpcsync run``, without a job: the record's JSON is
written and read by one class (another version, a foreign key, a wrong type: skipped with a
warning), and the verdicts follow the evidence (tests/test_verdict_simulator.py draws thousands
of failures; these are the defects of issue 57, one each)."""
import json
import logging

from hpcsync.core.nodemap import NodeMap
from hpcsync.observe import failure
from hpcsync.observe.record import KIND, VERSION, Cause, FailureRecord, RecordError, Reporter
from hpcsync.resilience import launchers, verdict
from hpcsync.resilience.verdict import Action


def layout(nodes, per_node):
    """The node map of ``nodes`` nodes of ``per_node`` ranks each (block placement)."""
    return NodeMap([r // per_node for r in range(nodes * per_node)], [f"n{k}" for k in range(nodes)])


def test_every_record_reads_back_as_written_and_a_person_can_read_it(tmp_path, monkeypatch):
    """Each writer's record (an exception, a hang, a stall, a silent rank, a send's peer) saved
    to a folder and read back is the same record; its file is JSON, one key a line."""
    monkeypatch.setenv("HPCSYNC_RUN_ATTEMPT", "2")
    nodes, me = layout(3, 2), Reporter(1, "n0")
    made = [failure.exception_record(ValueError("bad sample"), me, exit_code=3),
            failure.hang_record({"no_reply": [4, 5], "never_entered": [2], "operation": {"op": "all_reduce", "seq": 9},
                                 "group": "0", "timeout_s": 6}, range(4), me, nodes),
            failure.hang_record({"no_reply": [], "never_entered": [0]}, range(6), me, nodes),
            failure.silent_record([5], range(5), "CollectiveTimeout: x", me, nodes),
            failure.p2p_record(3, False, "recv from 3", me, nodes)]
    for rec in made:
        assert failure.save(rec, str(tmp_path))
    back = sorted(failure.read(str(tmp_path)), key=lambda r: r.time)
    assert back == sorted(made, key=lambda r: r.time)
    hang = next(r for r in back if r.cause is Cause.HANG and r.silent == (4, 5))
    assert hang.silent_at == {4: "n2", 5: "n2"} and hang.reached_nodes == ("n0", "n1") and hang.attempt == "2"
    text = open(hang.path).read()
    assert text.count("\n") > 10 and json.loads(text)["version"] == VERSION and '"cause": "hang"' in text


def test_a_record_this_code_did_not_write_is_skipped_with_a_warning(tmp_path, caplog):
    """Another version, a key it does not know, a wrong type, an unknown cause, torn JSON: each
    refused by the reader, which warns and goes on (the good record is still read)."""
    good = failure.build(Cause.HANG, [3], ["n1"], "x", Reporter(0, "n0"), silent=(3,), silent_at={3: "n1"})
    base = good.to_dict()
    bad = {"v2": {**base, "version": 2}, "noversion": {k: v for k, v in base.items() if k != "version"},
           "strversion": {**base, "version": "1"}, "key": {**base, "blame_everything": True},
           "type": {**base, "blame_nodes": "n1"}, "cause": {**base, "cause": "cosmic ray"},
           "rank": {**base, "reporter": {"rank": "0", "node": "n0"}}, "at": {**base, "silent_at": {"x": "n1"}},
           "kind": {**base, "kind": "something else"}}
    for name, data in bad.items():
        try:
            FailureRecord.from_dict(data)
        except RecordError:
            pass
        else:
            raise AssertionError(f"{name}: accepted {data}")
        (tmp_path / f"{failure.PREFIX}{name}.json").write_text(json.dumps(data))
    (tmp_path / f"{failure.PREFIX}torn.json").write_text(good.to_json()[:40])
    failure.save(good, str(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert failure.read(str(tmp_path)) == [good]
    assert sum("skipped" in r.getMessage() for r in caplog.records) == len(bad) + 1, caplog.text
    assert FailureRecord.from_dict({"kind": KIND, "version": VERSION, "cause": "stall",
                                    "reporter": {"rank": 0, "node": "n0"}}).reached_ranks() == (0,)


def test_the_action_is_an_enum_with_the_words_of_the_logs():
    assert [a.value for a in Action] == ["done", "relaunch", "stop-program", "requeue"]
    v = verdict.judge(0, [], launchers.LauncherWords(), False)
    assert v.action is Action.DONE and v.action == "done"
