"""Benchmark: how the hang report behaves as the number of ranks grows (root: namespace nodes).

    flock /tmp/hpcsync-netns.lock .venv/bin/python bench/bench_failures.py [--quick] [--big]
        [--ranks 8,16,32] [--backends hpcsync,gloo] [--cases stall,frozen,link,late0] [--timeout 10]
        [--append] [--out bench/results/failures.json]

N ranks spread evenly over four routed namespace nodes, Open MPI, a training-like loop of
16-float all_reduce (a small program written to a temporary folder), ``hpcsync.init(backend=...)``
with a group timeout of ``--timeout`` seconds. Once every rank is in the loop, one failure:

- ``stall``: the last rank (on the last node) sleeps in Python before its next all_reduce (it
  still answers the report: it is alive, it never entered the operation);
- ``frozen``: the last rank is SIGSTOPped (found among the last node's processes,
  ``ip netns pids`` + psutil): it cannot answer;
- ``link``: the last node's link goes down (its ranks live on, unreachable); ``link0``: the first
  node's (rank 0's, and the first candidates to print);
- ``late0``: rank 0 spends 40 s on its own (an evaluation) before its next all_reduce, and
  meanwhile the last rank is SIGSTOPped: the report must come from another rank, name the frozen
  rank (silent) and rank 0 (never entered, alive), and blame the frozen rank's node only.

For each run: the time from the failure to the first ``HANG REPORT`` line on the job's stderr and
to the job's end, how many lines the report printed, which ranks it called "no reply" (silent)
and "never entered" (from the JSON hang reports in ``HPCSYNC_REPORT_DIR``, a folder per run), and
the ``blame_nodes`` of the failure records there. The truth: only the failed rank (node) may be
silent or blamed -- a healthy rank called silent, or a healthy node blamed, is a wrong blame.
For ``link`` the cut-off node's ranks may write records of their own (their side of the split:
everyone else silent); those are kept apart (``minority``), as ``hpcsync run`` weighs the sides.
JSON: ``bench/results/failures.json``.

``--responder``: how many questions one rank's responder answers per second (2 ranks on this
machine, rank 1 asking rank 0 K at once), for a gloo group whose flight recorder (a full ring)
is read for every question and read once per operation, and for hpcsync's backend; then the
report's model to 8,192 ranks from those rates. JSON: ``bench/results/responder.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

from common import save_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from hpcsync.core.nodemap import ranges  # noqa: E402  (after the path: the tree's hpcsync)

PROGRAM = r'''
"""The bench's training loop: all_reduce until the job ends; the last rank stalls on a trigger file."""
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

import hpcsync

backend, timeout, seconds, out = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
topo = hpcsync.init(backend=backend, timeout=timeout)
R, W = topo.rank, topo.world_size
t = torch.ones(16)
for _ in range(3):
    dist.all_reduce(t)
with open(os.path.join(out, f"ready{R}.tmp"), "w") as f:
    f.write(f"{os.getpid()} {socket.gethostname()}\n")
os.replace(os.path.join(out, f"ready{R}.tmp"), os.path.join(out, f"ready{R}"))
trigger, late = os.path.join(out, "stall"), os.path.join(out, "late0")
end = time.monotonic() + seconds
steps = 0
while time.monotonic() < end:
    if R == 0 and os.path.exists(late):  # a rank-0-only evaluation, 40 s, before the next step
        os.remove(late)
        with open(os.path.join(out, "late.tmp"), "w") as f:
            f.write(repr(time.time()))
        os.replace(os.path.join(out, "late.tmp"), os.path.join(out, "late"))
        time.sleep(40)  # RANK 0 EVALUATING
    if R == W - 1 and os.path.exists(trigger):
        with open(os.path.join(out, "stalled.tmp"), "w") as f:
            f.write(repr(time.time()))
        os.replace(os.path.join(out, "stalled.tmp"), os.path.join(out, "stalled"))
        time.sleep(timeout + 300)  # STUCK HERE
    dist.all_reduce(t)  # TRAINING STEP
    steps += 1
    time.sleep(0.01)
with open(os.path.join(out, f"done{R}"), "w") as f:
    f.write(str(steps))
