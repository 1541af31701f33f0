"""Questions between ranks while the job may be broken: a responder thread per process answers
them on a private duplicate of ``COMM_WORLD`` (polled every 0.1 s: a few µs a second), and
:func:`ask` waits for the answers within a bound. What a question means is registered in
:data:`ANSWERS` by the modules that ask (the hang report, the failure report, the relay).

Answers are computed on the responder thread, except the kinds in :data:`SLOW` (a relay that
asks others in turn: :mod:`hpcsync.observe.relay`), which run on a few daemon threads of their own
(not a ``concurrent.futures`` pool: that one takes no work once the interpreter begins to exit,
while ranks that finished still answer from the exit barrier); such an answer is told when its
question arrived, so time spent queued counts against its bound. :func:`ask` may be called from
several threads at once: an answer that reaches the wrong thread is handed to the one that asked."""
from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ..core import mpi, settings

__all__ = [
    "POLL_S", "SLOW_WORKERS", "ANSWERS", "SLOW", "Responder", "start", "responder", "ask", "ask_each", "wait_done",
    "notify_done"
]

_TAG_ASK, _TAG_STATE, _TAG_DONE = settings.TAG_REPORT_ASK, settings.TAG_REPORT_STATE, settings.TAG_REPORT_DONE
POLL_S = 0.1
SLOW_WORKERS = 4  #: slow answers computed at once (each waits for other ranks within its bound)

# question kind -> function(asking rank, *arguments) -> plain data
ANSWERS: Dict[str, Callable[..., Any]] = {}
SLOW: Set[str] = set()  # kinds answered off the responder thread: function(asking rank, *arguments, arrived=)

_lock = threading.Lock()
_responder: Optional["Responder"] = None
_inflight: List[Any] = []  # sends that may still be in flight when their caller returns: kept alive
_questions = 0  # this process's questions so far: an answer names the one it answers
_open: Dict[Tuple[int, int], Dict[int, Any]] = {}  # questions being waited for -> answers received so far
_done: Dict[Any, Set[int]] = {}  # reports said to be done (by their ``about``) -> who said so


class Responder:
    """Answers other ranks' questions, on its own communicator and thread."""

    def __init__(self) -> None:
        self.comm = mpi.MPI().COMM_WORLD.Dup()  # collective: created with the default group
        self._stop = threading.Event()
        self._sends: List[Any] = []
        self._slow: "queue.Queue[Tuple[int, Any, str, Tuple[Any, ...], float]]" = queue.Queue()
        self._workers: List[threading.Thread] = []
        self.thread = threading.Thread(target=self._loop, name="hpcsync-watchdog", daemon=True)
        self.thread.start()

    def _answer(self, source: int, qid: Any, kind: str, args: Tuple[Any, ...], **extra: Any) -> Any:
        answer = (qid, ANSWERS[kind](source, *args, **extra))
        return self.comm.isend(answer, dest=source, tag=_TAG_STATE)

    def _work(self) -> None:
        """A slow answer's thread: one question at a time, until the responder stops."""
        while not self._stop.is_set():
            try:
                source, qid, kind, args, arrived = self._slow.get(timeout=1.0)
            except queue.Empty:
                continue
            try:
                sent = self._answer(source, qid, kind, args, arrived=arrived)
                with _lock:
                    _inflight.append(sent)
            except Exception:  # never let a report take the job down
                pass

    def _queue_slow(self, item: Tuple[int, Any, str, Tuple[Any, ...], float]) -> None:
        if len(self._workers) < SLOW_WORKERS:
            worker = threading.Thread(target=self._work, name="hpcsync-relay", daemon=True)
            worker.start()
            self._workers.append(worker)
        self._slow.put(item)

    def _loop(self) -> None:
        MPI = mpi.MPI()
        while not self._stop.wait(POLL_S):
            try:
                while True:
                    msg = self.comm.improbe(source=MPI.ANY_SOURCE, tag=_TAG_ASK)
                    if msg is None:
                        break
                    status = MPI.Status()
                    qid, kind, args = msg.recv(status=status)  # mprobe-matched: any size
                    if kind in SLOW:
                        self._queue_slow((status.Get_source(), qid, kind, args, time.monotonic()))
                    else:
                        self._sends.append(self._answer(status.Get_source(), qid, kind, args))
                self._sends = [r for r in self._sends if not r.Test()]
            except Exception:  # never let the flight recorder take the job down
                if MPI.Is_finalized():
                    return

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=2 * POLL_S + 1)


