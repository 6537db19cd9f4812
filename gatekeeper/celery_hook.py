"""The Celery adapter: :func:`install` wraps one app's task sender and connects worker signals.

The worker signals live in :mod:`gatekeeper.worker`.

Why the sender and not a router or ``before_task_publish``: a ``before_task_publish`` handler
cannot change the queue (Celery passes it by value), and routers see neither the task id nor
``retries``. The function that ``app.amqp._create_task_sender()`` returns sees every publish,
retries and canvas included, with the built headers (``id``, ``task``, ``retries``), and takes
``queue=``; ``app.amqp.send_task_message`` caches it, so setting that attribute on one app's
``amqp`` replaces it for that app alone. This is private API: :func:`check_celery_shape` fails
loudly at install (and in the test suite) if its shape changes.

To make the message really land in the chosen queue whatever the caller or a router chose, the
wrapper publishes to the queue by name on the default exchange: ``exchange`` and
``routing_key`` are cleared so that an explicit ``queue=``, a route, or a retry's previous
``delivery_info`` cannot send it elsewhere.

``install`` also wraps ``app.send_task`` (the same per-app attribute trick), only to start the
decision early: it fixes the task id and sends the gate script before Celery routes and builds
the message, and the wrapped sender reads the reply, so the round trip runs alongside Celery's
own work (:mod:`gatekeeper.early_start`). :func:`check_send_task_shape` guards the parameters
it reads. Publishes that do not pass through ``send_task`` are decided in the sender from
start to end.
"""

from __future__ import annotations

import inspect
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery
from kombu.exceptions import OperationalError

from gatekeeper.early_start import EarlyStart
from gatekeeper.errors import ConfigError, GatekeeperError, PublishFailed
from gatekeeper.fastpath import (
    PLACEHOLDERS,
    Push,
    capture_message,
    fast_path_possible,
    publish_observed,
    same_server,
)
from gatekeeper.pipeline import (
    FLAGS_UNREAD,
    GATE_ERROR,
    Pipeline,
    Publish,
)
from gatekeeper.settings import GatekeeperSettings, load_settings
from gatekeeper.spec import H_FREE_ADMITTED, H_WINDOW, BadDeclaredInput, GatedSpec, spec_of
from gatekeeper.worker import WorkerSide

__all__ = ["Installed", "check_celery_shape", "install"]

SENDER_PARAMETERS = ("producer", "name", "message", "exchange", "routing_key", "queue", "headers")
"""Parameters of Celery's task sender that the wrapper relies on, in this order."""
SEND_TASK_PARAMETERS = ("name", "args", "kwargs", "countdown", "eta", "task_id")
"""The leading parameters of ``Celery.send_task`` that the early start relies on."""
UNFIT_RECHECK_S = 30.0
"""After a publish that could not take fast publish, the early start runs for this long
before a publish asks again (one that could not costs its early start, nothing else)."""

_installed: weakref.WeakKeyDictionary[Any, Installed] = weakref.WeakKeyDictionary()
_install_lock = threading.Lock()


class CeleryShapeError(GatekeeperError):
    """Celery's private task sender no longer looks the way gatekeeper relies on."""


def check_celery_shape(app: Celery) -> Callable[..., Any]:
    """Return the app's current task sender after checking the shape gatekeeper relies on."""
    amqp = app.amqp
    if not hasattr(type(amqp), "send_task_message") or not hasattr(amqp, "_create_task_sender"):
        raise CeleryShapeError(
            "celery's AMQP.send_task_message/_create_task_sender are gone; gatekeeper supports "
            "celery 5.5 to 5.7"
        )
    sender: Callable[..., Any] = amqp.send_task_message
    params = list(inspect.signature(sender).parameters)
    if tuple(p for p in params if p in SENDER_PARAMETERS) != SENDER_PARAMETERS or params[
        :3
    ] != list(SENDER_PARAMETERS[:3]):
        raise CeleryShapeError(f"celery's task sender changed shape: parameters {params}")
    return sender