'''


def _reader(stream, into: List) -> None:
    for line in iter(stream.readline, ""):
        into.append((time.time(), line.rstrip("\n")))


def _find_pid(cluster, node: int, prog: str, want: int) -> int:
    """``want`` (a rank's pid from its ready file), checked against the node's processes that run
    the bench program (tests/test_supervisor.py::ranks_on: ``ip netns pids`` + psutil)."""
    from test_supervisor import ranks_on

    found = ranks_on(cluster, node, prog)
    if want not in found:
        raise RuntimeError(f"rank pid {want} not among node {node}'s programs {found}")
    return want


def one_run(base: Path, case: str, backend: str, n: int, timeout: float, prog: str) -> Dict[str, Any]:
    from launch import PY, clean_env
    from netns_cluster import ROUTED, Cluster

    from hpcsync.observe import failure

    nodes = 4
    per = n // nodes
    work = base / f"{case}-{backend}-{n}"
    work.mkdir(parents=True)
    reports = work / "reports"
    reports.mkdir()
    cluster = Cluster(work, nodes, ROUTED).start()
    names = cluster.names
    faulty_node = 0 if case == "link0" else nodes - 1
    node_of = {r: names[r // per] for r in range(n)}  # block placement (--map-by slot)
    faulty_ranks = (list(range(faulty_node * per, (faulty_node + 1) * per)) if case.startswith("link")
                    else [n - 1])
    expect_silent = [] if case == "stall" else faulty_ranks
    expect_blame = [] if case == "stall" else [names[faulty_node]]
    row: Dict[str, Any] = {"case": case, "backend": backend, "ranks": n, "nodes": nodes, "timeout_s": timeout,
                           "faulty_ranks": faulty_ranks, "faulty_node": names[faulty_node],
                           "expect_silent": expect_silent, "expect_blame": expect_blame}
    proc = None
    t_fault = None
    out_lines: List = []
    err_lines: List = []
    try:
        lau = cluster.openmpi([per] * nodes)
        env = clean_env({**lau.env, "HPCSYNC_TEST_OUT": str(work), "HPCSYNC_REPORT_DIR": str(reports)})
        cmd = lau.command(n, env)
        at = len(cmd) - 2  # before "-n N": ranks that wait yield the core (2 cores, up to 32 ranks)
        cmd[at:at] = ["--mca", "mpi_yield_when_idle", "1"]
        cmd += [PY, prog, backend, str(timeout), "3600", str(work)]
        t_launch = time.time()
        proc = subprocess.Popen(cmd, env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        readers = [threading.Thread(target=_reader, args=(s, into), daemon=True)
                   for s, into in ((proc.stdout, out_lines), (proc.stderr, err_lines))]
        for th in readers:
            th.start()
        ready_limit = 60 + 10 * n
        while len(list(work.glob("ready[0-9]*"))) < n:
            if proc.poll() is not None or time.time() - t_launch > ready_limit:
                raise RuntimeError(f"not all ranks ready after {time.time() - t_launch:.0f} s (rc {proc.poll()})")
            time.sleep(0.2)
        row["startup_s"] = time.time() - t_launch
        hosts = {int(f.name[5:]): f.read_text().split() for f in work.glob("ready[0-9]*")}
        row["placement_ok"] = all(hosts[r][1] == node_of[r] for r in range(n))
        time.sleep(2.0)  # steady training

        def trigger(name: str, marker: str, never: str) -> Path:
            """Write the trigger file ``name``; wait for the program's ``marker`` file (its path)."""
            (work / name).write_text("")
            while not (work / marker).exists():
                if proc.poll() is not None or time.time() - t_launch > ready_limit + 60:
                    raise RuntimeError(never)
                time.sleep(0.01)
            return work / marker

        if case == "stall":
            t_fault = float(trigger("stall", "stalled", "the last rank never stalled").read_text())
        elif case in ("frozen", "late0"):
            pid = _find_pid(cluster, faulty_node, prog, int(hosts[n - 1][0]))
            if case == "late0":
                trigger("late0", "late", "rank 0 never began its evaluation")
                time.sleep(1.0)  # the others are in the next all_reduce, waiting for rank 0
            t_fault = time.time()
            os.kill(pid, signal.SIGSTOP)
        else:  # link, link0
            t_fault = time.time()
            cluster.link_down(faulty_node)
        limit = timeout + 150
        while proc.poll() is None and time.time() - t_fault < limit:
            time.sleep(0.05)
        t_end = time.time()
        row["ended"] = proc.poll() is not None
        row["returncode"] = proc.returncode
        row["end_s"] = t_end - t_fault if row["ended"] else None
        if not row["ended"]:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for th in readers:
            th.join(5)
    except Exception as exc:  # noqa: BLE001 - the finding is the row
        row["error"] = f"{type(exc).__name__}: {exc}"
        t_fault = time.time() if t_fault is None else t_fault
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    finally:
        cluster.stop()
    # -- the console -----------------------------------------------------------------------------------
    err = [ln for _, ln in err_lines]
    heads = [(t, ln) for t, ln in err_lines if "HANG REPORT" in ln]
    row["report_count"] = len(heads)
    row["report_s"] = heads[0][0] - t_fault if heads else None
    report_lines: List[str] = []
    if heads:
        i = next(k for k, ln in enumerate(err) if "HANG REPORT" in ln)
        for ln in err[i:]:
            if ln.startswith("[hpcsync] report written") or ln.startswith("[hpcsync] could not write"):
                break
            report_lines.append(ln)
    row["report_lines"] = len(report_lines)
    row["report_text"] = report_lines[:40]
    row["console_no_reply"] = [ln.strip() for ln in report_lines if ln.strip().startswith("no reply:")]
    row["stderr_lines"] = len(err)
    row["stderr_tail"] = err[-25:]
    # -- the JSON reports and failure records --------------------------------------------------------
    faulty_nodes = {names[faulty_node]} if case.startswith("link") else set()
    hangs = []
    for f in sorted(reports.glob("hpcsync-hang-*.json")):
        try:
            rep = json.loads(f.read_text())
        except ValueError:
            continue
        reporter = int(f.name.split("-r")[-1].split("-")[0]) if "-r" in f.name else -1
        hangs.append({"file": f.name, "reporter": reporter, "no_reply": rep.get("no_reply", []),
                      "never_entered": rep.get("never_entered", []), "inside": len(rep.get("inside", [])),
                      "groups": len(rep.get("groups", [])), "bytes": f.stat().st_size})
    row["hang_reports"] = hangs
    records = [r.to_dict() for r in failure.read(str(reports))]  # (as their JSON reads)
    row["records"] = [{"cause": r.get("cause"), "reporter": r.get("reporter"), "blame_nodes": r.get("blame_nodes"),
                       "silent": r.get("silent"), "never_entered": r.get("never_entered"),
                       "reached": len(r.get("reached") or []), "time_s": r.get("time", 0) - t_fault}
                      for r in records]
    major = [r for r in records if (r.get("reporter") or {}).get("node") not in faulty_nodes]
    minor = [r for r in records if (r.get("reporter") or {}).get("node") in faulty_nodes]
    main_hangs = [h for h in hangs if node_of.get(h["reporter"]) not in faulty_nodes]
    silent = sorted({r for h in main_hangs for r in h["no_reply"]})
    never = sorted({r for h in main_hangs for r in h["never_entered"]})
    blamed = sorted({b for r in major for b in (r.get("blame_nodes") or [])})
    row.update(silent_called=silent, never_entered=never, blamed_nodes=blamed,
               minority_blamed=sorted({b for r in minor for b in (r.get("blame_nodes") or [])}),
               wrong_silent=[r for r in silent if r not in faulty_ranks],
               missed_silent=[r for r in expect_silent if r not in silent],
               wrong_blame=[b for b in blamed if b not in expect_blame])
    ok = bool(heads) and bool(main_hangs) and row.get("ended") and silent == expect_silent and blamed == expect_blame
    if case == "stall":
        ok = ok and never == faulty_ranks
    if case == "late0":  # rank 0 is alive and late: never entered, not silent; the report is another rank's
        ok = ok and 0 in never and all(h["reporter"] != 0 for h in main_hangs)
    row["correct"] = bool(ok)
    row["names"] = names
    return row


def _fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def table(rows: List[Dict[str, Any]]) -> None:
    print(f"\n{'case':7}{'N':>4} {'backend':8}{'start':>7}{'report':>8}{'end':>7}{'#rep':>5}{'lines':>6}  "
          f"{'silent called':16}{'never entered':15}{'blamed':10}{'correct':8}")
    for r in rows:
        blamed = ",".join("n" + b.rsplit("n", 1)[-1] for b in r.get("blamed_nodes", [])) or "none"
        print(f"{r['case']:7}{r['ranks']:>4} {r['backend']:8}{_fmt(r.get('startup_s'), '.0f'):>6}s"
              f"{_fmt(r.get('report_s')):>7}s{_fmt(r.get('end_s')):>6}s{r.get('report_count', 0):>5}"
              f"{r.get('report_lines', 0):>6}  {ranges(r.get('silent_called', [])):16}"
              f"{ranges(r.get('never_entered', [])):15}{blamed:10}{'yes' if r.get('correct') else 'NO':8}"
              + (f" {r['error']}" if r.get("error") else ""))


RESPONDER = r'''
import json, os, sys, time
os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
import torch, torch.distributed as dist
import hpcsync
from hpcsync.core import mpi
from hpcsync.observe import responder, watchdog
backend, k, cache = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "cache"
watchdog.FLIGHT_CACHE_S = watchdog.FLIGHT_CACHE_S if cache else 0.0
topo = hpcsync.init(backend=backend)
t = torch.zeros(16)
for _ in range(2100):  # a full flight-recorder ring (2,000 entries), as after a while of training
    dist.all_reduce(t)
