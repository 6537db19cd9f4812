"""The Celery app the demo and docker-compose run: ``celery -A workers.app worker -Q free``.

Settings come from the environment, ``.env`` and ``config/gatekeeper.toml`` (this is an
edge, so it reads them). The queues are declared here so that every worker and producer
agrees on them; a task's normal route (its prior stable path) is the reserved queue.
"""

from __future__ import annotations

from celery import Celery

from gatekeeper.errors import ConfigError
from gatekeeper.settings import GatekeeperSettings, load_settings

__all__ = ["create_app"]


def create_app(settings: GatekeeperSettings | None = None) -> Celery:
    """Build the app; raises ConfigError when no broker is configured."""
    settings = settings or load_settings()
    broker = settings.effective_broker_url
    if not broker:
        raise ConfigError(
            "GATEKEEPER_BROKER_URL or GATEKEEPER_REDIS_URL: expected a broker URL such as "
            "redis://127.0.0.1:6379/0, got neither"
        )
    app = Celery("gatekeeper_workers", broker=broker, include=["workers.tasks"])
    app.conf.update(
        task_default_queue=settings.reserved_queue,
        task_create_missing_queues=True,
        worker_prefetch_multiplier=1,
        task_acks_late=False,
        broker_connection_retry_on_startup=True,
    )
    return app
