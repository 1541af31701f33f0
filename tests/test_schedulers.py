"""The scheduler seam of ``hpcsync run`` (:mod:`hpcsync.resilience.schedulers`): what each
scheduler's environment and commands say, read from generated inputs (``scontrol show node -o``
lines, ``SLURM_*`` and ``PBS_*`` environments, ``pbsnodes`` blocks) against their ground truth; a
record's hostname mapped to Slurm's NodeName wherever the two differ, so the failed node is the
one left out, probed and excluded; a probe that timed out behind a slow controller retried alone."""
import json
import os
import random
import signal
import socket
import time

import pytest

from hpcsync.observe import failure, record
from hpcsync.resilience import launchers, probe, requeue, schedulers, supervisor
from hpcsync.resilience.schedulers import NodeState

UP_STATES = ["IDLE", "ALLOCATED", "MIXED", "COMPLETING", "ALLOCATED+REBOOT_REQUESTED", "IDLE+POWER_UP", "MIXED+PLANNED"]
DOWN_STATES = ["DOWN", "DOWN+DRAIN", "IDLE+DRAIN", "ALLOCATED+DRAIN", "IDLE+NOT_RESPONDING", "MIXED*", "IDLE*",
               "DOWN+NOT_RESPONDING", "ALLOCATED+FAIL", "IDLE+POWERED_DOWN", "DRAINED"]


def node_line(name, host, addr, state):
    """One ``scontrol show node -o`` line, with the fields around the ones read."""
    return (f"NodeName={name} Arch=x86_64 CoresPerSocket=8 CPUAlloc=0 CPUTot=16 AvailableFeatures=(null) "
            f"NodeAddr={addr} NodeHostName={host} Version=23.02.6 OS=Linux RealMemory=64000 State={state} "
            "ThreadsPerCore=1 Partitions=debug BootTime=2026-12-01T10:00:00 Reason=(null)")


def generated_nodes(rng, n):
    """``n`` nodes: a NodeName, a hostname that is the same, its FQDN or another name altogether,
    an address, and a state that is up or down -- the ground truth beside the lines."""
    out = []
    for i in range(n):
        name = f"{rng.choice(['n', 'gpu', 'cn'])}{i:0{rng.choice([1, 3])}d}"
        host = rng.choice([name, f"{name}.cluster.example", f"host-{rng.randrange(10**6)}",
                           f"r{i}c{rng.randrange(9)}.hpc.example"])
        down = rng.random() < 0.3
        out.append((name, host, f"10.{rng.randrange(256)}.{i // 256}.{i % 256}",
                    rng.choice(DOWN_STATES if down else UP_STATES), down))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_scontrol_lines_give_each_nodes_state_and_names(seed):
    rng = random.Random(seed)
    nodes = generated_nodes(rng, rng.randrange(1, 40))
    show = "\n".join(node_line(*n[:4]) for n in nodes) + "\n"
    states = schedulers.slurm_node_states(show)
    assert states == {n[0]: NodeState.DOWN if n[4] else NodeState.UP for n in nodes}
    names = schedulers.slurm_host_names(show)
    for name, host, addr, _, _ in nodes:
        assert names[host] == names[addr] == names[host.split(".")[0]] == name

    asked = []

    def run(argv):  # scontrol as the job's nodes would answer
        asked.append(argv[1:])
        return True, show

    slurm = schedulers.Slurm({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": ",".join(n[0] for n in nodes),
                              "PATH": os.environ["PATH"]}, run=run)
    names_of = [n[0] for n in nodes]
    for name, host, addr, _, _ in nodes:
        assert slurm.node_name(host) == name and slurm.node_name(addr) == name
    assert slurm.node_name("not-a-node") == "not-a-node"  # unknown: unchanged, never another node's
    assert slurm.down(names_of) == [n[0] for n in nodes if n[4]]
    silent = []  # a controller that does not answer: asked once for the many names of a verdict, not once each
    mute = schedulers.Slurm(slurm.env, run=lambda argv: silent.append(argv) or (False, "timed out"))
    assert [mute.node_name(n[1]) for n in nodes] == [n[1] if n[1].split(".")[0] != n[0] else n[0] for n in nodes]
    assert len(silent) == (0 if all(n[1].split(".")[0] == n[0] for n in nodes) else 1), silent


