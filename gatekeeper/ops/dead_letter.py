"""``gatekeeper dead-letter list`` and ``... requeue``: see and re-drive abandoned tasks.

A task whose deadline passed in defer waits in the dead-letter queue, on the broker (Redis or
RabbitMQ: :mod:`gatekeeper.celery.broker`). ``requeue`` gives it a new deadline, given
explicitly (an operator's decision: it is the one place a deadline is ever moved, and a
``deadline_moved`` line says so, whatever the gate decided), scores it again through the same
pipeline as a publish, keeps how it hands it on (beside the record:
:mod:`gatekeeper.redis.handoff`), then hands it to the queue decided: on Redis in one atomic
step (``move.lua``), on RabbitMQ acked only once its new copy is confirmed. A requeue cut short
between the keep and the move (or whose keep got no answer, and was kept) leaves the task
listed; a second requeue of it hands it on exactly as the first did (its deadline too), and a
worker runs one of the copies; but not to free once the path is closed: its admission is then
withdrawn, and it goes to reserved (:func:`_withdrawn`). A keep refused fails the command,
saying so, and undoes the decision: the task is listed as it was. Cut short before the keep,
the task is listed with that decision in the record and no copy: the next requeue undoes it and
scores the task again (a second publish of a live attempt would be a ``duplicate_publish``).
Requeues take turns (``dead_letter:lock``); a keep is made only while the record still holds
the requeue's decision (``keep.lua``: the replayer, handing on a twin of the task, may have
undone it).
"""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from functools import partial
from typing import Any

import click
import redis
from redis.exceptions import LockError

from gatekeeper.celery.broker import BROKER_ERRORS, Taken
from gatekeeper.celery.deadletter import unanswered
from gatekeeper.celery.expiry import EXPIRED_REASON, expire_call, unless_withdrawn, withdrawn
from gatekeeper.celery.message import nonce_of
from gatekeeper.core.headers import (
    H_ATTEMPT,
    H_COPY,
    H_DEADLINE_AT,
    H_DECISION,
    H_NONCE,
)
from gatekeeper.errors import GateUnreachable, LedgerUnavailable
from gatekeeper.logs import make_logger
from gatekeeper.ops.context import settings_of
from gatekeeper.ops.flag_commands import actor
from gatekeeper.ops.oncall import as_deployed, broker_of, redis_client
from gatekeeper.redis.attempt import carried_publish
from gatekeeper.redis.flags import FlagStore
from gatekeeper.redis.gate import Pipeline
from gatekeeper.redis.handoff import (
    Handoff,
    Superseded,
    as_scored,
    handed_on,
    read,
    recalled,
    remember,
)
from gatekeeper.redis.runs import RunLedger
from gatekeeper.redis.scripts import load_lua
from gatekeeper.settings import GatekeeperSettings

__all__ = ["REQUEUE_LOCK_S", "REQUEUE_WAIT_S", "dead_letter"]

REQUEUE_LOCK_S = 30
"""How long a requeue holds its lock at most (it takes a second or so)."""
REQUEUE_WAIT_S = 10.0
"""How long a requeue waits for another's lock."""


def _taken(ctx: click.Context, queue: str) -> tuple[Any, list[Taken]]:
    broker = broker_of(ctx)
    try:
        return broker, [t for t in broker.take(queue, claim=False) if t.message is not None]
    except BROKER_ERRORS as exc:
        raise click.ClickException(f"cannot read the broker ({broker.shown}): {exc}") from exc


def _give_back(broker: Any, taken: list[Taken]) -> None:
    for each in taken:
        broker.leave(each)


def _unsent(record: dict[str, str], nonce: str) -> bool:
    """Whether a requeue scored this message and was cut short before its handoff was kept
    (no copy left, its decision holds what it admitted): the record's decision replaced the
    message's nonce, and no handoff is kept for it. (Unlike the replayer's
    :func:`~gatekeeper.redis.handoff.scored_unsent`, its deadline is not the record's: the
    requeue moved it.)"""
    return bool(nonce) and record.get("prev_nonce") == nonce and handed_on(record, nonce) is None


def _live(record: dict[str, str], nonce: Any) -> bool:
    """Whether the record holds another publish of the attempt that has not run to its row
    (gate.lua would decide this one a ``duplicate_publish``, with no record of its own)."""
    if not record.get("nonce") or record["nonce"] == nonce or record.get("abandoned") == "1":
        return False
    runs, rowed = (record.get(name, "0") for name in ("runs", "rowed"))
    return not (runs.isdigit() and rowed.isdigit()) or int(runs) == 0 or int(rowed) < int(runs)


