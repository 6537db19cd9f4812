"""Log lines rendered and written off the caller's path, at most ``log_buffer_s`` later.

A decision's line used to be rendered and written (one ``write`` and one ``flush``) inside the
publish it reports, about 45 us of a gated publish. Here the caller only stamps the event (its
time and level, as before) and queues it, about 12 us; a daemon thread renders what is queued
and writes it, one write and one flush per file and up to 256 lines, every ``log_buffer_s``
(0.1 s by default). The rendering still takes the GIL: what the publisher gains is the write
per line and the part of the rendering that falls in its waits on Redis (on the publish
bench, 0.01 to 0.035 of the gated/plain ratio; bench/README.md).

:func:`flush` renders and writes what is queued at once. It runs at the end of every task in
the process that ran it (``task_postrun``: a prefork child SIGKILLed after its task has
written its lines), when a prefork child shuts down (``worker_process_shutdown``: it leaves
by ``os._exit``, without atexit), across a fork (a child neither repeats its parent's lines
nor inherits a write half done), at exit, and when a ``multiprocessing`` child ends (it too
leaves by ``os._exit``, after its finalizers). A process killed between two passes loses at
most ``log_buffer_s`` of lines; ``log_buffer_s = 0`` writes each line in the call, as
structlog's ``PrintLogger``.

Lines keep the order they were logged in, across loggers and threads. A value is rendered
when the line is written: a mutable value changed in between (gatekeeper logs none) shows
its later state. A line that cannot be rendered is written as ``event=log_render_failed``; a
file that cannot be written to (closed, a broken pipe) loses that write's lines, and no
flush ever raises into its caller.
"""

from __future__ import annotations

import atexit
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import MutableMapping
from typing import Any, TextIO

from structlog.typing import Processor

from gatekeeper.forks import in_a_multiprocessing_child

__all__ = [
    "LINES",
    "MIN_INTERVAL_S",
    "MOST_QUEUED",
    "DeferredLogger",
    "Lines",
    "flush",
    "flush_after_task",
]

MOST_QUEUED = 10_000
"""Past this many queued lines (a stderr nobody reads, a stalled disk) the caller writes them
itself, as it did before lines were queued: back-pressure, not memory that grows unbounded."""

CHUNK = 256
"""Lines joined into one write at most."""
DEFAULT_INTERVAL_S = 0.1
"""The thread's pass interval before any logger asked for one."""
MIN_INTERVAL_S = 0.001
"""No logger makes the thread pass more often than this (it would spin)."""

Render = Processor
"""The logger's renderer (the processor that writes the event as a line's text)."""