def test_slurm_nodes_ranks_job_and_end_from_the_environment():
    """The allocation's hostlist, its ranks a node (``-N 2 -n 8`` sets only
    ``SLURM_TASKS_PER_NODE=4(x2)``; uneven counts are a clear error), the array-aware job id and
    the end time."""
    env = {"SLURM_JOB_ID": "12", "SLURM_JOB_NODELIST": "gpu[01-03,07],login5", "SLURM_TASKS_PER_NODE": "4(x5)",
           "SLURM_JOB_END_TIME": "1765000000"}
    s = schedulers.Slurm(env)
    assert s.nodes() == ["gpu01", "gpu02", "gpu03", "gpu07", "login5"]
    assert (s.tasks_per_node(), s.job_id(), s.end_time()) == (4, "12", 1765000000.0)
    assert schedulers.Slurm({**env, "SLURM_ARRAY_JOB_ID": "10", "SLURM_ARRAY_TASK_ID": "2"}).job_id() == "10_2"
    assert schedulers.Slurm({"SLURM_NTASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2(x3)"}).tasks_per_node() == 2
    assert schedulers.Slurm({}).tasks_per_node() == 1
    with pytest.raises(SystemExit, match=r"3,2.*--ntasks-per-node"):
        schedulers.Slurm({"SLURM_TASKS_PER_NODE": "3,2"}).tasks_per_node()


@pytest.mark.parametrize("seed", range(3))
def test_pbs_nodes_and_ranks_from_its_nodefile(tmp_path, seed):
    """PBS_NODEFILE names a host once per rank: the nodes in their order, the ranks each; uneven
    counts are a clear error; ``pbsnodes`` blocks give each node's state."""
    rng = random.Random(seed)
    hosts = [f"node{i:02d}.pbs.example" for i in rng.sample(range(100), rng.randrange(1, 9))]
    per = rng.randrange(1, 5)
    lines = [h for h in hosts for _ in range(per)] if rng.random() < 0.5 else [h for _ in range(per) for h in hosts]
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("\n".join(lines) + "\n")
    env = {"PBS_JOBID": f"{rng.randrange(10**5)}.pbs01", "PBS_NODEFILE": str(nodefile), "PATH": os.environ["PATH"]}
    found = schedulers.detect(env)
    assert isinstance(found, schedulers.PBS) and found.can_requeue
    assert (found.nodes(), found.tasks_per_node(), found.job_id()) == (hosts, per, env["PBS_JOBID"])
    assert found.node_name(hosts[0].split(".")[0]) == hosts[0]  # a record's short hostname
    nodefile.write_text("\n".join(lines + [hosts[-1]] * (len(hosts) > 1)) + "\n")
    if len(hosts) > 1:
        with pytest.raises(SystemExit, match="uneven ranks per node"):
            found.tasks_per_node()
    down = {h for h in hosts if rng.random() < 0.4}
    text = "".join(f"{h}\n     Mom = {h}\n     state = {rng.choice(['down', 'offline', 'down,offline']) if h in down else rng.choice(['free', 'job-busy', 'job-exclusive'])}\n     pcpus = 16\n\n" for h in hosts)
    assert schedulers.pbs_node_states(text) == {h: NodeState.DOWN if h in down else NodeState.UP for h in hosts}


