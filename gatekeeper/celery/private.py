"""Every touch of private Celery and kombu API, each with the check that fails loudly when its
shape changes (``tests/test_celery_internals.py`` runs them on both ends of the pinned range).

What is touched, and why (``docs/design.md`` has the longer story):

- ``app.amqp.send_task_message``: a cached property holding the function that
  ``app.amqp._create_task_sender()`` returned. It sees every publish (retries and canvas
  included) with the built headers and takes ``queue=``, which neither routers nor
  ``before_task_publish`` can offer. Setting the attribute on one app's ``amqp`` replaces it
  for that app alone. :func:`check_celery_shape` checks it is there at install; Celery's
  own sender is made at the first publish (:class:`CelerySender`, which checks its
  parameters), from the configuration as it then stands, as Celery itself makes it.
- What a task promise holds (``@app.task`` on an app not finalized: a ``PromiseProxy`` of
  ``app._task_from_fun`` with the function and the options): ``@gated`` reads them
  (:func:`promised_task`) rather than make the task, which would bind it to the app's
  configuration before it may be loaded.
- Where Celery keeps a task's function (``_decorated_fun`` on 5.7, ``__wrapped__`` before):
  ``@shared_task`` makes its task again for every app, so ``@gated`` marks that function too
  (:func:`task_functions`).
- The worker's ``celery.worker.state.active_requests`` and ``reserved_requests``: a failure
  or revocation seen in the worker's main process names only a task id (``sender.request``
  is empty on 5.5 and 5.6), and two messages can share one; Celery discards the request that
  ended from these sets before it sends the signal (``task_ready``, on 5.5 to 5.7), so the
  received messages still in them are not the one that ended (:func:`outstanding`).
- A gated task's ``Request`` class, in the worker's main process: Celery's strategy subclasses
  ``task.Request`` and asks ``revoked()`` before it hands a message to the pool (and again
  when an ETA is due); a subclass whose ``revoked()`` also says "moved" (after acking it, as
  Celery's own revocation does, through ``acknowledge``, ``task_ready`` and
  ``_already_revoked``) lets a free message past its wait allowance go to reserved instead
  of running (:func:`use_request_check`, checked by :func:`check_request_shape`). On Celery
  5.7, whose ``on_failure`` asks ``_success_was_stored()`` of a lost pool child and then sends
  no ``task_failure`` (the child stored SUCCESS, then died: in ``on_success``, a
  ``task_postrun`` receiver), the same subclass notes that answer and tells the worker side
  (``lost``) after ``on_failure``: that run ends killed all the same. Celery 5.5 has no such
  method and sends ``task_failure``.
- kombu's virtual Redis channel and the producer's publish batch (fast publish): their
  touches are kombu's alone, in :mod:`gatekeeper.celery.private_kombu` (imported here).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any

from celery import Celery
from celery.app.amqp import AMQP
from celery.local import PromiseProxy

from gatekeeper.celery.private_kombu import (
    CHANNEL_API,
    cached_value,
    capture_message,
    channel_fits,
)
from gatekeeper.errors import CeleryShapeError

__all__ = [
    "CHANNEL_API",
    "SENDER_PARAMETERS",
    "CelerySender",
    "bound_for",
    "cached_value",
    "capture_message",
    "channel_fits",
    "check_celery_shape",
    "check_request_shape",
    "checked_sender",
    "current_task",
    "outstanding",
    "promised_task",
    "replace_sender",
    "task_functions",
    "use_request_check",
]

SENDER_PARAMETERS = ("producer", "name", "message", "exchange", "routing_key", "queue", "headers")
"""Parameters of Celery's task sender that the wrapper relies on, in this order."""


def check_celery_shape(app: Celery) -> None:
    """Check, at install, that the app's ``amqp`` has the task sender gatekeeper replaces.
    Nothing is built or read here: Celery makes its sender from the app's configuration
    (serializer, delivery mode, publish retry, queues), which may be loaded after install."""
    amqp = app.amqp
    if not hasattr(type(amqp), "send_task_message") or not hasattr(amqp, "_create_task_sender"):
        raise CeleryShapeError(
            "celery's AMQP.send_task_message/_create_task_sender are gone; gatekeeper supports "
            "celery 5.5 to 5.7"
        )


