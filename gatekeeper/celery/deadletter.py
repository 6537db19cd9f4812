"""A task whose deadline passed in defer is abandoned (:func:`abandon`: its row, the dead
letter, the alert lines), and ends in the result backend, so that callers, ``link_error`` and
chords see it end instead of waiting forever. A message that fails to replay is set aside
(:func:`set_aside`): back to defer with a backoff, or to the dead letters after
``MAX_REPLAY_ERRORS`` failures in a row. One whose handoff was not kept waits in defer
(:func:`unkept`).

When the replayer abandons a task (its deadline passed in defer) and it knows the Celery app
(``gatekeeper -A proj replay``, ``celery -A proj gatekeeper replay``), it stores a failure for
it: :class:`~gatekeeper.errors.DeadlineAbandoned`, naming the deadline, through the app's
backend with the request the message carries (its group and chord, its errbacks), as a
worker would for a task that raised. ``AsyncResult.get()`` then raises it, a chord's error
callback runs, and ``link_error`` callbacks are called, once: a task abandoned again (its
message given back after a pass stored its failure) finds it stored and leaves it.
"""

from __future__ import annotations

import base64
import contextlib
import json
from datetime import datetime, timezone
from typing import Any

import redis
from celery import states
from celery.app.task import Context
from celery.backends.base import DisabledBackend
from celery.backends.rpc import RPCBackend

from gatekeeper.celery.freeze import maybe_freeze
from gatekeeper.celery.message import nonce_of
from gatekeeper.celery.taken import Taken, copy_message
from gatekeeper.core.headers import (
    H_ATTEMPT,
    H_DEADLINE_AT,
    H_DECISION,
    H_DWELL_S,
    H_REASON,
    H_REPLAY_AFTER,
)
from gatekeeper.core.ledger import Outcome, Path, deadline_slack_ms, make_row
from gatekeeper.errors import DeadlineAbandoned, GateUnreachable, LedgerUnavailable
from gatekeeper.redis.breaker import not_answering
from gatekeeper.redis.handoff import as_scored, scored_unsent
from gatekeeper.redis.runs import Finished
from gatekeeper.redis.store import NO_ANSWER

__all__ = ["H_REPLAY_ERRORS", "MAX_REPLAY_ERRORS", "abandon", "fail_in_backend", "set_aside",
           "unanswered"]  # fmt: skip

MAX_REPLAY_ERRORS = 5
"""A message that fails this many replays in a row goes to the dead letters, with an alert
(its count, in ``H_REPLAY_ERRORS``, is dropped once a replay scores it and hands it on)."""
H_REPLAY_ERRORS = "gatekeeper_replay_errors"
UNANSWERED = (GateUnreachable, *NO_ANSWER)
"""What stops a pass instead of striking its message: Redis gave no answer (a failover, a
restart, a blip); the batch waits for the next pass."""


def fail_in_backend(app: Any, message: dict[str, Any], deadline_at: float) -> str:
    """Store the abandoned task's failure; returns what was done (``failed``, or why not)."""
    headers = message.get("headers") or {}
    if app is None:
        return "no_app"
    if isinstance(app.backend, DisabledBackend):
        return "no_backend"
    try:
        args, kwargs, embed = _body(message)
    except (ValueError, TypeError, KeyError):
        return "body_unreadable"  # not JSON (a pickle or a compressed body): nothing stored
    when = datetime.fromtimestamp(deadline_at, tz=timezone.utc).isoformat(timespec="seconds")
    error = DeadlineAbandoned(
        f"task {headers.get('id')} abandoned: its deadline {when} passed before it could run"
    )
    if _failed_before(app.backend, headers.get("id"), error):
        return "failed_before"  # stored again, its errbacks and chord would be called twice
    delivery = message.get("properties", {}).get("delivery_info")
    request = Context({**headers, **(embed or {}), "args": args, "kwargs": kwargs,
                       "delivery_info": delivery})  # fmt: skip
    app.backend.mark_as_failure(headers.get("id"), error, request=request)
    return "failed"


