"""N clients connect at once to a connect-proof listener, with or without hpcsync's acceptor.

    accept_queue.py N accept|noaccept TIMEOUT     prints {"reached": k, "n": N}
"""
import json
import sys
from concurrent.futures import ThreadPoolExecutor

from hpcsync.start.network import Acceptor, open_listener, try_connect

n, accept, timeout = int(sys.argv[1]), sys.argv[2] == "accept", float(sys.argv[3])
sock, port, err = open_listener("127.0.0.1", backlog=n + 16)
assert sock is not None, err
acceptor = Acceptor([sock]) if accept else None
with ThreadPoolExecutor(n) as pool:  # every "node leader" at once
    results = list(pool.map(lambda _: try_connect([("127.0.0.1", port)], timeout)[0], range(n)))
if acceptor is not None:
    acceptor.close()
sock.close()
print(json.dumps({"reached": sum(r is None for r in results), "n": n}))
