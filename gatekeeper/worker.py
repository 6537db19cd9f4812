"""The Celery adapter's worker side: one ledger row per run, slack misses, auto-freeze.

Which signal ends a run, and where it fires (prefork):

=====================================  ==============  ===================================
how the run ended                      signal          process
=====================================  ==============  ===================================
returned                               task_success    pool child -> ``ok``
raised (soft time limit included)      task_failure    pool child -> ``killed``
asked for a retry                      task_retry      pool child -> ``killed``
hard time limit, child SIGKILLed       task_failure    main process (``sender.request``
                                                       may be empty: headers cached from
                                                       ``task_received``) -> ``killed``
revoked with ``terminate=True``        task_revoked    main process -> ``killed``
child killed with ``acks_late`` and    none            the redelivered copy's start finds
``reject_on_worker_lost``                              the dead run -> ``killed``
worker gone, no signal at all          none            ``gatekeeper sweep`` -> ``killed``
=====================================  ==============  ===================================

Signals that fire twice (a hard time limit on Celery 5.7) are harmless: ``finish.lua`` writes
one row per run. Nothing here raises into Celery: a fault is logged and the task goes on.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import redis
from celery import Celery
from celery.signals import (
    task_failure,
    task_prerun,
    task_received,
    task_retry,
    task_revoked,
    task_success,
)

from gatekeeper.errors import GatekeeperError
from gatekeeper.flags import FlagStore
from gatekeeper.health import WindowHealth, should_freeze
from gatekeeper.keys import Keys
from gatekeeper.ledger import Outcome, Path
from gatekeeper.logs import make_logger
from gatekeeper.metering import take_metered
from gatekeeper.runs import RunLedger, RunRecord
from gatekeeper.settings import GatekeeperSettings
from gatekeeper.spec import (
    H_ATTEMPT,
    H_ATTEMPT_PUBLISHED_AT,
    H_DEADLINE_AT,
    H_DECISION,
    H_DWELL_S,
    H_FREE_ADMITTED,
    H_MAX_RETRIES,
    H_PUBLISHED_AT,
    H_TOKENS_IN,
    H_TOKENS_OUT,
    H_WINDOW,
    spec_of,
)
from gatekeeper.store import GateStore

__all__ = ["WorkerSide", "maybe_freeze", "record_from_headers"]

RECEIVED_CACHE_SIZE = 10_000
"""Headers kept per task id in the worker's main process, for signals that lose the request."""
HEADERS = (
    H_ATTEMPT,
    H_FREE_ADMITTED,
    H_MAX_RETRIES,
    H_WINDOW,
    H_ATTEMPT_PUBLISHED_AT,
    H_DEADLINE_AT,
    H_DECISION,
    H_DWELL_S,
    H_PUBLISHED_AT,
    H_TOKENS_IN,
    H_TOKENS_OUT,
    "retries",
)


def _whole(value: Any) -> int:
    """A token count from a header; a bad one (the publish was routed for it) counts 0."""
    try:
        number = int(value or 0)
    except (TypeError, ValueError):
        return 0
    return max(number, 0)


def record_from_headers(task: Any, headers: Mapping[str, Any]) -> tuple[int, RunRecord] | None:
    """(attempt, record) for a message the gate routed; None for untouched messages."""
    attempt, decision = headers.get(H_ATTEMPT), headers.get(H_DECISION)
    if attempt is None or decision is None:
        return None
    published = headers.get(H_ATTEMPT_PUBLISHED_AT) or headers.get(H_PUBLISHED_AT) or 0
    try:
        spec = spec_of(task)
    except GatekeeperError:
        spec = None
    tokens_out = headers.get(H_TOKENS_OUT, spec.tokens_out if spec else 0)
    dwell = headers.get(H_DWELL_S)
    admitted_ms = round(float(headers.get(H_PUBLISHED_AT) or published) * 1000)
    max_retries = headers.get(H_MAX_RETRIES)
    time_limit = getattr(task, "time_limit", None) or getattr(
        getattr(getattr(task, "app", None), "conf", None), "task_time_limit", None
    )
    record = RunRecord(
        task=getattr(task, "name", "") or "",
        path=(Path.FREE if decision == "admit_free" else Path.RESERVED).value,
        decision=str(decision),
        published_ms=round(float(published) * 1000),
        admitted_ms=admitted_ms,
        window=int(headers.get(H_WINDOW) or 0),
        deadline_ms=round(float(headers.get(H_DEADLINE_AT) or 0) * 1000),
        tokens_in=_whole(headers.get(H_TOKENS_IN)),
        tokens_out=_whole(tokens_out),
        dwell_s=math.nan if dwell is None else float(dwell),
        retries=int(headers.get("retries") or 0),
        free_admitted=bool(headers.get(H_FREE_ADMITTED)) or decision == "admit_free",
        max_retries=-1 if max_retries is None else int(max_retries),
        time_limit_s=float(time_limit or 0),
    )
    return int(attempt), record


