"""Every rank inside one operation chooses whom to leave its hang report to; then rank 0 asks
every rank through the relays, with every rank answering, then with the relay of
the third node silent (its responder stopped, as a frozen process's would be).

    relay_tree.py FANOUT

Each rank reports how many ranks it asked at most in one question (its fan-out) and, on rank 0,
who answered, who passed each question on, and how long each round took against its bound."""
import sys
import time

import hpcsync
from hpcsync.core import deadlines, mpi, nodemap
from hpcsync.observe import relay, responder, watchdog
from _report import report

topo = hpcsync.topology()
deadlines.FANOUT = int(sys.argv[1])
responder.start()
world = mpi.MPI().COMM_WORLD
widest = [0]
ask_each = responder.ask_each


def counted(questions, wait_s):
    widest[0] = max(widest[0], len(questions))
    return ask_each(questions, wait_s)


responder.ask_each = counted
responder.ANSWERS["whoami"] = lambda asker: {"rank": world.Get_rank(), "host": topo.hostname, "asker": asker}
nodes = nodemap.current()
victim = nodes.node_of.index(2)  # the lowest rank of the third node: a relay
out = {"rank": topo.rank, "world_size": topo.world_size, "node": nodes.node_of[topo.rank]}
# who leaves a hang report to whom, every rank inside the same operation; and how many questions each answered
log = watchdog.group_log(999, "relay-test", list(range(world.Get_size())))
rec = log.start("all_reduce", "float32", (16,), -1)
asked = [0]
digest = responder.ANSWERS["digest"]


def counted_digest(asker, group, seq):
    asked[0] += 1
    return digest(asker, group, seq)


responder.ANSWERS["digest"] = counted_digest
world.Barrier()
out["defers_to"] = watchdog._printer_before(log, rec, topo.rank)
world.Barrier()
out["digest_questions"] = asked[0]
world.Barrier()
if topo.rank == 0:  # rank 0 went on to the next operation and reports its hang: one report, not two
    rec.finished, log.timed_out = time.time(), rec.seq + 1
world.Barrier()
if nodes.node_of[topo.rank] == 1 and topo.rank == nodes.node_of.index(1):
    out["defers_to_reporting"] = watchdog._printer_before(log, rec, topo.rank)
world.Barrier()
if topo.rank == 0:
    t0 = time.monotonic()
    answers = relay.ask_all(range(world.Get_size()), ("whoami",)).answers
    out["healthy"] = {"answered": sorted(answers), "took": time.monotonic() - t0, "bound": relay.job_budget(),
                      "askers": {r: a["asker"] for r, a in answers.items()}}
world.Barrier()
if topo.rank == victim:
    responder.responder()._stop.set()
    responder.responder().thread.join()
world.Barrier()
if topo.rank == 0:
    t0 = time.monotonic()
    answers = relay.ask_all(range(world.Get_size()), ("whoami",)).answers
    out["relay_silent"] = {"answered": sorted(answers), "took": time.monotonic() - t0, "victim": victim}
world.Barrier()
out["widest"] = widest[0]
report(topo.rank, out)
