"""Logs of a job of many ranks that read as one: a file per rank, rank 0 on the console.

Asked for with :func:`setup_logging`, ``hpcsync.init(log_dir=...)``, or ``HPCSYNC_LOG_DIR`` in
the environment (then ``hpcsync.init()`` alone turns it on); never otherwise: the application's
own handlers stay as they are, and hpcsync adds two handlers to the root logger:

- a file per rank, ``<log_dir>/rank-00007.log``, every record with its rank, world and node,
  written to the log folder directly (line by line: what a rank logged before it died is there);
- the console (stderr): rank 0's records at the level asked for, and WARNING and above from every
  rank, marked with the rank and node. Those go through rank 0 over MPI, which prints a line that
  many ranks logged alike (each within a second of the last, for 5 s at most) once, with their
  ranks (``[ranks 0-63 on n0-n3]``), not once per rank, and how often when a rank repeated it
  (``(logged 12 times)``). At exit rank 0 waits for every rank's last warnings (bounded). Without
  MPI, or below ``MPI_THREAD_MULTIPLE``, every rank prints its own warnings, marked.

Without either, :func:`console_warnings` (``hpcsync.init`` calls it; ``HPCSYNC_WARNINGS=0``
turns it off) puts hpcsync's own warnings on that console, folded the same way, as long as the
program has no logging of its own that takes them: a handler the program adds to the root logger
or the ``hpcsync`` loggers, before or after ``init``, takes them instead, never both
(:func:`reaches_handler`; a handler whose level is above WARNING takes none).

``print`` output joins the files with ``capture_print=True`` (``HPCSYNC_LOG_PRINT=1``; it needs a
log folder): rank 0's still reaches stdout, the other ranks' only their files. A record logged
with ``extra={"console": False}`` skips hpcsync's console. The root logger's level is set (to
``level``) only when the program configured no handler of its own.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from typing import Any, Dict, Iterable, List, Optional, TextIO, Tuple

from ..core import deadlines, mpi, jobend, nodemap, settings
from . import failure

__all__ = [
    "FORMAT", "WINDOW_S", "HOLD_S", "POLL_S", "BYE", "CLOSED", "setup_logging", "console_warnings",
    "reaches_handler", "to_file", "flush_console"
]

FORMAT = "%(asctime)s r%(rank)d/%(world)d %(node)s %(levelname)s %(name)s: %(message)s"
WINDOW_S = 1.0  # alike warnings from several ranks, each within this of the last, are printed once
HOLD_S = 5.0  # ... but none is held longer than this after its first rank's
POLL_S = 0.1
BYE, CLOSED = "bye", "closed"  # a rank's last message to rank 0; rank 0's answer to those it left

_state: Dict[str, Any] = {}


class _RankFields(logging.Filter):
    """Adds ``rank``, ``world`` and ``node`` to every record a handler of ours sees."""

    def __init__(self, rank: int, world: int, node: str) -> None:
        super().__init__()
        self.rank, self.world, self.node = rank, world, node

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank, record.world, record.node = self.rank, self.world, self.node
        return True


def _on_console(record: logging.LogRecord) -> bool:
    return getattr(record, "console", True)


class _Console(logging.Handler):
    """Rank 0's records at the level asked for; WARNING and above from every rank, to rank 0's
    collector (under MPI) or straight to stderr with the rank (without)."""

    def __init__(self, rank: int, level: int, collector: Optional["_Collector"], sender: Optional["_Sender"]) -> None:
        super().__init__(logging.NOTSET)
        self.rank, self.floor, self.collector, self.sender = rank, level, collector, sender
        self.addFilter(_on_console)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info and record.exc_info[0] is not None:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            if record.levelno >= logging.WARNING:
                item = (record.levelno, record.name, text, self.rank)
                if self.collector is not None:
                    self.collector.add(*item)
                elif self.sender is not None:
                    self.sender.send(item)
                else:
                    _write(_line(record.levelno, record.name, text, [self.rank]))
            elif self.rank == 0 and record.levelno >= self.floor:
                _write(f"{record.levelname} {record.name}: {text}")
        except Exception:
            self.handleError(record)


def _write(line: str) -> None:
    stream = _state.get("stderr") or sys.stderr
    stream.write(line + "\n")
    stream.flush()


def _line(level: int, name: str, text: str, ranks: List[int], times: int = 0) -> str:
    """One console line for ``text`` that ``ranks`` logged, ``times`` records in all (said when
    more than one a rank)."""
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"{len(ranks)} ranks {nodemap.ranges(ranks)}"
    nodes = nodemap.current()
    where = f" on {', '.join(nodes.nodes(ranks)[:4])}" if nodes is not None else ""
    count = f" (logged {times} times)" if times > len(ranks) else ""
    return f"[{who}{where}] {logging.getLevelName(level)} {name}: {text}{count}"


class _Sender:
    """A rank other than 0: its warnings to rank 0's collector, without waiting; once rank 0 has
    left (it said so), to this rank's own stderr, marked."""

    def __init__(self, comm: Any) -> None:
        self.comm, self.sends, self.lock = comm, [], threading.Lock()
        self.root_gone = False

    def _root_left(self) -> bool:
        if not self.root_gone and self.comm.iprobe(source=0, tag=settings.TAG_LOG):  # only CLOSED comes this way
            self.comm.recv(source=0, tag=settings.TAG_LOG)
            self.root_gone = True
        return self.root_gone

    def send(self, item: Tuple[int, str, str, int]) -> None:
        with self.lock:
            if self._root_left():
                _write(_line(item[0], item[1], item[2], [item[3]]))
                return
            self.sends = [r for r in self.sends if not r.Test()]
            self.sends.append(self.comm.isend(item, dest=0, tag=settings.TAG_LOG))

    def close(self, wait_s: float = 2.0) -> None:
        """The warnings in flight, then :data:`BYE`: rank 0's console waits for it (bounded)."""
        deadline = time.monotonic() + wait_s
        with self.lock:
            if not self._root_left():
                self.sends.append(self.comm.isend((BYE, self.comm.Get_rank()), dest=0, tag=settings.TAG_LOG))
            while self.sends and time.monotonic() < deadline:
                self.sends = [r for r in self.sends if not r.Test()]
                time.sleep(0.01)