def start() -> Responder:
    """Start the responder once per process (collective over COMM_WORLD the first time)."""
    global _responder
    if _responder is None:
        _responder = Responder()  # stopped at exit by hpcsync.backend, before MPI_Finalize
    return _responder


def responder() -> Optional[Responder]:
    """This process's responder, once :func:`start` ran (None without THREAD_MULTIPLE)."""
    return _responder


def ask(ranks: List[int], question: Tuple[Any, ...], wait_s: float) -> Dict[int, Any]:
    """Send ``question`` (a kind of :data:`ANSWERS` and its arguments) to ``ranks``' responders;
    the answers that came within ``wait_s`` (a late answer to an earlier question is dropped)."""
    return ask_each({r: question for r in ranks}, wait_s)


def ask_each(questions: Dict[int, Tuple[Any, ...]], wait_s: float) -> Dict[int, Any]:
    """:func:`ask` with a question of its own for each rank (``{rank: question}``)."""
    global _questions
    MPI = mpi.MPI()
    assert _responder is not None
    comm = _responder.comm
    with _lock:
        _questions += 1
        qid = (os.getpid(), _questions)
        _open[qid] = answers = {}
        _inflight[:] = [s for s in _inflight if not s.Test()]
    sends: List[Any] = []
    deadline = time.monotonic() + wait_s
    try:
        for r, q in questions.items():
            sends.append(comm.isend((qid, q[0], q[1:]), dest=r, tag=_TAG_ASK))
        while len(answers) < len(questions) and time.monotonic() < deadline:
            msg = comm.improbe(source=MPI.ANY_SOURCE, tag=_TAG_STATE)
            if msg is None:
                time.sleep(0.01)
                continue
            status = MPI.Status()
            got, data = msg.recv(status=status)
            with _lock:
                box = _open.get(got)  # this question's, or another thread's still waiting (which keeps
                if box is not None:   # only the answers of the ranks it asked)
                    box[status.Get_source()] = data
    finally:
        with _lock:
            _open.pop(qid, None)
            mine = {r: a for r, a in answers.items() if r in questions}
            _inflight.extend(s for s in sends if not s.Test())  # their buffers must outlive them
    return mine


def wait_done(printer: Optional[int], wait_s: float, about: Any = None) -> bool:
    """Let the printing rank (None: whichever prints) finish before this one raises (an uncaught
    error here aborts the job). False when it did not say it was done within ``wait_s``. ``about``
    names the report (a group): the words are taken off the line and kept by report, so that a
    word about another report waits for its own waiter (another thread) instead of being lost."""
    if _responder is None:
        return False
    MPI = mpi.MPI()
    deadline = time.monotonic() + wait_s
    while True:
        with _lock:
            said = _done.get(about, set())
            if said and (printer is None or printer in said):
                return True
        if time.monotonic() >= deadline:
            return False
        status = MPI.Status()
        with _lock:  # one thread at a time takes a word off the line
            msg = _responder.comm.improbe(source=MPI.ANY_SOURCE, tag=_TAG_DONE, status=status)
            if msg is not None:
                _done.setdefault(msg.recv(), set()).add(status.Get_source())
        if msg is None:
            time.sleep(0.05)


def notify_done(ranks: List[int], about: Any = None) -> None:
    """Tell ``ranks`` (but this one) that the report they wait for (``about``) is out."""
    if _responder is None:
        return
    me = _responder.comm.Get_rank()
    sends = [_responder.comm.isend(about, dest=r, tag=_TAG_DONE) for r in ranks if r != me]
    with _lock:
        _inflight.extend(sends)