def test_detect_picks_the_scheduler_of_the_environment(tmp_path):
    (tmp_path / "nf").write_text("a\n")
    assert isinstance(schedulers.detect({"SLURM_JOB_ID": "3"}), schedulers.Slurm)
    assert isinstance(schedulers.detect({"PBS_JOBID": "3.x", "PBS_NODEFILE": str(tmp_path / "nf")}), schedulers.PBS)
    assert schedulers.detect({"PBS_JOBID": "3.x"}) is None  # no nodefile: not a job hpcsync can run in
    assert schedulers.detect({"OMPI_COMM_WORLD_SIZE": "2"}) is None
    hl = schedulers.HostList([("a", 2), ("b.example", 2)])
    assert (hl.nodes(), hl.tasks_per_node(), hl.job_id(), hl.can_requeue) == (["a", "b.example"], 2, None, False)
    assert hl.node_name("b") == "b.example" and hl.node_name("c") == "c" and hl.down(["a"]) == []


def fake_scontrol(tmp_path, nodes, job_state="RUNNING", update_rc=0):
    """A ``scontrol`` that answers for ``nodes`` ``[(NodeName, NodeHostName, addr, State)]`` and a
    job 7, and logs each call's arguments."""
    show = "\\n".join(node_line(*n) for n in nodes)
    exe = tmp_path / "scontrol"
    exe.write_text(f"""#!/bin/sh
echo "$@" >> {tmp_path}/calls
case "$1 $2" in
  "show node") printf '{show}\\n' ;;
  "show job") echo "JobId=7 JobState={job_state} Restarts=0 ExcNodeList=n9" ;;
  update*) exit {update_rc} ;;
esac
""")
    exe.chmod(0o755)
    return {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": ",".join(n[0] for n in nodes), "SLURM_TASKS_PER_NODE": f"1(x{len(nodes)})",
            "PATH": f"{tmp_path}:{os.environ['PATH']}"}


@pytest.mark.parametrize("job_state,update_rc,code,calls", [
    ("RUNNING", 0, 0, ["requeue", "update"]),
    ("RUNNING", 1, 70, ["requeue", "update"]),  # requeued, never held: nothing to release
    ("COMPLETING", 0, 143, []),  # scancel'ed meanwhile: not brought back
])
def test_requeue_without_the_bad_nodes(tmp_path, job_state, update_rc, code, calls):
    env = fake_scontrol(tmp_path, [("n1", "n1", "10.0.0.1", "IDLE")], job_state, update_rc)
    term, asked = signal.getsignal(signal.SIGTERM), []
    try:
        outcome = schedulers.Slurm(env).requeue_excluding(["n1"], asking=lambda: asked.append(1))
    finally:
        signal.signal(signal.SIGTERM, term)
    assert (outcome.exit_code, outcome.requeued) == (code, code == 0), outcome
    assert asked == ([1] if calls else []), "a requeue counted where none was asked for, or one not counted"
    done = (tmp_path / "calls").read_text().splitlines()
    assert [c.split()[0] for c in done] == ["show", *calls], done
    if calls:
        assert done[-1].split() == ["update", "JobId=7", "ExcNodeList=n9,n1"]
    assert schedulers.Slurm({"SLURM_JOB_ID": "7", "PATH": "/nonexistent"}).requeue_excluding(
        ["n1"], asking=lambda: asked.append(2)).exit_code == requeue.EXIT_NO_SCONTROL
    assert 2 not in asked, "a requeue counted without scontrol"


def hang_record(reporter, rank, silent, reached, ranks_nodes):
    """A hang report's record by ``reporter`` (a hostname): ``silent`` ranks answered nobody."""
    return {"kind": record.KIND, "version": record.VERSION, "cause": "hang", "program_error": False,
            "blame_nodes": sorted({ranks_nodes[r] for r in silent}), "detail": "a rank stopped answering",
            "reporter": {"rank": rank, "node": reporter}, "time": time.time(), "silent": silent,
            "silent_at": {str(r): ranks_nodes[r] for r in silent}, "reached": reached,
            "reached_nodes": sorted({ranks_nodes[r] for r in reached})}


