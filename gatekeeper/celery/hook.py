"""The publish seam: :func:`install` wraps one app's task sender and connects worker signals.

Every publish of a gated task goes through :meth:`Installed.send_task_message`, which reads
top to bottom: find the task's spec, decide (:class:`gatekeeper.redis.gate.Pipeline`), address
the message to the chosen queue, send it. Ungated tasks pass straight through.

Why the sender and not a router or ``before_task_publish``: a ``before_task_publish`` handler
cannot change the queue (Celery passes it by value), and routers see neither the task id nor
``retries``. The sender sees every publish, retries and canvas included, with the built
headers, and takes ``queue=`` (:mod:`gatekeeper.celery.private` holds that touch of private
API and its shape check).

To make the message really land in the chosen queue whatever the caller or a router chose,
it is addressed to the queue by name on the default exchange: ``exchange`` and
``routing_key`` are cleared so that an explicit ``queue=``, a route, or a retry's previous
``delivery_info`` cannot send it elsewhere.

When the broker is the gate's Redis, fast publish (:mod:`gatekeeper.celery.fastpath`) lets
``gate.lua`` push the message Celery built in the same round trip as the decision: the
``send`` step is then already done when the decision returns.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery
from kombu.exceptions import OperationalError

from gatekeeper.celery.expiry import Expiry
from gatekeeper.celery.fastpath import FastRender, possible, publish_observed, same_server
from gatekeeper.celery.gating import spec_of
from gatekeeper.celery.heartbeat import Heartbeat
from gatekeeper.celery.private import bound_for, check_celery_shape, replace_sender
from gatekeeper.celery.worker import WorkerSide
from gatekeeper.core.dwell import Decision, Reason
from gatekeeper.core.headers import H_WINDOW
from gatekeeper.core.spec import GatedSpec
from gatekeeper.errors import BadDeclaredInput, ConfigError, GatekeeperError, PublishFailed
from gatekeeper.redis.breaker import no_retry
from gatekeeper.redis.gate import Pipeline, Publish, Routing
from gatekeeper.settings import GatekeeperSettings, load_settings

__all__ = ["Installed", "install"]

_installed: weakref.WeakKeyDictionary[Any, Installed] = weakref.WeakKeyDictionary()
_install_lock = threading.Lock()


def _client(settings: GatekeeperSettings) -> redis.Redis:
    url = settings.gate_redis_url()
    # Short timeouts: an unreachable gate must cost a publish milliseconds, not seconds. No
    # automatic retry (redis-py 6+ retries a timeout several times by default): a timeout
    # opens the pipeline's breaker and the publish fails closed (gatekeeper/redis/breaker.py).
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=settings.redis_timeout_s,
        socket_timeout=settings.redis_timeout_s,
        **no_retry(),
    )


@dataclass(frozen=True)
class _Gated:
    """A gated task's spec (or why it is malformed) and its max_retries, cached by name."""

    spec: GatedSpec | None
    error: BadDeclaredInput | None
    max_retries: int | None