def _keep(broker: Any, taken: Taken, gate: tuple[RunLedger, Pipeline],
          kept: tuple[str, int, str, bool], handoff: Handoff) -> None:  # fmt: skip
    """Keep the requeue's handoff before any copy leaves (a copy handed on with none kept
    could not be told from a message scored and never handed on). Not kept, the task stays
    in the dead letters, its decision undone at once when it can be (abandoned again, when
    it was: ``kept``'s last part; else by the next requeue), and the command fails saying
    so."""
    (runs, pipeline), (job_id, attempt, nonce, ended) = gate, kept
    try:
        remember(runs, job_id, attempt, nonce, handoff)
        return
    except redis.RedisError as exc:
        error = exc
    broker.leave(taken)
    broker.close()
    if isinstance(error, Superseded):  # undone meanwhile (the replayer, for a twin of it)
        raise click.ClickException(
            f"the record of {job_id} holds another decision now: the task stays in the dead "
            f"letters, requeue it again")  # fmt: skip
    if unanswered(error):  # it may be kept: the next requeue hands it on as decided, or not
        raise click.ClickException(
            f"no answer keeping the handoff of {job_id} ({error}): it may be kept; the task "
            f"stays in the dead letters, requeue it again")  # fmt: skip
    with contextlib.suppress(GateUnreachable, LedgerUnavailable, redis.RedisError):
        record = runs.fields(job_id, attempt)
        if _unsent(record, nonce):
            headers = {**(taken.message or {})["headers"], H_NONCE: nonce}
            as_scored(pipeline.store, job_id, attempt, record, headers, ended)
    raise click.ClickException(
        f"the gate's Redis refused the handoff of {job_id} ({error}): the task stays in the "
        f"dead letters, requeue it again once it takes writes")  # fmt: skip


@click.group(name="dead-letter")
def dead_letter() -> None:
    """Tasks abandoned because their deadline passed: list them, requeue one."""


@dead_letter.command(name="list")
@click.pass_context
def list_command(ctx: click.Context) -> None:
    """One line per dead-lettered task, oldest first."""
    settings = settings_of(ctx)
    broker, found = _taken(ctx, settings.dead_letter_queue)
    _give_back(broker, found)
    broker.close()
    for each in found:
        headers = (each.message or {}).get("headers") or {}
        click.echo(f"job_id={headers.get('id')} task={headers.get('task')} "
                   f"attempt={headers.get(H_ATTEMPT)} deadline_at={headers.get(H_DEADLINE_AT)} "
                   f"reason={headers.get('gatekeeper_reason')}")  # fmt: skip
    click.echo(f"dead_lettered={len(found)} queue={settings.dead_letter_queue}")


@dead_letter.command(name="requeue")
@click.argument("job_id")
@click.option("--deadline-s", type=float, required=True,
              help="Its new deadline, in seconds from now (given explicitly).")  # fmt: skip
@click.pass_context
def requeue(ctx: click.Context, job_id: str, deadline_s: float) -> None:
    """Score one dead-lettered task again with a new deadline, and move it where it goes."""
    if not (deadline_s > 0 and math.isfinite(deadline_s)):  # inf: a deadline never reached
        raise click.BadParameter(f"expected a positive, finite number of seconds, got "
                                 f"{deadline_s!r}", param_hint="--deadline-s")  # fmt: skip
    settings = settings_of(ctx)
    gate = redis_client(ctx)
    lock = gate.lock(RunLedger.from_settings(gate, settings).keys.requeue_lock,
                     timeout=REQUEUE_LOCK_S, blocking_timeout=REQUEUE_WAIT_S)  # fmt: skip
    try:
        if not lock.acquire():
            raise click.ClickException("another dead-letter requeue is running (waited "
                                       f"{REQUEUE_WAIT_S:g} s): try again")  # fmt: skip
    except redis.RedisError as exc:
        raise click.ClickException(f"cannot reach the gate's Redis: {exc}") from exc
    try:
        _requeue(ctx, gate, job_id, deadline_s)
    finally:
        with contextlib.suppress(redis.RedisError, LockError):  # (expired: nothing to give back)
            lock.release()


