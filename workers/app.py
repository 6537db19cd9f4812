"""The Celery app the demo and docker-compose run: ``celery -A workers.app worker -Q free``.

Settings come from the environment, ``.env`` and ``config/gatekeeper.toml`` (this is an edge,
so it reads them). The app is built on first use of ``workers.app.app`` (Celery's ``-A``
finds it there), not at import. A task's normal route, its prior stable path, is the reserved
queue; the gate sends gated tasks to free, defer or reserved.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

import gatekeeper
from gatekeeper.errors import ConfigError
from gatekeeper.settings import GatekeeperSettings, load_settings
from workers.tasks import register_tasks

__all__ = ["create_app"]

_app: Celery | None = None


def create_app(settings: GatekeeperSettings | None = None) -> Celery:
    """Build the app with its demo task and install the gate; ConfigError without a broker."""
    settings = settings or load_settings()
    broker = settings.effective_broker_url
    if not broker:
        raise ConfigError(
            "GATEKEEPER_BROKER_URL: expected a broker URL such as redis://127.0.0.1:6379/0, "
            "got none (GATEKEEPER_REDIS_URL stands for it, unless it is a Redis Cluster)"
        )
    app = Celery("gatekeeper_workers", broker=broker)
    app.conf.update(
        task_default_queue=settings.reserved_queue,
        task_create_missing_queues=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        broker_transport_options=dict(settings.broker_transport_options),  # a Sentinel's master
    )
    register_tasks(app, settings)
    gatekeeper.install(app, settings)
    return app


def __getattr__(name: str) -> Any:
    """``workers.app.app`` (and ``.celery``): the app from the environment, built once."""
    global _app
    if name in ("app", "celery"):
        if _app is None:
            _app = create_app()
        return _app
    raise AttributeError(name)
