"""Several "nodes" on this machine: Linux network + UTS namespaces, a real cluster network, MPI across them.

Each node is a network namespace with its own hostname (a UTS namespace entered by the launch
agent), a hostname that resolves to 127.0.1.1 on that node (``/etc/netns/<node>/hosts``), a
``docker0`` with the same address 172.17.0.1/16 on every node, IPv6 link-local addresses on every
link, and a node-local directory (``cluster.node_local``: the same path, a different directory
on each node). The cluster network is either

- ``bridged``: every node's ``eth0`` in 10.80.0.0/24, veths into one bridge, plus an ``ib0`` in
  10.70.0.0/24 on every node that is not connected to anything (a dead fabric: the address tables
  say "shared subnet", only a connection test can tell), or
- ``routed``: node *i*'s ``eth0`` alone in 10.(81+i).0.0/24 ("racks"), joined by a router
  namespace with IP forwarding, or
- ``dual-homed``: two cluster networks, 10.91.0.0/24 and 10.92.0.0/24, joined by a router; the
  first node sits on both (``eth0`` and ``eth1``), every other node on one of them (odd nodes on
  the first, even on the second), so no subnet is shared by all and every address is routed, or
- ``split-names``: the same networks, but every node names its link after the network it is on,
  ``eth0`` on the first and ``eth1`` on the second (node 1 has only ``eth0``, node 2 only
  ``eth1``): interface names differ from node to node, or
- ``ib0-node``: ``bridged`` without the dead fabric, and the last node's only link is ``ib0``.

MPI is launched across the nodes as on a cluster: Open MPI's ``mpirun`` (rsh agent) or MPICH's
hydra ``mpiexec`` (``-launcher ssh -launcher-exec``) runs inside the first node and starts the
others through ``agent``, which enters the node's namespaces. :meth:`Cluster.start_slurm` runs a
``slurmctld`` in the first node and a ``slurmd`` in every node, and :meth:`Cluster.srun` launches
with ``srun`` from the first node. :meth:`Cluster.link_down` and :meth:`Cluster.kill_node` break a
node. Needs root (CI has it); without it the fixture fails with the reason instead of skipping.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

from launch import VENV_BIN, Launcher

BRIDGED, ROUTED, DUAL_HOMED = "bridged", "routed", "dual-homed"
SPLIT_NAMES, IB0_NODE = "split-names", "ib0-node"  # interface names that differ between nodes
_TWO_NETS = (DUAL_HOMED, SPLIT_NAMES)
DOCKER0 = "172.17.0.1/16"
# Variables a remote rank needs from the test (Open MPI forwards only what -x names).
_FORWARD = ("HPCSYNC_", "BENCH_", "MPI4PY_", "PYTHON", "OMP_NUM_THREADS", "TORCH_", "LD_LIBRARY_PATH", "PATH", "HOME")

# MPICH's UCX reaches every process on one machine by shared memory, whatever the namespaces
# (it goes by boot id, not hostname): force the cluster network, as between real nodes.
_MPICH_NETWORK = {"UCX_TLS": "self,tcp", "UCX_NET_DEVICES": "eth0"}

# MPICH under `srun --mpi=pmi2` runs over OFI (tcp provider), not UCX. MPICH 5's UCX netmod
# publishes a 4,096-byte business card through PMI whatever UCX's address needs (the rest is heap
# garbage: MPICH's own "FIXME: use the actual addrname_len"), hex-encoded in 511-byte segments, so
# a `cmd=put` line is 1,000-1,090 bytes; Slurm's pmi2 plugin reads a PMI-1 request with one read()
# of at most 1,024 bytes. A longer line is cut and the step aborts or hangs in MPI_Init, the same
# way every time for a given environment (docs/harness.md). OFI's card holds the real address.
_MPICH_UNDER_SRUN = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}

_AGENT = r"""#!/bin/sh
# rsh/ssh agent for namespace nodes: agent [ssh options] NODE COMMAND...
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
node=$1; shift
exec ip netns exec "$node" unshare --uts sh -c "hostname $node && mount --bind '{dir}/nodes/'$node '{dir}/nodelocal' && cd '{cwd}' && $*"
"""


def _sh(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")


class Cluster:
    """``nodes`` namespace nodes on a ``bridged`` or ``routed`` network; :meth:`stop` removes them."""

    def __init__(self, base: Path, nodes: int = 2, network: str = BRIDGED) -> None:
        if network not in (BRIDGED, ROUTED, DUAL_HOMED, SPLIT_NAMES, IB0_NODE):
            raise ValueError(network)
        self.network = network
        tag = uuid.uuid4().hex[:5]
        self.names = [f"h{tag}n{i}" for i in range(nodes)]
        self.infra = f"h{tag}sw"
        self.dir = base / f"cluster-{tag}"
        self.node_local = str(self.dir / "nodelocal")
        self.agent = str(self.dir / "agent")
        self._started: List[str] = []
        self.slurm_env: Dict[str, str] = {}
        self.slurm_dir = Path(f"/tmp/hpcsync-slurm-{tag}")

    def address(self, i: int) -> str:
        """Node ``i``'s cluster address (the first node's first one when it has two)."""
        if self.network in _TWO_NETS:
            return f"10.{91 if i % 2 or i == 0 else 92}.0.{i + 2}"
        return f"10.80.0.{i + 2}" if self.network in (BRIDGED, IB0_NODE) else f"10.{81 + i}.0.2"

    def addresses(self, i: int) -> List[str]:
        """Every cluster address of node ``i``."""
        return [self.address(0), "10.92.0.2"] if self.network in _TWO_NETS and i == 0 else [self.address(i)]

    def links(self, i: int) -> List[str]:
        """The names of node ``i``'s cluster links."""
        if self.network in _TWO_NETS:
            return ["eth0", "eth1"] if i == 0 else \
                ["eth1" if self.network == SPLIT_NAMES and self.address(i).startswith("10.92.") else "eth0"]
        return ["ib0"] if self.network == IB0_NODE and i == len(self.names) - 1 else ["eth0"]

    def networks(self) -> str:
        """The cluster networks in CIDR form (what MPI's TCP may use: names differ between nodes)."""
        if self.network in _TWO_NETS:
            return "10.91.0.0/24,10.92.0.0/24"
        if self.network == ROUTED:
            return ",".join(f"10.{81 + i}.0.0/24" for i in range(len(self.names)))
        return "10.80.0.0/24"

    def _mpi_links(self) -> Dict[str, str]:
        """Open MPI's and UCX's interface settings for this network."""
        if self.network in (SPLIT_NAMES, IB0_NODE):  # no one name exists on every node
            devices = sorted({d for i in range(len(self.names)) for d in self.links(i)})
            return {"openmpi": self.networks(), "ucx": ",".join(devices)}
        return {"openmpi": "eth0", "ucx": "eth0"}

    def start(self) -> "Cluster":
        if os.geteuid() != 0:
            pytest.fail("the multi-node tests need root (network namespaces); run them as root, as CI does")
        for tool in ("ip", "unshare"):
            if not shutil.which(tool):
                pytest.fail(f"the multi-node tests need `{tool}` (iproute2 / util-linux)")
        (self.dir / "nodelocal").mkdir(parents=True)
        Path(self.agent).write_text(_AGENT.replace("{dir}", str(self.dir)).replace("{cwd}", os.getcwd()))
        os.chmod(self.agent, 0o755)
        try:
            self._build()
            self._wait_links_up()
        except RuntimeError as exc:
            self.stop()
            pytest.fail(f"cannot build namespace nodes here (need root and network namespaces): {exc}")
        return self

    def _build(self) -> None:
        sw = self.infra
        _sh("ip", "netns", "add", sw)
        self._started.append(sw)
        _sh("ip", "-n", sw, "link", "set", "lo", "up")
        bridged = self.network in (BRIDGED, IB0_NODE)
        if bridged:
            _sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", sw, "link", "set", "br0", "up")
        else:
            _sh("ip", "netns", "exec", sw, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        if self.network in _TWO_NETS:  # one bridge per network, the router's address on each
            for br, net in (("br0", 91), ("br1", 92)):
                _sh("ip", "-n", sw, "link", "add", br, "type", "bridge")
                _sh("ip", "-n", sw, "addr", "add", f"10.{net}.0.1/24", "dev", br)
                _sh("ip", "-n", sw, "link", "set", br, "up")
        for i, name in enumerate(self.names):
            _sh("ip", "netns", "add", name)
            self._started.append(name)
            (self.dir / "nodes" / name).mkdir(parents=True)
            etc = Path("/etc/netns") / name
            etc.mkdir(parents=True, exist_ok=True)
            # as on many clusters: the node's own name resolves to loopback, the others' to their
            # cluster address; no DNS (a query routed nowhere would stall every lookup for seconds)
            others = "".join(f"{self.address(k)} {n}\n" for k, n in enumerate(self.names) if k != i)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {name}\n{others}")
            (etc / "resolv.conf").write_text("# no DNS on namespace test nodes\n")
            peer = f"p{i}"
            _sh("ip", "-n", name, "link", "set", "lo", "up")
            if self.network == BRIDGED:  # created first: it is listed (and tried) before eth0
                _sh("ip", "-n", name, "link", "add", "ib0", "type", "veth", "peer", "name", "ib0p")
                _sh("ip", "-n", name, "addr", "add", f"10.70.0.{i + 2}/24", "dev", "ib0")
                _sh("ip", "-n", name, "link", "set", "ib0", "up")
                _sh("ip", "-n", name, "link", "set", "ib0p", "up")
            if self.network in _TWO_NETS:
                self._dual_homed_links(i, name, peer)
                continue
            (dev,) = self.links(i)
            _sh("ip", "link", "add", dev, "netns", name, "type", "veth", "peer", "name", peer, "netns", sw)
            if bridged:
                _sh("ip", "-n", sw, "link", "set", peer, "master", "br0")
                _sh("ip", "-n", name, "addr", "add", f"{self.address(i)}/24", "dev", dev)
            else:
                _sh("ip", "-n", sw, "addr", "add", f"10.{81 + i}.0.1/24", "dev", peer)
                _sh("ip", "-n", name, "addr", "add", f"{self.address(i)}/24", "dev", dev)
            _sh("ip", "-n", sw, "link", "set", peer, "up")
            _sh("ip", "-n", name, "link", "set", dev, "up")
            if self.network == ROUTED:
                _sh("ip", "-n", name, "route", "add", "default", "via", f"10.{81 + i}.0.1")
            self._docker0(name)

    def _docker0(self, name: str) -> None:
        """A node-local bridge with the same address on every node (no `dummy` links here)."""
        _sh("ip", "-n", name, "link", "add", "docker0", "type", "veth", "peer", "name", "dk0p")
        _sh("ip", "-n", name, "addr", "add", DOCKER0, "dev", "docker0")
        _sh("ip", "-n", name, "link", "set", "docker0", "up")
        _sh("ip", "-n", name, "link", "set", "dk0p", "up")

    def _dual_homed_links(self, i: int, name: str, peer: str) -> None:
        links = [("eth0", "br0", self.address(0)), ("eth1", "br1", "10.92.0.2")] if i == 0 else \
            [(self.links(i)[0], "br0" if self.address(i).startswith("10.91.") else "br1", self.address(i))]
        for k, (dev, br, addr) in enumerate(links):
            p = f"{peer}{'abc'[k]}"
            _sh("ip", "link", "add", dev, "netns", name, "type", "veth", "peer", "name", p, "netns", self.infra)
            _sh("ip", "-n", self.infra, "link", "set", p, "master", br)
            _sh("ip", "-n", self.infra, "link", "set", p, "up")
            _sh("ip", "-n", name, "addr", "add", f"{addr}/24", "dev", dev)
            _sh("ip", "-n", name, "link", "set", dev, "up")
        if i == 0:  # replies leave by the direct link, requests may arrive by the routed one
            for conf in ("all", "default", "eth0", "eth1"):
                _sh("ip", "netns", "exec", name, "sysctl", "-qw", f"net.ipv4.conf.{conf}.rp_filter=0")
        else:
            _sh("ip", "-n", name, "route", "add", "default", "via", links[0][2].rsplit(".", 1)[0] + ".1")
        self._docker0(name)

    def _wait_links_up(self, timeout: float = 10) -> None:
        """veth carriers come up asynchronously: a node used at once may see its eth0 still down."""
        import time

        deadline = time.monotonic() + timeout
        for i, name in enumerate(self.names):
            for dev in self.links(i):
                while True:
                    out = subprocess.run(["ip", "-n", name, "-o", "link", "show", dev], capture_output=True,
                                         text=True).stdout
                    if "state UP" in out:
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{name}: {dev} did not come up: {out.strip()}")
                    time.sleep(0.05)

    def stop(self) -> None:
        for ns in reversed(self._started):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (OSError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        self._started.clear()
        shutil.rmtree(self.slurm_dir, ignore_errors=True)

    # -- failures --------------------------------------------------------------------------------

    def link_down(self, node: int) -> None:
        """The node drops off the network (its processes live on, unreachable)."""
        for dev in self.links(node):
            _sh("ip", "-n", self.names[node], "link", "set", dev, "down")

    def kill_node(self, node: int) -> None:
        """Every process of the node dies at once (SIGKILL), as when it crashes or is power-cycled."""
        for pid in subprocess.run(["ip", "netns", "pids", self.names[node]], capture_output=True,
                                  text=True).stdout.split():
            try:
                os.kill(int(pid), 9)
            except (OSError, ValueError):
                pass

    def on_node(self, node: int, *cmd: str) -> List[str]:
        """argv that runs ``cmd`` inside node ``node`` (its namespaces, hostname, node-local dir)."""
        return [self.agent, self.names[node], shlex.join(cmd)]

    # -- launchers ------------------------------------------------------------------------------

    def start_slurm(self, cpus: int = 8, timeout: float = 60) -> Dict[str, str]:
        """One ``slurmctld`` in node 0 and one ``slurmd`` in every node; returns the clients' env.

        Each daemon runs in its node's network namespace with the node's hostname, ``/etc/hosts``
        and node-local directory (``nsenter --net`` + ``unshare --uts --mount``: ``ip netns exec``
        would remount /sys and hide the cgroup tree slurmd needs). Each node has its own copy of
        slurm.conf and an ``mpi.conf`` with its own PMIx temp dir (two slurmstepd on one /tmp collide).
        """
        import slurm_cluster

        d = self.slurm_dir  # short: slurmstepd's Unix socket paths must fit in 108 bytes
        nodes = [(name, self.address(i)) for i, name in enumerate(self.names)]
        text = slurm_cluster.config(d, nodes[0], nodes, cpus)
        (d / "state").mkdir(parents=True)
        for name in self.names:
            for sub in (f"etc/{name}", f"spool/{name}", f"pmix/{name}"):
                (d / sub).mkdir(parents=True)
            (d / "etc" / name / "slurm.conf").write_text(text)
            (d / "etc" / name / "mpi.conf").write_text(f"PMIxCliTmpDirBase={d}/pmix/{name}\n")
        slurm_cluster.munge()
        self._daemon(0, "slurmctld", "-D")
        for i, name in enumerate(self.names):
            self._daemon(i, "slurmd", "-D", "-N", name)
        env = {"SLURM_CONF": str(d / "etc" / self.names[0] / "slurm.conf")}
        import time

        deadline, states = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            states = subprocess.run(self.on_node(0, "sinfo", "-h", "-N", "-o", "%N %t"), capture_output=True,
                                    text=True, env={**os.environ, **env}).stdout
            if states.count(" idle") == len(self.names):
                self.slurm_env = env
                return env
            time.sleep(0.2)
        raise RuntimeError(f"Slurm nodes not idle after {timeout}s: {states!r}\n{self.slurm_logs()}")

    def slurm_logs(self, tail: int = 1500) -> str:
        """The last ``tail`` characters of each Slurm daemon's log (slurmctld, each slurmd)."""
        return "".join(f"--- {f.name}\n{f.read_text(errors='replace')[-tail:]}"
                       for f in sorted(self.slurm_dir.glob("*.log")))

    def _daemon(self, node: int, *cmd: str) -> None:
        name = self.names[node]
        etc = Path("/etc/netns") / name
        script = (f"hostname {name} && mount --bind {etc}/hosts /etc/hosts && "
                  f"mount --bind {etc}/resolv.conf /etc/resolv.conf && "
                  f"mount --bind '{self.dir}/nodes/{name}' '{self.dir}/nodelocal' && exec {shlex.join(cmd)}")
        log = open(self.slurm_dir / f"{cmd[0]}.{name}.out", "w")
        env = {**os.environ, "SLURM_CONF": str(self.slurm_dir / "etc" / name / "slurm.conf")}
        subprocess.Popen(["nsenter", f"--net=/var/run/netns/{name}", "unshare", "--uts", "--mount", "sh", "-c",
                          script], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def srun(self, per_node: Sequence[int], mpi: str = "pmix", *extra: str) -> "ClusterLauncher":
        """``srun --mpi=MPI`` from node 0, ``per_node[i]`` tasks on node i (needs :meth:`start_slurm`)."""
        if not getattr(self, "slurm_env", None):
            raise RuntimeError("start_slurm() first")
        used = [k for k in per_node if k]
        argv = [shutil.which("srun") or "srun", f"--mpi={mpi}", "-N", str(len(used)),
                f"--ntasks-per-node={max(used)}", *extra]
        env = dict(self.slurm_env)
        links = self._mpi_links()
        if mpi == "pmix":  # tasks on two nodes talk TCP; docker0 has the same address everywhere
            env.update({"MPI4PY_MPIABI": "openmpi", "OMPI_MCA_btl": "self,vader,tcp",
                        "OMPI_MCA_btl_tcp_if_include": links["openmpi"]})
        else:  # MPICH over OFI's tcp provider: see _MPICH_UNDER_SRUN
            env.update({**_MPICH_UNDER_SRUN, "FI_TCP_IFACE": links["ucx"].split(",")[0]})
        return ClusterLauncher(f"srun-{mpi}", argv, env, self)

    def hosts(self, per_node: Sequence[int]) -> List[str]:
        return [f"{self.names[i]}:{k}" for i, k in enumerate(per_node) if k]

    def openmpi(self, per_node: Sequence[int], placement: str = "block") -> "ClusterLauncher":
        exe = shutil.which("mpirun.openmpi")
        if not exe:
            pytest.fail("Open MPI (mpirun.openmpi) is not installed: run `bash tests/run.sh`")
        links = self._mpi_links()["openmpi"]
        argv = [exe, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
                "--host", ",".join(self.hosts(per_node)), "--map-by", "node" if placement == "round-robin" else "slot",
                "--mca", "plm_rsh_agent", self.agent, "--mca", "oob_tcp_if_include", links,
                "--mca", "btl", "self,vader,tcp", "--mca", "btl_tcp_if_include", links]
        return ClusterLauncher("openmpi", argv, {"MPI4PY_MPIABI": "openmpi"}, self, forward_flag="-x")

    def mpich(self, per_node: Sequence[int], placement: str = "block") -> "ClusterLauncher":
        exe = VENV_BIN / "mpiexec"
        if not exe.exists():
            pytest.fail(f"MPICH's mpiexec is not in {VENV_BIN}: run `bash tests/run.sh`")
        hosts = ",".join(self.hosts([1 if k else 0 for k in per_node]) if placement == "round-robin"
                         else self.hosts(per_node))
        links = self._mpi_links()
        iface = ["-iface", "eth0"] if links["ucx"] == "eth0" else []  # else hydra goes by the host names
        argv = [str(exe), "-launcher", "ssh", "-launcher-exec", self.agent, "-hosts", hosts, *iface]
        return ClusterLauncher("mpich", argv, {**_MPICH_NETWORK, "UCX_NET_DEVICES": links["ucx"]}, self)


def with_slurm(base: Path, nodes: int, network: str = ROUTED) -> Cluster:
    """Started nodes with Slurm running on them; the test fails (never skips) when Slurm cannot start."""
    c = Cluster(base, nodes, network).start()
    try:
        c.start_slurm()
    except RuntimeError as exc:
        c.stop()
        pytest.fail(f"could not start Slurm on the namespace nodes: {exc}")
    return c


class ClusterLauncher(Launcher):
    """A launcher whose command starts inside node 0 and reaches the other nodes via the agent."""

    def __init__(self, name: str, argv: List[str], env: Dict[str, str], cluster: Cluster,
                 forward_flag: Optional[str] = None) -> None:
        super().__init__(name, argv, env)
        self.cluster = cluster
        self.forward_flag = forward_flag

    def command(self, n: int, env: Optional[Dict[str, str]] = None) -> List[str]:
        forward: List[str] = []
        if self.forward_flag:
            for key in sorted(env or {}):
                if key.startswith(_FORWARD):
                    forward += [self.forward_flag, key]
        return [self.cluster.agent, self.cluster.names[0], *self.argv, *forward, "-n", str(n)]


def main() -> int:
    """By hand: build the nodes, run one MPI job across them, tear them down.

        sudo .venv/bin/python tests/netns_cluster.py --network routed --nodes 2 -n 4 -- \\
            .venv/bin/python -m hpcsync info
        sudo .venv/bin/python tests/netns_cluster.py --launcher slurm --mpi pmix --nodes 2 -n 4 -- \\
            .venv/bin/python -m hpcsync info
    """
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    ap.add_argument("--network", choices=[BRIDGED, ROUTED, DUAL_HOMED, SPLIT_NAMES, IB0_NODE], default=ROUTED)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--launcher", choices=["openmpi", "mpich", "slurm"], default="openmpi",
                    help="slurm: start slurmctld + one slurmd per node, then srun from the first node")
    ap.add_argument("--mpi", choices=["pmix", "pmi2"], default="pmix", help="srun --mpi= (with --launcher slurm)")
    ap.add_argument("--placement", choices=["block", "round-robin"], default="block")
    ap.add_argument("-n", type=int, default=4, help="ranks (spread evenly over the nodes)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- PROGRAM ARGS...")
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd or args.n % args.nodes:
        ap.error("give a command after --, and -n divisible by --nodes")
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="hpcsync-nodes-")), args.nodes, args.network)
    cluster.start()
    try:
        for i, name in enumerate(cluster.names):
            print(f"# node {name}: eth0={cluster.address(i)} docker0={DOCKER0} (hostname -> 127.0.1.1)", flush=True)
        per_node = [args.n // args.nodes] * args.nodes
        if args.launcher == "slurm":
            cluster.start_slurm()
            lau = cluster.srun(per_node, args.mpi)
        else:
            lau = getattr(cluster, args.launcher)(per_node, args.placement)
        env = {**os.environ, **lau.env}
        return subprocess.run([*lau.command(args.n, env), *cmd], env=env).returncode
    finally:
        cluster.stop()


if __name__ == "__main__":
    import sys

    sys.exit(main())
