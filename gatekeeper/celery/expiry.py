"""Free messages past their wait allowance go to reserved instead of running late on free.

SPEC section 2's ceiling: an admission reserves its tokens and a wait allowance
(``free_wait_allowance_s``); an attempt still waiting on free when the allowance runs out gets
an ``expired`` row (charged the allowance's wait, no tokens) and runs on reserved. A message
cannot be picked out of the middle of a RabbitMQ queue, and on Redis prefetched and ETA
messages have left the list, so the dependable place is the worker's main process, before it
hands a free message to the pool: the gated tasks' request class asks :meth:`Expiry.check`
(:func:`gatekeeper.celery.private.use_request_check`). The same check first skips a
duplicate copy of a replayer's handoff (:mod:`gatekeeper.celery.duplicates`).

The message's own headers are a hint (no round trip for a message within its allowance);
``expire.lua`` decides from the gate's record (the nonce, the admission time, never started).
The message is republished to reserved, then acked: a crash between the two may run it twice
(``expire.lua`` answers ``again`` and writes no second row), never loses it. A message the
pool already holds (a prefork child's own queue) runs where it is, its charged wait capped at
the allowance (:meth:`gatekeeper.redis.runs.RunLedger.row_for`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from gatekeeper.celery.duplicates import Duplicates
from gatekeeper.celery.gating import spec_of
from gatekeeper.celery.message import nonce_of
from gatekeeper.celery.private import check_request_shape, use_request_check
from gatekeeper.celery.taken import Taken, copy_message
from gatekeeper.core.headers import (
    H_ATTEMPT,
    H_ATTEMPT_PUBLISHED_AT,
    H_COPY,
    H_DEADLINE_AT,
    H_DECISION,
    H_PUBLISHED_AT,
    H_REASON,
    H_REPLAY_AFTER,
    H_WINDOW,
)
from gatekeeper.core.ledger import Outcome, Path, deadline_slack_ms, make_row
from gatekeeper.defaults import WINDOW_RETENTION_S
from gatekeeper.errors import BadDeclaredInput
from gatekeeper.redis.attempt import delay_of
from gatekeeper.redis.handoff import Handoff
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.scripts import evalsha, load_lua, text_of
from gatekeeper.settings import GatekeeperSettings

__all__ = ["EXPIRED_REASON", "Expiry", "closed_recall", "unless_withdrawn"]

EXPIRED_REASON = "free_wait_expired"


class Expiry:
    """The allowance check of one app's gated tasks, in its workers' main process."""

    def __init__(
        self,
        app: Celery,
        settings: GatekeeperSettings,
        client: redis.Redis,
        log: Any,
        clock: Callable[[], float] = time.time,
        lost: Callable[[Any], None] | None = None,
    ) -> None:
        self.app = app
        self.lost = lost  # a child lost after it stored SUCCESS (private.use_request_check)
        self.settings = settings
        self.keys = Keys(settings.key_prefix, settings.namespace)
        self.log = log
        self.clock = clock
        self.allowance_s = settings.free_wait_allowance_s
        self._script = client.register_script(load_lua("expire.lua"))
        self._client = client
        self.duplicates = Duplicates(client, self.keys, log)

    def on_worker_init(self, sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not self.app:
            return
        check_request_shape()  # a worker on an unsupported Celery fails here, loudly
        for task in list(self.app.tasks.values()):  # type: ignore[union-attr]
            try:
                gated = spec_of(task) is not None
            except BadDeclaredInput:
                gated = True  # routed to reserved at publish; never free, checked anyway
            if gated:
                use_request_check(task, self.check, self.lost)

    def check(self, request: Any) -> str:
        """``run`` (here), ``skip`` (moved to reserved, or a spare copy of one moved before:
        acked, not run) or ``requeue`` (moved, but the republish failed: given back to the
        broker, it is asked again and republished). Never raises: before the record says
        it moved, a fault leaves the message to run where it is."""
        try:
            return self._verdict(request)
        except Exception as exc:  # the message must run somewhere: here, then
            self.log.warning("free_wait_check_failed", job_id=getattr(request, "id", None),
                             error=repr(exc))  # fmt: skip
            return "run"

    def _verdict(self, request: Any) -> str:
        message = request.message
        headers: dict[str, Any] = dict(message.headers or {})
        if self.duplicates.verdict(request, headers) == "skip":
            return "skip"
        if headers.get(H_DECISION) != "admit_free" or not nonce_of(headers):
            return "run"
        decided = headers.get(H_PUBLISHED_AT)
        if isinstance(decided, bool) or not isinstance(decided, (int, float)):
            return "run"
        now = self.clock()
        due = decided + delay_of(headers.get("eta"), decided)
        if now - due < self.allowance_s:
            return "run"  # within its allowance (the record decides the rest)
        job_id, attempt = str(headers.get("id")), headers.get(H_ATTEMPT)
        window = headers.get(H_WINDOW)
        if not (type(attempt) is int and type(window) is int):
            return "run"
        answer = self.expire(job_id, attempt, window, headers, now)
        if answer == "no":
            return "run"
        if answer == "done":  # its copy on reserved ran already: this one is a spare
            self.log.warning("free_wait_spare_copy", job_id=job_id, attempt=attempt,
                             reason=EXPIRED_REASON)  # fmt: skip
            return "skip"
        try:
            self._republish(message, headers)
        except Exception as exc:  # the record says reserved now: never run it here
            self.log.warning("free_wait_republish_failed", job_id=job_id, attempt=attempt,
                             error=repr(exc), requeued=True)  # fmt: skip
            return "requeue"
        self.log.warning(
            "free_wait_expired", task=getattr(request, "name", None), job_id=job_id,
            attempt=attempt, waited_s=round(now - due, 3), allowance_s=self.allowance_s,
            decision="reserved", reason=EXPIRED_REASON, queue=self.settings.reserved_queue,
            again=answer == "again",
        )  # fmt: skip
        return "skip"

    def expire(
        self, job_id: str, attempt: int, window: int, headers: dict[str, Any], now: float,
        withdraw: bool = False,
    ) -> str:  # fmt: skip
        """``expire.lua``'s answer for this free message (its row written when 'expired');
        ``withdraw``: now, within its allowance too, charged the wait so far."""
        return expire_call(self._client, self._script, self.settings, job_id, attempt, window,
                           headers, now, withdraw)  # fmt: skip

    def _republish(self, message: Any, headers: dict[str, Any]) -> None:
        """The same message (body, properties), addressed to reserved, decided so."""
        reserved = self.settings.reserved_queue
        headers.update(
            {
                H_DECISION: "reserved",
                H_REASON: EXPIRED_REASON,
                H_WINDOW: None,
                H_COPY: uuid.uuid4().hex,
            }
        )  # republished twice, one copy runs
        properties = dict(getattr(message, "properties", None) or {})
        declared = self.app.amqp.queues[reserved]  # made here when the worker lacks it
        with self.app.producer_or_acquire() as producer:
            producer.publish(
                message.body, exchange="", routing_key=reserved, headers=headers,
                content_type=message.content_type, content_encoding=message.content_encoding,
                priority=properties.get("priority"), correlation_id=properties.get(
                    "correlation_id"), reply_to=properties.get("reply_to"),
                delivery_mode=properties.get("delivery_mode"), retry=True,
                declare=[declared],
            )  # fmt: skip


def expire_call(
    client: redis.Redis, script: Any, settings: GatekeeperSettings, job_id: str, attempt: int,
    window: int, headers: dict[str, Any], now: float, withdraw: bool = False,
) -> str:  # fmt: skip
    """``expire.lua`` for a free message (:meth:`Expiry.expire`; also a dead-letter requeue's
    withdrawal of a handoff to free it kept before the path closed)."""
    keys = Keys(settings.key_prefix, settings.namespace)
    first = headers.get(H_ATTEMPT_PUBLISHED_AT)
    first = first if isinstance(first, (int, float)) and first <= now else now
    deadline = headers.get(H_DEADLINE_AT)
    slack_ms = deadline_slack_ms(deadline, now) if isinstance(deadline, (int, float)) else 0
    row = make_row(
        job_id=job_id, attempt=attempt, path=Path.FREE, outcome=Outcome.EXPIRED,
        queue_wait_ms=round((now - first) * 1000), tokens_in=0, tokens_out=0,
        deadline_slack_ms=slack_ms,
    ).to_json()  # fmt: skip
    row.pop("retry_tax")
    member = f"{job_id}:{attempt}"
    names = [keys.run(job_id, attempt), keys.inflight, keys.free_waiting, keys.window(window),
             keys.window_rows(window)]  # fmt: skip
    args = [member, nonce_of(headers), str(round(now * 1000)),
            str(round(settings.free_wait_allowance_s * 1000)),
            repr(settings.queue_wait_unit_per_second), str(WINDOW_RETENTION_S),
            json.dumps(row)[:-1], str(window), "1" if withdraw else ""]  # fmt: skip
    return str(text_of(evalsha(client, script, names, args)))


def closed_recall(
    self: Any, taken: Taken, message: dict[str, Any], handoff: Handoff, now: float
) -> str:
    """A kept handoff to free, recalled while the free path is closed or its flags were never
    read (``self``: the :class:`~gatekeeper.celery.replay.Replayer`): never to free now. It
    expires at once, as a worker expires a message past its allowance (its ``expired`` row,
    charged the wait so far, its reservation closed), and goes to reserved; it is not scored
    again (a copy may be in free already). Held instead, its reservation was given back as
    lost (the sweep's purged admissions, the gate's horizon) and its run charged nothing.
    One ``expire.lua`` refuses (a copy of it started: this one is a spare) waits in defer."""
    answer, copy = withdrawn(self.expiry.expire, message, handoff, now)
    headers = copy["headers"]
    job_id, attempt = str(headers.get("id")), headers.get(H_ATTEMPT)
    if answer != "no":  # expired now ('again', 'done': before; a spare copy is skipped)
        headers.update({H_DECISION: "reserved", H_REASON: EXPIRED_REASON, H_WINDOW: None})
        self.log.warning("free_wait_expired", job_id=job_id, attempt=attempt, decision="reserved",
                         reason=EXPIRED_REASON, queue=self.settings.reserved_queue)  # fmt: skip
        return str(self._send(taken, copy, self.settings.reserved_queue, EXPIRED_REASON))
    wait = self.settings.replay_backoff_max_s
    held = copy_message(message)
    held["headers"][H_REPLAY_AFTER] = now + wait
    self.log.warning("replay_recall_held", job_id=job_id, attempt=attempt)
    self.broker.hold(taken, held, wait)
    return "held_free_path_closed"


def withdrawn(
    expire: Callable[..., str], message: dict[str, Any], handoff: Handoff, now: float
) -> tuple[str, dict[str, Any]]:
    """A kept handoff to free, recalled while the path is closed: ``expire.lua``'s withdrawal
    of its admission (``expire``: :meth:`Expiry.expire` or :func:`expire_call` bound), and
    the copy of the message with the handoff applied. 'no': not withdrawn (a copy started)."""
    copy = copy_message(message)
    headers = copy["headers"]
    handoff.apply(headers)
    job_id, attempt, window = str(headers.get("id")), headers.get(H_ATTEMPT), headers.get(H_WINDOW)
    if type(attempt) is int and type(window) is int:
        return expire(job_id, attempt, window, headers, now, withdraw=True), copy
    return "no", copy


def unless_withdrawn(handoff: Handoff, record: Any, settings: GatekeeperSettings) -> Handoff:
    """A kept handoff as it is, but one to free of an admission the replayer withdrew (the
    record's reason ``free_wait_expired``: :func:`closed_recall`) goes to reserved, decided so:
    a free copy of it is skipped (``take.lua``), so to free it would never run."""
    if handoff.queue != settings.free_queue or record.get("reason") != EXPIRED_REASON:
        return handoff
    changes = {**handoff.set, H_DECISION: "reserved", H_REASON: EXPIRED_REASON, H_WINDOW: None}
    return Handoff(settings.reserved_queue, changes, handoff.drop, 0.0)