class CelerySender:
    """Celery's own task sender for one app, which gatekeeper wraps, made at the app's first
    publish from its configuration as it then stands (as Celery makes it: an app configured
    after ``install`` keeps its serializer, delivery mode, publish retry and queues), its
    parameters checked then. A sender the app already held at install (a publish made it, or
    another wrapper set it) is the one wrapped."""

    def __init__(self, app: Celery) -> None:
        check_celery_shape(app)
        self.app = app
        held: Callable[..., Any] | None = vars(app.amqp).get("send_task_message")
        self.sender = checked_sender(held) if held is not None else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        sender = self.sender
        if sender is None:  # made twice at worst, by two first publishes: the same sender
            sender = self.sender = checked_sender(made_by_class(self.app.amqp))
        return sender(*args, **kwargs)


def made_by_class(amqp: Any) -> Callable[..., Any]:
    """The sender the app's ``amqp`` class makes (Celery's cached property, or the property
    of an ``AMQP`` subclass that wraps it: ``Celery(amqp=...)``), made now: the instance's
    attribute is gatekeeper's wrapper."""
    made = inspect.getattr_static(type(amqp), "send_task_message")
    if made is inspect.getattr_static(AMQP, "send_task_message"):
        return amqp._create_task_sender()  # type: ignore[no-any-return]  # Celery's own
    func = getattr(made, "func", None)
    # A subclass's: the wrapper out of the way while it makes it, or its
    # ``super().send_task_message`` would find the wrapper cached and wrap it (each then
    # calling the other forever). Under the property's own lock (kombu's, re-entrant), which
    # another thread's lookup takes: it would otherwise make the subclass's sender, publish
    # unwrapped, and cache that over the wrapper for good.
    lock = getattr(made, "lock", None)
    with lock if lock is not None else contextlib.nullcontext():
        held = vars(amqp).pop("send_task_message", None)
        try:
            sender: Callable[..., Any] = (
                func(amqp) if callable(func) else made.__get__(amqp, type(amqp))
            )
        finally:
            if held is not None:
                vars(amqp)["send_task_message"] = held
    return sender


def checked_sender(sender: Callable[..., Any]) -> Callable[..., Any]:
    """``sender`` after checking it takes the parameters the hook passes, in that order."""
    params = list(inspect.signature(sender).parameters)
    if tuple(p for p in params if p in SENDER_PARAMETERS) != SENDER_PARAMETERS or params[
        :3
    ] != list(SENDER_PARAMETERS[:3]):
        raise CeleryShapeError(f"celery's task sender changed shape: parameters {params}")
    return sender


REQUEST_API = ("revoked", "acknowledge", "reject", "message", "_already_revoked")
"""What the request check uses of ``celery.worker.request.Request``."""


def check_request_shape() -> None:
    """Raise :class:`CeleryShapeError` when the worker's request lacks what the check uses."""
    from celery.worker import request, state, strategy

    missing = [name for name in REQUEST_API if not hasattr(request.Request, name)]
    if missing or not hasattr(state, "task_ready"):
        raise CeleryShapeError(f"celery's worker Request changed shape: missing {missing}")
    source = inspect.getsource(strategy.create_request_cls)
    if "self.revoked()" not in source:
        raise CeleryShapeError("celery's strategy no longer asks revoked() before it executes")
    stored = hasattr(request.Request, "_success_was_stored")
    if stored and "self._success_was_stored()" not in inspect.getsource(request.Request.on_failure):
        raise CeleryShapeError("celery's Request.on_failure no longer asks _success_was_stored()")


def use_request_check(
    task: Any, check: Callable[[Any], str], lost: Callable[[Any], None] | None = None
) -> bool:
    """Make ``task`` ask ``check(request)`` before a message of it runs (worker main
    process): ``"run"``, ``"skip"`` (moved elsewhere: acked and not run) or ``"requeue"``
    (not run here, and given back to the broker to be asked again); and call
    ``lost(request)`` for a pool child lost after it stored SUCCESS, for which Celery 5.7
    sends no ``task_failure``. False when the task already has it."""
    from celery.utils.imports import symbol_by_name
    from celery.worker.state import reserved_requests, task_ready

    base = symbol_by_name(task.Request)
    if getattr(base, "gatekeeper_check", None) is not None:
        return False

    class GatekeeperRequest(base):  # type: ignore[misc, valid-type]
        gatekeeper_check = staticmethod(check)

        def revoked(self) -> bool:
            if super().revoked():
                return True
            # Asked once, as it is handed to the pool (Celery reserved it then): not at its
            # receipt, where Celery asks too when it has an ``expires``, before a wait on its
            # ETA or a rate limit that the check is there to catch.
            if self.__dict__.get("_gatekeeper_asked") or self not in reserved_requests:
                return False
            self._gatekeeper_asked = True
            verdict = self.gatekeeper_check(self)
            if verdict == "run":
                return False
            task_ready(self)
            if verdict == "requeue":
                self.reject(requeue=True)
            else:
                self.acknowledge()
            self._already_revoked = True
            return True

        if hasattr(base, "_success_was_stored"):  # Celery 5.7 (checked: check_request_shape)

            def _success_was_stored(self) -> Any:
                stored = super()._success_was_stored()
                self._gatekeeper_stored = bool(stored)
                return stored

            def on_failure(self, *args: Any, **kwargs: Any) -> Any:
                try:
                    return super().on_failure(*args, **kwargs)
                finally:  # asked of a lost child alone: SUCCESS stored, no task_failure sent
                    if lost is not None and self.__dict__.get("_gatekeeper_stored"):
                        lost(self)

    GatekeeperRequest.__qualname__ = f"GatekeeperRequest({base.__qualname__})"
    task.Request = GatekeeperRequest
    return True


