"""A Celery app for the end-to-end tests: gated tasks that record each run in Redis.

The worker subprocess imports ``app`` (settings from its environment); tests build their own
instance with :func:`create_app` and explicit settings. Same task names in both.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery
from celery.exceptions import Ignore, Reject, Retry

import gatekeeper
from gatekeeper.errors import LedgerUnavailable
from gatekeeper.redis.connect import client_for
from gatekeeper.settings import GatekeeperSettings, load_settings

RUNS_KEY = "test:runs"
"""List of JSON records, one per task run: task, id, attempt, queue, gatekeeper headers."""
HELD_KEY = "test:held"
"""List of JSON lists, one per run of ``tests.held``: the task ids its process held open."""


def create_app(
    settings: GatekeeperSettings,
    broker_url: str,
    clock: Callable[[], float] = time.time,
    recorder_url: str | None = None,
) -> Celery:
    """The test app; its runs are recorded on ``recorder_url``, else the gate's Redis (a gate
    user held to gatekeeper's keys by an ACL records them on the broker)."""
    app = Celery("gated_app", broker=broker_url)
    app.conf.update(
        task_default_queue="celery",
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    recorder = client_for(recorder_url or settings.redis_url or broker_url, 5.0)

    def record(task: Any) -> None:
        request = task.request
        headers = {
            key: getattr(request, key)
            for key in (
                "gatekeeper_attempt",
                "gatekeeper_deadline_at",
                "gatekeeper_first_published_at",
                "gatekeeper_published_at",
                "gatekeeper_decision",
            )
            if getattr(request, key, None) is not None
        }
        recorder.rpush(
            RUNS_KEY,
            json.dumps(
                {
                    "task": task.name,
                    "id": request.id,
                    "attempt": request.retries + 1,
                    "queue": (request.delivery_info or {}).get("routing_key"),
                    "pid": os.getpid(),
                    **headers,
                }
            ),
        )

    def runs_of(job_id: str) -> int:
        return sum(json.loads(raw)["id"] == job_id for raw in recorder.lrange(RUNS_KEY, 0, -1))

    @gatekeeper.gated(expected_service_s=1, tokens_in=100, deadline_s=60)
    @app.task(bind=True, name="tests.embed", max_retries=1, shared=False)
    def embed(self: Any, chunk: Any, sleep_s: float = 0.0) -> Any:
        record(self)
        time.sleep(sleep_s)
        return chunk

    @gatekeeper.gated(expected_service_s=1, tokens_in=100, deadline_s=60)
    @app.task(bind=True, name="tests.flaky", max_retries=1, shared=False)
    def flaky(self: Any, sleep_s: float = 0.0, then_s: float = 0.0) -> str:
        record(self)
        if self.request.retries == 0:
            time.sleep(sleep_s)
            raise self.retry(countdown=0)
        time.sleep(then_s)
        return "ok"

    @gatekeeper.gated(expected_service_s=1, tokens_in=100, deadline_s=60)
    @app.task(bind=True, name="tests.nothrow", max_retries=1, shared=False)
    def nothrow(self: Any, then_s: float = 0.0) -> str:
        """Attempt 1 publishes its retry (``throw=False``) and goes on: both attempts end ok."""
        record(self)
        if self.request.retries == 0:
            self.retry(countdown=0, throw=False)
        time.sleep(then_s)
        return "ok"

    kill_spec = {"expected_service_s": 1, "tokens_in": 1200, "deadline_s": 60}

    @app.task(bind=True, name="tests.boom", max_retries=0, shared=False, gatekeeper=kill_spec)
    def boom(self: Any) -> None:
        record(self)
        raise ValueError("boom")

    @app.task(bind=True, name="tests.ignores", max_retries=0, shared=False, gatekeeper=kill_spec)
    def ignores(self: Any) -> None:
        record(self)
        raise Ignore()  # no end signal but task_postrun (Task.replace raises it too)

    @app.task(bind=True, name="tests.replaces", max_retries=0, shared=False, gatekeeper=kill_spec)
    def replaces(
        self: Any, chunk: Any, sleep_s: float = 0.0, chained: bool = False, countdown: float = 0,
        ungated: bool = False,
    ) -> Any:  # fmt: skip
        """Replaced by ``tests.embed`` (gated too), which Celery publishes with this task's id
        while this run is still going (then raises ``Ignore``); ``chained``: by a chain of
        two, whose last task takes this task's id (published once the first has run);
        ``ungated``: by ``tests.plain``."""
        record(self)
        if ungated:
            raise self.replace(plain.s())
        if chained:
            raise self.replace(embed.s(chunk, sleep_s) | embed.s())
        raise self.replace(embed.s(chunk, sleep_s).set(countdown=countdown or None))

    @gatekeeper.gated(expected_service_s=1, tokens_in=100, deadline_s=600)
    @app.task(bind=True, name="tests.limited", max_retries=0, shared=False, rate_limit="12/m")
    def limited(self: Any) -> None:
        """One run every five seconds in a worker: the next waits there, received."""
        record(self)

    @app.task(bind=True, name="tests.rejects", max_retries=0, shared=False, gatekeeper=kill_spec,
              acks_late=True)  # fmt: skip
    def rejects(self: Any, requeue: bool = True, sleep_s: float = 0.0) -> str:
        """Rejects its first run (requeued: its copy returns ok), or every run."""
        record(self)
        time.sleep(sleep_s)
        if not requeue or runs_of(self.request.id) == 1:
            raise Reject("not now", requeue=requeue)  # no end signal but task_postrun either
        return "ok"

    class RejectsAfterItsBody(app.Task):  # type: ignore[misc]  # Celery is untyped
        """``on_success`` rejects the message of a run whose body returned (Celery sends no
        ``task_success`` then): requeued on the first run only (its copy returns ok), or
        dropped; or raises an ordinary exception (``how="raise"``)."""

        def on_success(self, retval: Any, task_id: str, args: Any, kwargs: Any) -> None:
            how = kwargs.get("how", "requeue")
            if how == "raise":
                raise RuntimeError("on_success failed")
            if how == "drop" or runs_of(task_id) == 1:
                raise Reject("not after all", requeue=how != "drop")

    @app.task(bind=True, name="tests.rejects_after", base=RejectsAfterItsBody, max_retries=0,
              shared=False, gatekeeper=kill_spec, acks_late=True)  # fmt: skip
    def rejects_after(self: Any, how: str = "requeue") -> str:
        record(self)
        return "ok"

    @app.task(
        bind=True, name="tests.soft", max_retries=0, soft_time_limit=0.5, shared=False,
        gatekeeper=kill_spec,
    )  # fmt: skip
    def soft(self: Any) -> None:
        record(self)
        time.sleep(5)

    @app.task(
        bind=True, name="tests.hard", max_retries=0, time_limit=1, shared=False,
        gatekeeper=kill_spec,
    )  # fmt: skip
    def hard(self: Any) -> None:
        record(self)
        time.sleep(10)

    @app.task(
        bind=True, name="tests.hard_requeued", max_retries=1, time_limit=3, acks_late=True,
        acks_on_failure_or_timeout=False, shared=False, gatekeeper=kill_spec,
    )  # fmt: skip
    def hard_requeued(self: Any) -> None:
        """Its first run is cut by the hard limit and its message requeued (acks_late, no ack
        on timeout); the copy retries: the job goes on."""
        record(self)
        if runs_of(self.request.id) == 1:
            time.sleep(10)
        if self.request.retries == 0:
            raise self.retry(countdown=0)

    @app.task(bind=True, name="tests.sleepy", max_retries=0, shared=False, gatekeeper=kill_spec)
    def sleepy(self: Any, sleep_s: float = 30) -> str:
        record(self)
        time.sleep(sleep_s)
        return "slept"

    @app.task(bind=True, name="tests.bare_retry", max_retries=0, shared=False, gatekeeper=kill_spec)
    def bare_retry(self: Any, sleep_s: float = 0.0) -> str:
        """Raises ``Retry`` itself: Celery marks the run retried, but publishes nothing."""
        record(self)
        time.sleep(sleep_s)
        raise Retry()

    @app.task(
        bind=True, name="tests.lost_late", max_retries=0, acks_late=True,
        reject_on_worker_lost=True, shared=False, gatekeeper=kill_spec,
    )  # fmt: skip
    def lost_late(self: Any, deaths: int = 1) -> str:
        record(self)
        if runs_of(self.request.id) <= deaths:
            time.sleep(30)  # the test kills this run's process (``deaths`` runs in turn)
        return "last run"

    @app.task(
        bind=True, name="tests.lost_retry", max_retries=1, retry_on_worker_lost=True,
        default_retry_delay=0, shared=False, gatekeeper=kill_spec,
    )  # fmt: skip
    def lost_retry(self: Any) -> str:
        """Its first run is killed by the test; Celery 5.7 retries it (``retry_on_worker_lost``)."""
        record(self)
        if self.request.retries == 0:
            time.sleep(30)
        return "retried"

    @app.task(bind=True, name="tests.metered", max_retries=0, shared=False, gatekeeper=kill_spec)
    def metered(self: Any, fail: bool = False) -> None:
        record(self)
        gatekeeper.meter(tokens_in=777, tokens_out=5)
        if fail:
            raise RuntimeError("after metering")

    @gatekeeper.gated(expected_service_s=0.1, tokens_in=10, deadline_s=60)
    @app.task(bind=True, name="tests.calls_metered", max_retries=0, shared=False)
    def calls_metered(self: Any, own: int | None = None) -> None:
        """Calls the metering task directly (its meter() keeps nothing); ``own``: then meters
        its own attempt by id, as the README says to."""
        record(self)
        metered()
        if own is not None:
            gatekeeper.meter(tokens_in=own, task_id=self.request.id)

    @gatekeeper.gated(expected_service_s=0.1, tokens_in=10, deadline_s=60)
    @app.task(bind=True, name="tests.coinflip", max_retries=2, shared=False)
    def coinflip(self: Any, chunk: int) -> int:
        record(self)
        if self.request.retries == 0 and chunk % 3 == 0:
            raise self.retry(countdown=0, exc=RuntimeError("injected kill"))
        return chunk

    @gatekeeper.gated(expected_service_s=0.3, tokens_in=100, deadline_s=600)
    @app.task(bind=True, name="tests.taxed", max_retries=0, shared=False)
    def taxed(self: Any, fail: bool, sleep_s: float) -> str:
        """The budget tests' task: 100 tokens, raises (killed) or returns (ok)."""
        record(self)
        time.sleep(sleep_s)
        if fail:
            raise RuntimeError("every attempt dies")
        return "ok"

    @app.task(
        bind=True, name="tests.late", max_retries=0, acks_late=True, shared=False,
        gatekeeper=kill_spec,
    )  # fmt: skip
    def late(self: Any) -> str:
        """acks_late: its first run sleeps until the test kills the whole worker."""
        record(self)
        if runs_of(self.request.id) == 1:
            time.sleep(30)
        return "second run"

    @gatekeeper.gated(expected_service_s=0.8, tokens_in=100, deadline_s=60)
    @app.task(bind=True, name="tests.long_tail", max_retries=0, shared=False)
    def long_tail(self: Any, sleep_s: float) -> str:
        """Declared at 0.8 s, runs as long as it is told (SPEC section 6's 8 s guess, scaled)."""
        record(self)
        time.sleep(sleep_s)
        return "ok"

    @app.task(bind=True, name="tests.die", shared=False)
    def die(self: Any) -> None:
        """Kills its own process at once, gated or not (tests/test_lines.py)."""
        os.kill(os.getpid(), signal.SIGKILL)

    class DiesInOnSuccess(app.Task):  # type: ignore[misc, name-defined]
        """Kills its pool child in ``on_success``: after the result is stored, before
        ``task_success`` (an OOM kill there, say)."""

        def on_success(self, retval: Any, task_id: str, args: Any, kwargs: Any) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

    @app.task(bind=True, name="tests.dies_after", base=DiesInOnSuccess, max_retries=0,
              shared=False, gatekeeper=kill_spec)  # fmt: skip
    def dies_after(self: Any) -> str:
        record(self)
        return "ok"

    @app.task(bind=True, name="tests.held", shared=False)
    def held(self: Any) -> None:
        """Records the runs its process's worker side holds open (ungated: its start reads
        none of the starts left unread)."""
        worker = installed.worker
        kept = (set(worker._running) | set(worker._starts.by_job)) - {self.request.id}
        recorder.rpush(HELD_KEY, json.dumps(sorted(kept)))

    @app.task(bind=True, name="tests.plain", shared=False)
    def plain(self: Any) -> str:
        record(self)
        return "plain"

    installed = gatekeeper.install(app, settings, clock=clock)
    return app


def _from_environment() -> Celery:
    settings = load_settings()
    fixed = os.environ.get("GATEKEEPER_TEST_CLOCK")
    clock = (lambda: float(fixed)) if fixed else time.time
    recorder = os.environ.get("GATEKEEPER_TEST_RECORDER_URL")
    app = create_app(settings, os.environ["GATEKEEPER_BROKER_URL"], clock, recorder)
    backend = os.environ.get("GATEKEEPER_TEST_RESULT_BACKEND")
    if backend:  # results stored (tests.dies_after: Celery 5.7 asks whether SUCCESS was)
        app.conf.result_backend = backend
    visibility = os.environ.get("GATEKEEPER_TEST_VISIBILITY_S")
    if visibility:  # kombu's Redis transport restores unacked messages older than this
        app.conf.broker_transport_options = {"visibility_timeout": float(visibility)}
    return app


def _freeze_check_unanswered_once() -> None:
    """The auto-freeze's first flag read gets no answer (a Redis gone silent right after
    finish.lua answered): GATEKEEPER_TEST_FREEZE_READ_SILENT=1."""
    from gatekeeper.celery import freeze

    real, done = freeze.maybe_freeze, []

    def maybe_freeze(*args: Any, **kwargs: Any) -> bool:
        if not done:
            done.append(1)
            silent = redis.TimeoutError("Timeout reading from socket")
            raise LedgerUnavailable(f"cannot read flags: {silent}") from silent
        return real(*args, **kwargs)

    freeze.maybe_freeze = maybe_freeze  # type: ignore[assignment]


if os.environ.get("GATEKEEPER_TEST_WORKER") == "1":
    app = _from_environment()
    if os.environ.get("GATEKEEPER_TEST_FREEZE_READ_SILENT") == "1":
        _freeze_check_unanswered_once()
