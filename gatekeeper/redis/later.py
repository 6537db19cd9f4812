"""Fast publish's replies read later: a publish returns once ``gate.lua``'s call is sent.

With ``publish_replies = "later"`` (the default) a fast publish made outside a worker's task
sends its ``EVALSHA`` on the thread's line (:mod:`gatekeeper.redis.wire`) and returns: the
script decides and pushes the message while the caller builds its next one. Its reply is read
by whichever comes first:

- the thread's next fast publish, just after it has sent its own call (two calls in flight
  on one socket at most: replies come back in order);
- any other use of the thread's line (the channel settles what it owes before it is taken);
- the process's settler thread, once the reply has been owed :data:`SETTLE_AFTER_S`;
- the end of a task (``task_postrun``), a pool child's exit (``worker_process_shutdown``) and
  the process's exit (atexit, before the log lines' last flush).

Reading it settles the publish as the ordinary fast publish would have at once: the decision
line is written then (the decision is the script's), or, when the script failed or no reply
came, ``fallback.lua`` pushes the message Celery built to reserved unless the script pushed it
for this request (the nonce): a message is pushed once whichever ran. When the fallback
cannot reach Redis either, the message is *held*: its line says so (``error``), each settler
pass sends it again, and the process's exit tries for ``2 x redis_timeout_s`` more, logging
``held_publish_lost`` (an error, with the job id) for each one it could not send. That is the
promise this gives up against ``now``: a returned publish has been sent, not answered, and a
process that dies (SIGKILL) while Redis refused its last call loses that call's message.

After an error reply the line goes back to one call at a time for that publish (the later
call's reply is read at once, and the line closed unless it was a ``NOSCRIPT``). A first call
on a new connection, or one idle for :data:`~gatekeeper.redis.wire.IDLE_PROVEN_S`, is asked
as before (``NOSCRIPT`` loads the script; a flow a NAT forgot is found out by the caller).
Publishes from inside a worker's task (retries, canvas, ``Task.replace``) wait as before: the
worker side's own scripts come after their decisions.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis
from redis.exceptions import NoScriptError

import gatekeeper.lines  # noqa: F401  its atexit flush is registered first, so it runs after ours
from gatekeeper.core.dwell import Decision, Reason
from gatekeeper.errors import LedgerUnavailable, PublishFailed
from gatekeeper.redis.attempt import Attempt, label_of
from gatekeeper.redis.push import Push, values_for
from gatekeeper.redis.routing import Routing
from gatekeeper.redis.store import GateStore, ScoredAttempt
from gatekeeper.redis.wire import IDLE_PROVEN_S, Channel

if TYPE_CHECKING:
    from gatekeeper.redis.gate import Pipeline

__all__ = ["OWING", "SETTLE_AFTER_S", "Later", "Owed", "send", "settle_all"]

SETTLE_AFTER_S = 0.005
"""A reply owed this long is read by the settler thread rather than by the next publish."""
PASS_S = 0.005
"""The settler's pass interval while anything is owed or held (none else: it waits)."""

Result = ScoredAttempt | LedgerUnavailable
Settle = Callable[[Result], Any]


class Owed:
    """A gate call sent whose reply is read later, and what settles it."""

    __slots__ = ("args", "keys", "sent_at", "store", "then")

    def __init__(self, store: GateStore, keys: list[str], args: list[str], then: Settle) -> None:
        self.store, self.keys, self.args, self.then = store, keys, args, then
        self.sent_at = time.monotonic()

    def settle(self, reply: Any) -> None:
        """Hand the reply (a table, or the error in its place) on as a decision; never raises."""
        with contextlib.suppress(Exception):  # settled in another publish, or the settler
            self.then(self.store._answer(self.keys, self.args, reply))