def check_send_task_shape(app: Celery) -> Callable[..., Any]:
    """Return ``app.send_task`` after checking the parameters the early start reads."""
    send_task: Callable[..., Any] = app.send_task
    params = inspect.signature(send_task).parameters
    kinds = {p.kind for p in params.values()}
    if (
        tuple(params)[: len(SEND_TASK_PARAMETERS)] != SEND_TASK_PARAMETERS
        or "retries" not in params
        or inspect.Parameter.VAR_KEYWORD not in kinds
    ):
        raise CeleryShapeError(f"celery's send_task changed shape: parameters {list(params)}")
    return send_task


def _client(settings: GatekeeperSettings) -> redis.Redis:
    url = settings.gate_redis_url()
    # Short timeouts: an unreachable gate must cost a publish milliseconds, not seconds.
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=settings.redis_timeout_s,
        socket_timeout=settings.redis_timeout_s,
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
        self.original_sender = check_celery_shape(app)
        self.early = EarlyStart(
            app, self.pipeline, check_send_task_shape(app), self._spec, self._early_start
        )
        self._specs: dict[str, _Gated | None] = {}
        self._fast: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self._fast_unfit_until = 0.0
        """Until then (``time.monotonic()``), publishes are expected not to take fast publish
        (the last one that asked could not): the early start runs for them instead."""

    def _early_start(self) -> bool:
        """Whether to start decisions in ``send_task``: when fast publish (which needs the
        built message) will not be taken. After a publish that could not take it, for
        ``UNFIT_RECHECK_S``; then the next publish asks again."""
        mode = self.settings.fast_publish
        if mode == "off" or time.monotonic() < self._fast_unfit_until:
            return True
        return mode == "auto" and publish_observed(self.app.amqp.producer_pool.Producer)

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

    def _renderer(
        self, producer: Any, name: str, message: Any, options: dict[str, Any], extra: dict[str, Any]
    ) -> _FastRender | None:
        """The fast-publish renderer when this publish can take it, else None."""
        mode = self.settings.fast_publish
        if mode == "off":
            return None
        if mode == "auto" and publish_observed(type(producer)):
            return None  # something would see this publish: Celery's own way
        channel = getattr(producer, "channel", None)
        queues = (self.settings.free_queue, self.settings.defer_queue, self.settings.reserved_queue)
        client = getattr(channel, "client", None)
        pool = getattr(client, "connection_pool", None)
        fits = (
            pool is not None
            and (mode == "on" or getattr(message, "sent_event", None) is None)
            and fast_path_possible(self.app, producer, channel, queues)
        )
        if fits:
            same = self._fast.get(pool)
            if same is None:
                same = same_server(client, self.client)
                if same is not None:  # unknown (a server unreachable): asked again next time
                    self._fast[pool] = same
            fits = bool(same)
        if not fits:
            self._fast_unfit_until = time.monotonic() + UNFIT_RECHECK_S
            return None
        self._fast_unfit_until = 0.0
        return _FastRender(self.original_sender, producer, name, message, options, extra, queues)

    def send_task_message(self, producer: Any, name: str, message: Any, **options: Any) -> Any:
        """The wrapped sender: gated tasks are scored and re-addressed, others pass through."""
        try:
            found = self._spec(name)
        except Exception:  # an app that cannot list its tasks must not break publishing
            found = None
        if found is None:
            return self.original_sender(producer, name, message, **options)
        extra = dict(options.get("headers") or {})
        publish: Publish | None = None
        render: _FastRender | None = None
        try:
            headers = message.headers
            job_id = str(headers["id"])
            begun = self.early.take(job_id, name, extra)
            if begun is not None:
                publish = begun.publish
                routing = self.pipeline.complete(begun)
            else:
                retries = int(headers.get("retries") or 0)
                publish = Publish(
                    task=name,
                    job_id=job_id,
                    retries=retries,
                    max_retries=found.max_retries,
                    spec=found.spec,
                    headers={**headers, **extra},
                    spec_error=found.error,
                )
                render = self._renderer(producer, name, message, options, extra)
                routing = self.pipeline.route(publish, render)
        except PublishFailed as exc:  # the broker is the gate's Redis: it is down too
            raise OperationalError(str(exc)) from exc
        except Exception as exc:  # never break the caller's publish; never route to free
            stub = publish or Publish(name, "unknown", 0, None, found.spec, {})
            # Fast publish: Celery already built and "sent" the message (its signals fired),
            # so the pipeline pushes that one; sending it again could publish it twice.
            push = render.push if render is not None else None
            try:
                routing = self.pipeline.fail_closed(
                    stub, GATE_ERROR, f"{type(exc).__name__}: {exc}", push
                )
            except PublishFailed as failed:
                raise OperationalError(str(failed)) from failed
        if routing.reason == FLAGS_UNREAD and publish is not None:
            # The gate cannot tell whether it is on: the task's own route stands, except free.
            try:
                to_free = _bound_for(self.app, options, self.settings.free_queue)
            except Exception:  # a route this cannot read: as if it were free
                to_free = True
            if to_free:
                routing = self.pipeline.route(publish, off_free=True)
            else:
                self.pipeline.kept_own_route(publish)
        if routing.published:
            return None  # gate.lua, or fallback.lua, pushed it with its decision
        if routing.queue is not None:
            options["queue"] = routing.queue
            options["exchange"] = None
            options["routing_key"] = None
            options.pop("exchange_type", None)
            options["headers"] = {**extra, **routing.headers}
        try:
            return self.original_sender(producer, name, message, **options)
        except Exception:
            # The broker refused the message after the gate admitted it: give back the exposure
            # and the waiting-set entry it took, then let the caller see the broker's error.
            if publish is not None and routing.decision == "admit_free":
                window = routing.headers.get(H_WINDOW, 0)
                try:
                    self.store.release(
                        publish.job_id, publish.attempt, int(window), unpublished=True
                    )
                except (GatekeeperError, TypeError, ValueError) as exc:
                    self.log.warning("release_failed", job_id=publish.job_id, error=str(exc))
            raise


