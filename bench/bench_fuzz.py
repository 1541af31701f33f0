"""Generated programs on the hpcsync backend (tests/programs/fuzz.py), judged: never a hang,
never a wrong result, and with a fault every rank ends with the same error or the job ends with a
report, within the timeout plus a slack. Prints a table, writes JSON, exits 1 on any bad seed
with the command that replays it.

    python bench/bench_fuzz.py [--quick] [--seeds N] [--ranks 3] [--mpi openmpi,mpich]
                               [--levels multiple,serialized,funneled] [--out F]

Per MPI library and MPI thread level (``MPI4PY_RC_THREAD_LEVEL``): N seeds without a fault
(several seeds per job), N seeds with a mismatch fault (op, dtype, count, reduce op, root: the
job goes on), and a few seeds per fault that may end the job (skip, extra, sleep, raise: one job
each). ``--quick`` (CI): a few of these cells, every level among them.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import mpirun_env, save_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM = os.path.join(ROOT, "tests", "programs", "fuzz.py")
ENDING = ("skip", "extra", "sleep", "raise")
TIMEOUT = 8  # fuzz.py's group timeout
# how a job that cannot go on must end: a hang report, the abort of an uncaught error, or the
# exit's abort of a group left with an operation nobody will join (it names the group and why)
ENDS = ("HANG REPORT", "uncaught exception on rank", "exiting with a broken process group")


def launcher(mpi: str, n: int) -> tuple:
    if mpi == "openmpi":
        return ([shutil.which("mpirun.openmpi") or "mpirun", "--oversubscribe", "--bind-to", "none", "-n", str(n)],
                mpirun_env())
    env = {k: v for k, v in os.environ.items() if k != "MPI4PY_MPIABI"}
    return [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", str(n)], env


def job(mpi: str, n: int, first: int, count: int, fault: str, wall: float, level: str = "multiple") -> Dict[str, Any]:
    """One mpirun of fuzz.py at MPI thread level ``level``; every rank's report (None where a rank
    wrote none)."""
    out = tempfile.mkdtemp(prefix="hpcsync-fuzz-")
    argv, env = launcher(mpi, n)
    env = {**env, "HPCSYNC_TEST_OUT": out, "HPCSYNC_REPORT_DIR": out, "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": "1", "MPI4PY_RC_THREAD_LEVEL": level}
    cmd = [*argv, sys.executable, PROGRAM, str(first), str(count), *([fault] if fault != "none" else [])]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=wall)
        rc, err, hung = p.returncode, p.stderr, False
    except subprocess.TimeoutExpired as exc:
        rc, err, hung = -9, (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) \
            else (exc.stderr or ""), True
    took = time.monotonic() - t0
    ranks = []
    for r in range(n):
        f = os.path.join(out, f"rank{r}.json")
        ranks.append(json.load(open(f)) if os.path.exists(f) else None)
    shutil.rmtree(out, ignore_errors=True)
    return {"rc": rc, "stderr": err[-3000:], "hung": hung, "seconds": took, "ranks": ranks}


def judge(res: Dict[str, Any], first: int, count: int, fault: str) -> List[str]:
    """What is wrong with a job's outcome (nothing: [])."""
    bad = []
    if res["hung"]:
        return [f"hung for {res['seconds']:.0f} s"]
    reports = [r for r in res["ranks"] if r is not None]
    for r in reports:
        for seed, d in r["seeds"].items():
            bad += [f"seed {seed} rank {r['rank']}: WRONG RESULT {f}" for f in d["failures"]]
    if fault in ("none", "mix") or res["rc"] == 0:  # the job must have gone on to its end
        if res["rc"] != 0 or len(reports) != len(res["ranks"]):
            return bad + [f"job failed (rc={res['rc']}, {len(reports)} reports): {res['stderr'][-600:]}"]
        for seed in range(first, first + count):
            errs = [r["seeds"][str(seed)]["errors"] for r in reports]
            first_errs = [e[0]["error"] if e else None for e in errs]
            if fault == "none" and any(first_errs):
                bad.append(f"seed {seed}: error without a fault: {next(e for e in first_errs if e)[:300]}")
            elif fault != "none" and len(set(first_errs)) != 1:
                bad.append(f"seed {seed}: ranks ended differently: {[str(e)[:160] for e in first_errs]}")
            elif fault != "none" and first_errs[0] is None and reports[0]["seeds"][str(seed)]["fault_at"]:
                bad.append(f"seed {seed}: the fault went unnoticed")
    elif not any(s in res["stderr"] for s in ENDS):
        bad.append(f"job ended (rc={res['rc']}) without a report or an abort message: {res['stderr'][-600:]}")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a CI-sized run")
    ap.add_argument("--seeds", type=int, default=2000)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--mpi", default="openmpi,mpich")
    ap.add_argument("--levels", default="multiple,serialized,funneled", help="MPI thread levels")
    ap.add_argument("--per-job", type=int, default=250, help="seeds per job when the job goes on")
    ap.add_argument("--ending", type=int, default=6, help="seeds per fault that may end the job")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "fuzz.json"))
    a = ap.parse_args()
    if a.quick:
        a.seeds, a.per_job, a.ending = 6, 6, 1
    rows, problems = [], []
    for mpi in a.mpi.split(","):
        if a.quick:  # three jobs per library: plain and mismatch programs, every thread level among
            # the two libraries, two ending faults in all
            plans = [("none", a.seeds, "multiple" if mpi == "openmpi" else "funneled"),
                     ("mix", a.seeds, "serialized" if mpi == "openmpi" else "multiple"),
                     ("raise" if mpi == "openmpi" else "skip", a.ending, "multiple")]
        else:
            plans = [(fault, seeds, level) for level in a.levels.split(",")
                     for fault, seeds in [("none", a.seeds), ("mix", a.seeds)] + [(f, a.ending) for f in ENDING]]
        for fault, seeds, level in plans:
            per = a.per_job if fault in ("none", "mix") else 1
            stats = {"mpi": mpi, "level": level, "fault": fault, "seeds": 0, "jobs": 0, "bad": 0,
                     "ended_by_report": 0, "same_error": 0, "max_job_s": 0.0, "seconds": 0.0}
            for first in range(0, seeds, per):
                count = min(per, seeds - first)
                wall = 60 + count * (TIMEOUT if fault in ENDING else 3)
                res = job(mpi, a.ranks, first, count, fault, wall, level)
                bad = judge(res, first, count, fault)
                stats["jobs"] += 1
                stats["seeds"] += count
                stats["seconds"] += res["seconds"]
                stats["max_job_s"] = max(stats["max_job_s"], res["seconds"])
                if res["rc"] != 0 and not bad:
                    stats["ended_by_report"] += 1
                elif fault != "none" and not bad:
                    stats["same_error"] += count
                if bad:
                    stats["bad"] += 1
                    replay = (f"MPI4PY_RC_THREAD_LEVEL={level} {' '.join(launcher(mpi, a.ranks)[0])} {sys.executable} "
                              f"{PROGRAM} {first} {count} {fault if fault != 'none' else ''}")
                    problems.append({"mpi": mpi, "level": level, "fault": fault, "first": first, "count": count,
                                     "problems": bad[:5], "replay": replay.strip()})
            rows.append(stats)
            print(f"{mpi:8s} {level:10s} {fault:6s} seeds={stats['seeds']:5d} jobs={stats['jobs']:4d} bad={stats['bad']} "
                  f"same-error={stats['same_error']} ended-by-report={stats['ended_by_report']} "
                  f"max-job={stats['max_job_s']:.1f}s total={stats['seconds']:.0f}s", flush=True)
    for p in problems:
        print(f"\nBAD: {p['mpi']} {p['level']} {p['fault']} seeds {p['first']}..{p['first'] + p['count'] - 1}:\n  "
              + "\n  ".join(p["problems"]) + f"\n  replay: {p['replay']}")
    save_json(a.out, "rows", rows, problems=problems, ranks=a.ranks, timeout_s=TIMEOUT)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