class Later:
    """One pipeline's publishes whose gate calls are answered later."""

    def __init__(self, pipeline: Pipeline, exit_wait_s: float) -> None:
        self.pipeline, self.store, self.exit_wait_s = pipeline, pipeline.store, exit_wait_s

    def route(self, attempt: Attempt, push: Push) -> Routing | None:
        """A fast publish sent without waiting (:meth:`Routing.owed`, its decision logged
        when settled); its decision when the call had to be answered now after all (an error
        on the line); None when it must be asked the ordinary way (nothing sent)."""
        pipeline = self.pipeline
        keys, args = self.store.gate_call(pipeline.gate_call(attempt, push))
        sent = send(self.store, keys, args, lambda result: self.settled(attempt, push, result))
        if sent is None:
            return None
        if sent is True:
            return Routing.owed()
        if isinstance(sent, LedgerUnavailable):  # the caller's own: a PublishFailed is theirs
            return pipeline.unscored(attempt, sent, push)
        return pipeline.scored(attempt, sent, published=True)

    def settled(self, attempt: Attempt, push: Push, result: Result) -> Routing | None:
        """A reply read: the decision's routing (its line written); None when its message
        is held (its fallback push could not reach Redis) or was lost to a fault."""
        try:
            if isinstance(result, LedgerUnavailable):
                return self.pipeline.unscored(attempt, result, push)
            return self.pipeline.scored(attempt, result, published=True)
        except PublishFailed:  # its line is written (with the error): held, sent again
            OWING.hold(Held(self, attempt, push))
        except Exception as exc:
            self.pipeline.log.error("held_publish_lost", job_id=attempt.publish.job_id,
                                    error=repr(exc))  # fmt: skip
        return None


class Held:
    """A message whose fast publish failed and whose fallback push could not reach Redis."""

    def __init__(self, later: Later, attempt: Attempt, push: Push) -> None:
        self.later, self.attempt, self.push = later, attempt, push

    def send(self) -> bool:
        """``fallback.lua`` again (it pushes nothing if a push for this nonce landed); False
        while Redis cannot be reached."""
        attempt, store = self.attempt, self.later.store
        publish, reserved = attempt.publish, self.later.pipeline.settings.reserved_queue
        reason = Reason.GATE_UNAVAILABLE
        text = self.push.filled(values_for(Decision.RESERVED.value, reason.value, None, False,
                                           None, reserved))  # fmt: skip
        try:
            store.push_fallback(self.push, publish.job_id, publish.attempt, Decision.RESERVED,
                                reason, text, attempt.record(math.nan), attempt.prev_nonce,
                                label_of(publish))  # fmt: skip
        except LedgerUnavailable:
            return False
        self.later.pipeline.log.warning("held_publish_sent", job_id=publish.job_id)
        return True

    def lost(self) -> None:
        self.later.pipeline.log.error("held_publish_lost", job_id=self.attempt.publish.job_id,
                                      task=self.attempt.publish.task)  # fmt: skip


def send(store: GateStore, keys: list[str], args: list[str], then: Settle) -> Any:
    """Send the gate call on this thread's line without reading its reply: True (owed), or
    the call's decision or :class:`LedgerUnavailable` when it had to be answered now, or None
    when nothing was sent (no line, the breaker open, the line busy, a new or idle
    connection: asked the ordinary way)."""
    if store._direct or (store.breaker is not None and store.breaker.is_open):
        return None
    channel = store._line.take(store.client.connection_pool, keep_owed=True)
    if channel is None:
        return None
    owed, earlier = Owed(store, keys, args, then), None
    exchange = _Exchange()
    try:
        with channel.lock:
            earlier = channel.owed  # cleared once sent: the line is not stale for its reply
            if earlier is None and not _proven(channel, store._gate.sha):
                return None
            try:
                exchange.run(channel, ["EVALSHA", store._gate.sha, str(len(keys)), *keys, *args])
            except BaseException as exc:  # a send refused, an interrupt: the line is unusable
                channel.owed = None
                channel.close()
                lost = exc if isinstance(exc, redis.RedisError) else redis.ConnectionError(
                    f"the gate's line was interrupted: {exc!r}")  # fmt: skip
                exchange.lost(lost)
                if exchange.sent:
                    owed.settle(lost)  # it may have run: fallback.lua finds its push, or pushes
                if exchange.sent or not isinstance(exc, redis.RedisError):
                    raise
                return None  # never sent whole, never run: asked the ordinary way
            if exchange.now is None:
                channel.owed = owed
    finally:
        channel.release()
        if earlier is not None:
            earlier.settle(exchange.reply)
    if exchange.now is not None:
        return store._answer(keys, args, exchange.now)
    OWING.owe(channel)
    return True