class _Collector:
    """Rank 0: gathers every rank's warnings and prints alike ones once (see the module text)."""

    def __init__(self, comm: Any) -> None:
        self.comm, self.lock = comm, threading.Lock()
        self.pending: Dict[Tuple[int, str, str], List[Any]] = {}  # line -> [first, last arrival, ranks]
        self.byes: set = set()  # the ranks that sent their last warning
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="hpcsync-logs", daemon=True)
        self.thread.start()

    def add(self, level: int, name: str, text: str, rank: int) -> None:
        now = time.monotonic()
        with self.lock:
            entry = self.pending.setdefault((level, name, text), [now, now, []])
            entry[1] = now
            entry[2].append(rank)

    def _drain(self) -> None:
        MPI = mpi.MPI()
        while True:
            msg = self.comm.improbe(source=MPI.ANY_SOURCE, tag=settings.TAG_LOG)
            if msg is None:
                return
            item = msg.recv()
            if item[0] == BYE:
                self.byes.add(item[1])
            else:
                self.add(*item)

    def flush(self, older_than: float = WINDOW_S) -> None:
        """Print each line no rank has logged for ``older_than`` seconds (or held ``HOLD_S``): a
        window that slides with each arrival, so ranks a loaded node slows still join their line."""
        now = time.monotonic()
        with self.lock:
            due = sorted((v[0], k) for k, v in self.pending.items()
                         if now - v[1] >= older_than or now - v[0] >= max(HOLD_S, older_than))
            lines = [(k, self.pending.pop(k)[2]) for _, k in due]
        for (level, name, text), ranks in lines:
            _write(_line(level, name, text, sorted(set(ranks)), len(ranks)))

    def _loop(self) -> None:
        while not self.stop.wait(POLL_S):
            try:
                self._drain()
                self.flush()
            except Exception:  # never let logging take the job down
                if mpi.MPI().Is_finalized():
                    return

    def close(self, wait_s: Optional[float] = None) -> None:
        """At exit: print until every other rank has sent :data:`BYE` (after its last warning), for
        ``wait_s`` at most (default the job's
        :attr:`~hpcsync.core.deadlines.Deadlines.logs_close_s`: 30 s and one answer's time per
        rank, 36.8 s at 8,192 ranks), as MPI_Finalize would wait for them; the ranks still logging
        then are told (:data:`CLOSED`) and print their later warnings on their own stderr, marked.
        At N ranks: one small message from each rank to rank 0, the way its warnings already
        travel (1,000 ranks: 1,000 byes of a few bytes, 30.8 s at most)."""
        if wait_s is None:
            wait_s = deadlines.current().logs_close_s
        self.stop.set()
        self.thread.join(timeout=2)
        try:
            others = set(range(1, self.comm.Get_size()))
        except Exception:  # MPI already finalized by the program: nothing more can arrive
            self.flush(older_than=0)
            return
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self._drain()
            except Exception:  # MPI already gone: nothing more can arrive
                break
            if self.byes >= others or time.monotonic() >= deadline:
                break
            self.flush()
            time.sleep(POLL_S / 10)
        self.flush(older_than=0)
        late = sorted(others - self.byes)
        if late:
            _write(f"[hpcsync] rank 0 leaves before rank(s) {nodemap.ranges(late)} finished logging ({wait_s:g} s); "
                   "their later warnings print on their own stderr")
            try:
                sends = [self.comm.isend(CLOSED, dest=r, tag=settings.TAG_LOG) for r in late]
                until = time.monotonic() + 1.0
                while not all(r.Test() for r in sends) and time.monotonic() < until:
                    time.sleep(0.01)
                self._drain()  # what they sent before CLOSED reached them
                self.flush(older_than=0)
            except Exception:
                pass


