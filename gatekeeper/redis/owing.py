"""The process's replies owed and messages held (:mod:`gatekeeper.redis.later`), and the
settler thread that reads the one and sends the other again.

The settler waits while nothing is owed or held; otherwise it passes every :data:`PASS_S`,
reads each reply owed for :data:`SETTLE_AFTER_S` (none waited for while the store's breaker is
open: settled as lost, its message held until Redis answers) and sends the held messages
again. :func:`settle_all` reads every reply owed now (a task's end, a test); :meth:`Owing.finish`
runs at exit and when a pool child shuts down (it leaves by ``os._exit``): every reply read,
held messages sent for ``2 x redis_timeout_s`` more, then given up with ``held_publish_lost``.
A fork leaves the parent's to the parent.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import gatekeeper.lines  # its atexit flush is registered first, so it runs after ours
from gatekeeper.forks import in_a_multiprocessing_child
from gatekeeper.redis.wire import Channel

if TYPE_CHECKING:
    from gatekeeper.redis.later import Held

__all__ = ["OWING", "PASS_S", "SETTLE_AFTER_S", "Owing", "finish", "settle_all"]

SETTLE_AFTER_S = 0.005
"""A reply owed this long is read by the settler thread rather than by the next publish."""
PASS_S = 0.005
"""The settler's pass interval while anything is owed or held (none else: it waits)."""


class Owing:
    """The process's channels with a reply owed, its held messages, and the settler."""

    def __init__(self) -> None:
        self._channels: dict[Channel, None] = {}
        self._held: list[Held] = []
        self._guard, self._sending = threading.Lock(), threading.Lock()  # _sending: held ones
        self._wake, self._pid = threading.Event(), os.getpid()
        self._thread: threading.Thread | None = None
        self._exit_wait_s, self._finalized = 0.0, 0

    def owe(self, channel: Channel) -> None:  # under the channel's lock
        self._channels[channel] = None
        self._awake()

    def hold(self, held: Held) -> None:
        with self._guard:
            self._held.append(held)
            self._exit_wait_s = max(self._exit_wait_s, held.later.exit_wait_s)
        self._awake()

    def _awake(self) -> None:
        if not self._wake.is_set():
            self._wake.set()
        thread = self._thread
        if thread is None or not thread.is_alive():
            with self._guard:
                thread = self._thread
                if thread is None or not thread.is_alive():
                    thread = threading.Thread(target=self._run, name="gatekeeper-later",
                                              daemon=True)  # fmt: skip
                    thread.start()
                    self._thread = thread
                    _finish_in_a_child(self)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            time.sleep(PASS_S)
            with contextlib.suppress(Exception):  # never dies: the next pass tries again
                self.settle(SETTLE_AFTER_S)
            if not self._channels and not self._held:
                self._wake.clear()
                if self._channels or self._held:  # owed or held meanwhile
                    self._wake.set()

    def settle(self, older_than: float = 0.0, held: bool = True, force: bool = False) -> None:
        """Read every reply owed at least ``older_than`` seconds; ``held``: send the held
        messages again (``force``: even through an open breaker)."""
        if os.getpid() != self._pid:
            self._forked()
            return
        now = time.monotonic()
        for channel in list(self._channels):
            owed = channel.owed
            if owed is not None and now - owed.sent_at >= older_than:
                channel.settle_owed(abandon=True)  # none awaited while its breaker is open
            elif owed is not None:
                continue  # young: not even the lock taken (a publisher waits for it)
            with channel.lock:  # its thread sets owed and registers it under this lock
                if channel.owed is None:
                    self._channels.pop(channel, None)
        if held and self._held:
            with self._sending:
                self._send_held(force)

    def _send_held(self, force: bool) -> None:
        """One try each, in order, until one finds Redis unreachable: the rest wait for the
        next pass (each try may cost two timeouts)."""
        with self._guard:
            batch, self._held = self._held, []
        kept, done = [], 0
        try:
            for message in batch:
                done += 1
                if not message.send(force):
                    kept.append(message)
                    break
        finally:
            with self._guard:
                self._held[:0] = kept + batch[done:]

    def finish(self) -> None:
        """At exit (a pool child's too): every reply read, held messages sent for a while,
        then given up with a ``held_publish_lost`` line each; the lines written."""
        self.settle(held=False)
        deadline = time.monotonic() + self._exit_wait_s
        while (self._held or self._sending.locked()) and time.monotonic() < deadline:
            self.settle(force=True)
            time.sleep(0.05 if self._held else 0)
        with self._sending, self._guard:
            lost, self._held = self._held, []
        for message in lost:
            message.lost()
        gatekeeper.lines.flush()  # (a multiprocessing child may have no other flush)

    def _forked(self) -> None:
        """In a new child: the parent reads and sends what it owed and held."""
        self._channels, self._held = {}, []
        self._guard, self._sending = threading.Lock(), threading.Lock()
        self._wake, self._thread, self._pid = threading.Event(), None, os.getpid()
        util = sys.modules.get("multiprocessing.util")
        if util is not None:  # a multiprocessing child leaves by os._exit, after its finalizers
            util.register_after_fork(self, _finish_at_the_end)


OWING = Owing()


def _finish_in_a_child(owing: Owing) -> None:
    """In a process that ``multiprocessing`` started (it leaves by ``os._exit``, after its
    finalizers), whatever imported gatekeeper: the exit pass as a finalizer, once."""
    if in_a_multiprocessing_child() and owing._finalized != os.getpid():
        owing._finalized = os.getpid()
        _finish_at_the_end(owing)


def _finish_at_the_end(owing: Owing) -> None:
    """In a ``multiprocessing`` child: its replies read when it ends (its finalizers)."""
    sys.modules["multiprocessing.util"].Finalize(None, owing.finish, exitpriority=110)


def settle_all(sender: Any = None, **_: Any) -> None:
    """Every reply owed in this process read now (a task's end, a test)."""
    OWING.settle(held=False)


def finish(sender: Any = None, **_: Any) -> None:  # worker_process_shutdown: os._exit next
    OWING.finish()


atexit.register(OWING.finish)
os.register_at_fork(after_in_child=OWING._forked)