class _Exchange:
    """One call sent on a line with a reply owed: that reply read after it, and this call's
    own reply read at once when that one was an error."""

    def __init__(self) -> None:
        self.sent = False
        self.reply: Any = redis.ConnectionError("the gate's line was closed before this reply")
        """The earlier call's reply, or the error standing for it."""
        self.now: Any = None
        """This call's reply when it was read now (else it is owed)."""

    def run(self, channel: Channel, command: list[str]) -> None:
        earlier = channel.owed
        channel.send(command)
        self.sent = True
        channel.owed = None
        if earlier is None:
            return
        self.reply, alive = channel.owed_reply()
        if not alive:  # the connection lost: this call's reply with it
            self.now = self.reply
        elif isinstance(self.reply, Exception):  # one call at a time again: this one's now
            self.now, alive = channel.owed_reply()
            flushed = isinstance(self.reply, NoScriptError) and isinstance(self.now, NoScriptError)
            if alive and not flushed:
                channel.close()  # a replica now, a script's error: a new connection

    def lost(self, error: redis.RedisError) -> None:
        """The line failed mid-exchange: this call's reply, if it was sent, is lost (the
        earlier one's stands for itself unless it was read)."""
        if self.sent and self.now is None:
            self.now = error


def _proven(channel: Channel, sha: str) -> bool:
    """Whether a call sent on this channel now is known to reach a server with the script."""
    fresh = time.monotonic() - channel.answered_at <= IDLE_PROVEN_S
    return fresh and sha in (channel.known or ()) and not channel._went_stale()


class Owing:
    """The process's channels with a reply owed, its held messages, and the settler."""

    def __init__(self) -> None:
        self._channels: dict[Channel, None] = {}
        self._held: deque[Held] = deque()
        self._wake = threading.Event()
        self._starting = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def owe(self, channel: Channel) -> None:
        self._channels[channel] = None
        if not self._wake.is_set():
            self._wake.set()
            thread = self._thread
            if thread is None or not thread.is_alive():
                self._start()

    def hold(self, held: Held) -> None:
        self._held.append(held)
        self._wake.set()

    def _start(self) -> None:
        with self._starting:
            thread = self._thread
            if thread is None or not thread.is_alive():
                thread = threading.Thread(target=self._run, name="gatekeeper-later", daemon=True)
                thread.start()
                self._thread = thread

    def _run(self) -> None:
        while True:
            self._wake.wait()
            time.sleep(PASS_S)
            self.settle(SETTLE_AFTER_S)
            if not self._channels and not self._held:
                self._wake.clear()
                if self._channels or self._held:  # owed meanwhile
                    self._wake.set()

    def settle(self, older_than: float = 0.0) -> None:
        """Read every reply owed at least ``older_than`` seconds; send held messages again."""
        if os.getpid() != self._pid:
            self._forked()
            return
        now = time.monotonic()
        for channel in list(self._channels):
            owed = channel.owed
            if owed is not None and now - owed.sent_at >= older_than:
                channel.settle_owed()
            with channel.lock:
                if channel.owed is None:
                    self._channels.pop(channel, None)
        for _ in range(len(self._held)):
            held = self._held.popleft()
            if not held.send():
                self._held.append(held)

    def finish(self) -> None:
        """At exit: every reply read, held messages sent for a while, then given up."""
        self.settle()
        deadline = time.monotonic() + max((h.later.exit_wait_s for h in self._held), default=0)
        while self._held and time.monotonic() < deadline:
            time.sleep(0.05)
            self.settle()
        while self._held:
            self._held.popleft().lost()

    def _forked(self) -> None:
        """In a new child: the parent reads and sends what it owed and held."""
        self._channels, self._held = {}, deque()
        self._wake, self._starting = threading.Event(), threading.Lock()
        self._thread, self._pid = None, os.getpid()


OWING = Owing()


def settle_all(sender: Any = None, **_: Any) -> None:
    """Every reply owed in this process read now (a task's end, a pool child's exit)."""
    OWING.settle()


atexit.register(OWING.finish)
os.register_at_fork(after_in_child=OWING._forked)