class _PrintToFile:
    """``sys.stdout`` that also writes each line to this rank's file (rank 0: and to stdout)."""

    def __init__(self, stream: TextIO, logger: logging.Logger, passthrough: bool) -> None:
        self.stream, self.logger, self.passthrough, self.buf = stream, logger, passthrough, ""

    def write(self, text: str) -> int:
        if self.passthrough:
            self.stream.write(text)
        self.buf += text
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            self.logger.info(line, extra={"console": False})
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _where() -> Tuple[int, int, str, bool]:
    """(rank, world, node, under MPI) without starting anything the job did not start."""
    if mpi.use_mpi():
        from ..core.topology import topology

        t = topology()
        # warnings travel on a thread of their own: only where MPI allows every thread to call it
        threads = t.uses_mpi and mpi.MPI().Query_thread() == mpi.MPI().THREAD_MULTIPLE
        return t.rank, t.world_size, t.hostname, threads and t.world_size > 1
    env = os.environ
    return int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1")), socket.gethostname(), False


def setup_logging(log_dir: Optional[str] = None, level: int = logging.INFO, console: bool = True,
                  capture_print: Optional[bool] = None) -> Optional[str]:
    """Turn on rank-aware logging (see the module text); collective under MPI. Returns this
    rank's log file, or None without a log folder (``log_dir`` or ``HPCSYNC_LOG_DIR``).
    A second call changes nothing and returns the same file."""
    if _state and not _state.get("default"):
        return _state.get("file")
    default = _state.pop("default", None)  # console_warnings' console: it becomes this one
    if default is not None:
        logging.getLogger("hpcsync").removeHandler(default)
        default.removeFilter(_unclaimed)
    folder = log_dir or settings.text("HPCSYNC_LOG_DIR")
    capture = capture_print if capture_print is not None else settings.flag("HPCSYNC_LOG_PRINT")
    if capture and not folder:  # the same on every rank: before anything collective
        raise ValueError("hpcsync.setup_logging: capture_print (HPCSYNC_LOG_PRINT) needs a log folder "
                         "(log_dir= or HPCSYNC_LOG_DIR): the other ranks' prints would go nowhere")
    rank, world, node, over_mpi = _where()
    fields = _RankFields(rank, world, node)
    root = logging.getLogger()
    theirs = [h for h in root.handlers if isinstance(h, logging.StreamHandler)]
    if not root.handlers:  # the program configured nothing: INFO by default
        root.setLevel(level)
    path = None
    if folder:
        os.makedirs(folder, exist_ok=True)
        failure.use_log_folder(os.path.abspath(folder))
        path = os.path.join(folder, f"rank-{rank:05d}.log")
        fh = logging.FileHandler(path, mode="a")
        fh.setLevel(level)
        fh.addFilter(fields)
        fh.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(fh)
        _state["file_handler"] = fh
    if console:
        if default is not None:
            ch, ch.floor = default, level
        else:
            ch = _new_console(rank, level, over_mpi)
            ch.addFilter(fields)
        root.addHandler(ch)
        _state.update(console=ch, collector=ch.collector, sender=ch.sender, stderr=sys.stderr)
    if capture:  # into this rank's file only: not through the program's handlers, not to the console
        printed = logging.getLogger("hpcsync.print")
        printed.propagate = False
        printed.setLevel(logging.INFO)
        printed.addHandler(_state["file_handler"])
        sys.stdout = _PrintToFile(sys.stdout, printed, passthrough=rank == 0)  # type: ignore
    _state["file"] = path
    if default is None:
        jobend.at_exit("store", _close)
        jobend.before_abort(flush_console)
    if rank == 0:
        log = logging.getLogger(__name__)
        log.info("hpcsync logging: %s", f"one file per rank in {folder}" if folder else "console only (no log folder)")
        if theirs and console:
            log.warning("hpcsync logging: the root logger already has the program's own console handler(s), "
                        "which print every rank's records; pass console=False to keep only those")
    return path


