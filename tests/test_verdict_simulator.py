"""A failure simulator with ground truth for ``hpcsync run``'s verdict.

Each seed draws a job -- N ranks on M nodes (up to 8,192 ranks), a launcher (srun, Open MPI's
mpirun, MPICH's hydra), spares, where the supervisor runs -- and one to three faults among: a
frozen rank, a rank killed while its node-mates live on (the OOM killer's SIGKILL), a node down,
a link cut (a split: the cut side smaller or equal, the supervisor on either side, on a training
node or not), a program exception, a desync. From that truth it produces what the real job would
leave: the records the real writers build (:func:`hpcsync.observe.failure.hang_record`,
``exception_record``: not hand-made dicts), written as JSON and read back by the real reader
(``FailureRecord.from_json``; every 50th seed through files and ``failure.read``), each printer's
record present or not (a launcher that tears the job down first), the launcher's lines in its
own words (the forms of tests/test_supervisor.py and ``LauncherWords``' patterns), the probe's
answer as ``hpcsync.resilience.probe.unreachable`` would give it from the supervisor's node, and
Slurm's node state. The real :func:`~hpcsync.resilience.verdict.judge` decides, and the verdict
is checked against the truth:

- no healthy node blamed (ever);
- no relaunch of the program's own failure (an exception; a desync that no silent rank masks);
- no failed node kept where the evidence names it (a believed record, the probe, the launcher,
  Slurm), unless it names more nodes than the spares and a second sign is missing;
- a step with a fault never ends as ``done``.

A wrong verdict prints its seed (``python tests/test_verdict_simulator.py SEED`` replays one, with
everything it drew); the counts by scenario kind are printed (``-s``) for the closing note.
"""
import collections
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hpcsync.core.errors import CollectiveTimeout  # noqa: E402
from hpcsync.core.nodemap import NodeMap  # noqa: E402
from hpcsync.observe import failure  # noqa: E402
from hpcsync.observe.record import FailureRecord, Reporter  # noqa: E402
from hpcsync.resilience import launchers, verdict  # noqa: E402
from hpcsync.resilience.verdict import Action  # noqa: E402

KINDS = ("frozen", "dead-rank", "node-down", "link-cut", "exception", "desync")
FULL_SEEDS = 4000
QUICK_SEEDS = 300


@dataclass
class Scenario:
    seed: int
    nodes: int
    per_node: int
    launcher: str
    spares: int
    faults: List[str]
    sup_side: str = "main"  # the supervisor's side of a split: "main" or "cut"
    sup_on_node: bool = True
    down: Set[int] = field(default_factory=set)  # nodes down
    cut: Set[int] = field(default_factory=set)  # the nodes a link cut split off
    frozen: Set[int] = field(default_factory=set)
    dead: Set[int] = field(default_factory=set)  # ranks SIGKILLed, node-mates alive
    raiser: Optional[int] = None
    never: Set[int] = field(default_factory=set)  # ranks that never entered (a desync)
    sup_node: int = 0
    notes: List[str] = field(default_factory=list)

    @property
    def size(self) -> int:
        return self.nodes * self.per_node

    def node(self, rank: int) -> int:
        return rank // self.per_node

    def ranks_of(self, node: int) -> range:
        return range(node * self.per_node, (node + 1) * self.per_node)


def name(k: int) -> str:
    return f"n{k}"