def replace_sender(app: Celery, sender: Callable[..., Any]) -> None:
    """Make ``sender`` this app's task sender (the cached property, set on one instance)."""
    app.amqp.send_task_message = sender


def bound_for(app: Celery, options: dict[str, Any], free: str) -> bool:
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


def current_task(task: object) -> object:
    """The task itself: a ``@shared_task`` proxy evaluated (as setting an attribute would)."""
    current = getattr(task, "_get_current_object", None)
    return current() if callable(current) else task


def promised_task(task: object) -> tuple[Any, str, dict[str, Any], type] | None:
    """For ``@app.task`` on an app not yet finalized, a promise that Celery makes into the task
    at its first use (binding it to the app's configuration as it then stands): the function,
    the task's name, its options and the class it will be made from (``base=``, else the
    app's ``Task``), read without making it. None for anything else. What a promise holds
    (``_Proxy__local``, ``_Proxy__args``, ``_Proxy__kwargs``) is private."""
    if not isinstance(task, PromiseProxy) or task.__evaluated__():
        return None
    try:
        make = object.__getattribute__(task, "_Proxy__local")
        (function,) = object.__getattribute__(task, "_Proxy__args")
        options = dict(object.__getattribute__(task, "_Proxy__kwargs"))
    except (AttributeError, TypeError, ValueError) as exc:
        raise CeleryShapeError(f"celery's task promise changed shape: {exc!r}") from exc
    app = getattr(make, "__self__", None)
    if getattr(make, "__name__", None) != "_task_from_fun" or not isinstance(app, Celery):
        return None  # a promise of something else: made as any object would be
    name = options.get("name") or app.gen_task_name(function.__name__, function.__module__)
    return function, str(name), options, options.get("base") or app.Task


def task_functions(task: object) -> list[Any]:
    """The function a decorator made the task from, and the one that wraps (pydantic).

    ``@shared_task`` makes its task again for every app, from that function alone: a mark
    set only on the task made for the first app would be lost. Celery keeps the function in
    the task class: ``_decorated_fun`` (5.7, as the caller passed it) or ``__wrapped__``
    (a staticmethod unless ``bind=True``; on 5.5 and 5.6, with ``pydantic=True``, a wrapper
    made for each app, whose ``__wrapped__`` is the function). Empty for a task class.
    """
    attributes = type(task).__dict__
    held = attributes.get("_decorated_fun", attributes.get("__wrapped__"))
    function = getattr(held, "__func__", held)
    if not inspect.isfunction(function):
        return []
    inner = getattr(function, "__wrapped__", None)
    return [function, inner] if inspect.isfunction(inner) else [function]


def outstanding(request: Any) -> bool:
    """Whether the worker still holds this request (reserved, running or, where Celery keeps
    them apart, waiting on its ETA): a request that has just ended is no longer held when its
    signal fires. Celery keeps them in weak sets, by identity: of two requests with one task
    id, the one that ended is told apart."""
    from celery.worker import state

    active, reserved = state.active_requests, state.reserved_requests
    if not isinstance(active, AbstractSet) or not isinstance(reserved, AbstractSet):
        raise CeleryShapeError("celery.worker.state's active/reserved requests changed shape")
    scheduled = getattr(state, "scheduled_requests", None)  # ETA and countdown (5.6+)
    waiting = isinstance(scheduled, AbstractSet) and request in scheduled
    return request in active or request in reserved or waiting
