"""A publish the gate does not decide, bound for the free queue while the free path is closed,
goes to reserved: a rollback binds whatever a route sends to free (SPEC section 4).

Such a publish is of a task this app does not register as gated: a name sent with ``send_task``
by a process that never imported the task's module, or Celery's ``celery.map`` of a gated task
(``.map()``: routed by the gated task's name). The gate cannot tell whether it is gated, so it
is not decided, and runs as an ordinary task; but while the free path is closed (or its flags
have never been read, or the last read failed: :class:`~gatekeeper.core.flagvalues.Flags`'s
``unread``, ``stale``) it is not sent to free. Where the route goes is worked out as for a
gated task (:func:`gatekeeper.celery.private.bound_for`) once the app declares the free queue;
before, only a route that names it (its queue, or its exchange: Celery's own for a queue it
makes) goes there. The flags are read only for a publish bound for free.

The install's parts are made at the first such publish; when they cannot be (settings that do
not validate), publishes go as they are from then on, without trying again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery import Celery

from gatekeeper.celery.parts import Parts
from gatekeeper.celery.private import bound_for

__all__ = ["OffFree"]


class OffFree:
    """The check, for one install's publishes the gate does not decide."""

    def __init__(self, app: Celery, parts: Callable[[], Parts]) -> None:
        self.app = app
        self._parts = parts
        self._unmade = False

    def __call__(self, name: str, options: dict[str, Any]) -> None:
        """Point ``options`` at the reserved queue when they go to the free queue and the
        free path is closed, or its flags were never read."""
        if self._unmade:
            return
        try:
            made = self._parts()
        except Exception:  # the gate cannot tell which queue is free: as it is, from now on
            self._unmade = True
            return
        settings = made.settings
        free = settings.free_queue
        queue = options.get("queue")
        # Celery's router's usual answer, a declared direct queue: sent to it by name on the
        # default exchange (as bound_for says, without its lookups: this is every publish).
        if (
            queue is not None and not isinstance(queue, str) and options.get("exchange") is None
            and options.get("exchange_type") in (None, "direct")  # (Celery's before the queue's)
            and getattr(getattr(queue, "exchange", None), "type", "direct") == "direct"
            and getattr(queue, "name", None) != free
        ):  # fmt: skip
            return
        try:
            if free in self.app.amqp.queues:
                to_free = bound_for(self.app, options, free)
            else:  # not declared: only a route that names it (its queue, or Celery's exchange)
                queue, exchange = options.get("queue"), options.get("exchange")
                to_free = free in (
                    getattr(queue, "name", queue),
                    getattr(exchange, "name", exchange),
                )
        except Exception:  # a route this cannot read: left alone (no gated task)
            return
        if not to_free:
            return
        flags = made.pipeline.flags.current()  # never raises: the last read (stale), or unread
        if flags.free_open:
            return
        options.update(queue=settings.reserved_queue, exchange=None, routing_key=None)
        options.pop("exchange_type", None)
        made.pipeline.log.warning(
            "routed_off_free", task=name, queue=settings.reserved_queue,
            reason="flags_unread" if flags.unread else "flags_stale" if flags.stale else
            "free_path_disabled",
        )  # fmt: skip
