"""Fast publish's replies read later: a publish returns once ``gate.lua``'s call is sent.

With ``publish_replies = "later"`` (the default) a fast publish made outside a worker's task
sends its ``EVALSHA`` on the thread's line (:mod:`gatekeeper.redis.wire`) and returns: the
script decides and pushes the message while the caller builds its next one. Its reply is read
by whichever comes first: the thread's next fast publish, just after it has sent its own call
(two calls in flight on a socket at most); any other use of the thread's line or of the
store's other scripts (``record.lua``, ``release.lua``: this thread's calls run in order);
the process's settler thread, once the reply has been owed :data:`SETTLE_AFTER_S`; a task's
end (``task_postrun``), a pool child's exit (``worker_process_shutdown``), the process's exit
(atexit, before the log lines' last flush). A reader takes the channel's lock.

Reading it settles the publish as the ordinary fast publish would have at once: the decision
line is written then (the decision is the script's), or, when the script failed or no reply
came, ``fallback.lua`` pushes the message Celery built to reserved unless the script pushed it
for this request (the nonce): a message is pushed once whichever ran. When the fallback
cannot reach Redis either, or an interrupt (Ctrl-C, ``SystemExit``) cuts the settling short,
the message is *held*: each settler pass sends it again (``held_publish_sent``), and the
process's exit tries for ``2 x redis_timeout_s`` more, then logs ``held_publish_lost`` (an
error, with the job id). That is the promise this gives up against ``now``: a returned
publish has been sent, not answered, and a process killed by a signal it does not handle
while its last call is unanswered loses that call's message if Redis refused it.

After an error reply the line goes back to one call at a time for that publish (the later
call's reply is read at once, and the line closed unless it was a ``NOSCRIPT``). A first call
on a new connection, or one idle for :data:`~gatekeeper.redis.wire.IDLE_PROVEN_S`, is asked
as before. Publishes from inside a worker's task (retries, canvas, ``Task.replace``) wait as
before: the worker side's own scripts come after their decisions.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import threading
import time
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

__all__ = ["OWING", "SETTLE_AFTER_S", "Later", "Owed", "finish", "send", "settle_all"]

SETTLE_AFTER_S = 0.005
"""A reply owed this long is read by the settler thread rather than by the next publish."""
PASS_S = 0.005
"""The settler's pass interval while anything is owed or held (none else: it waits)."""

Result = ScoredAttempt | LedgerUnavailable


class Owed:
    """A gate call sent whose reply is read later, and the publish it settles."""

    __slots__ = ("args", "attempt", "keys", "later", "logged", "push", "sent_at")

    def __init__(
        self, later: Later, attempt: Attempt, push: Push, keys: list[str], args: list[str]
    ) -> None:
        self.later, self.attempt, self.push, self.keys, self.args = later, attempt, push, keys, args
        self.sent_at = time.monotonic()
        self.logged = False
        """Its decision line written (settled, or its fallback refused)."""

    def settle(self, reply: Any) -> None:
        """Hand the reply (a table, or the error in its place) on as a decision. Raises only
        an interrupt (Ctrl-C, ``SystemExit``), the message held first."""
        try:
            self.later.settled(self.attempt, self.push,
                               self.later.store._answer(self.keys, self.args, reply))  # fmt: skip
            self.logged = True
        except Exception:  # (settled logs its own faults) in another publish, or the settler
            pass
        except BaseException:
            self.hold()
            raise

    def hold(self) -> None:
        """Keep the message to be sent again (``fallback.lua``): no I/O here."""
        OWING.hold(Held(self.later, self.attempt, self.push, self.logged))


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
        sent = send(self.store, Owed(self, attempt, push, keys, args))
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
            OWING.hold(Held(self, attempt, push, logged=True))
        except Exception as exc:
            self.pipeline.log.error("held_publish_lost", job_id=attempt.publish.job_id,
                                    error=repr(exc))  # fmt: skip
        return None


class Held:
    """A message whose fast publish failed and whose fallback push could not reach Redis."""

    def __init__(self, later: Later, attempt: Attempt, push: Push, logged: bool) -> None:
        self.later, self.attempt, self.push, self.logged = later, attempt, push, logged

    def send(self) -> bool:
        """``fallback.lua`` again (it pushes nothing if a push for this nonce landed), and a
        ``held_publish_sent`` line naming where the message is; False while Redis cannot be
        reached."""
        attempt, store = self.attempt, self.later.store
        publish, reserved = attempt.publish, self.later.pipeline.settings.reserved_queue
        reason = Reason.GATE_UNAVAILABLE
        text = self.push.filled(values_for(Decision.RESERVED.value, reason.value, None, False,
                                           None, reserved))  # fmt: skip
        try:
            earlier = store.push_fallback(self.push, publish.job_id, publish.attempt,
                                          Decision.RESERVED, reason, text,
                                          attempt.record(math.nan), attempt.prev_nonce,
                                          label_of(publish))  # fmt: skip
        except LedgerUnavailable:
            return False
        decision, why = earlier if earlier is not None else (Decision.RESERVED, reason)
        pipeline = self.later.pipeline
        if not self.logged:  # interrupted before its line: the line of where it is, now
            pipeline._finish(decision, why, {}, attempt.fields, published=True, recovered=True,
                             error="interrupted; its message sent again")  # fmt: skip
        pipeline.log.warning("held_publish_sent", job_id=publish.job_id,
                             decision=decision.value, reason=why.value)  # fmt: skip
        return True

    def lost(self) -> None:
        self.later.pipeline.log.error("held_publish_lost", job_id=self.attempt.publish.job_id,
                                      task=self.attempt.publish.task)  # fmt: skip