@pytest.mark.parametrize("spares", [1, 0])
def test_a_node_whose_slurm_name_is_not_its_hostname_is_the_one_left_out(tmp_path, spares):
    """Slurm calls the nodes n0..n2, their hostnames are others (``NodeHostName``): the records
    name the failed node by its hostname. It is left out by Slurm's name: with a spare the next
    attempt runs without n1; without one the job is requeued with ``ExcNodeList`` holding n1 --
    never a hostname Slurm does not know (``scontrol update`` refuses it and the bad node stays)."""
    nodes = [("n0", "alpha.cluster", "10.0.0.10", "ALLOCATED"), ("n1", "beta.cluster", "10.0.0.11", "ALLOCATED"),
             ("n2", "gamma.cluster", "10.0.0.12", "ALLOCATED"), ("n3", "delta.cluster", "10.0.0.13", "ALLOCATED")]
    env = fake_scontrol(tmp_path, nodes)
    width = 4 - spares
    hosts = {0: "alpha", 1: "beta.cluster", 2: "gamma", 3: "delta"}  # gethostname(): short or not
    src = tmp_path / "rec.json"
    src.write_text(json.dumps(hang_record("alpha", 0, [1], [0, *range(2, width)], hosts)))

    class Fails(launchers.Launcher):  # the first attempt's rank 0 reports rank 1 silent
        def command(self, nodes, per_node, program):
            return ["sh", "-c", f'[ "$HPCSYNC_RUN_ATTEMPT" = 1 ] || exit 0; '
                    f'cp {src} "$HPCSYNC_REPORT_DIR/{failure.PREFIX}7-r0-hang-0.json"; exit 1']

        def probe(self, node):
            return ["true"]

    sched = schedulers.Slurm(env)
    term = signal.getsignal(signal.SIGTERM)
    try:
        sup = supervisor.Supervisor(Fails("sh", []), sched.nodes(), 1, spares, 2, str(tmp_path / "state"), ["prog"],
                                    scheduler=sched)
        code = sup.run()
    finally:
        for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT):
            signal.signal(s, signal.SIG_DFL if s != signal.SIGINT else signal.default_int_handler)
        signal.signal(signal.SIGTERM, term)
    first = sup.state.attempts[0]
    assert first.nodes == [n[0] for n in nodes][:width] and first.blamed == ["n1"], sup.state.attempts
    assert sup.state.bad_nodes == ["n1"]
    if spares:
        assert code == 0 and sup.state.attempts[1].nodes == ["n0", "n2", "n3"], sup.state.attempts
    else:
        calls = (tmp_path / "calls").read_text().splitlines()
        assert code == 0 and calls[-1].split() == ["update", "JobId=7", "ExcNodeList=n9,n1"], calls


@pytest.mark.parametrize("case", range(6))
def test_a_slow_controller_makes_no_healthy_node_fail_its_probe(case):
    """Probes through a slow controller time out on healthy nodes: each is tried again alone,
    with a longer bound, and checked against the scheduler's state. Generated cases: each node
    healthy (answers at once), slow (answers after the first bound, within the retry's), hung
    (never answers), or broken (exits with an error), and Slurm's word on it (up, down, unknown).
    Failed: broken; hung unless the scheduler calls it up (its lone retry only timed out: the
    controller's); anything it calls down that timed out. Healthy and slow ones never."""
    cmd = {"ok": ["true"], "slow": ["sh", "-c", "sleep 0.8"], "hung": ["sh", "-c", "exec sleep 31"],
           "broken": ["sh", "-c", "exit 1"]}
    rng = random.Random(case)
    if True:
        kinds = ["ok", "ok", "slow"] + [rng.choice(["ok", "slow", "broken"]) for _ in range(rng.randrange(1, 4))]
        kinds += ["hung"] if case % 2 else []
        kinds += ["slow"] * (3 * len(kinds) if case == 4 else 0)  # most nodes at once: the controller
        rng.shuffle(kinds)
        nodes = [f"n{i}" for i in range(len(kinds))]
        states = list(NodeState)  # each late node's state in turn: every pairing is met across the cases
        said = {n: states[(case + i) % 3] if k in ("slow", "hung") else NodeState.UP
                for i, (n, k) in enumerate(zip(nodes, kinds))}
        kind = dict(zip(nodes, kinds))
        late = [n for n in nodes if kind[n] in ("slow", "hung")]
        expected = [n for n in nodes if kind[n] == "broken" or (kind[n] in ("slow", "hung") and said[n] is NodeState.DOWN)
                    or (kind[n] == "hung" and said[n] is NodeState.UNKNOWN)]
        if 2 * len(late) > len(nodes):  # most timed out: the controller's; only the nodes it calls down
            expected = [n for n in nodes if kind[n] == "broken" or (n in late and said[n] is NodeState.DOWN)]
        asked = []
        t0 = time.monotonic()
        got = probe.unreachable(nodes, lambda n: cmd[kind[n]], timeout=0.3, retry_timeout=1.5,
                                node_state=lambda ns: asked.append(list(ns)) or {n: said[n] for n in ns})
        assert got == expected, (kinds, said, got)
        assert asked == ([late] if late else []), asked
        assert time.monotonic() - t0 < 20