class Installed:
    """Gatekeeper installed on one Celery app: the wrapped sender and the worker hooks."""

    def __init__(
        self,
        app: Celery,
        settings: GatekeeperSettings,
        client: redis.Redis,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.app = app
        self.settings = settings
        self.client = client
        self.pipeline = Pipeline.create(settings, client, clock)
        self.keys, self.store, self.flags = (
            self.pipeline.store.keys,
            self.pipeline.store,
            self.pipeline.flags,
        )
        self.log = self.pipeline.log
        self.worker = WorkerSide(app, settings, client, self.flags, clock)
        self.expiry = Expiry(app, settings, client, self.worker.log, clock)
        self.heartbeat = Heartbeat(app, client, self.keys, settings.worker_heartbeat_s)
        self.original_sender = check_celery_shape(app)
        self.queues = (settings.free_queue, settings.defer_queue, settings.reserved_queue)
        self._specs: dict[str, _Gated | None] = {}
        self._same_server: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()

    def send_task_message(self, producer: Any, name: str, message: Any, **options: Any) -> Any:
        """The wrapped sender: gated tasks are decided, addressed and sent; others pass."""
        try:
            found = self._spec(name)
        except Exception:  # an app that cannot list its tasks must not break publishing
            found = None
        if found is None:
            return self.original_sender(producer, name, message, **options)
        publish, routing = self._decide(found, producer, name, message, options)
        if routing.published:
            return None  # gate.lua (or fallback.lua) pushed it with its decision
        self._address(message, options, routing)
        return self._send(producer, name, message, options, publish, routing)

    # -- the steps, in the order a publish takes them ---------------------------------------

    def _spec(self, name: str) -> _Gated | None:
        """What the hook needs of a task by name, looked up once; None when it is not gated.

        A name the app does not know (yet) is looked up again next time, so a task
        registered after its first publish by name is still gated.
        """
        if name in self._specs:
            return self._specs[name]
        task = self.app.tasks.get(name)
        if task is None:
            return None
        try:
            spec, error = spec_of(task), None
        except BadDeclaredInput as exc:
            spec, error = None, exc
        gated = None
        if spec is not None or error is not None:
            gated = _Gated(spec, error, getattr(task, "max_retries", None))
        self._specs[name] = gated
        return gated

    def _decide(
        self, found: _Gated, producer: Any, name: str, message: Any, options: dict[str, Any]
    ) -> tuple[Publish | None, Routing]:
        """The routing of one gated publish; never raises but for a fast publish that could
        not be pushed at all (the broker, the gate's own Redis, is down)."""
        extra = dict(options.get("headers") or {})
        publish: Publish | None = None
        render: FastRender | None = None
        try:
            # The id the message will carry: a caller's ``id`` header overrides Celery's own
            # when Celery merges the headers, and the record must be the message's.
            headers = {**message.headers, **extra}
            publish = Publish(
                task=name,
                job_id=str(headers["id"]),
                retries=int(headers.get("retries") or 0),
                max_retries=found.max_retries,
                spec=found.spec,
                headers=headers,
                spec_error=found.error,
            )
            render = self._renderer(producer, name, message, options)
            routing = self.pipeline.route(publish, render)
            if routing.decision is None and (
                routing.reason is Reason.FLAGS_UNREAD or not self.flags.current().free_path_enabled
            ):
                routing = self._own_route(publish, options, routing)
        except PublishFailed as exc:
            raise OperationalError(str(exc)) from exc
        except Exception as exc:  # never break the caller's publish; never route to free
            stub = publish or Publish(name, "unknown", 0, None, found.spec, {})
            # Fast publish: Celery already built and "sent" the message (its signals fired),
            # so the pipeline pushes that one; sending it again could publish it twice.
            push = render.push if render is not None else None
            try:
                routing = self.pipeline.fail_closed(stub, Reason.GATE_ERROR, repr(exc), push)
            except PublishFailed as failed:
                raise OperationalError(str(failed)) from failed
        return publish, routing

    def _renderer(
        self, producer: Any, name: str, message: Any, options: dict[str, Any]
    ) -> FastRender | None:
        """The fast-publish renderer, unless the setting is off; whether this publish can
        take it is asked only when the decision needs the gate script (:meth:`_fits`)."""
        if self.settings.fast_publish == "off":
            return None
        return FastRender(self.original_sender, producer, name, message, options, self.queues,
                          lambda: self._fits(producer, message))  # fmt: skip

    def _fits(self, producer: Any, message: Any) -> bool:
        """Whether this publish can take fast publish (see :mod:`gatekeeper.celery.fastpath`)."""
        if self.settings.fast_publish == "auto" and (
            publish_observed(type(producer)) or getattr(message, "sent_event", None) is not None
        ):
            return False  # "auto": something would see this publish, so Celery's own way
        if not possible(self.app, producer, self.queues):
            return False
        broker = getattr(getattr(producer, "channel", None), "client", None)
        pool = getattr(broker, "connection_pool", None)
        if pool is None:
            return False
        same = self._same_server.get(pool)
        if same is None:
            breaker = self.store.breaker
            if breaker is not None and breaker.is_open:
                return False  # not asked of a server that is not answering: Celery's own way
            same = same_server(broker, self.client)
            if same is not None:  # unknown (a server unreachable): asked again next time
                self._same_server[pool] = same
        return bool(same)

    def _own_route(self, publish: Publish, options: dict[str, Any], routing: Routing) -> Routing:
        """A gated task left on its own route (the gate off, outside the canary, or the flags
        never read) keeps it, unless that route is the free queue and the free path may be
        closed: then it is decided as if the gate were on (reserved while it is closed)."""
        try:
            to_free = bound_for(self.app, options, self.settings.free_queue)
        except Exception:  # a route this cannot read: as if it were free
            to_free = True
        if to_free:
            return self.pipeline.route(publish, off_free=True)
        if routing.reason is Reason.FLAGS_UNREAD:
            self.pipeline.kept_own_route(publish)
        return routing

    @staticmethod
    def _address(message: Any, options: dict[str, Any], routing: Routing) -> None:
        """Point the publish at the chosen queue by name, whatever else asked for another;
        headers that were bad inputs are not forwarded (from the caller's or Celery's)."""
        if routing.queue is None:
            return  # untouched: its normal route
        options["queue"] = routing.queue
        options["exchange"] = None
        options["routing_key"] = None
        options.pop("exchange_type", None)
        headers = {**(options.get("headers") or {}), **routing.headers}
        for name in routing.drop:
            headers.pop(name, None)
            message.headers.pop(name, None)
        options["headers"] = headers

    def _send(
        self,
        producer: Any,
        name: str,
        message: Any,
        options: dict[str, Any],
        publish: Publish | None,
        routing: Routing,
    ) -> Any:
        """Celery's own sender; if the broker refuses an admitted message, the admission is
        given back before the caller sees the broker's error."""
        try:
            return self.original_sender(producer, name, message, **options)
        except Exception:
            if publish is not None and routing.decision is Decision.ADMIT_FREE:
                window = routing.headers.get(H_WINDOW, 0)
                try:
                    self.store.release(
                        publish.job_id, publish.attempt, int(window), unpublished=True
                    )
                except (GatekeeperError, TypeError, ValueError) as exc:
                    self.log.warning("release_failed", job_id=publish.job_id, error=str(exc))
            raise


def install(
    app: Celery,
    settings: GatekeeperSettings | None = None,
    *,
    client: redis.Redis | None = None,
    clock: Callable[[], float] = time.time,
) -> Installed:
    """Install the gate on ``app`` and return it; installing twice returns the first install.

    ``settings`` default to the environment (``load_settings()``); ``client`` to a Redis client
    on ``settings.redis_url`` (else ``broker_url``).
    """
    with _install_lock:
        existing = _installed.get(app)
        if existing is not None:
            return existing
        settings = settings or load_settings()
        if not app.conf.task_create_missing_queues:
            declared = set(app.amqp.queues)
            wanted = {settings.free_queue, settings.defer_queue, settings.reserved_queue}
            missing = wanted - declared
            if missing:
                raise ConfigError(
                    f"task_queues: expected gatekeeper's queues to be declared when "
                    f"task_create_missing_queues is off, missing {sorted(missing)}"
                )
        gate = Installed(app, settings, client or _client(settings), clock)
        replace_sender(app, gate.send_task_message)
        gate.worker.connect()
        gate.expiry.connect()
        gate.heartbeat.connect()
        _installed[app] = gate
        return gate