def send(store: GateStore, owed: Owed) -> Any:
    """Send the gate call on this thread's line without reading its reply: True (owed), or
    the call's decision or :class:`LedgerUnavailable` when it had to be answered now, or None
    when nothing was sent (no line, the breaker open, the line busy, a new or idle
    connection: asked the ordinary way). The reply owed on the line before it is read after
    it is sent, and settled."""
    if store._direct or (store.breaker is not None and store.breaker.is_open):
        return None
    channel = store._line.take(store.client.connection_pool, keep_owed=True)
    if channel is None:
        return None
    earlier, exchange = None, _Exchange()
    command = ["EVALSHA", store._gate.sha, str(len(owed.keys)), *owed.keys, *owed.args]
    try:
        with channel.lock:  # the settler may be reading the reply owed
            earlier = channel.owed  # cleared once sent: the line is not stale for its reply
            if earlier is None and not _proven(channel, store._gate.sha):
                return None
            try:
                exchange.run(channel, command)
            except Exception as exc:  # a send refused, a reply unreadable: the line unusable
                channel.owed = None
                channel.close()
                exchange.lost(exc)  # this call may have run: fallback.lua finds its push
            except BaseException:  # an interrupt: this call may have run; held, sent again
                channel.owed = None
                channel.close()
                owed.hold()
                raise
            if exchange.now is None:
                channel.owed = owed
                OWING.owe(channel)
    finally:
        channel.release()
        try:
            if earlier is not None:
                earlier.settle(exchange.reply)
        except BaseException:  # an interrupt: this call's reply, read already, is settled later
            if exchange.now is not None:
                owed.hold()
            raise
    if exchange.now is not None:
        return store._answer(owed.keys, owed.args, exchange.now)
    return True


class _Exchange:
    """One call sent on a line with a reply owed: that reply read after it, and this call's
    own reply read at once when that one was an error."""

    def __init__(self) -> None:
        self.reply: Any = redis.ConnectionError("the gate's line failed before this reply")
        """The earlier call's reply, or the error standing for it."""
        self.now: Any = None
        """This call's reply when it was read now (else it is owed)."""

    def run(self, channel: Channel, command: list[str]) -> None:
        earlier = channel.owed
        channel.send(command)
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

    def lost(self, exc: Exception) -> None:
        """The line failed mid-exchange: this call's reply is lost (the earlier one's too)."""
        failed = redis.ConnectionError(f"the gate's line failed: {exc!r}")
        self.now = self.now if self.now is not None else failed


def _proven(channel: Channel, sha: str) -> bool:
    """Whether a call sent on this channel now is known to reach a server with the script."""
    fresh = time.monotonic() - channel.answered_at <= IDLE_PROVEN_S
    return fresh and sha in (channel.known or ()) and not channel._went_stale()


class Owing:
    """The process's channels with a reply owed, its held messages, and the settler."""

    def __init__(self) -> None:
        self._channels: dict[Channel, None] = {}
        self._held: list[Held] = []
        self._guard, self._sending = threading.Lock(), threading.Lock()  # _sending: held ones
        self._wake, self._pid = threading.Event(), os.getpid()
        self._thread: threading.Thread | None = None

    def owe(self, channel: Channel) -> None:  # under the channel's lock
        self._channels[channel] = None
        self._awake()

    def hold(self, held: Held) -> None:
        with self._guard:
            self._held.append(held)
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

    def settle(self, older_than: float = 0.0, held: bool = True) -> None:
        """Read every reply owed at least ``older_than`` seconds; ``held``: send the held
        messages again."""
        if os.getpid() != self._pid:
            self._forked()
            return
        now = time.monotonic()
        for channel in list(self._channels):
            owed = channel.owed
            if owed is not None and now - owed.sent_at >= older_than:
                channel.settle_owed()
            with channel.lock:  # its thread sets owed and registers it under this lock
                if channel.owed is None:
                    self._channels.pop(channel, None)
        if held and self._held:
            with self._sending:
                self._send_held()

    def _send_held(self) -> None:
        with self._guard:
            batch, self._held = self._held, []
        kept, done = [], 0
        try:
            for message in batch:
                if not message.send():
                    kept.append(message)
                done += 1
        finally:
            with self._guard:
                self._held[:0] = kept + batch[done:]

    def finish(self) -> None:
        """At exit (a pool child's too): every reply read, held messages sent for a while,
        then given up with a ``held_publish_lost`` line each."""
        self.settle()
        wait = max((message.later.exit_wait_s for message in self._held), default=0.0)
        deadline = time.monotonic() + wait
        while self._held and time.monotonic() < deadline:
            time.sleep(0.05)
            self.settle()
        with self._sending, self._guard:
            lost, self._held = self._held, []
        for message in lost:
            message.lost()

    def _forked(self) -> None:
        """In a new child: the parent reads and sends what it owed and held."""
        self._channels, self._held = {}, []
        self._guard, self._sending = threading.Lock(), threading.Lock()
        self._wake, self._thread, self._pid = threading.Event(), None, os.getpid()


OWING = Owing()


def settle_all(sender: Any = None, **_: Any) -> None:
    """Every reply owed in this process read now (a task's end, a test)."""
    OWING.settle(held=False)


def finish(sender: Any = None, **_: Any) -> None:  # worker_process_shutdown: os._exit next
    OWING.finish()


atexit.register(OWING.finish)
os.register_at_fork(after_in_child=OWING._forked)