def test_a_probe_that_passed_on_this_nodes_own_address_proves_nothing():
    """mpirun starts a process on its own node without the network, however the host list names
    that node: a pass on one of this node's addresses is no proof that the network works."""
    names = probe.own_names()
    addrs = [n for n in names if n[:1].isdigit()]
    assert socket.gethostname() in names and "127.0.0.1" in addrs, names
    assert probe.unreachable(["127.0.0.1", "far"], lambda n: ["true"] if n == "127.0.0.1" else ["false"],
                             here=names) == []
    assert probe.unreachable(["127.0.0.1", "far", "near"], lambda n: ["false"] if n == "far" else ["true"],
                             here=names) == ["far"]


@pytest.mark.parametrize("job_state,rerun_rc,code", [("R", 0, 0), ("R", 1, 70), ("E", 0, 143)])
def test_pbs_reruns_a_running_job_only(tmp_path, job_state, rerun_rc, code):
    """``qstat -f`` says whether the job runs (``job_state = R``); a running one is rerun with
    ``qrerun``, one being ended (``E``: exiting) is not."""
    for name, body in (("qstat", f"echo 'Job Id: 5.pbs01'; echo '    job_state = {job_state}'"),
                       ("qrerun", f"exit {rerun_rc}")):
        exe = tmp_path / name
        exe.write_text(f"#!/bin/sh\necho {name} \"$@\" >> {tmp_path}/calls\n{body}\n")
        exe.chmod(0o755)
    (tmp_path / "nf").write_text("a\na\nb\nb\n")
    pbs = schedulers.PBS({"PBS_JOBID": "5.pbs01", "PBS_NODEFILE": str(tmp_path / "nf"),
                          "PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert pbs.running() is (job_state == "R")
    term = signal.getsignal(signal.SIGTERM)
    try:
        outcome = pbs.requeue(["b"])
    finally:
        signal.signal(signal.SIGTERM, term)
    assert outcome.exit_code == code, outcome
    calls = (tmp_path / "calls").read_text().splitlines()
    assert ("qrerun 5.pbs01" in calls) == (job_state == "R"), calls


def test_hosts_given_as_addresses_are_never_one_short_name():
    """A host list of IPv4 addresses (``--hosts 10.0.0.5,10.0.0.6``) with this node among them by
    its address: the others' short names are not ``10``, so a pass on 10.0.0.6 proves the
    network and 10.0.0.7, which fails, is named."""
    from hpcsync.resilience.schedulers import short_name

    assert short_name("10.0.0.5") == "10.0.0.5" and short_name("n1.cluster") == "n1" and short_name("::1") == "::1"
    got = probe.unreachable(["10.0.0.5", "10.0.0.6", "10.0.0.7"], lambda n: ["false"] if n == "10.0.0.7" else ["true"],
                            here=["me", "10.0.0.5"])
    assert got == ["10.0.0.7"], got
