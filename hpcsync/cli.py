"""Command line: ``hpcsync info`` (run it under your launcher)."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Optional


def _torch_backends() -> str:
    try:
        import torch.distributed as dist
    except ImportError:
        return "torch not installed"
    names = [n for n, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                             ("mpi", dist.is_mpi_available())) if ok]
    try:
        from . import backend  # noqa: F401

        names.append("hpcsync")
    except ImportError:
        pass
    return ",".join(names) or "none"


def cmd_info(args: argparse.Namespace) -> int:
    from .bootstrap import master_address
    from .comm import gather
    from .topology import topology

    topo = topology()
    choice = master_address(topo)
    line = (f"rank={topo.rank}/{topo.world_size} local={topo.local_rank}/{topo.local_size} "
            f"node={topo.node_rank}/{topo.num_nodes} host={topo.hostname} "
            f"master={choice.address} ifname={choice.ifname or '-'} launcher={topo.launcher} "
            f"mpi={topo.mpi_library or 'none'} torch_backends={_torch_backends()}")
    lines = gather(line, dst=0)
    if topo.rank == 0:
        print(f"# master address: {choice.address} ({choice.reason})")
        for text in lines:
            print(text)
        sys.stdout.flush()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpcsync", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="one line per rank: ranks, node, host, master address, MPI, backends")
    info.set_defaults(func=cmd_info)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    from .errors import HpcsyncError

    try:
        return int(args.func(args) or 0)
    except HpcsyncError as exc:
        print(f"hpcsync {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