def _failed_before(backend: Any, task_id: Any, error: DeadlineAbandoned) -> bool:
    """Whether this very failure is stored already (the task id, the deadline): a pass
    abandoned the task and then gave the message back (its move refused) or died before the
    move, and this pass abandons it again. Any other result under the id (a caller's own id
    reused, an earlier run's failure) is overwritten, as a worker would. An RPC backend cannot
    be read without consuming its replies (not asked); a backend that cannot be read is
    written (a failure stored twice, rather than never)."""
    if isinstance(backend, RPCBackend):
        return False
    try:
        meta = backend.get_task_meta(task_id, cache=False)
    except Exception:
        return False
    stored = meta.get("result")
    return (meta.get("status") == states.FAILURE and type(stored).__name__ == "DeadlineAbandoned"
            and str(stored) == str(error))  # fmt: skip


def _body(message: dict[str, Any]) -> tuple[Any, Any, Any]:
    if message.get("content-type") != "application/json":
        raise ValueError("not JSON")
    raw = message["body"]
    if message.get("properties", {}).get("body_encoding") == "base64":
        raw = base64.b64decode(raw)
    args, kwargs, embed = json.loads(raw)
    return args, kwargs, embed


def abandon(
    self: Any, taken: Any, message: dict[str, Any], now: float, record: dict[str, str]
) -> str:
    """The replayer's abandonment of a task whose deadline passed in defer: its row, the move
    to the dead letter, its failure in the result backend, the alert lines, the freeze check
    (``self`` is the :class:`~gatekeeper.celery.replay.Replayer`)."""
    headers = message["headers"]
    job_id, attempt = str(headers.get("id")), int(headers.get(H_ATTEMPT) or 1)
    slack_ms = deadline_slack_ms(headers[H_DEADLINE_AT], now)
    row = make_row(
        job_id=job_id, attempt=attempt, path=Path.FREE, outcome=Outcome.ABANDONED,
        queue_wait_ms=0, tokens_in=0, tokens_out=0, deadline_slack_ms=slack_ms,
    )  # fmt: skip
    # Whether a free admission is abandoned (a slack miss) is the gate's record's word,
    # and only for the message that carries its nonce; another gets an unverified row.
    trusted = bool(record) and record.get("nonce") == nonce_of(headers)
    was_free = trusted and record.get("free_admitted") == "1"
    if trusted:
        done = self.runs.abandon(row, round(now * 1000), was_free, record["nonce"])
    elif self.runs.abandoned_before(job_id, attempt, nonce_of(headers)):
        done = Finished(False, 0, 0)  # a copy of an earlier life's abandoned message: rowed
    else:
        # Run 0: the attempt's abandonment, rowed once (a message given back and abandoned
        # again by a later pass is rowed as the first time).
        self.unverified.write(row, 0, round(now * 1000))
        done = Finished(False, 0, 0)
    headers.update({H_DECISION: "abandoned", H_REASON: "deadline_passed"})
    self._send(taken, message, self.settings.dead_letter_queue, "deadline_passed")
    fields = {
        "task": headers.get("task"), "job_id": job_id, "attempt": attempt,
        "deadline_slack_s": slack_ms / 1000, "retries": headers.get("retries"),
        "queue": self.settings.dead_letter_queue,
    }  # fmt: skip
    # Only the gate's own message may end a task in the backend: a forged copy naming
    # another job's id must not mark that job failed.
    stored = "unverified"
    if trusted:
        try:  # a backend that is down must not hide the alerts below, nor the freeze check
            stored = fail_in_backend(self.app, message, float(headers[H_DEADLINE_AT]))
        except Exception as exc:
            stored = f"not_stored: {exc!r}"
    self.alerts.error("task_abandoned", reason="deadline_passed", result=stored, **fields)
    if was_free and (done.slack_miss or not done.written):  # (not a second of its admission)
        self.alerts.error(
            "slack_miss", decision="admit_free", slack_miss=True,
            dwell_s=headers.get(H_DWELL_S), abandoned=True, **fields,
        )  # fmt: skip
        if done.written:  # in the window that counted the miss: its admission's (owner.py)
            maybe_freeze(
                self.pipeline.flags, self.alerts, done.window, done.slack_misses,
                done.admitted_free, now,
            )  # fmt: skip
    return "dead_lettered"