def _requeue(ctx: click.Context, gate: redis.Redis, job_id: str, deadline_s: float) -> None:
    settings = as_deployed(ctx, gate, writes=True)  # the deployment's window and budget
    broker, found = _taken(ctx, settings.dead_letter_queue)
    match = [t for t in found if ((t.message or {}).get("headers") or {}).get("id") == job_id]
    _give_back(broker, [t for t in found if t is not (match[0] if match else None)])
    if not match:
        raise click.ClickException(f"no task {job_id} in {settings.dead_letter_queue}")
    taken = match[0]
    message: dict[str, Any] = taken.message or {}
    headers: dict[str, Any] = message["headers"]
    runs = RunLedger.from_settings(gate, settings)
    attempt, nonce = headers.get(H_ATTEMPT), nonce_of(headers)
    record = runs.fields(job_id, attempt) if type(attempt) is int else {}
    in_key = ""
    if type(attempt) is int and handed_on(record, nonce) == "key":
        in_key = read(gate, runs.keys, job_id, attempt)
    handoff = recalled(record, nonce, in_key)
    if handoff is not None:  # (withdrawn since by the replayer: to reserved, never free)
        handoff = unless_withdrawn(handoff, record, settings)
    closed = False
    if handoff is not None and handoff.queue == settings.free_queue and not _open(ctx, gate):
        closed = True  # kept for free by a requeue cut short, and the path closed since
        handoff = _withdrawn(gate, settings, handoff, message, (broker, taken))
    was = headers.get(H_DEADLINE_AT)
    moved_to: float | None = None
    if handoff is None:  # the first requeue of it: scored again, with its new deadline
        pipeline = Pipeline.create(settings, gate, time.time)
        ended = record.get("abandoned") == "1" or headers.get(H_DECISION) == "abandoned"
        if type(attempt) is int and _unsent(record, nonce):  # an earlier requeue's, cut short
            as_scored(pipeline.store, job_id, attempt, record, headers, ended)  # before its keep
        if _live(record, headers.get(H_NONCE)):
            broker.leave(taken)
            broker.close()
            raise click.ClickException(
                f"a publish of {job_id} is live (its record holds another message's decision): "
                f"the task stays in the dead letters; requeue it once that run has its row, or "
                f"drop it")  # fmt: skip
        headers[H_DEADLINE_AT] = moved_to = time.time() + deadline_s
        publish = carried_publish(headers, "requeue", record.get("label", ""))
        routing = pipeline.route(publish)
        handoff = Handoff(routing.queue or settings.reserved_queue, dict(routing.headers),
                          routing.drop)  # fmt: skip
        if H_NONCE in routing.headers and nonce:  # kept under the nonce it came with
            _keep(broker, taken, (runs, pipeline), (job_id, publish.attempt, nonce, ended),
                  handoff)  # fmt: skip
        why = routing.reason.value
    else:  # a requeue that kept its handoff and moved nothing (cut short, or unanswered)
        given = handoff.set.get(H_DEADLINE_AT)
        if isinstance(given, (int, float)) and given != was:
            moved_to = given  # that requeue moved it: said now, as the move happens
        deadline_s = float(moved_to or was or 0) - time.time()
        why = "handed_on_again: a requeue of it kept its handoff and moved nothing"
        if closed:
            why = f"{EXPIRED_REASON}: a requeue of it kept a handoff to free, now closed"
    handoff.apply(headers)
    headers[H_COPY] = uuid.uuid4().hex  # a requeue cut short and redone: a worker runs one copy
    try:
        moved = broker.send(taken, handoff.queue, message)
    except BROKER_ERRORS as exc:
        raise click.ClickException(f"cannot move {job_id} ({broker.shown}): {exc}") from exc
    finally:
        broker.close()
    if not moved:
        raise click.ClickException(f"{job_id} left {settings.dead_letter_queue} meanwhile")
    if moved_to is not None:  # the one place a deadline moves: said whatever the gate decided
        make_logger(settings, "dead_letter").warning(
            "deadline_moved", job_id=job_id, attempt=attempt, deadline_at=moved_to, was=was,
            queue=handoff.queue, reason=why, actor=actor(),
        )  # fmt: skip
    click.echo(f"requeued {job_id} to {handoff.queue} (reason {why}, "
               f"deadline in {deadline_s:g} s)")  # fmt: skip


def _open(ctx: click.Context, gate: redis.Redis) -> bool:
    """Whether the free path is open, as the gate's flags say now (unread or stale: closed)."""
    return FlagStore(gate, settings_of(ctx)).current().free_open  # (no pipeline: no pair)


def _withdrawn(
    gate: redis.Redis, settings: GatekeeperSettings, handoff: Handoff, message: dict[str, Any],
    held: tuple[Any, Taken],
) -> Handoff:  # fmt: skip
    """A handoff to free that an earlier requeue kept before the free path closed (a rollback
    after that requeue was cut short, a reviewer found): never to free now. Its admission is
    withdrawn as the replayer withdraws one (:func:`~gatekeeper.celery.expiry.closed_recall`:
    an ``expired`` row, charged the wait so far), and it goes to reserved. A copy of it that
    started (its free message reached a worker) cannot be withdrawn: the task stays listed."""
    expire = partial(expire_call, gate, gate.register_script(load_lua("expire.lua")), settings)
    answer, copy = withdrawn(expire, message, handoff, time.time())
    if answer == "no":
        job_id = copy["headers"].get("id")
        broker, taken = held
        broker.leave(taken)
        broker.close()
        raise click.ClickException(
            f"an earlier requeue handed {job_id} to {settings.free_queue}, which is closed now, "
            f"and its admission cannot be withdrawn (a copy of it started): the task stays in "
            f"the dead letters")  # fmt: skip
    return unless_withdrawn(handoff, {"reason": EXPIRED_REASON}, settings)
