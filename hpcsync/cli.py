"""Command line: ``hpcsync info``, ``merge``, ``stage`` and ``doctor`` (run them under your launcher), and
``run`` (in the batch script: the step, relaunched without a failed node)."""
from __future__ import annotations

import argparse
import logging
import re
import sys
import textwrap
from typing import List, Optional

__all__ = ["cmd_info", "cmd_merge", "cmd_stage", "cmd_doctor", "plain", "MERGE_METHODS", "HelpFormatter", "build_parser", "main"]

_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`(~?)([^`<]+?)(?:\s*<[^`]*>)?`")


def plain(text: Optional[str]) -> Optional[str]:
    """The reST markup out of a docstring that argparse shows: double backquotes dropped, a role
    (``:func:`~a.b```) its name alone."""
    if text is None:
        return None
    text = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), text)
    return text.replace("``", "")


# hpcsync.data.filesync.METHODS, spelt out: `hpcsync --help` imports no numpy (tests/test_cli.py compares them)
MERGE_METHODS = ["auto", "copy", "gather", "mpiio"]


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, but an option named in a help text stays whole (``--mpi=pmix``, not ``--`` at
    the end of one line and ``mpi=pmix`` on the next)."""

    def _split_lines(self, text: str, width: int) -> List[str]:
        return textwrap.wrap(re.sub(r"\s+", " ", text).strip(), width, break_on_hyphens=False)


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
    from .start.bootstrap import master_address
    from .core.comm import gather
    from .core.topology import topology

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


def cmd_merge(args: argparse.Namespace) -> int:
    """Merge part files left by a job that died before syncing; parts split across ranks in order."""
    from .core.comm import get_rank, get_world_size
    from .data.filesync import merge_parts

    size, rank = get_world_size(), get_rank()
    per, extra = divmod(len(args.parts), size)
    lo = rank * per + min(rank, extra)
    mine = args.parts[lo: lo + per + (1 if rank < extra else 0)]
    result = merge_parts(args.target, mine, strip_header=args.strip_header, text=not args.binary,
                         keep_parts=not args.delete_parts, method=args.method, allow_missing=args.allow_missing,
                         progress=None if not args.no_progress else False, append=args.append)
    if rank == 0:
        print(f"merged {len(args.parts)} part(s) from {size} rank(s) into {result.path}: "
              f"{result.bytes} bytes in {result.seconds:.2f}s ({result.method})")
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    """Copy SRC to DST on every node (one read of the source); a summary from rank 0."""
    from .data.staging import stage

    r = stage(args.src, args.dst, chunk_bytes=args.chunk_mib * 2**20, durable=args.durable,
              progress=False if args.no_progress else None)
    from .core.comm import get_rank

    if get_rank() == 0:
        print(f"staged {r.source} to {r.destination} on {r.nodes} node(s): {r.files} file(s), {r.bytes} bytes; "
              f"copied {r.copied_files} ({r.copied_bytes} bytes, read once), {r.skipped_files} up to date, "
              f"{r.broadcasts} broadcast(s), {r.seconds:.2f}s"
              + (f"; ignored {len(r.ignored)} special file(s)" if r.ignored else ""))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from .start.doctor import run

    return run(connect=not args.no_connect)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpcsync", description=plain(__doc__), formatter_class=HelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="run `hpcsync COMMAND --help` for its arguments")

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".")

    info = command("info", "one line per rank: ranks, node, host, master address, MPI, backends")
    info.set_defaults(func=cmd_info)
    merge = command("merge", "join part files into TARGET in the order given (one process or mpirun)")
    merge.add_argument("target", help="the file to write (written beside it and renamed into place: a failed "
                                      "merge leaves it as it was)")
    merge.add_argument("parts", nargs="+", metavar="PART", help="the part files, in the order they are joined")
    merge.add_argument("--strip-header", action="store_true", help="drop the first line of every part but the first")
    merge.add_argument("--binary", action="store_true", help="byte-exact: add no newline after parts lacking one")
    merge.add_argument("--append", action="store_true", help="keep what TARGET holds and add the parts after it "
                                                             "(one header with --strip-header)")
    merge.add_argument("--delete-parts", action="store_true", help="delete the parts after a durable merge")
    merge.add_argument("--allow-missing", action="store_true", help="treat a missing part as empty")
    merge.add_argument("--method", default="auto", choices=MERGE_METHODS,
                       help="copy: rank 0 reads the parts itself (it must see the very files); gather: the ranks "
                            "send their parts to rank 0 over MPI; mpiio: every rank writes its own into the target "
                            "(a shared filesystem); auto (default): copy where it can, else mpiio or gather")
    merge.add_argument("--no-progress", action="store_true", help="no progress bar (on a terminal a bar, else a line every 10 s)")
    merge.set_defaults(func=cmd_merge)
    stg = command("stage", "copy SRC (a file or directory rank 0 can read) into DST on every node")
    stg.add_argument("src", help="a file or directory that rank 0 can read (read once)")
    stg.add_argument("dst", help="a node-local directory, the same path on every node")
    stg.add_argument("--chunk-mib", type=int, default=16, metavar="MIB",
                     help="MiB per broadcast round and pipeline buffer (default 16)")
    stg.add_argument("--durable", action="store_true", help="sync the destination before recording files")
    stg.add_argument("--no-progress", action="store_true", help="no progress bar (on a terminal a bar, else a line every 10 s)")
    stg.set_defaults(func=cmd_stage)
    doctor = command("doctor", "check MPI, launcher, addresses, torch, GPUs, HDF5; non-zero exit on problems")
    doctor.add_argument("--no-connect", action="store_true", help="skip the TCP reachability test to rank 0")
    doctor.set_defaults(func=cmd_doctor)
    from .resilience import supervisor

    supervisor.add_parser(sub)
    for p in sub.choices.values():  # every subcommand's help: plain text, options kept whole
        p.formatter_class = HelpFormatter
        p.description = plain(p.description)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    from .core.errors import HpcsyncError

    try:
        return int(args.func(args) or 0)
    except HpcsyncError as exc:
        print(f"hpcsync {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
