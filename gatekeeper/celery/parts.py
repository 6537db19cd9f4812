"""What an install builds when it is first needed, not at ``install()``: the settings (from
the app's config too), the gate's Redis client, the pipeline and the worker side.

Django projects often load their Celery config after the module that calls ``install(app)``
is imported, and an app in ``task_always_eager`` mode never needs Redis at all: so
``install()`` only wraps the sender and connects the signals, and :func:`build` runs at the
first gated publish or the first signal. Settings that do not validate raise
:class:`~gatekeeper.errors.ConfigError` there, naming the field. No Redis URL (or a broker
that is not Redis, with no ``redis_url``) is no error: the gate's client then fails every
call at once (:func:`unconfigured_client`), so gated publishes fail closed as with an
unreachable Redis (reserved, ``gate_unavailable``; with the gate off in the settings, their
own route unless it reaches free), each decision line saying why. A broker that is neither
Redis nor RabbitMQ (``sqs://``, ``memory://``: deferred work would have nothing able to read
it) refuses gating the same way, with an ``event=broker_unsupported`` error line at first use.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery
from celery.signals import (
    task_failure,
    task_postrun,
    task_prerun,
    task_received,
    task_retry,
    task_revoked,
    task_success,
    worker_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)

from gatekeeper.celery.broker import check_broker
from gatekeeper.celery.expiry import Expiry
from gatekeeper.celery.heartbeat import Heartbeat
from gatekeeper.celery.worker import WorkerSide
from gatekeeper.errors import ConfigError
from gatekeeper.logs import make_logger
from gatekeeper.redis.breaker import no_retry
from gatekeeper.redis.connect import client_for
from gatekeeper.redis.deployment import announcer
from gatekeeper.redis.gate import Pipeline
from gatekeeper.settings import GatekeeperSettings, load_settings

__all__ = ["SIGNALS", "Parts", "build", "gate_client", "unconfigured_client"]

SIGNALS = (
    (task_received, "worker", "on_received"),
    (task_prerun, "worker", "on_prerun"),
    (task_success, "worker", "on_success"),
    (task_failure, "worker", "on_failure"),
    (task_retry, "worker", "on_retry"),
    (task_postrun, "worker", "on_postrun"),  # before the lines' flush (hook.connect)
    (task_revoked, "worker", "on_revoked"),
    (worker_init, "expiry", "on_worker_init"),
    (worker_init, "heartbeat", "on_init"),
    (worker_ready, "heartbeat", "on_ready"),
    (worker_process_shutdown, "worker", "on_process_exit"),  # rows kept unanswered: once more
    (worker_shutdown, "worker", "on_process_exit"),  # (before the heartbeat that keeps them)
    (worker_shutdown, "heartbeat", "on_shutdown"),
)
"""The Celery signals an install listens to: (signal, part, method)."""


@dataclass(frozen=True)
class Parts:
    """An install's working parts, built once."""

    settings: GatekeeperSettings
    client: redis.Redis
    pipeline: Pipeline
    worker: WorkerSide
    expiry: Expiry
    heartbeat: Heartbeat
    unconfigured: str | None
    """Why the gate has no Redis (no URL configured), or None."""
    queues: tuple[str, str, str]
    """The free, defer and reserved queue names (read on every gated publish)."""


def gate_client(settings: GatekeeperSettings) -> redis.Redis:
    """The gate's client: ``redis_url``, else the broker's when it is Redis (ConfigError when
    neither). Short timeouts: an unreachable gate must cost a publish milliseconds, not
    seconds. No automatic retry (redis-py 6+ retries a timeout several times by default): a
    timeout opens the pipeline's breaker and the publish fails closed."""
    url = settings.gate_redis_url()
    options = settings.transport_options_for(url)  # the broker's, when the gate is the broker
    return client_for(url, settings.redis_timeout_s, options, **no_retry())


class _Unconfigured(redis.Connection):
    """A connection that never connects: every call fails at once with ``reason``."""

    reason = "the gate's Redis is not configured"

    def connect(self, *args: Any, **kwargs: Any) -> None:
        raise redis.ConnectionError(self.reason)


def unconfigured_client(reason: str) -> redis.Redis:
    """A client whose every call raises ``ConnectionError(reason)``, touching no network."""
    connection = type("Unconfigured", (_Unconfigured,), {"reason": reason})
    return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=connection))


def build(
    app: Celery,
    settings: GatekeeperSettings | None,
    client: redis.Redis | None,
    clock: Callable[[], float] = time.time,
) -> Parts:
    """The parts of one install; raises ConfigError for settings that do not validate."""
    settings = settings or load_settings(app=app)
    if not app.conf.task_create_missing_queues:
        missing = {settings.free_queue, settings.defer_queue, settings.reserved_queue} - set(
            app.amqp.queues
        )
        if missing:
            raise ConfigError(
                f"task_queues: expected gatekeeper's queues to be declared when "
                f"task_create_missing_queues is off, missing {sorted(missing)}"
            )
    unconfigured = None
    broker = settings.effective_broker_url
    try:
        options = settings.broker_transport_options or app.conf.get("broker_transport_options")
        check_broker(broker, options=options if isinstance(options, dict) else None)
    except ConfigError as exc:
        if broker:  # a transport gatekeeper cannot read: gating is refused, said once
            unconfigured = f"gating refused: {exc}"
            client = unconfigured_client(unconfigured)
            make_logger(settings, "decision").error(
                "broker_unsupported", broker=broker.split("://", 1)[0], reason=str(exc)
            )
    if client is None:
        try:
            client = gate_client(settings)
        except ConfigError as exc:
            unconfigured = f"no gate Redis: {exc}"
            client = unconfigured_client(unconfigured)
            make_logger(settings, "decision").warning("gate_unconfigured", reason=unconfigured)
    pipeline = Pipeline.create(settings, client, clock)
    worker = WorkerSide(app, settings, client, pipeline.flags, clock)
    expiry = Expiry(app, settings, client, worker.log, clock, worker.on_lost_after_success)
    heartbeat = Heartbeat(app, client, pipeline.store.keys, settings.worker_heartbeat_s,
                          also=announcer(client, pipeline.store.keys, settings, pipeline.log,
                                         pipeline.flags.breaker, rows=True))  # fmt: skip
    queues = (settings.free_queue, settings.defer_queue, settings.reserved_queue)
    return Parts(settings, client, pipeline, worker, expiry, heartbeat, unconfigured, queues)
