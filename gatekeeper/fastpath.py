"""Fast publish: when the broker is the gate's own Redis, one round trip decides and publishes.

A plain publish costs one round trip (kombu's LPUSH); a gated one would cost two (the gate
script, then the LPUSH). When the broker and the gate share a Redis server and database, the
hook instead lets Celery build the message as usual, catches it at kombu's Redis channel just
before the LPUSH, and hands it to ``gate.lua``, which decides and pushes it to the chosen
queue's list in the same atomic step. What the decision decides (the queue in
``delivery_info``, and the ``gatekeeper_decision``, ``_reason``, ``_dwell_s``,
``_free_admitted`` and ``_window`` headers) is left in the message as placeholders that the
script fills in.

This leans on kombu's virtual Redis channel (``_put``, ``_q_for_pri``,
``_get_message_priority``): private API, covered by tests that fail if it changes. Anything
unusual (another transport, another server, a fanout exchange) takes the ordinary path.
Celery's ``before_task_publish`` and ``after_task_publish`` see the free queue's routing key on
this path whatever the decision. ``fast_publish = false`` turns it off.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from kombu.utils.json import dumps

from gatekeeper.spec import H_DECISION, H_DWELL_S, H_FREE_ADMITTED, H_REASON, H_WINDOW

__all__ = ["PLACEHOLDERS", "Push", "capture_message", "same_server"]

QUEUE_PLACEHOLDER = "__gk_queue__"
PLACEHOLDERS = {
    H_DECISION: "__gk_decision__",
    H_REASON: "__gk_reason__",
    H_DWELL_S: "__gk_dwell__",
    H_FREE_ADMITTED: "__gk_free__",
    H_WINDOW: "__gk_window__",
}
"""Headers whose values ``gate.lua`` writes (placeholders are JSON strings it replaces)."""

_SERVER_KEYS = ("host", "port", "db", "path", "username")
_PLACEHOLDER = re.compile(r'"__gk_([a-z]+)__"')
_ALLOWED = {"decision", "reason", "dwell", "free", "window", "queue"}
_REQUIRED = _ALLOWED - {"free"}  # free is absent when an earlier attempt already ran free


@dataclass(frozen=True)
class Push:
    """A message ready for ``gate.lua`` to push: one list and queue name per decision."""

    template: str
    lists: tuple[str, str, str]
    """Broker lists for admit_free, defer, reserved (priority sub-lists where needed)."""
    queues: tuple[str, str, str]

    @property
    def pieces(self) -> list[str]:
        """The template cut at its placeholders: text, name, text, ..., text (for gate.lua)."""
        return _PLACEHOLDER.split(self.template)


def same_server(broker: Any, gate: redis.Redis) -> bool:
    """Whether a kombu channel's Redis client talks to the gate's server and database."""
    try:
        theirs = broker.connection_pool.connection_kwargs
        ours = gate.connection_pool.connection_kwargs
    except AttributeError:
        return False
    return all(theirs.get(key) == ours.get(key) for key in _SERVER_KEYS)


def capture_message(
    sender: Callable[..., Any],
    producer: Any,
    args: tuple[Any, ...],
    options: dict[str, Any],
    queues: tuple[str, str, str],
) -> Push | None:
    """Run Celery's sender with kombu's final LPUSH caught; None if the channel is not one.

    ``options`` must already carry the placeholders and ``queue=queues[0]``.
    """
    channel = getattr(producer, "channel", None)
    if channel is None or not all(
        hasattr(channel, name) for name in ("_put", "_q_for_pri", "_get_message_priority")
    ):
        return None
    caught: list[Push] = []

    def catch(queue: str, message: dict[str, Any], **_: Any) -> None:
        # Serialized here, before the headers (shared with Celery's message) are put back.
        message["properties"]["delivery_info"]["routing_key"] = QUEUE_PLACEHOLDER
        priority = channel._get_message_priority(message, reverse=False)
        lists = tuple(channel._q_for_pri(name, priority) for name in queues)
        caught.append(Push(dumps(message), lists, queues))  # type: ignore[no-untyped-call]

    headers = getattr(args[1], "headers", None) if len(args) > 1 else None
    saved = dict(headers) if isinstance(headers, dict) else None
    channel._put = catch
    try:
        sender(producer, *args, **options)
    finally:
        del channel._put
        if saved is not None and isinstance(headers, dict):
            # Celery merged the placeholders into the message's own headers; put them back
            # so that a fallback publish carries none of them.
            headers.clear()
            headers.update(saved)
    if not caught:  # with the default exchange kombu always ends in _put
        raise RuntimeError("kombu published without its Redis channel's _put: fast path off")
    names = caught[0].pieces[1::2]
    if len(set(names)) != len(names) or not _REQUIRED <= set(names) <= _ALLOWED:
        return None  # a header value that looks like a placeholder: take the ordinary path
    return caught[0]
