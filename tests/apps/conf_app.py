"""A Celery app configured as a Django project configures it: ``CELERY_*`` settings through
``config_from_object(..., namespace='CELERY')``, gatekeeper installed before the config is
loaded, and no ``GATEKEEPER_*`` variable. The worker and CLI processes import ``app`` (its
broker from ``CONF_APP_REDIS_URL``, the test's Redis; with ``CONF_APP_DECLARED_QUEUES`` set,
every queue declared in ``task_queues`` and ``task_create_missing_queues`` off; with
``CONF_APP_RESULTS`` set, results kept in that Redis)."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from kombu import Queue

import gatekeeper


def settings_object(redis_url: str) -> type:
    class DjangoSettings:  # what a project's settings.py would say
        CELERY_BROKER_URL = redis_url
        CELERY_TASK_DEFAULT_QUEUE = "celery"
        CELERY_WORKER_PREFETCH_MULTIPLIER = 1
        CELERY_WORKER_HIJACK_ROOT_LOGGER = False
        CELERY_GATEKEEPER_DWELL_GATE_ENABLED = True
        CELERY_GATEKEEPER_CANARY_PERCENT = 100
        CELERY_GATEKEEPER_FLAG_CACHE_S = 0.2
        CELERY_GATEKEEPER_MAX_QUEUE_AGE_S = 0.5
        CELERY_RESULT_BACKEND = redis_url if os.environ.get("CONF_APP_RESULTS") else None

    return DjangoSettings


def declared_queues() -> type:
    class Declared:  # a project that declares its queues, gatekeeper's three included
        CELERY_TASK_CREATE_MISSING_QUEUES = False
        CELERY_TASK_QUEUES = tuple(Queue(name) for name in ("celery", "free", "defer", "reserved"))

    return Declared


def create_app(redis_url: str, declared: bool = False) -> Celery:
    app = Celery("conf_app")
    gatekeeper.install(app)  # first, as a project's celery.py often does

    @gatekeeper.gated(expected_service_s=0.2, tokens_in=10, deadline_s=120)
    @app.task(name="conf.embed", max_retries=0, shared=False)
    def embed(chunk: Any) -> Any:
        return chunk

    @app.task(name="conf.plain", shared=False)
    def plain(task_id: Any = None) -> Any:  # one argument: an errback is published, as a task
        return task_id

    settings = settings_object(redis_url)
    if declared:
        settings = type("DjangoSettings", (declared_queues(), settings), {})
    app.config_from_object(settings, namespace="CELERY")
    return app


if os.environ.get("CONF_APP_REDIS_URL"):
    app = create_app(os.environ["CONF_APP_REDIS_URL"],
                     declared=bool(os.environ.get("CONF_APP_DECLARED_QUEUES")))  # fmt: skip
