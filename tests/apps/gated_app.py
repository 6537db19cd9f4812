"""A Celery app for the end-to-end tests: gated tasks that record each run in Redis.

The worker subprocess imports ``app`` (settings from its environment); tests build their own
instance with :func:`create_app` and explicit settings. Same task names in both.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

import gatekeeper
from gatekeeper.settings import GatekeeperSettings, load_settings

RUNS_KEY = "test:runs"
"""List of JSON records, one per task run: task, id, attempt, queue, gatekeeper headers."""


def create_app(settings: GatekeeperSettings, broker_url: str) -> Celery:
    app = Celery("gated_app", broker=broker_url)
    app.conf.update(
        task_default_queue="celery",
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    recorder = redis.Redis.from_url(settings.redis_url or broker_url)

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
                    **headers,
                }
            ),
        )

    @gatekeeper.gated(expected_service_s=1, tokens_in=100, deadline_s=60)
    @app.task(bind=True, name="tests.embed", max_retries=1, shared=False)
    def embed(self: Any, chunk: Any, sleep_s: float = 0.0) -> Any:
        record(self)
        time.sleep(sleep_s)
        return chunk

    @gatekeeper.gated(expected_service_s=1, tokens_in=100, deadline_s=60)
    @app.task(bind=True, name="tests.flaky", max_retries=1, shared=False)
    def flaky(self: Any) -> str:
        record(self)
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        return "ok"

    @app.task(bind=True, name="tests.plain", shared=False)
    def plain(self: Any) -> str:
        record(self)
        return "plain"

    gatekeeper.install(app, settings)
    return app


def _from_environment() -> Celery:
    settings = load_settings()
    return create_app(settings, os.environ["GATEKEEPER_BROKER_URL"])


if os.environ.get("GATEKEEPER_TEST_WORKER") == "1":
    app = _from_environment()