def _new_console(rank: int, level: int, over_mpi: bool) -> "_Console":
    collector = sender = None
    if over_mpi:
        comm = _dup()
        _state["comm"] = comm
        collector, sender = (_Collector(comm), None) if rank == 0 else (None, _Sender(comm))
    return _Console(rank, level, collector, sender)


def reaches_handler(logger: logging.Logger, level: int = logging.WARNING,
                    ignore: Iterable[logging.Handler] = ()) -> bool:
    """Whether a record of ``level`` from ``logger`` reaches a handler that takes it: one on the
    logger or on an ancestor it propagates to, other than a ``NullHandler`` (a library's, as
    hpcsync's own) or those in ``ignore``, whose level lets the record through (the handlers'
    filters are not asked)."""
    skip = list(ignore)
    current: Optional[logging.Logger] = logger
    while current is not None:
        if any(not isinstance(h, logging.NullHandler) and h not in skip and level >= h.level for h in current.handlers):
            return True
        current = current.parent if current.propagate else None
    return False


def _unclaimed(record: logging.LogRecord) -> bool:
    """A record no handler of the program's takes, on the ``hpcsync`` loggers or the root logger,
    whenever the program set it up (before or after ``init``: then it prints hpcsync's warnings
    its own way, and this console does not print them a second time)."""
    ours = [h for h in (_state.get("console"), _state.get("file_handler")) if h is not None]
    return not reaches_handler(logging.getLogger(record.name), record.levelno, ours)


def console_warnings() -> None:
    """hpcsync's own warnings (WARNING and above, the ``hpcsync`` loggers) on the console, folded
    across ranks as :func:`setup_logging`'s console folds them, where the program has set up no
    logging of its own; ``HPCSYNC_WARNINGS=0`` turns it off. Collective under MPI (as
    :func:`setup_logging`); nothing when logging is already set up. A later
    :func:`setup_logging` takes this console over."""
    if _state or not settings.flag("HPCSYNC_WARNINGS"):
        return
    hpcsync_log = logging.getLogger("hpcsync")
    rank, world, node, over_mpi = _where()
    ch = _new_console(rank, logging.WARNING, over_mpi)
    ch.addFilter(_RankFields(rank, world, node))
    ch.addFilter(_unclaimed)
    ch.setLevel(logging.WARNING)
    hpcsync_log.addHandler(ch)
    _state.update(console=ch, collector=ch.collector, sender=ch.sender, stderr=sys.stderr, default=ch)
    jobend.at_exit("store", _close)
    jobend.before_abort(flush_console)


def _dup() -> Any:
    """A private duplicate of the world for the warnings, bounded (collective: a rank that never
    sets logging up is a clear error on the others, not a hang)."""
    from ..core import bounded

    comm, req = mpi.MPI().COMM_WORLD.Idup()
    timeout = bounded.default_timeout()
    try:
        bounded.wait(req, timeout)
    except Exception:
        bounded.abandon("hpcsync.setup_logging: duplicating the communicator timed out", req, (comm,))
        raise
    return comm


def to_file(level: int, text: str) -> None:
    """A record for this rank's file only (not the console, not the program's handlers)."""
    handler = _state.get("file_handler")
    if handler is not None:
        record = logging.LogRecord("hpcsync", level, __file__, 0, text, None, None)
        handler.handle(record)


def flush_console() -> None:
    """Print what rank 0 holds back now (before the job ends: an abort would lose it)."""
    collector = _state.get("collector")
    if collector is not None:
        try:
            collector._drain()
        except Exception:
            pass
        collector.flush(older_than=0)


def _close() -> None:
    """At exit, before MPI_Finalize: every rank's last warnings reach rank 0's console, which waits
    for them (bounded); warnings after this rank's exit steps go straight to its stderr, marked."""
    console = _state.get("console")
    if console is not None:
        sender, collector = console.sender, console.collector
        console.sender = console.collector = _state["sender"] = _state["collector"] = None
        if sender is not None:
            sender.close()
        if collector is not None:
            collector.close()
    if isinstance(sys.stdout, _PrintToFile):
        sys.stdout.flush()
        if sys.stdout.buf:
            sys.stdout.write("\n")
        sys.stdout = sys.stdout.stream
