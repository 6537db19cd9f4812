"""The publish seam: :func:`install` wraps one app's task sender and connects worker signals.

Every publish of a gated task goes through :meth:`Installed.send_task_message`, which reads
top to bottom: find the task's spec, decide (:class:`gatekeeper.redis.gate.Pipeline`), address
the message to the chosen queue, send it. Ungated tasks pass straight through.

Why the sender and not a router or ``before_task_publish``: a ``before_task_publish`` handler
cannot change the queue (Celery passes it by value), and routers see neither the task id nor
``retries``. The sender sees every publish, retries and canvas included, with the built
headers, and takes ``queue=`` (:mod:`gatekeeper.celery.private` holds that touch of private
API and its shape check).

The message is addressed to the chosen queue by name on the default exchange, whatever the
caller or a router chose (:mod:`gatekeeper.celery.address`).

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
from celery.signals import task_postrun, worker_process_shutdown
from kombu.exceptions import OperationalError

from gatekeeper.celery.address import address
from gatekeeper.celery.bootstep import add_to_worker
from gatekeeper.celery.expiry import Expiry
from gatekeeper.celery.fastpath import FastRender, one_server, possible, publish_observed, sendable
from gatekeeper.celery.gating import spec_of
from gatekeeper.celery.heartbeat import Heartbeat
from gatekeeper.celery.offfree import OffFree
from gatekeeper.celery.parts import SIGNALS, Parts, build
from gatekeeper.celery.private import CelerySender, bound_for, replace_sender
from gatekeeper.celery.worker import WorkerSide
from gatekeeper.core.dwell import Decision, Reason
from gatekeeper.core.headers import H_DECISION, H_WINDOW
from gatekeeper.core.spec import GatedSpec
from gatekeeper.errors import BadDeclaredInput, ConfigError, GatekeeperError, PublishFailed
from gatekeeper.forks import renew_in_children
from gatekeeper.lines import flush_after_task
from gatekeeper.redis.attempt import retries_of
from gatekeeper.redis.durable import finish_pending
from gatekeeper.redis.flags import FlagStore
from gatekeeper.redis.gate import Pipeline, Publish, Routing
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.owing import finish as finish_later
from gatekeeper.redis.owing import settle_all
from gatekeeper.redis.store import GateStore
from gatekeeper.settings import GatekeeperSettings

__all__ = ["Installed", "install"]

_installed: weakref.WeakKeyDictionary[Any, Installed] = weakref.WeakKeyDictionary()
_install_lock = threading.Lock()


@dataclass(frozen=True)
class _Gated:
    """A gated task's spec (or why it is malformed) and its max_retries, cached by name."""

    spec: GatedSpec | None
    error: BadDeclaredInput | None
    max_retries: int | None