def unanswered(exc: BaseException | None) -> bool:
    """Whether Redis gave no answer, raised as it is or wrapped (LedgerUnavailable's cause):
    also a reply that says it is not the primary (``READONLY`` after a failover, ``LOADING``:
    the breaker's :func:`~gatekeeper.redis.breaker.not_answering`)."""
    while exc is not None:
        if isinstance(exc, UNANSWERED) or not_answering(exc):
            return True
        exc = exc.__cause__
    return False


def set_aside(self: Any, taken: Taken, exc: Exception) -> str:
    """A message that failed to replay (``self``: the :class:`~gatekeeper.celery.replay.Replayer`):
    back to defer with a backoff, or, after ``MAX_REPLAY_ERRORS`` failures, to the dead letters
    with an alert. Never lost.

    Raises :class:`~gatekeeper.errors.GateUnreachable` (or redis-py's connection error or
    timeout, from a write of its handling) again: Redis gave no answer, which is no fault of
    the message. The pass stops there, its batch given back as it was (no strike, no
    backoff), and the next pass tries again: a failover or a restart of a few seconds must
    not strike, hold past its deadline or dead-letter the whole queue."""
    if unanswered(exc) and not taken.done:
        raise exc
    self.log.warning("replay_failed", queue=self.defer, error=repr(exc))
    if taken.done:  # handed on already (a fault after): nothing more to move
        return "replay_error_after_handoff"
    if not self.broker.holds(taken):  # its connection is gone: the broker gives it back
        return "given_back"
    message = taken.message
    if message is None:  # not even readable: kept as it is, where a person can see it
        self.broker.send(taken, self.settings.dead_letter_queue, None)
        return "dead_lettered_unreadable"
    headers = message["headers"]
    try:
        errors = int(headers.get(H_REPLAY_ERRORS) or 0) + 1
    except (TypeError, ValueError):
        errors = MAX_REPLAY_ERRORS
    headers[H_REPLAY_ERRORS] = errors
    wait = self.settings.replay_backoff_max_s
    headers[H_REPLAY_AFTER] = self.clock() + wait
    if errors >= MAX_REPLAY_ERRORS:
        try:
            self.broker.send(taken, self.settings.dead_letter_queue, message)
        except Exception as refused:  # refused (a length cap, a nack): held with a backoff,
            if not self.broker.holds(taken):  # not left at defer's head to stop every pass
                raise
            self.alerts.error("replay_dead_letter_refused", job_id=headers.get("id"),
                              error=repr(refused),
                              queue=self.settings.dead_letter_queue)  # fmt: skip
            self.broker.hold(taken, message, wait)
            return "dead_letter_refused"
        self.alerts.error("replay_gave_up", job_id=headers.get("id"), errors=errors,
                          error=repr(exc), queue=self.settings.dead_letter_queue)  # fmt: skip
        return "dead_lettered_after_errors"
    self.broker.hold(taken, message, wait)
    return "replay_error"


def unkept(self: Any, taken: Taken, message: dict[str, Any], attempt: int, exc: Exception,
           now: float) -> str:  # fmt: skip
    """A decision whose handoff was not kept (``self``: the replayer): its message is not handed
    on (a twin of a copy handed on with no handoff kept could not be told from a message scored
    and never handed on, and would give back that copy's admission), but waits in defer a
    backoff long. The decision is undone at once when it can be (``as_scored``: its admission
    given back, the record the message's again), else when the message comes back; either
    way it is scored again then. No strike: the fault is the gate's Redis, not the message's.
    When no answer came (the write may be kept), the error is raised again, as
    :func:`set_aside` does: the pass stops, its batch claimed, and a message back is handed on
    as decided when its handoff was kept."""
    if unanswered(exc):
        raise exc
    wait = self.settings.replay_backoff_s
    job_id = str(message["headers"].get("id"))
    self.log.warning("replay_handoff_unrecorded", job_id=job_id, attempt=attempt,
                     error=repr(exc), queue=self.defer, wait_s=wait)  # fmt: skip
    message = copy_message(message)
    with contextlib.suppress(LedgerUnavailable, redis.RedisError):  # best effort (above)
        record = self.runs.fields(job_id, attempt)
        if scored_unsent(record, message["headers"]):  # held as it is, whatever is undone
            as_scored(self.pipeline.store, job_id, attempt, record, dict(message["headers"]))
    message["headers"][H_REPLAY_AFTER] = now + wait
    self.broker.hold(taken, message, wait)
    return "handoff_unrecorded"
