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

import math
import threading
import time
from typing import TYPE_CHECKING, Any

import redis
from redis.exceptions import NoScriptError

from gatekeeper.core.dwell import Decision, Reason
from gatekeeper.errors import LedgerUnavailable, PublishFailed
from gatekeeper.redis import wire
from gatekeeper.redis.attempt import Attempt
from gatekeeper.redis.owing import OWING
from gatekeeper.redis.push import Push
from gatekeeper.redis.routing import Routing
from gatekeeper.redis.store import GateStore, ScoredAttempt
from gatekeeper.redis.wire import Channel

if TYPE_CHECKING:
    from gatekeeper.redis.gate import Pipeline

__all__ = ["Held", "Later", "Owed", "send"]

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

    def unanswerable(self) -> bool:
        """Its store's breaker is open: a reply is not waited for."""
        breaker = self.later.store.breaker
        return breaker is not None and breaker.is_open

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

    def send(self, force: bool = False) -> bool:
        """``fallback.lua`` again (it pushes nothing if a push for this nonce landed), and a
        ``held_publish_sent`` line naming where the message is; False while Redis cannot be
        reached (``force``: asked even while the breaker is open)."""
        attempt, pipeline, reason = self.attempt, self.later.pipeline, Reason.GATE_UNAVAILABLE
        publish = attempt.publish
        try:
            earlier = pipeline.push_reserved(self.push, publish, reason, attempt.record(math.nan),
                                             attempt.prev_nonce, force)  # fmt: skip
        except LedgerUnavailable:
            return False
        decision, why = earlier if earlier is not None else (Decision.RESERVED, reason)
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
        with channel.lock:  # the settler may be reading the reply owed; an exit waits
            channel.holder = threading.get_ident()
            try:
                earlier = channel.owed  # cleared once sent: the line is not stale for its reply
                if earlier is None and not _proven(channel, store._gate.sha):
                    return None
                _exchange(channel, owed, exchange, command)
            finally:
                try:
                    if earlier is not None:  # settled under the lock: an exit waits for it
                        earlier.settle(exchange.reply)
                except BaseException:  # an interrupt: this call's reply, read, settled later
                    if exchange.now is not None:
                        owed.hold()
                    raise
                finally:
                    channel.holder = 0
    finally:
        channel.release()
    if exchange.now is not None:
        return store._answer(owed.keys, owed.args, exchange.now)
    return True


def _exchange(channel: Channel, owed: Owed, exchange: _Exchange, command: list[str]) -> None:
    """Under the channel's lock: the call sent, the reply owed before it read."""
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
    fresh = time.monotonic() - channel.answered_at <= wire.IDLE_PROVEN_S
    return fresh and sha in (channel.known or ()) and not channel._went_stale()
