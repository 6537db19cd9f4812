"""Decisions for a batch of publishes, with the gate script's calls made in one round trip.

The replayer scores a batch of deferred messages at once. Each publish takes
:class:`~gatekeeper.redis.gate.Pipeline`'s own steps (``unscripted``: the flags, the inputs,
the decisions made in process; ``gate_call``: the script's request; ``scored`` or
``unscored``: its routing and its one log line), so a batch decides exactly what as many
:meth:`~gatekeeper.redis.gate.Pipeline.route` calls would; only the scripts of those that
reach step 4 go together (:class:`Scoring`): each is sent as its publish is made, a few at a
time, and each routing made as its answer comes, so Redis runs one script while the next
publish is made or the last answer read. Redis runs them one after the other, in the
batch's order, each atomic as on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import redis

from gatekeeper.errors import GatekeeperError, LedgerUnavailable
from gatekeeper.redis.attempt import Attempt, Publish
from gatekeeper.redis.breaker import not_answering
from gatekeeper.redis.call import GateCall, ScoredAttempt
from gatekeeper.redis.gate import Pipeline, Routing
from gatekeeper.redis.queued import Queued
from gatekeeper.redis.store import NO_ANSWER, RERUN, GateStore

__all__ = ["Scoring", "route_all"]

LOST = "the replayer's lock was lost"


def route_all(
    pipeline: Pipeline, publishes: Sequence[Publish], alive: Callable[[], bool] = lambda: True
) -> list[Routing | Exception]:
    """The routing of each publish, in order, or the exception its decision raised (one bad
    publish does not stop the others). ``alive`` (the replayer's lock) is asked before each
    publish's steps in process and before the last scripts are sent: once it is false
    nothing more is decided or sent, and each publish's answer is that error (a script sent
    before has its answer read, and made nothing of)."""
    routed: list[Routing | Attempt | Exception] = []
    scoring = Scoring(pipeline.store)
    sending = False
    try:
        for publish in publishes:
            if not alive():
                break
            try:
                step = pipeline.unscripted(publish)
                if isinstance(step, Attempt):
                    scoring.add(pipeline.gate_call(step))
                routed.append(step)
            except Exception as exc:
                routed.append(exc)
        sending = len(routed) == len(publishes) and alive()
        if not sending:
            return [GatekeeperError(LOST)] * len(publishes)
        answers = scoring.answers()
        return [_routing(pipeline, step, answers) for step in routed]
    finally:
        scoring.close(sent=sending)


def _routing(
    pipeline: Pipeline,
    step: Routing | Attempt | Exception,
    answers: Iterator[ScoredAttempt | LedgerUnavailable],
) -> Routing | Exception:
    if not isinstance(step, Attempt):
        return step
    answer = next(answers)
    try:
        if isinstance(answer, LedgerUnavailable):
            return pipeline.unscored(step, answer, None)
        return pipeline.scored(step, answer)
    except Exception as exc:
        return exc


class Scoring:
    """``GateStore.score`` for calls added one at a time (:meth:`add`), their scripts
    sent as they come, a few at a time, on the thread's line (:class:`~gatekeeper.redis.wire.
    Queued`), and what each decided read in order (:meth:`answers`), so the server runs one
    while the caller makes the next or reads the last. The gate's client never sends a
    script again (:func:`~gatekeeper.redis.breaker.no_retry`): when one gets no answer (a
    timeout, a dropped connection), it may have run, so each call without an answer is sent
    once more as a rerun (``_reply_now``: gate.lua answers a request it decided with that
    decision), until one of those gets no answer either."""

    def __init__(self, store: GateStore) -> None:
        self._store = store
        self._requests: list[tuple[list[str], list[str]]] = []
        self._closed: LedgerUnavailable | None = None
        self._queued: Queued | None = None
        self._answers: Iterator[Any] | None = None
        try:
            if store.breaker is not None:
                store.breaker.check("gate script")
        except LedgerUnavailable as exc:  # the breaker is open: nothing is sent
            self._closed = exc
        else:  # the thread's line is taken until answers() has read every reply
            self._queued = Queued(None if store._direct else store._line, store.client)

    def add(self, call: GateCall) -> None:
        keys, args = self._store.gate_call(call)
        args[RERUN] = "1"
        self._requests.append((keys, args))
        if self._queued is not None:
            self._queued.add(["EVALSHA", self._store._gate.sha, str(len(keys)), *keys, *args])

    def close(self, sent: bool = True) -> None:
        """Every reply read, so that the thread's line is free and in step again. ``sent``
        false: what was not sent yet never is, and the replies of what was are read and
        made nothing of."""
        if self._answers is None:
            self._answers = self._queued.replies(sent) if self._queued is not None else None
        for _ in self._answers or ():
            pass

    def answers(self) -> Iterator[ScoredAttempt | LedgerUnavailable]:
        """Each call's answer, in order."""
        store, requests = self._store, self._requests
        if self._queued is None:
            yield from [self._closed or LedgerUnavailable("not sent")] * len(requests)
            return
        replies = self._answers = self._queued.replies()
        try:
            first = next(replies, None)  # redis-py's pipeline raises here, before any answer
        except redis.RedisError as exc:  # no answer to trust: one failure for all
            if store.breaker is not None:
                store.breaker.failed(exc)
            yield from [LedgerUnavailable(f"gate script failed: {exc}")] * len(requests)
            return
        lost = None
        for i, (keys, args) in enumerate(requests):
            reply = first if i == 0 else next(replies)
            if isinstance(reply, NO_ANSWER):
                reply = lost or store._reply_now(keys, args)
                # Asked again and not answered either (a replica's READONLY among them):
                # the rest that got no answer are not asked again, one reconnect each.
                lost = reply if not_answering(reply) else None
            yield store._answer(keys, args, reply)