def draw(seed: int) -> Scenario:
    """The truth of one seed: the job, its faults."""
    rng = random.Random(seed)
    shape = rng.random()
    per_node = rng.choice([1, 2, 4, 8])
    nodes = rng.randint(2, 16) if shape < 0.7 else rng.randint(17, 128) if shape < 0.95 else \
        rng.randint(129, 8192 // per_node)
    sc = Scenario(seed, nodes, per_node, rng.choice(["srun", "ompi", "hydra"]), rng.randint(0, 3), [])
    kinds = [k for k in KINDS if per_node > 1 or k not in ("frozen", "dead-rank")]  # a node-mate to live on
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(kinds)
        if kind in ("link-cut", "exception", "desync"):
            kinds.remove(kind)  # one of each
        sc.faults.append(kind)
    busy: Set[int] = set()  # nodes with a fault already (a node down is not also cut, ...)
    for kind in sc.faults:
        free = [k for k in range(nodes) if k not in busy]
        if kind == "node-down":
            if len(free) < 2:
                continue
            k = rng.choice(free)
            sc.down.add(k)
            busy.add(k)
        elif kind == "link-cut":
            # the side cut off: at most half of the ranks (an equal split is possible)
            most = max(1, (nodes // 2))
            cut = rng.sample(free, min(len(free) - 1, rng.randint(1, most))) if len(free) > 1 else []
            sc.cut |= set(cut)
            busy |= set(cut)
            sc.sup_side = rng.choice(["main", "cut"]) if sc.cut else "main"
            sc.sup_on_node = rng.random() < 0.7
        elif kind in ("frozen", "dead-rank"):
            k = rng.choice(free) if free else 0
            if k in busy and k not in {sc.node(r) for r in sc.frozen | sc.dead}:
                continue
            taken = [r for r in sc.ranks_of(k) if r in sc.frozen | sc.dead]
            options = [r for r in sc.ranks_of(k) if r not in taken]
            if len(options) <= 1:  # one node-mate must live on and answer
                continue
            (sc.frozen if kind == "frozen" else sc.dead).add(rng.choice(options))
            busy.add(k)
        elif kind == "exception":
            live = [r for r in range(sc.size) if sc.node(r) not in sc.down | sc.cut and r not in sc.frozen | sc.dead]
            sc.raiser = rng.choice(live) if live else None
        elif kind == "desync":
            sc.never = set(rng.sample(range(sc.size), rng.randint(1, max(1, sc.size // 4))))
    # where the supervisor runs: a training node of its side (or a node without ranks there)
    main = [k for k in range(nodes) if k not in sc.cut | sc.down]
    side = sorted(sc.cut) if sc.sup_side == "cut" else main
    sc.sup_node = rng.choice(side) if side else 0
    return sc


def lines_of(sc: Scenario, rng: random.Random) -> List[str]:
    """The launcher's output for the faults, in its own words."""
    out: List[str] = []
    hnp = name(sc.sup_node) if sc.sup_on_node else "head"
    for r in sorted(sc.dead):
        n = name(sc.node(r))
        if sc.launcher == "srun":
            out.append(f"srun: error: {n}: task {r}: Killed")
        elif sc.launcher == "ompi":
            if not any("exited on signal" in line for line in out):  # mpirun reports the first death only
                out.append(f"mpirun noticed that process rank {r} with PID 4{r} on node {n} exited on signal 9 (Killed).")
        else:
            out += [f"=   RANK {r} PID 4{r} RUNNING AT {n}", "=   KILLED BY SIGNAL: 9 (Killed)"]
    for k in sorted(sc.down):
        if sc.launcher == "srun" and rng.random() < 0.7:
            out.append(f"srun: error: Node failure on {name(k)}")
            if rng.random() < 0.3:
                ranks = sc.ranks_of(k)
                out.append(f"srun: error: {name(k)}: tasks {ranks[0]}-{ranks[-1]}: Killed")
        elif sc.launcher == "ompi" and rng.random() < 0.7:
            out += ["ORTE has lost communication with a remote daemon.", f"  HNP daemon   : [[4321,0],0] on node {hnp}",
                    f"  Remote daemon: [[4321,0],{k + 1}] on node {name(k)}"]
    if sc.cut and sc.launcher == "ompi" and rng.random() < 0.6:  # mpirun loses the daemons across the split
        other = [k for k in range(sc.nodes) if (k in sc.cut) != (sc.sup_side == "cut") and k not in sc.down]
        if other:
            k = min(other)  # it reports the first and aborts
            out += ["ORTE has lost communication with a remote daemon.", f"  HNP daemon   : [[4321,0],0] on node {hnp}",
                    f"  Remote daemon: [[4321,0],{k + 1}] on node {name(k)}"]
    if sc.raiser is not None:
        r, n = sc.raiser, name(sc.node(sc.raiser))
        out.append({"srun": f"srun: error: {n}: task {r}: Exited with exit code 1",
                    "ompi": f"MPI_ABORT was invoked on rank {r} in communicator MPI_COMM_WORLD with errorcode 1",
                    "hydra": f"=   RANK {r} PID 4{r} RUNNING AT {n}"}[sc.launcher])
    if sc.launcher == "srun" and (sc.dead or sc.raiser is not None) and rng.random() < 0.5:
        out.append("srun: launch/slurm: _step_signal: Terminating StepId=7.0")  # its cleanup of the rest
        for r in rng.sample(range(sc.size), min(3, sc.size)):
            if sc.node(r) not in sc.down | sc.cut and r not in sc.dead | sc.frozen:
                out.append(f"srun: error: {name(sc.node(r))}: task {r}: Terminated")
    return out


def records_of(sc: Scenario, nodes: NodeMap, rng: random.Random) -> List[FailureRecord]:
    """The records the ranks write, by the real writers: each side's printer its hang report
    (or not: the launcher may end it first), the raiser its exception, a few ranks a timeout."""
    out: List[FailureRecord] = []
    gone = {r for k in sc.down for r in sc.ranks_of(k)} | sc.dead
    cut_ranks = {r for k in sc.cut for r in sc.ranks_of(k)}
    sides = [[r for r in range(sc.size) if r not in cut_ranks], sorted(cut_ranks)] if sc.cut else [list(range(sc.size))]
    torn_down = sc.launcher in ("ompi", "hydra") and bool(sc.dead or sc.raiser is not None)  # the launcher ends all fast
    for side in sides:
        answer = [r for r in side if r not in gone and r not in sc.frozen]  # those who can answer a gathering
        if not answer:
            continue
        silent = sorted(set(range(sc.size)) - set(answer))
        never = sorted(r for r in sc.never if r in answer)
        if not silent and not never:
            continue
        if rng.random() < (0.5 if torn_down else 0.85):
            printer = answer[0]
            out.append(failure.hang_record({"no_reply": silent, "never_entered": never, "timed_out_ranks": never,
                                            "operation": {"op": "all_reduce", "seq": 40}, "group": "0", "timeout_s": 30},
                                           answer, Reporter(printer, nodes.host(printer)), nodes))
        for r in rng.sample(answer, min(2, len(answer))):  # ranks whose own wait timed out first
            if rng.random() < 0.3:
                out.append(failure.exception_record(CollectiveTimeout("the other ranks did not all arrive"),
                                                    Reporter(r, nodes.host(r))))
    if sc.raiser is not None:
        out.append(failure.exception_record(ValueError("bad sample at step 40"),
                                            Reporter(sc.raiser, nodes.host(sc.raiser))))
    rng.shuffle(out)
    return out


def probe_of(sc: Scenario):
    """``probe.unreachable`` as it would answer from the supervisor's node: the nodes it cannot
    start a process on, believed only when a node that proves the network (for mpirun and hydra,
    not its own) answered."""
    def probe(asked):
        main = sc.sup_side == "main"
        reach = {k for k in range(sc.nodes) if k not in sc.down and (k in sc.cut) != main}
        proof = reach - ({sc.sup_node} if sc.launcher != "srun" and sc.sup_on_node else set())
        names = {name(k): k for k in range(sc.nodes)}
        return [n for n in asked if names[n] not in reach] if proof else []
    return probe


def node_state_of(sc: Scenario, rng: random.Random):
    """Slurm's node state (srun only): a node down is DOWN once SlurmdTimeout passed (or not yet)."""
    if sc.launcher != "srun":
        return None
    said = rng.random() < 0.5

    def node_state(asked):
        return [n for n in asked if said and int(n[1:]) in sc.down]
    return node_state


def judge_one(seed: int, folder: Optional[str] = None):
    """The scenario of ``seed``, its verdict, and what is wrong with it ("" when right)."""
    sc = draw(seed)
    rng = random.Random(seed * 7919 + 1)
    nodes = NodeMap([sc.node(r) for r in range(sc.size)], [name(k) for k in range(sc.nodes)])
    written = records_of(sc, nodes, rng)
    if folder is not None:  # through files and the real reader
        for rec in written:
            failure.save(rec, folder)
        records = failure.read(folder)
    else:
        records = sorted((FailureRecord.from_json(r.to_json()) for r in written), key=lambda r: r.time)
    words = launchers.LauncherWords()
    for line in lines_of(sc, rng):
        words.feed(line)
    if not words.lines and (sc.down or sc.cut or (sc.frozen and rng.random() < 0.5)):
        words.hung = True  # the launcher waits for ranks it lost: the supervisor ends it
    step_nodes = [name(k) for k in range(sc.nodes)]
    asked = []

    def probe(nodes):
        asked.append(list(nodes))
        return probe_of(sc)(nodes)
    v = verdict.judge(1, records, words, False, node_state_of(sc, rng), ranks=sc.size, nodes=step_nodes,
                      probe=probe, spares=sc.spares)
    return sc, records, words, v, wrong(sc, records, words, v, probed=bool(asked))


def wrong(sc: Scenario, records, words, v, probed: bool) -> str:
    """What is wrong with the verdict ``v`` on ``sc``, "" when nothing (``probed``: whether the
    verdict asked the probe -- only then is its answer evidence at hand)."""
    failed = {name(k) for k in sc.down | sc.cut}
    healthy = set(v.blamed) - failed
    cut_ranks = len(sc.cut) * sc.per_node
    if healthy and 2 * cut_ranks == sc.size:  # an equal split: either side may be the one cut off
        failed = {name(k) for k in sc.down} | {name(k) for k in range(sc.nodes) if k not in sc.cut}
        healthy = set(v.blamed) - failed
    if healthy:
        return f"healthy node(s) blamed: {sorted(healthy)}"
    masked = bool(sc.frozen or sc.dead or sc.down or sc.cut)  # silent ranks hide a desync
    stalled = any(r.cause.value == "stall" for r in records)  # what says "desync" (its printer may not write)
    program = sc.raiser is not None or (stalled and not masked)
    if program:  # stopped, or ended with its exit code: never relaunched
        return "" if v.action in (Action.STOP_PROGRAM, Action.DONE) else f"the program's own failure {v.action.value}"
    if set(sc.faults) <= {"desync", "exception"}:  # a desync whose record was not written: nothing says so
        return ""
    if v.action is Action.DONE and (records or words.lines or words.hung):
        return "a failed step ended as done"  # (with no evidence at all there is nothing to act on)
    if v.action is Action.STOP_PROGRAM and not sc.never:
        return "stopped, but the program did nothing wrong"
    if v.action is Action.STOP_PROGRAM:
        return ""  # a desync behind a silent rank: stopping is allowed too
    # the failed nodes some evidence names, and how many signs each has
    # (a probe that fails more than half of the nodes, a daemon Open MPI lost: no sign by itself --
    # from the supervisor's side of a split they look the same as the other side's failure)
    signs: Dict[str, int] = collections.Counter()
    probe = set(probe_of(sc)([name(k) for k in range(sc.nodes)])) if probed else set()
    if 2 * len(probe) > sc.nodes:
        probe = set()
    for n in failed:
        signs[n] += n in probe
        signs[n] += n in words.failed or (n in words.deaths and len(words.deaths[n]) >= sc.per_node)
        signs[n] += n in words.lost and signs[n] > 0
    believed = [r for r in records if r.reached is not None and 2 * len(r.reached) > sc.size and r.silent]
    for n in failed:
        signs[n] += any(n in r.silent_at.values() and n not in r.reached_nodes for r in believed)
    named = {n for n in failed if signs[n]}
    must = named if len(named) <= sc.spares else {n for n in named if signs[n] >= 2}
    kept = must - set(v.blamed)
    return f"failed node(s) kept: {sorted(kept)}" if kept else ""


def simulate(seeds: int):
    started = time.monotonic()
    counts: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    bad = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(seeds):
            folder = None
            if seed % 50 == 0:
                folder = os.path.join(tmp, str(seed))
                os.makedirs(folder)
            sc, _, _, v, why = judge_one(seed, folder)
            kind = "+".join(sorted(set(sc.faults)))
            for k in set(sc.faults):
                counts[k]["wrong" if why else "right"] += 1
            counts["(all)"]["wrong" if why else "right"] += 1
            counts[f"({sc.launcher})"]["wrong" if why else "right"] += 1
            if why:
                bad.append(f"seed {seed}: {kind} on {sc.nodes}x{sc.per_node} ({sc.launcher}, {sc.spares} spare(s)): "
                           f"{why}; verdict {v.action.value} {v.cause!r} blamed {v.blamed}")
    took = time.monotonic() - started
    print(f"\n{seeds} seeds in {took:.1f} s; verdicts right / wrong, by fault kind (a seed counts once per kind):")
    for k in sorted(counts):
        print(f"  {k:12s} {counts[k]['right']:6d} right {counts[k]['wrong']:5d} wrong")
    return bad, took


def test_verdicts_match_the_truth_of_generated_failures():
    seeds = int(os.environ.get("HPCSYNC_SIM_SEEDS", FULL_SEEDS))
    bad, took = simulate(seeds)
    assert not bad, "\n".join(bad[:30]) + (f"\n... and {len(bad) - 30} more" if len(bad) > 30 else "")
    assert took < 60, took


def test_verdicts_match_the_truth_quick():
    """The quick lane's share: a few hundred seeds."""
    bad, _ = simulate(QUICK_SEEDS)
    assert not bad, "\n".join(bad[:30])


if __name__ == "__main__":  # replay one seed: everything it drew, and its verdict
    for arg in sys.argv[1:]:
        sc, records, words, v, why = judge_one(int(arg))
        print(sc)
        for rec in records:
            print(" record", rec.cause.value, "by", rec.reporter, "silent", list(rec.silent)[:20],
                  "reached", len(rec.reached_ranks()), "blame", rec.blame_nodes)
        print(" launcher:", words.lines, "deaths", words.deaths, "alive", sorted(words.alive), "hung", words.hung)
        print(" verdict:", v)
        print(" wrong:", why or "no")
