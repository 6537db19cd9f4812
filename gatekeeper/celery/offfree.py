"""A publish the gate does not decide, bound for the free queue while the free path is closed,
goes to reserved: a rollback binds whatever a route sends to free (SPEC section 4).

Such a publish is of a task this app does not register as gated: a name sent with
``send_task`` by a process that never imported the task's module, or Celery's ``celery.map``
of a gated task (``.map()``: routed by the gated task's name). The gate cannot tell whether
it is gated, so it is not decided, and runs as an ordinary task; but while the free path is
closed it is not sent to free by name. Only a route that names the free queue is looked at
(``queue``, or a ``routing_key`` on the default exchange): the flags are read only then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gatekeeper.celery.parts import Parts

__all__ = ["off_free"]


def off_free(name: str, options: dict[str, Any], parts: Callable[[], Parts]) -> None:
    """Point ``options`` at the reserved queue when they name the free queue and the free
    path is closed (or its flags cannot be read: never to free then). The install's parts
    are made at the first publish that names a queue; when they cannot be, the publish goes
    as it is (the gate cannot tell which queue is free)."""
    queue = options.get("queue")
    named = getattr(queue, "name", queue)
    if named is None and not options.get("exchange"):
        named = options.get("routing_key")
    if named is None:
        return
    try:
        made = parts()
    except Exception:
        return
    settings = made.settings
    if named != settings.free_queue:
        return
    try:
        closed = not made.pipeline.flags.current().free_path_enabled
    except Exception:  # as if closed
        closed = True
    if closed:
        options.update(queue=settings.reserved_queue, exchange=None, routing_key=None)
        options.pop("exchange_type", None)
        made.pipeline.log.warning("routed_off_free", task=name, queue=settings.reserved_queue,
                                  reason="free_path_disabled")  # fmt: skip
