"""The replayer: scores deferred tasks again, without running them, and hands each one on.

``defer`` is a parking queue that no ordinary worker consumes. The replayer reads it from the
broker itself (:mod:`gatekeeper.celery.broker`: kombu's lists on a Redis broker, or RabbitMQ
through kombu with acks and confirms) and, for each message that is due:

- deadline passed -> the ``dead_letter`` queue, an ``abandoned`` row and an alert line (with
  ``decision=admit_free slack_miss=true`` when an earlier attempt of the job ran free);
- otherwise the same pipeline as at publish (same task id, deadline and attempt) -> ``free``
  or ``reserved``, or back to ``defer`` with a backoff in its headers, due by its deadline at
  the latest (never an ETA message: an ETA past the visibility timeout would run twice; on
  RabbitMQ it waits in a delay queue). While the free path is off, it is never ``free``.

On Redis it works in batches (``replay_batch_size``, :mod:`gatekeeper.celery.batch`): a
batch is claimed, its records read, its decisions made, its handoffs kept and its messages
moved in one round trip each; on RabbitMQ one message at a time.

Nothing is lost when the replayer is killed at any moment. On Redis a message is claimed
into its lock tenure's processing list (RPOPLPUSH) and leaves it only by ``move.lua`` (one
atomic step per message, a batch's in one call, none once the tenure's heartbeat is gone);
on RabbitMQ it is acked only once its rewritten copy is confirmed. The lock is checked before
every claim, before each step of each message and round trip of a batch, and before its
moves (:mod:`gatekeeper.redis.lock`; renewed once a third of its TTL has passed, so a slow
batch keeps it): a replayer that lost it decides, moves and writes nothing more, and only
dead tenures' claims are taken back. A message that comes back after it was scored (its
move refused, or its replayer killed before the ack) is handed on again as it was the first
time (no copy leaves before its handoff is kept: :mod:`gatekeeper.redis.handoff`), never to
free while the path is closed (``expiry.closed_recall``), and a worker runs one copy of the
two (``duplicates``). ``abandon.lua`` writes one row per attempt.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import redis
from redis.exceptions import LockError

from gatekeeper.celery.batch import Decide, KeepHandoff, ReadHandoff, ReadRecord, Step, run_batch
from gatekeeper.celery.broker import Broker, RedisBroker, Taken, gone_for_good
from gatekeeper.celery.deadletter import H_REPLAY_ERRORS, abandon, set_aside, unkept
from gatekeeper.celery.expiry import EXPIRED_REASON, Expiry, closed_recall
from gatekeeper.celery.lists import PRIORITY_SEP, PRIORITY_STEPS, queue_list
from gatekeeper.celery.message import nonce_of, replays_of
from gatekeeper.celery.taken import copy_message
from gatekeeper.core.headers import (
    H_ATTEMPT,
    H_COPY,
    H_DEADLINE_AT,
    H_NONCE,
    H_REPLAY_AFTER,
    H_REPLAYS,
)
from gatekeeper.lines import flush as flush_lines
from gatekeeper.logs import make_logger
from gatekeeper.redis.attempt import carried_publish
from gatekeeper.redis.gate import Pipeline, Routing
from gatekeeper.redis.handoff import Handoff, as_scored, handed_on, recalled, scored_unsent
from gatekeeper.redis.lock import OneHolder
from gatekeeper.redis.runs import RunLedger
from gatekeeper.redis.snapshot import forget_deferred, pass_completed
from gatekeeper.redis.sweep import forget_purged, sweep
from gatekeeper.redis.unverified import UnverifiedRuns
from gatekeeper.settings import GatekeeperSettings

__all__ = ["PRIORITY_SEP", "PRIORITY_STEPS", "Replayer", "queue_list"]

SWEEP_EVERY_S = 60.0


class Replayer:
    """Works the defer queue of one namespace (one live replayer at a time, by lock)."""

    def __init__(
        self,
        settings: GatekeeperSettings,
        broker: redis.Redis | Broker,
        gate: redis.Redis,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        app: Any = None,
    ) -> None:
        self.settings = settings
        self.app = app  # with it, an abandoned task's failure is stored in its backend
        if isinstance(broker, redis.Redis):
            broker = RedisBroker(broker, settings)
        self.broker: Broker = broker
        self.gate_client, self.clock = gate, clock
        self.pipeline = Pipeline.create(settings, gate, clock)
        self.runs = RunLedger.from_settings(gate, settings)
        self.unverified = UnverifiedRuns(self.runs)  # an abandoned message's without a nonce
        self.log = make_logger(settings, "replay")
        self.expiry = Expiry(app, settings, gate, self.log)  # a recall while free is closed
        self.alerts = make_logger(settings, "alert")
        self.defer = settings.defer_queue
        self.ident = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._last_sweep = -math.inf
        self._holder = OneHolder(gate, self.pipeline.store.keys.replayer_lock,
                                 settings.replay_lock_ttl_s, monotonic,
                                 on_renew=lambda: self.broker.beat())  # fmt: skip
        self.counts: Counter[str] = Counter()

    # -- the lock and recovery ----------------------------------------------------------

    def acquire(self) -> bool:
        """Take (or keep) the namespace's replayer lock; a new take begins a tenure."""
        state = self._holder.take()
        if state == "lost":
            self._lost()
        if state == "taken":
            self.broker.begin(self.ident)
            self.log.info("replay_lock_taken", replayer=self.ident, broker=self.broker.shown)
        return state in ("taken", "kept")

    def _lost(self) -> None:
        self.log.warning("replay_lock_lost", why=self._holder.lost_why, replayer=self.ident)
        self.broker.end()

    def release(self) -> None:
        """Give the lock back; when Redis cannot be reached it expires on its own."""
        try:
            self._holder.give_back()
        except (LockError, redis.RedisError) as exc:
            self.log.warning("replay_lock_not_released", error=repr(exc))
        self.broker.end()

    def recover(self) -> int:
        """Put back what dead tenures left claimed; returns how many messages."""
        moved = self.broker.recover()
        if moved:
            self.log.warning("replay_recovered", messages=moved, queue=self.defer)
        return moved

    # -- one pass -----------------------------------------------------------------------

    def pass_once(self) -> Counter[str]:
        """Look at every message in defer once; returns what happened to them. Ends early,
        with ``lock_lost``, when the lock is found lost before a decision."""
        counts: Counter[str] = Counter()
        began = self.clock()
        try:
            if self._holder.check():
                self.recover()
                self._replay_all(counts)
        except BaseException:
            self.counts.update(counts)  # what a pass moved before it failed is said too
            raise
        if not self._holder.held:
            self._lost()
            counts["lock_lost"] += 1
        self.counts.update(counts)
        now = self.clock()
        if self._holder.held:  # for gatekeeper metrics: the last pass, the deadlines left
            pass_completed(self.gate_client, self.pipeline.store.keys, began, now,
                           self.settings.replay_backoff_max_s)  # fmt: skip
        if self._holder.held and now - self._last_sweep >= SWEEP_EVERY_S:
            self._last_sweep = now
            self._sweep(now)
        return counts

    def _sweep(self, now: float) -> None:
        stale = self.settings.stale_attempt_s
        for row, verified in sweep(self.runs, round(now * 1000), stale, self.pipeline.store):
            self.log.warning("ledger_row", job_id=row.job_id, attempt=row.attempt,
                             outcome=row.outcome.value, reason="vanished",
                             **({} if verified else {"verified": False}))  # fmt: skip
        present = self.broker.waiting(self.settings.free_queue)  # None: RabbitMQ cannot list
        if present is not None and forget_purged(self.pipeline.store, present, round(now * 1000)):
            self.log.warning("free_admissions_forgotten", queue=self.settings.free_queue)

    def _replay_all(self, counts: Counter[str]) -> None:
        batches = self.broker.take_batches(self.defer, self.settings.replay_batch_size)
        # Checked before each claim: a claim re-sets the tenure's heartbeat, which a replayer
        # that lost its lock must not do.
        while self._holder.check() and (batch := next(batches, None)) is not None:
            try:
                labels = self._replay_batch(batch)
            except BaseException:  # nothing could move them (the broker, the gate's Redis)
                self._leave(batch)  # given back now, not held unacked for ever
                raise
            if labels is None:
                return
            counts.update(labels)
            forget_deferred(self.gate_client, self.pipeline.store.keys,
                            *gone_for_good(batch, labels))  # fmt: skip

    def _replay_batch(self, batch: list[Taken]) -> list[str] | None:
        """Decide and hand on one batch (:mod:`gatekeeper.celery.batch`); None, with nothing
        moved, when the lock is found lost before its decisions, among them or before moving."""
        if not self._holder.check():
            # No decision, no move, no row. The messages are left where they are: without
            # the lock we write nothing to the queues; the holder takes them back (Redis:
            # our tenure has ended; RabbitMQ: they are given back to defer).
            self._leave(batch)
            return None
        steps = [(self._job_of(taken), self._handle(taken)) for taken in batch]
        labels = run_batch(steps, self.runs, self.pipeline,
                           lambda i, exc: set_aside(self, batch[i], exc),
                           self._holder.check)  # fmt: skip
        if not self._holder.held or (any(taken.move is not None for taken in batch)
                                     and not self._holder.check()):  # fmt: skip
            # Lost while deciding: nothing of the batch moves (and move.lua refuses once our
            # tenure's heartbeat is gone). Its holder takes the claims back, and each comes
            # back handed on as decided (its kept handoff) or, with none kept, scored again.
            self._leave(batch)
            return None
        flush_lines()  # the batch's lines are in the log before its messages move
        self.broker.hand_on(batch)  # a move refused (the tenure over, the copy gone): given back
        if refused := [str(t.message["headers"].get("id")) if t.message else "unreadable"
                       for t in batch if t.refused]:  # fmt: skip
            # Their lines (alerts included) are said again when a later pass hands them on.
            self.log.warning("replay_given_back", reason="move_refused", messages=len(refused),
                             queue=self.defer, job_ids=",".join(refused))  # fmt: skip
        pairs = zip(batch, labels, strict=True)
        return ["given_back" if taken.refused else label for taken, label in pairs]

    def _leave(self, batch: list[Taken]) -> None:
        for taken in batch:
            if not taken.done:
                self.broker.leave(taken)

    @staticmethod
    def _job_of(taken: Taken) -> object:
        """What two messages of one job share (they are not handled side by side)."""
        return str(taken.message["headers"].get("id")) if taken.message else object()

    def _handle(self, taken: Taken) -> Step:
        """One message's replay, top to bottom; what it needs of the gate's Redis is yielded,
        to be asked with the batch's others (:func:`gatekeeper.celery.batch.run_batch`)."""
        now = self.clock()
        message = taken.message
        if message is None:
            self.broker.send(taken, self.settings.dead_letter_queue, None)
            self.alerts.error("replay_malformed", queue=self.defer,
                              error="not a kombu message with headers and properties")  # fmt: skip
            return "malformed"
        headers: dict[str, Any] = message["headers"]
        job_id, deadline = str(headers.get("id")), headers.get(H_DEADLINE_AT)
        passed = isinstance(deadline, (int, float)) and deadline <= now  # once due (a hold kept)
        after = headers.get(H_REPLAY_AFTER)
        if isinstance(after, (int, float)) and after > now:
            self.broker.hold(taken, None, after - now)
            return "not_due"
        if H_ATTEMPT not in headers:
            return self._send(taken, message, self.settings.reserved_queue, "not_gated")
        attempt = headers[H_ATTEMPT]
        gated = type(attempt) is int
        record: dict[str, str] = (yield ReadRecord(job_id, attempt)) if gated else {}
        nonce = nonce_of(headers)  # a handoff in its own key is read for the message it names
        in_key = (yield ReadHandoff(job_id, attempt)) if handed_on(record, nonce) == "key" else ""
        again = recalled(record, nonce, in_key)
        if (
            again is not None
            and again.queue == self.settings.free_queue
            and (record.get("reason") == EXPIRED_REASON or not self._open())
        ):  # never to free now, nor once withdrawn (its copy to reserved may not have gone)
            return closed_recall(self, taken, message, again, now)
        if again is not None:  # handed on before, and the original came back: the same again
            self.log.warning("replay_handed_on_again", job_id=job_id, attempt=attempt,
                             queue=again.queue)  # fmt: skip
            return self._hand_on(taken, message, again, "handed_on_again")
        if gated and scored_unsent(record, headers):  # scored, never handed on (below): the
            # record's own, also past its deadline (its row, slack miss and end)
            self.log.warning("replay_scored_not_handed_on", job_id=job_id, attempt=attempt,
                             decision=record.get("decision"))  # fmt: skip
            as_scored(self.pipeline.store, job_id, attempt, record, headers)
        if passed:
            return abandon(self, taken, message, now, record)
        if not (gated and self._deferred_by_the_gate(record, headers)):
            # Not a message the gate parked here (put in defer by hand or by a caller, or by
            # a publisher older than records): its headers are not the gate's, so it is not
            # scored from them. It runs on reserved, and its row is unverified or none.
            self.log.warning("replay_unverified", job_id=job_id, queue=self.defer)
            return self._send(taken, message, self.settings.reserved_queue, "unverified")
        publish = carried_publish(headers, "replay", record.get("label", ""))
        try:
            routing: Routing = yield Decide(publish)
        except Exception as exc:  # never lose the message: park it where it can run
            self.log.warning("replay_route_failed", job_id=job_id, error=repr(exc))
            return self._send(taken, message, self.settings.reserved_queue, "gate_error")
        replays = replays_of(headers) + 1
        changes = {**routing.headers, H_REPLAYS: replays}
        drop, wait = (*routing.drop, H_REPLAY_ERRORS), 0.0  # replayed: its errors start again
        queue = routing.queue or self.settings.reserved_queue
        if queue == self.defer:
            wait = min(self.settings.replay_backoff_s * 2 ** min(replays - 1, 64),
                       self.settings.replay_backoff_max_s)  # fmt: skip
            if isinstance(deadline, (int, float)):  # due again by its deadline: abandoned then
                wait = max(0.0, min(wait, deadline - now))
            changes[H_REPLAY_AFTER] = now + wait
        else:
            drop = (*drop, H_REPLAY_AFTER)
        handoff = Handoff(queue, changes, drop, wait)
        if H_NONCE in routing.headers:  # the gate recorded this decision: keep its handoff
            try:
                yield KeepHandoff((job_id, publish.attempt, nonce, handoff))  # as it came
            except redis.RedisError as exc:  # not handed on: a twin could not tell (as_scored)
                return unkept(self, taken, message, publish.attempt, exc, now)
        return self._hand_on(taken, message, handoff, routing.reason)

    def _hand_on(self, taken: Taken, message: dict[str, Any], handoff: Handoff, why: str) -> str:
        message = copy_message(message)  # the taken one stays as it came (set_aside holds that)
        handoff.apply(message["headers"])
        if handoff.queue == self.defer:
            self.broker.hold(taken, message, handoff.wait_s)
            return "deferred_again"
        label = self._send(taken, message, handoff.queue, why)
        return "handed_on_again" if why == "handed_on_again" else label

    def _open(self) -> bool:  # the free path, for a recalled handoff (never read: closed)
        flags = self.pipeline.flags.current()
        return flags.free_open

    def _deferred_by_the_gate(self, record: dict[str, str], headers: dict[str, Any]) -> bool:
        """Whether the gate's record of this attempt deferred it, and the message carries
        the record's nonce."""
        nonce = nonce_of(headers)
        return bool(nonce) and record.get("nonce") == nonce and record.get("decision") == "defer"

    def _send(self, taken: Taken, message: dict[str, Any], queue: str, why: str) -> str:
        if message is taken.message:
            message = copy_message(message)
        message["headers"][H_COPY] = uuid.uuid4().hex  # this copy's own: a worker runs one
        self.broker.send(taken, queue, message)
        return f"to_{queue}" if why not in ("not_gated", "unverified") else why

    # -- the loop -----------------------------------------------------------------------

    def run(self, stop: threading.Event, once: bool = False) -> Counter[str]:
        """Replay until ``stop`` is set (or one pass with ``once``); returns the totals."""
        while not stop.is_set():
            try:
                if not self.acquire():
                    self.log.info("replay_waiting_for_lock", holder="another replayer")
                    if once:
                        self.counts["lock_held"] += 1
                        break
                    stop.wait(self.settings.replay_poll_s * 4)
                    continue
                counts = self.pass_once()
            except Exception as exc:  # Redis down, a bug: log, wait, try again; never exit
                self.log.warning("replay_pass_failed", error=repr(exc))
                self.counts["pass_failed"] += 1
                self.broker.abort()  # nothing stays taken and unacked behind a failed pass
                counts = Counter()
            if once:
                break
            moved = sum(v for k, v in counts.items() if k != "not_due")
            if not moved:
                stop.wait(self.settings.replay_poll_s)
        self.release()
        return self.counts
