"""The Celery adapter's worker side: one ledger row per run, slack misses, auto-freeze.

The gate's own record of an attempt (written in Redis when it was decided) is the truth, not
the message: a run is priced only when its message carries the record's nonce. A message that
claims gatekeeper headers with another nonce, or with an attempt the gate never writes (forged:
a caller chooses task ids and headers), runs as an ordinary task, counted and logged once, and
charges nothing; one with no nonce (a publisher that predates records, or a decision made
without Redis) gets an unverified row, unpriced and never counted toward a freeze or against a
clean hour.

Which signal ends a run, and where it fires (prefork):

=====================================  ==============  ===================================
how the run ended                      signal          process
=====================================  ==============  ===================================
returned                               task_success    pool child -> ``ok``
raised (soft time limit included)      task_failure    pool child -> ``killed``
asked for a retry (a bare ``Retry``:    task_retry      pool child -> ``killed``
none published, the job's end)
raised ``Ignore``                     task_postrun    pool child -> ``ok`` (``ignored``)
``Task.replace`` by a gated task      its publish     pool child -> ``ok`` (``replaced``)
raised ``Reject``, requeued or not     task_postrun    pool child -> ``killed``
(or ``on_success`` raised it)                          (``reject``); a requeued copy is
                                                       a new run of the attempt
hard time limit, child SIGKILLed       task_failure    main process (``sender.request``
                                                       may be empty: headers cached from
                                                       ``task_received``) -> ``killed``
revoked with ``terminate=True``        task_revoked    main process -> ``killed``
child killed, and Celery 5.7's         task_retry      main process -> ``killed`` (the
``retry_on_worker_lost`` retries it                    retry is a new attempt)
child killed with ``acks_late`` and    none            the redelivered copy's start finds
``reject_on_worker_lost``                              the dead run -> ``killed`` (a copy
                                       task_revoked    discarded before it starts: the main
                                                       process, as it discards it)
worker gone, no signal at all          none            ``gatekeeper sweep`` -> ``killed``
=====================================  ==============  ===================================

Signals that fire twice (on Celery 5.7: a hard time limit; a ``Reject`` not requeued, whose
``task_failure`` the main process sends after its row; before 5.6.3, a ``Reject`` from
``on_success``, whose ``task_failure`` the child sends after its postrun) are harmless:
``finish.lua`` writes one row per run and tells only the call that wrote it so (that call sent
again after its reply was lost too), so the row's line is logged once. Nothing here raises
into Celery: a fault is logged and the task goes on.

A run's start is sent before its body runs and its reply read when it ends
(gatekeeper/redis/run_start.py): the task waits for one round trip of the ledger's, not two; a
redelivered message's start is read at once (the dead run's row is written first).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery
from celery.exceptions import Retry

from gatekeeper.celery import message
from gatekeeper.celery.freeze import maybe_freeze, row_written
from gatekeeper.celery.message import claims, nonce_of, own_fields, request_headers
from gatekeeper.celery.metering import take_metered
from gatekeeper.celery.pending import PendingRows
from gatekeeper.celery.postrun import ended_at_postrun, rejected_for_good, requeued_on_timeout
from gatekeeper.celery.received import NOWHERE, RanIn, Received
from gatekeeper.celery.running import REPLACED, Running, Starting, Starts, another_run, learns_from
from gatekeeper.celery.unverified import UnverifiedSide
from gatekeeper.core.ledger import Outcome
from gatekeeper.logs import make_logger
from gatekeeper.redis.flags import FlagStore
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.runs import RunLedger, RunRecord
from gatekeeper.redis.store import GateStore
from gatekeeper.settings import GatekeeperSettings

__all__ = ["WorkerSide", "maybe_freeze"]


class WorkerSide:
    """The worker signals of one app, on the run ledger (connected by the install: its
    parts are built at first use, gatekeeper/celery/parts.py)."""

    def __init__(
        self,
        app: Celery,
        settings: GatekeeperSettings,
        client: redis.Redis,
        flags: FlagStore,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.app = app
        self.settings = settings
        self.flags = flags
        self.clock = clock
        self.runs = RunLedger.from_settings(client, settings)
        self.store = GateStore(client, Keys(settings.key_prefix, settings.namespace))
        self.log = make_logger(settings, "worker")
        self.pending = PendingRows.for_settings(self.log, settings)  # (pending.py)
        self.unverified = UnverifiedSide(self.runs, self.log, self._now_ms, self.pending)
        self.alerts = make_logger(settings, "alert")
        self._running: dict[str, Running] = {}
        self._starts = Starts()
        self._received = Received()

    def _ours(self, task: Any) -> bool:
        return task is not None and getattr(task, "app", None) is self.app

    def _now_ms(self) -> int:
        return round(self.clock() * 1000)

    def _guarded(self, what: str, job_id: str | None, action: Callable[[], None]) -> None:
        try:
            action()
        except Exception as exc:  # a ledger fault must never fail the task or the worker
            self.log.warning("ledger_write_failed", step=what, job_id=job_id, error=repr(exc))

    # -- main process -------------------------------------------------------------------

    def on_received(self, sender: Any = None, request: Any = None, **_: Any) -> None:
        """Cache a gated message's headers by task id (main process)."""
        task = getattr(request, "task", None)
        if not self._ours(task):
            return
        headers = dict(getattr(getattr(request, "message", None), "headers", None) or {})
        self._received.add(request, headers)

    def on_revoked(
        self, sender: Any = None, request: Any = None, terminated: bool = False, **_: Any
    ) -> None:
        """Revoked while running (``terminate=True``): killed. Before it ran: no row, and
        the exposure its admission held is given back (:meth:`_release`)."""
        task = sender if self._ours(sender) else getattr(request, "task", None)
        if not self._ours(task) or request is None:
            return
        self._guarded("revoked", request.id, lambda: self._finish_elsewhere(
            task, request.id, "revoked") if terminated else self._release(request))  # fmt: skip

    def _headers_of(self, job_id: str, request: Any) -> tuple[dict[str, Any], RanIn]:
        """The headers of the request that just ended, and where it ran (:class:`Received`)."""
        ended, ran_in = self._received.ended(job_id, self.runs)  # (the record's nonce decides)
        if ended is None:
            self.log.warning("ledger_ambiguous_end", job_id=job_id)
            return {}, NOWHERE
        return ended or request_headers(request), ran_in

    def _release(self, request: Any) -> None:
        """Revoked (or past its ``expires``) before it ran: the exposure its admission held
        goes back. A redelivered copy (``acks_late``) of a run that died unseen never starts
        now: that run, the attempt's last, is written killed, as the copy's start would."""
        self._received.ended(request.id)  # (forgotten: the revoked message itself is here)
        headers = request_headers(request)  # its own (Celery's context of it), not a guess
        if not claims(headers):
            return
        job_id, attempt, lost = request.id, message.attempt_of(headers), "worker_lost_redelivered"
        fields = self.runs.fields(job_id, attempt) if nonce_of(headers) else {}
        if "nonce" not in fields:  # unverified (a late row's marks only: no record either)
            self.unverified.end_latest(None, job_id, attempt, {}, lost, NOWHERE)
            return
        if fields.get("nonce") != nonce_of(headers):
            return  # not the gate's message
        record = RunRecord.from_fields(fields)
        if "runs" in fields:
            if int(fields.get("rowed") or 0) < int(fields["runs"]):
                self._end(job_id, attempt, int(fields["runs"]), record, Outcome.KILLED, lost,
                          True, final=True)  # fmt: skip
        elif record.path == "free":
            self.store.release(job_id, attempt, record.window)

    def _finish_elsewhere(self, task: Any, job_id: str, reason: str, **ends: bool) -> None:
        """End the latest run of an attempt from the main process, where no run is in memory
        (``ends``: :meth:`_end`'s ``final`` or ``went_on``)."""
        headers, ran_in = self._headers_of(job_id, getattr(task, "request", None))
        if not claims(headers):
            return
        attempt = message.attempt_of(headers)
        fields = self.runs.fields(job_id, attempt) if nonce_of(headers) else {}
        if "nonce" not in fields:  # unverified (no nonce, no record: a late row's marks at most)
            self.unverified.end_latest(task, job_id, attempt, headers, reason, ran_in)
            return
        if "runs" not in fields or fields.get("nonce") != nonce_of(headers):
            return  # never started, or not the gate's message (a forged one: no row)
        run, record = int(fields["runs"]), RunRecord.from_fields(fields)
        self._end(job_id, attempt, run, record, Outcome.KILLED, reason, True, **ends)

    def on_lost_after_success(self, request: Any) -> None:
        """A pool child lost after its task stored SUCCESS (killed in ``on_success``, a
        ``task_postrun`` receiver): Celery 5.7 sends no ``task_failure`` (private.py)."""
        task = getattr(request, "task", None)
        if self._ours(task):
            self._guarded("failure", request.id, lambda: self._finish_elsewhere(
                task, request.id, "WorkerLostError", final=True))  # fmt: skip

    def on_process_exit(self, **_: Any) -> None:
        """A pool child or the worker ends: its unanswered rows are sent once more."""
        self.pending.at_exit()

    # -- pool child ---------------------------------------------------------------------

    def on_prerun(self, sender: Any = None, task_id: str | None = None, **_: Any) -> None:
        """A run starts: count it, and record a dead earlier run of the same attempt."""
        if not self._ours(sender) or task_id is None:
            return
        take_metered(task_id)  # a meter left by an earlier run of this id is not this run's
        self.pending.send("run_start")  # rows Redis did not answer for before (pending.py)
        headers = request_headers(sender.request)
        if not claims(headers):
            if message.forged_attempt(headers):  # no record can be its: start.lua is not asked
                self._guarded("start", task_id, lambda: self.unverified.forged(sender, task_id))
            return
        attempt = message.attempt_of(headers)
        for earlier in list(self._starts.by_job):  # a run inside a run, or one with no end signal
            self._read_start(earlier)
        delivery = getattr(sender.request, "delivery_info", None) or {}
        # Redelivered (kombu's Redis transport marks both): a dead earlier run may be owed a row.
        again = bool(delivery.get("redelivered") or headers.get("redelivered"))

        def start() -> None:
            now, nonce = self._now_ms(), nonce_of(headers)
            own = own_fields(sender, headers)
            if nonce:
                call = self.runs.send_start(task_id, attempt, nonce, own, now)
            else:  # no nonce: an unverified run (gatekeeper/celery/unverified.py)
                call = self.unverified.send_start(sender, task_id, attempt, headers, own, now,
                                                  again)  # fmt: skip
            self._starts.by_job[task_id] = Starting(call, sender, attempt, headers, now, again)
            if again:  # its dead run's row now, not after this run
                self._read_start(task_id)

        self._guarded("start", task_id, start)

    def _read_start(self, job_id: str) -> None:
        """Read the reply of the start this thread sent for ``job_id``, and act on it: the
        run is this process's to end, or refused; a dead earlier run gets its row."""
        starting = self._starts.by_job.pop(job_id, None)
        if starting is None:
            return

        def read() -> None:
            started = self.unverified.unrecorded(job_id, starting, starting.call.started())
            task, attempt = starting.task, starting.attempt
            if started.record is None:
                self.unverified.refused(task, job_id, attempt, starting.headers, started,
                                        starting.now, self._running)  # fmt: skip
                return
            record = message.with_dwell(started.record, starting.headers)
            self._running[job_id] = Running(attempt, started.run, record, True)
            if started.dead is not None:
                self._end(job_id, attempt, started.dead_run, started.dead, Outcome.KILLED,
                          "worker_lost_redelivered", current=False)  # fmt: skip

        self._guarded("start", job_id, read)

    def _end_running(
        self, job_id: str | None, outcome: Outcome, reason: str, final: bool = False,
        went_on: bool = False,
    ) -> bool:  # fmt: skip
        """End the run this process is executing; False when it is not one of ours. ``final``:
        the job ends with it (no retry, no copy requeued); ``went_on``: it goes on (a retry)."""
        if job_id is not None:
            self._read_start(job_id)
        if job_id is None or job_id not in self._running:
            if job_id is not None:
                take_metered(job_id)  # a run with no row (forged, ungated): its meter goes
            return False
        running = self._running.pop(job_id)
        tokens_in, tokens_out = take_metered(job_id)
        if not running.verified:
            self._guarded("finish", job_id, lambda: self.unverified.end(
                job_id, running, outcome, reason, tokens_in, tokens_out))  # fmt: skip
        else:
            self._guarded("finish", job_id, lambda: self._end(
                job_id, running.attempt, running.run, running.record, outcome, reason, True,
                tokens_in, tokens_out, final, went_on))  # fmt: skip
        self.pending.send("run_end")  # (not at once after a row of its own just kept)
        return True

    def on_replaced(self, task: Any, job_id: str) -> None:
        """``Task.replace`` is publishing a gated replacement with this run's task id (the
        hook): the run ends now, ``ok``, so the gate takes the replacement for the attempt
        begun again (a record, run and row of its own), not a duplicate of a live one."""
        if self._ours(task):
            self._end_running(job_id, Outcome.OK, REPLACED)

    def on_success(self, sender: Any = None, **_: Any) -> None:
        if self._ours(sender):
            self._end_running(sender.request.id, Outcome.OK, "ok")

    def on_retry(self, sender: Any = None, request: Any = None, **kw: Any) -> None:
        """In the child: a retry asked for (``Task.retry`` published it first; a ``Retry`` the
        task raised itself has no ``sig`` and published none: the job ends). In the main process
        (5.7's ``retry_on_worker_lost``): its child died, and Celery published the retry."""
        if self._ours(sender):
            job_id = getattr(request, "id", None) or sender.request.id
            bare = isinstance(kw.get("reason"), Retry) and kw["reason"].sig is None
            if not self._end_running(job_id, Outcome.KILLED, "retry", final=bare, went_on=not bare):
                why = type(getattr(kw.get("reason"), "exc", None) or kw.get("reason")).__name__
                self._guarded("failure", job_id, lambda: self._finish_elsewhere(
                    sender, job_id, why, went_on=True))  # fmt: skip

    def on_postrun(
        self, sender: Any = None, task_id: Any = None, state: Any = None, retval: Any = None,
        **_: Any,
    ) -> None:  # fmt: skip
        """A run no other signal ended ends here (gatekeeper/celery/postrun.py): ``Ignore``
        (``Task.replace`` raises it): ok. ``Reject``, from the body or ``on_success``:
        killed, at once, requeued or not: no copy may come back to this process, or run at
        all; one that runs is a new run of the attempt (start.lua)."""
        if task_id not in self._running and task_id not in self._starts.by_job:
            return  # ended by its own signal (most runs), or not ours: two lookups, at once
        if another_run(self._running.get(task_id), getattr(sender, "request", None)):
            return  # (a threads pool: Task.replace's replacement; this run ended at its publish)
        if self._ours(sender):
            outcome, reason = ended_at_postrun(state)
            self._end_running(task_id, outcome, reason, final=rejected_for_good(retval))

    def on_failure(
        self, sender: Any = None, task_id: str | None = None, exception: Any = None, **_: Any
    ) -> None:
        """In the child: the task raised. In the main process: time limit or worker lost."""
        if not self._ours(sender) or task_id is None:
            return
        reason = type(exception).__name__ if exception is not None else "failure"
        final = not requeued_on_timeout(sender, exception)
        if not self._end_running(task_id, Outcome.KILLED, reason, final=final):
            self._guarded("failure", task_id, lambda: self._finish_elsewhere(
                sender, task_id, reason, final=final))  # fmt: skip

    # -- both ---------------------------------------------------------------------------

    def _end(
        self, job_id: str, attempt: int, run: int, record: RunRecord, outcome: Outcome,
        reason: str, current: bool, tokens_in: int | None = None, tokens_out: int | None = None,
        final: bool = False, went_on: bool = False,
    ) -> None:  # fmt: skip
        """Write the run's row. A slack miss: a job admitted to free (any attempt) that ends
        after its deadline, ``ok`` or ``final`` (failed for good); not a retry (``went_on``)."""
        now = self._now_ms()
        row = self.runs.row_for(job_id, attempt, record, outcome, now, tokens_in, tokens_out)
        ends = outcome is Outcome.OK or final
        miss = ends and (record.free_admitted or record.path == "free") and now > record.deadline_ms
        learns = current and learns_from(self.app, record, outcome, reason)
        token = secrets.token_hex(4)  # the same if sent again (Redis gave no answer: pending.py)

        def write() -> bool:
            done = self.runs.finish(
                row, run, record, now, slack_miss=miss, ends=ends, went_on=went_on, current=current,
                service_s=(now - record.started_ms) / 1000 if learns else None,
                lower_bound=outcome is not Outcome.OK, token=token,
            )  # fmt: skip
            if done.written:
                row_written(self.log, self.alerts, self.flags, self.clock(), record, row, run,
                            reason, done)  # fmt: skip
            return done.written

        self.pending.write(job_id, run, write)
