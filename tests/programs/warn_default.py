"""hpcsync's own warnings with no logging set up by the program (``none``), with
``logging.basicConfig`` before ``hpcsync.init()`` (``before``) or after it (``after``): every
rank logs one alike warning under ``hpcsync``, rank 1 one of its own."""
import logging
import sys

import hpcsync
from _report import report

mode = sys.argv[1]
if mode == "before":
    logging.basicConfig(format="USER %(levelname)s %(name)s: %(message)s")
topo = hpcsync.init()
if mode == "after":
    logging.basicConfig(format="USER %(levelname)s %(name)s: %(message)s")
log = logging.getLogger("hpcsync.resilience.checkpoint")
log.warning("checkpoint step-7 skipped: incomplete")
if topo.rank == 1:
    log.warning("only rank one says this")
report(topo.rank, {"rank": topo.rank, "world_size": topo.world_size})