class Lines:
    """The queue of one process's pending lines, and the thread that writes them."""

    def __init__(self) -> None:
        self._queue: deque[tuple[TextIO, Render, MutableMapping[str, Any]]] = deque()
        self._lock = threading.RLock()  # held by a fork too: no child inherits a half write
        self._starting = threading.Lock()
        self._thread: threading.Thread | None = None
        self._draining = threading.local()
        self.interval = math.inf
        self._finalized = 0  # the pid whose multiprocessing finalizer flushes (if any)

    def want(self, interval: float) -> None:
        """A logger needs its lines written within ``interval`` seconds: the smallest any
        logger of the process asked for wins (1 ms at least)."""
        self.interval = min(self.interval, max(interval, MIN_INTERVAL_S))

    def put(self, file: TextIO, render: Render, event: MutableMapping[str, Any]) -> None:
        self._queue.append((file, render, event))
        thread = self._thread
        if thread is None or not thread.is_alive():
            self._start()
        elif len(self._queue) > MOST_QUEUED:  # the writes are not keeping up: wait for them
            self.flush()

    def _start(self) -> None:
        with self._starting:
            thread = self._thread
            if thread is None or not thread.is_alive():
                thread = threading.Thread(target=self._run, name="gatekeeper-lines", daemon=True)
                thread.start()
                self._thread = thread
                self._flush_in_a_child()

    def _flush_in_a_child(self) -> None:
        """In a process ``multiprocessing`` started (by ``forkserver``: it leaves by
        ``os._exit``, after its finalizers) that imported gatekeeper itself: the lines
        written at its end, once (a fork of a process that had them registers in
        :meth:`_forked`)."""
        if in_a_multiprocessing_child() and self._finalized != os.getpid():
            self._finalized = os.getpid()
            _flush_at_the_end(self)

    def _run(self) -> None:
        while True:
            time.sleep(self.interval if self.interval < math.inf else DEFAULT_INTERVAL_S)
            if self._queue:
                self.flush()

    def flush(self) -> None:
        """Render and write every line queued so far, in order; never raises. Waits for the
        thread's pass under way. A flush from inside a pass of the same thread (a value whose
        ``str()`` logs, a signal handler) returns at once: its lines follow in the next."""
        if getattr(self._draining, "on", False):
            return
        try:
            with self._lock:
                self._draining.on = True
                try:
                    self._drain()
                finally:
                    self._draining.on = False
        except Exception:  # a log line must never fail its caller
            pass

    def _drain(self) -> None:
        """Render and write what is queued now (lines logged meanwhile wait for the next
        pass), :data:`CHUNK` lines per write at most. No pause between lines: a ``sleep(0)``
        after each (to hand the GIL back to a publisher sooner) made the publish bench slower
        (bench/README.md). Interrupted (Ctrl-C), it writes what it rendered and puts back what
        it had not."""
        batch = [self._queue.popleft() for _ in range(len(self._queue))]
        chunk: list[str] = []
        current: TextIO | None = None
        done = 0
        try:
            for file, render, event in batch:
                if chunk and (file is not current or len(chunk) >= CHUNK):
                    written, chunk = chunk, []  # taken first: an interrupt never writes it twice
                    _write(current, written)
                current = file
                chunk.append(_rendered(render, event))
                done += 1
        finally:
            self._queue.extendleft(reversed(batch[done:]))
            if chunk:
                _write(current, chunk)

    def _before_fork(self) -> None:
        """Held across the fork, so that the thread is not inside a write the child would
        inherit half done (a stream's own lock held, its buffer half flushed: the child's
        first write would wait for it for ever). So a write that does not end (a pipe nobody
        reads) holds the fork too, as it holds every other writer of that stream."""
        self._lock.acquire()
        self.flush()

    def _after_fork_in_parent(self) -> None:
        self._lock.release()

    def _forked(self) -> None:
        """In a new child: the parent keeps (and writes) what it had queued; no thread yet."""
        self._queue.clear()
        self._lock = threading.RLock()
        self._starting = threading.Lock()
        self._draining = threading.local()
        self._thread = None
        util = sys.modules.get("multiprocessing.util")
        if util is not None:  # a multiprocessing child leaves by os._exit, after its finalizers
            self._finalized = os.getpid()
            util.register_after_fork(self, _flush_at_the_end)  # (which it clears first)


def _flush_at_the_end(lines: Lines) -> None:
    """In a ``multiprocessing`` child: its lines written when it ends (its finalizers)."""
    sys.modules["multiprocessing.util"].Finalize(None, lines.flush, exitpriority=100)


def _rendered(render: Render, event: MutableMapping[str, Any]) -> str:
    ts, logger, name = event.get("ts", ""), event.get("logger", ""), event.get("event", "")
    try:
        text = render(None, "", event)
        return (text if isinstance(text, str) else str(text)) + "\n"
    except Exception as error:  # a value whose str() raises must not lose the other lines
        lost = "".join(c if c.isalnum() or c in "_.-" else "_" for c in str(name)[:64])
        return (f"ts={ts} level=error logger={logger} event=log_render_failed lost_event={lost}"
                f" error={type(error).__name__}\n")  # fmt: skip


def _write(file: TextIO | None, chunk: list[str]) -> None:
    if file is None:
        return
    try:
        file.write("".join(chunk))
        file.flush()
    except Exception:  # closed, a reader gone, a stream not text: lines lost
        pass


LINES = Lines()
"""This process's queue (one per process: a fork starts the child's own)."""

flush = LINES.flush


def flush_after_task(sender: Any = None, **_: Any) -> None:
    """``task_postrun``'s receiver: a task's lines are written before its process can die."""
    LINES.flush()


atexit.register(LINES.flush)
os.register_at_fork(
    before=LINES._before_fork,
    after_in_parent=LINES._after_fork_in_parent,
    after_in_child=LINES._forked,
)


class DeferredLogger:
    """A structlog logger whose lines :data:`LINES` renders and writes: the processor chain
    ends in :meth:`defer`, which hands the stamped event on instead of a rendered string."""

    def __init__(self, file: TextIO, render: Render, interval: float) -> None:
        self._file = file
        self._render = render
        LINES.want(interval)

    def queue(self, event: MutableMapping[str, Any]) -> None:
        """An event already stamped, queued as :meth:`msg` queues it (the decision line's
        shorter way: :class:`gatekeeper.logs.LineWriter`)."""
        LINES.put(self._file, self._render, event)

    def defer(
        self, _: Any, __: str, event: MutableMapping[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The last processor: the event itself is the logger method's one argument."""
        return (event,), {}

    def msg(self, event: MutableMapping[str, Any]) -> None:
        LINES.put(self._file, self._render, event)

    debug = info = warning = warn = error = err = critical = fatal = exception = log = msg