def _request_headers(request: Any) -> dict[str, Any]:
    """Gatekeeper's headers (and ``retries``) from a task's request context."""
    return {
        name: getattr(request, name, None)
        for name in HEADERS
        if getattr(request, name, None) is not None
    }


class WorkerSide:
    """Connects the worker signals of one app to the run ledger."""

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
        self.alerts = make_logger(settings, "alert")
        self._running: dict[str, tuple[int, int, RunRecord]] = {}
        self._received: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def connect(self) -> None:
        """Connect the handlers (each ignores other apps' tasks)."""
        task_received.connect(self.on_received, weak=False)
        task_prerun.connect(self.on_prerun, weak=False)
        task_success.connect(self.on_success, weak=False)
        task_failure.connect(self.on_failure, weak=False)
        task_retry.connect(self.on_retry, weak=False)
        task_revoked.connect(self.on_revoked, weak=False)

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
        message = getattr(request, "message", None)
        headers = dict(getattr(message, "headers", None) or {})
        if H_ATTEMPT not in headers:
            return
        self._received[request.id] = {k: headers[k] for k in HEADERS if k in headers}
        while len(self._received) > RECEIVED_CACHE_SIZE:
            self._received.popitem(last=False)

    def on_revoked(
        self, sender: Any = None, request: Any = None, terminated: bool = False, **_: Any
    ) -> None:
        """Revoked while running (``terminate=True``): killed. Before it ran: no row, and
        the exposure it held is given back."""
        task = sender if self._ours(sender) else getattr(request, "task", None)
        if not self._ours(task) or request is None:
            return
        if terminated:
            self._guarded(
                "revoked", request.id, lambda: self._finish_elsewhere(task, request.id, "revoked")
            )
            return
        self._guarded("revoked", request.id, lambda: self._release(task, request))

    def _release(self, task: Any, request: Any) -> None:
        headers = self._received.pop(request.id, None) or _request_headers(request)
        found = record_from_headers(task, headers)
        if found is None or found[1].path != Path.FREE.value:
            return
        attempt, record = found
        if self.runs.record(request.id, attempt) is None:  # it never started
            self.store.release(request.id, attempt, record.window)

    def _finish_elsewhere(self, task: Any, job_id: str, reason: str) -> None:
        """End the latest run of an attempt from the main process, where no run is in memory."""
        headers = self._received.pop(job_id, None) or _request_headers(
            getattr(task, "request", None)
        )
        found = record_from_headers(task, headers)
        if found is None:
            return
        attempt, _ = found
        stored = self.runs.record(job_id, attempt)
        if stored is None:
            return  # never started: no row (its exposure ages out with the attempt)
        run, record = stored
        self._end(job_id, attempt, run, record, Outcome.KILLED, reason, current=True)

    # -- pool child ---------------------------------------------------------------------

    def on_prerun(self, sender: Any = None, task_id: str | None = None, **_: Any) -> None:
        """A run starts: count it, and record a dead earlier run of the same attempt."""
        if not self._ours(sender) or task_id is None:
            return
        found = record_from_headers(sender, _request_headers(sender.request))
        if found is None:
            return
        attempt, record = found

        def start() -> None:
            now = self._now_ms()
            started = self.runs.start(task_id, attempt, record, now)
            self._running[task_id] = (attempt, started.run, _with_start(record, now))
            if started.dead is not None:
                self._end(
                    task_id, attempt, started.dead_run, started.dead, Outcome.KILLED,
                    "worker_lost_redelivered", current=False,
                )  # fmt: skip

        self._guarded("start", task_id, start)

    def _end_running(self, job_id: str | None, outcome: Outcome, reason: str) -> bool:
        """End the run this process is executing; False when it is not one of ours."""
        if job_id is None or job_id not in self._running:
            return False
        attempt, run, record = self._running.pop(job_id)
        tokens_in, tokens_out = take_metered(job_id)
        self._guarded(
            "finish",
            job_id,
            lambda: self._end(
                job_id, attempt, run, record, outcome, reason, True, tokens_in, tokens_out
            ),
        )
        return True

    def on_success(self, sender: Any = None, **_: Any) -> None:
        if self._ours(sender):
            self._end_running(sender.request.id, Outcome.OK, "ok")

    def on_retry(
        self, sender: Any = None, request: Any = None, reason: Any = None, **_: Any
    ) -> None:
        if self._ours(sender):
            job_id = getattr(request, "id", None) or sender.request.id
            self._end_running(job_id, Outcome.KILLED, "retry")

    def on_failure(
        self, sender: Any = None, task_id: str | None = None, exception: Any = None, **_: Any
    ) -> None:
        """In the child: the task raised. In the main process: time limit or worker lost."""
        if not self._ours(sender) or task_id is None:
            return
        reason = type(exception).__name__ if exception is not None else "failure"
        if not self._end_running(task_id, Outcome.KILLED, reason):
            self._guarded(
                "failure", task_id, lambda: self._finish_elsewhere(sender, task_id, reason)
            )

    # -- both ---------------------------------------------------------------------------

    def _end(
        self,
        job_id: str,
        attempt: int,
        run: int,
        record: RunRecord,
        outcome: Outcome,
        reason: str,
        current: bool,
        tokens_in: int | None = None,
        tokens_out: int | None = None,
    ) -> None:
        now = self._now_ms()
        row = self.runs.row_for(job_id, attempt, record, outcome, now, tokens_in, tokens_out)
        miss = (
            outcome is Outcome.OK and record.decision == "admit_free" and now > record.deadline_ms
        )
        done = self.runs.finish(row, run, record, now, slack_miss=miss, current=current)
        if not done.written:
            return
        self.log.info(
            "ledger_row",
            task=record.task,
            job_id=job_id,
            attempt=attempt,
            run=run,
            path=row.path.value,
            outcome=row.outcome.value,
            reason=reason,
            queue_wait_ms=row.queue_wait_ms,
            tokens_in=row.tokens_in,
            retry_tax=row.retry_tax,
            deadline_slack_ms=row.deadline_slack_ms,
        )
        if miss:
            self.alerts.error(
                "slack_miss",
                decision="admit_free",
                slack_miss=True,
                task=record.task,
                job_id=job_id,
                attempt=attempt,
                dwell_s=record.dwell_s,
                deadline_slack_s=row.deadline_slack_ms / 1000,
                retries=record.retries,
            )
            maybe_freeze(
                self.flags, self.alerts, record.window, done.slack_misses, done.admitted_free,
                self.clock(),
            )  # fmt: skip


def maybe_freeze(
    flags: FlagStore, alerts: Any, window: int, misses: int, admitted: int, now: float
) -> bool:
    """Freeze the free path when a window's misses exceed the error budget; True if frozen."""
    settings = flags.settings
    health = WindowHealth(window_id=window, admitted_free=admitted, slack_misses=misses)
    budget = settings.miss_error_budget
    if not should_freeze(health, budget, settings.miss_min_admissions):
        return False
    if flags.stored().get("free_path_enabled") == "false":
        return False
    reason = (
        f"slack misses {misses}/{admitted} = {misses / admitted:.1%} of free admissions in "
        f"window {window} exceed miss_error_budget {budget:.1%}"
    )
    flags.set("free_path_enabled", "false", reason, "gatekeeper:auto-freeze", now)
    alerts.error(
        "free_path_frozen", window=window, slack_misses=misses, admitted_free=admitted,
        miss_error_budget=budget, reason=reason,
    )  # fmt: skip
    return True


def _with_start(record: RunRecord, started_ms: int) -> RunRecord:
    return replace(record, started_ms=started_ms)