def _bound_for(app: Celery, options: dict[str, Any], free: str) -> bool:
    """Whether Celery's options send the message to the ``free`` queue, worked out as
    Celery's own ``send_task_message`` does; when that cannot be told, True."""
    queue, exchange = options.get("queue"), options.get("exchange")
    routing_key, kind = options.get("routing_key"), options.get("exchange_type")
    declared = app.amqp.queues
    name = queue
    if queue is None and exchange is None:
        queue = app.amqp.default_queue
    if isinstance(queue, str):
        name, queue = queue, declared.get(queue)
    elif queue is not None:
        name = queue.name
    if kind is None:
        kind = getattr(getattr(queue, "exchange", None), "type", None) or "direct"
    if (not exchange or not routing_key) and kind == "direct":
        return bool(name == free)  # kombu's anonymous exchange: straight to the queue name
    if exchange is None:
        exchange = getattr(getattr(queue, "exchange", None), "name", None)
        routing_key = routing_key or getattr(queue, "routing_key", None)
    target = declared.get(free)
    if target is None:
        return True
    if getattr(exchange, "name", exchange) != getattr(target.exchange, "name", None):
        return False
    return kind != "direct" or routing_key == target.routing_key


class _FastRender:
    """Fast publish for one publish: Celery's sender run with kombu's push caught
    (:func:`gatekeeper.fastpath.capture_message`), the caught message kept for a fallback."""

    def __init__(
        self,
        sender: Callable[..., Any],
        producer: Any,
        name: str,
        message: Any,
        options: dict[str, Any],
        extra: dict[str, Any],
        queues: tuple[str, str, str],
    ) -> None:
        self.sender, self.producer, self.name, self.message = sender, producer, name, message
        self.options, self.extra, self.queues = options, extra, queues
        self.push: Push | None = None

    def __call__(self, headers: dict[str, Any]) -> Push | None:
        placeholders = dict(PLACEHOLDERS)
        if headers.get(H_FREE_ADMITTED):
            placeholders.pop(H_FREE_ADMITTED)  # an earlier attempt ran free: stays true
        opts = {**self.options, "queue": self.queues[0], "exchange": None, "routing_key": None}
        opts.pop("exchange_type", None)
        opts["headers"] = {**self.extra, **headers, **placeholders}
        job_id = str(self.message.headers.get("id"))
        self.push = capture_message(
            self.sender, self.producer, (self.name, self.message), opts, self.queues, job_id
        )
        return self.push


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
        app.amqp.send_task_message = gate.send_task_message
        app.send_task = gate.early.send_task
        gate.worker.connect()
        _installed[app] = gate
        return gate