comm = responder.responder().comm
if topo.rank == 1:  # K questions at once, as K timed-out ranks ask rank 0
    t0 = time.perf_counter()
    sends = [comm.isend(((os.getpid(), 10**6 + i), "digest", ("0", 2101)), dest=0, tag=responder._TAG_ASK)
             for i in range(k)]
    got = 0
    while got < k and time.perf_counter() - t0 < 120:
        msg = comm.improbe(source=0, tag=responder._TAG_STATE)
        if msg is None:
            time.sleep(0.001)
            continue
        msg.recv()
        got += 1
    took = time.perf_counter() - t0
    mpi.MPI().Request.Waitall(sends)
    print("RESULT " + json.dumps({"answered": got, "seconds": took}), flush=True)
dist.barrier()
'''


def responder(quick: bool) -> Dict[str, Any]:
    """How many digest questions one responder answers per second (rank 1 asks rank 0 K at once),
    for a gloo group (torch's flight recorder, a full ring) read every time and read once per
    operation, and for hpcsync's backend; then the report's model to 8,192 ranks from those rates."""
    from launch import PY, clean_env, openmpi

    prog = Path(tempfile.mkdtemp(prefix="hpcsync-bench-responder-")) / "responder.py"
    prog.write_text(RESPONDER)
    rows = []
    for backend, cache, k in (("gloo", False, 100 if quick else 300), ("gloo", True, 1000 if quick else 4000),
                              ("hpcsync", True, 1000 if quick else 4000)):
        lau = openmpi()
        out = subprocess.run([*lau.command(2), PY, str(prog), backend, str(k), "cache" if cache else "nocache"],
                             env=clean_env({**lau.env, "PYTHONPATH": str(ROOT)}), capture_output=True, text=True,
                             timeout=600)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if out.returncode != 0 or line is None:
            raise SystemExit(f"the responder run failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
        got = json.loads(line[len("RESULT "):])
        rows.append({"group": backend, "flight_read": "once per operation" if cache else "every question",
                     "questions": k, **got, "per_s": got["answered"] / got["seconds"]})
    print(f"\n{'group':10}{'flight recorder read':22}{'questions':>10}{'answers/s':>11}")
    for r in rows:
        print(f"{r['group']:10}{r['flight_read'] if r['group'] == 'gloo' else '-':22}{r['questions']:>10}"
              f"{r['per_s']:>11.0f}")
    model = [dict(rate=r["per_s"], group=r["group"], flight_read=r["flight_read"], **m)
             for r in rows for m in report_model(r["per_s"])]
    print(f"\n{'group':10}{'read':22}{'ranks':>7}{'to rank 0':>10}{'gathering':>10}{'hops':>5}{'bound':>7}"
          f"{'heard':>7}{'silent':>8}")
    for m in model:
        print(f"{m['group']:10}{m['flight_read'] if m['group'] == 'gloo' else '-':22}{m['ranks']:>7}"
              f"{m['questions_to_rank0']:>10}{m['gather']:>10}{m['hops']:>5}{m['bound_s']:>7.0f}{m['heard']:>7.0%}"
              f"{m['called_silent']:>8}")
    return {"responder": rows, "model": model}


def report_model(rate: float, sizes=(32, 128, 512, 1024, 8192), per_node: int = 8) -> List[Dict[str, Any]]:
    """The hang report at N ranks (``per_node`` a node) when N - 1 time out together, from one
    responder's answer rate (docs/timeouts.md). Who prints: each rank asks the ranks of its node
    before it; one rank a node asks the first three nodes' ranks, rank 0 among them, which answers
    ``rate`` of them in its second (and ranks 1, 2, ... the rest); one that found nobody gathers for itself.
    Gathering: along the relays (``hpcsync.observe.relay``), a round of :func:`relay.round_budget`
    seconds; every gatherer's question reaches every rank once, so a responder faced with G
    gatherers answers ``rate x round`` of them and a printer hears min(1, rate x round / G)."""
    from hpcsync.core import deadlines
    from hpcsync.observe import relay

    out = []
    for n in sizes:
        nodes = max(1, n // per_node)
        to_rank0 = (nodes - 1) + (per_node - 1)  # node leaders, and rank 0's own node's ranks
        defer_leaders = min(nodes - 1, int(3 * rate))
        gather = 1 + (nodes - 1 - defer_leaders)  # the printer, and the leaders that found no one to defer to
        window = relay.round_budget(nodes)
        heard = min(1.0, rate * window / gather)
        out.append({"ranks": n, "nodes": nodes, "questions_to_rank0": to_rank0, "gather": gather,
                    "defer": n - gather, "heard": heard, "called_silent": round((1 - heard) * (n - 2)),
                    "hops": relay.hops(nodes), "round_s": window, "bound_s": relay.budget(nodes),
                    "most_sent_by_one_rank": deadlines.FANOUT + per_node - 1,
                    "questions": int(n * (per_node - 1) / 2) + 3 * per_node * nodes + gather * (n - 1),
                    "printer_bytes": 400 * n, "first_relay_bytes": 400 * n // min(deadlines.FANOUT, max(1, nodes - 1))})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--responder", action="store_true",
                    help="only a responder's answer rate (2 ranks on this machine) and the model to 8,192 ranks")
    ap.add_argument("--quick", action="store_true", help="N=32, the hpcsync backend, the late0 case only")
    ap.add_argument("--big", action="store_true", help="also 64 ranks (~300 MB of memory per rank)")
    ap.add_argument("--ranks", default="8,16,32")
    ap.add_argument("--backends", default="hpcsync,gloo")
    ap.add_argument("--cases", default="stall,frozen,link,late0")
    ap.add_argument("--timeout", type=float, default=10.0, help="the group timeout, seconds")
    ap.add_argument("--append", action="store_true", help="add to the rows already in --out")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "failures.json"))
    args = ap.parse_args()
    if args.responder:
        out = args.out if args.out != ap.get_default("out") else str(ROOT / "bench" / "results" / "responder.json")
        save_json(out, "responder", responder(args.quick))
        return
    ranks = [int(x) for x in args.ranks.split(",")] + ([64] if args.big else [])
    backends, cases = args.backends.split(","), args.cases.split(",")
    if args.quick:
        ranks, backends, cases = [32], ["hpcsync"], ["late0"]
    rows: List[Dict[str, Any]] = []
    if args.append and os.path.exists(args.out):
        rows = json.loads(Path(args.out).read_text()).get("failures", [])
    base = Path(tempfile.mkdtemp(prefix="hpcsync-bench-failures-"))
    prog = str(base / "failure_loop.py")
    Path(prog).write_text(PROGRAM)
    about = {"timeout_s": args.timeout, "nodes": 4, "network": "routed", "launcher": "openmpi"}
    for backend in backends:
        for n in ranks:
            for case in cases:
                t0 = time.time()
                row = one_run(base, case, backend, n, args.timeout, prog)
                row["wall_s"] = time.time() - t0
                rows.append(row)
                table([row])
                save_json(args.out, "failures", rows, **about)
    print(f"\nhang report vs ranks: 4 routed namespace nodes, Open MPI, group timeout {args.timeout:g} s; "
          "times from the failure")
    table(rows)


if __name__ == "__main__":
    main()