class Installed:
    """Gatekeeper installed on one Celery app: the wrapped sender and the worker hooks."""

    def __init__(
        self, app: Celery, settings: GatekeeperSettings | None = None,
        client: redis.Redis | None = None, clock: Callable[[], float] = time.time,
    ) -> None:  # fmt: skip
        self.app = app
        self.clock = clock
        self._given = (settings, client)
        self._parts: Parts | None = None
        self._building = threading.Lock()
        self.original_sender: Callable[..., Any] = CelerySender(app)  # made at first use
        self._specs: dict[str, _Gated | None] = {}
        self._same_server: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self._off_free = OffFree(app, self.parts)
        renew_in_children(self)

    def _forked(self) -> None:
        """In a forked child: a lock of its own (the parent's may be held mid-build)."""
        self._building = threading.Lock()

    # -- the parts, built at first use (gatekeeper/celery/parts.py) ------------------------

    def parts(self) -> Parts:
        """The install's working parts, built the first time they are needed."""
        if self._parts is None:
            with self._building:
                if self._parts is None:
                    self._parts = build(self.app, *self._given, self.clock)
        return self._parts

    def connect(self) -> None:
        """Listen to the worker signals; each reaches its part when it fires."""
        task_postrun.connect(settle_all, weak=False)  # replies owed read before the run ends
        for signal, part, method in SIGNALS:
            signal.connect(self._forward(part, method), weak=False)
        task_postrun.connect(flush_after_task, weak=False)  # a task's lines written as it ends
        worker_process_shutdown.connect(finish_later, weak=False)  # held ones: sent or logged
        worker_process_shutdown.connect(flush_after_task, weak=False)  # a child's os._exit
        worker_process_shutdown.connect(finish_pending, weak=False)  # an auto-freeze's disk

    def _forward(self, part: str, method: str) -> Callable[..., Any]:
        def forward(sender: Any = None, **kwargs: Any) -> Any:
            return getattr(getattr(self.parts(), part), method)(sender=sender, **kwargs)

        forward.__name__ = f"gatekeeper_{part}_{method}"
        return forward

    @property
    def settings(self) -> GatekeeperSettings:
        return self.parts().settings

    @property
    def client(self) -> redis.Redis:
        return self.parts().client

    @property
    def pipeline(self) -> Pipeline:
        return self.parts().pipeline

    @property
    def store(self) -> GateStore:
        return self.pipeline.store

    @property
    def keys(self) -> Keys:
        return self.pipeline.store.keys

    @property
    def flags(self) -> FlagStore:
        return self.pipeline.flags

    @property
    def log(self) -> Any:
        return self.pipeline.log

    @property
    def worker(self) -> WorkerSide:
        return self.parts().worker

    @property
    def expiry(self) -> Expiry:
        return self.parts().expiry

    @property
    def heartbeat(self) -> Heartbeat:
        return self.parts().heartbeat

    @property
    def queues(self) -> tuple[str, str, str]:
        return self.parts().queues

    def send_task_message(self, producer: Any, name: str, message: Any, **options: Any) -> Any:
        """The wrapped sender: gated tasks are decided, addressed and sent; others pass."""
        try:
            found = self._spec(name)
        except Exception:  # an app that cannot list its tasks must not break publishing
            found = None
        if found is None:
            self._off_free(name, options)  # but not to free while its path is closed
            return self.original_sender(producer, name, message, **options)
        publish, routing = self._decide(found, producer, name, message, options)
        if routing.published:
            return None  # gate.lua (or fallback.lua) pushed it with its decision
        return self._send(producer, name, message, options, publish, routing)

    # -- the steps, in the order a publish takes them ---------------------------------------

    def _spec(self, name: str) -> _Gated | None:
        """What the hook needs of a task by name, looked up once; None when it is not gated. A
        name the app does not know (yet) is looked up again next time (registered later)."""
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
        publish: Publish | None = None
        render: FastRender | None = None
        try:
            # Celery's sender takes (key, value) pairs too (it merges them with dict.update):
            # a dict from here on, for each step that merges them.
            options["headers"] = extra = dict(options.get("headers") or {})
            # The id the message will carry: a caller's ``id`` header overrides Celery's own
            # when Celery merges the headers, and the record must be the message's.
            headers = {**message.headers, **extra}
            retries, bad = retries_of(headers)  # bad: reserved (bad_input), no attempt
            publish = Publish(name, str(headers["id"]), retries, found.max_retries, found.spec,
                              headers, spec_error=bad or found.error)  # fmt: skip
            if headers.get("replaced_task_nesting"):  # Celery's Task.replace (or a caller's)
                self._replacing(publish.job_id, headers["replaced_task_nesting"])
            if sendable(publish.job_id, name):  # else the gate cannot be asked (gate_error),
                render = self._renderer(producer, name, message, options)  # and it is Celery's
            later = render is not None and self.app.current_worker_task is None
            routing = self.pipeline.route(publish, render, later=later)
            if (
                not routing.published
                and routing.decision is None
                and (
                    routing.reason is Reason.FLAGS_UNREAD
                    or (publish.retries and H_DECISION in headers)  # a retry: sent where it ran
                    or not self.flags.current().free_open  # closed, unread or stale
                )
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

    def _replacing(self, job_id: str, nesting: Any) -> None:
        """``Task.replace``: Celery publishes the replacement with the id of the task this
        thread runs, one nesting level deeper, before that run ends (it raises ``Ignore``
        next). The run ends first, with its row (:meth:`WorkerSide.on_replaced`), so that the
        gate decides the replacement as its attempt begun again, not as a duplicate."""
        current = self.app.current_worker_task
        request = getattr(current, "request", None)
        if request is None or getattr(request, "id", None) != job_id:
            return
        if type(nesting) is int and nesting > (getattr(request, "replaced_task_nesting", 0) or 0):
            self.worker.on_replaced(current, job_id)

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
        breaker = self.store.breaker
        if breaker is not None and breaker.is_open:
            # The script would not be asked, and its fallback push refused: Celery's own
            # publish, which fails only if the broker does (Redis may answer again already).
            return False
        if not possible(self.app, producer, self.queues):
            return False
        return one_server(producer, self.client, self._same_server)

    def _own_route(self, publish: Publish, options: dict[str, Any], routing: Routing) -> Routing:
        """A gated task left on its own route (the gate off, outside the canary, the flags
        unread) keeps it, unless it is the free queue (the path may be closed, or a retry's:
        the gate's choice): then decided as if the gate were on, never free unadmitted."""
        try:  # a route this cannot read: as if it were free
            to_free = bound_for(self.app, options, self.settings.free_queue)
        except Exception:
            to_free = True
        if to_free:
            return self.pipeline.route(publish, off_free=True)
        if routing.reason is Reason.FLAGS_UNREAD:
            self.pipeline.kept_own_route(publish)
        return routing

    def _send(
        self,
        producer: Any,
        name: str,
        message: Any,
        options: dict[str, Any],
        publish: Publish | None,
        routing: Routing,
    ) -> Any:
        """The publish addressed (:func:`~gatekeeper.celery.address.address`) and sent by
        Celery's own sender; if either fails (the broker refuses the message), an admission is
        given back before the caller sees the error: no admission is held without a message."""
        try:
            address(message, options, routing, publish.attempt if publish else None)
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
    app: Celery, settings: GatekeeperSettings | None = None, *,
    client: redis.Redis | None = None, clock: Callable[[], float] = time.time,
) -> Installed:  # fmt: skip
    """Install the gate on ``app`` and return it; installing twice returns the first install
    (ConfigError when the second gives other settings or another client). Nothing is read
    or connected here: ``settings`` default to the environment and the app's
    config (``load_settings(app=app)``), ``client`` to a Redis client on ``redis_url`` (else
    the broker's, when it is Redis), both when first needed (:mod:`gatekeeper.celery.parts`),
    so importing an app never fails for Redis, and an eager app never needs it."""
    with _install_lock:
        existing = _installed.get(app)
        if existing is not None:
            given, given_client = existing._given  # a rollback in other ones: not dropped unsaid
            given = given or (settings and existing.settings)  # read now, when first given here
            if (settings or given) != given or (client or given_client) is not given_client:
                raise ConfigError("install: installed on this app already with other settings or "
                                  "another client; install it once, with both")  # fmt: skip
            return existing
        gate = Installed(app, settings, client, clock)
        replace_sender(app, gate.send_task_message)
        gate.connect()
        add_to_worker(app, gate)
        _installed[app] = gate
        return gate
