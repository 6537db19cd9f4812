"""The touches of kombu's private API (fast publish), each with the check that fails loudly when
its shape changes; :mod:`gatekeeper.celery.private` holds Celery's (and re-exports these).

kombu's virtual Redis channel (``_put``, ``_q_for_pri``, ``_get_message_priority``,
``_expires``, ``global_keyprefix``) and the producer's publish batch: fast publish catches the
serialized message at ``_put`` (:func:`capture_message`) and stands aside where the channel
would not put it as one plain list push (:func:`channel_fits`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gatekeeper.errors import CeleryShapeError

__all__ = ["CHANNEL_API", "cached_value", "capture_message", "channel_fits"]

CHANNEL_API = ("_put", "_q_for_pri", "_get_message_priority")
"""What fast publish uses of kombu's virtual Redis channel."""


def channel_fits(producer: Any, queues: tuple[str, ...]) -> bool:
    """Whether kombu would put a message for any of ``queues`` as one plain list push on this
    producer's channel: a virtual Redis channel with the API fast publish catches, no
    ``global_keyprefix``, no queue expiry, and no publish batch under way."""
    channel = getattr(producer, "channel", None)
    if channel is None:
        return False
    if type(channel) not in _WITH_API:  # asked once per channel class
        if not all(callable(getattr(type(channel), name, None)) for name in CHANNEL_API):
            return False
        _WITH_API.add(type(channel))
    if getattr(channel, "global_keyprefix", ""):
        return False
    expires = getattr(channel, "_expires", None)
    if expires and any(queue in expires for queue in queues):
        return False
    batches = getattr(producer, "_batch_local", None)  # the thread's own: read, not raised
    return batches is None or batches.__dict__.get("current") is None


_WITH_API: set[type] = set()
"""Channel classes found to have :data:`CHANNEL_API`."""


def cached_value(owner: Any, name: str) -> Any:
    """``owner.name`` of kombu's ``cached_property`` (Celery's ``app.amqp``, ``amqp.queues``,
    a Redis channel's ``client``), read where ``functools.cached_property`` keeps the value,
    the instance's ``__dict__``, once computed: kombu's own read takes a lock and two Python
    calls, three times a gated publish (bench/README.md). Should kombu keep it elsewhere,
    the attribute is read as it is (slower, never stale); None when ``owner`` has no such
    attribute. ``tests/test_celery_internals.py`` fails loudly if the storage moves."""
    value = getattr(owner, "__dict__", _NOTHING).get(name)
    return getattr(owner, name, None) if value is None else value


_NOTHING: dict[str, Any] = {}


def capture_message(
    sender: Callable[..., Any],
    producer: Any,
    args: tuple[Any, ...],
    options: dict[str, Any],
    queues: tuple[str, ...],
    mark: tuple[str, str],
    routing_key: str,
    serialize: Callable[[Any], str],
) -> tuple[str, tuple[str, ...]]:
    """Run Celery's sender with kombu's final list push caught, and return what it would have
    pushed: ``(text, lists)``, the message serialized with ``serialize`` after its
    ``delivery_info.routing_key`` is set to ``routing_key``, and the broker list of each of
    ``queues`` at the message's priority.

    ``mark`` is a header and value only this publish's message carries (a placeholder with
    its nonce). The producer must have passed :func:`channel_fits`. Celery merges
    ``options['headers']``
    into the message's own headers; they are put back afterwards, so a later publish of the
    same message object carries none of them.
    """
    channel = producer.channel
    caught: list[tuple[str, tuple[str, ...]]] = []
    previous = channel.__dict__.get("_put")
    forward = previous or type(channel)._put.__get__(channel)

    def catch(queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        headers = message.get("headers")
        if caught or not isinstance(headers, dict) or headers.get(mark[0]) != mark[1]:
            # Not ours (another publish on a shared channel): on its way, untouched. Ours is
            # told by a placeholder only this publish carries, not by its id, which a
            # caller's ``id`` header can change.
            forward(queue, message, **kwargs)
            return
        message["properties"]["delivery_info"]["routing_key"] = routing_key
        priority = channel._get_message_priority(message, reverse=False)
        lists = tuple(channel._q_for_pri(name, priority) for name in queues)
        # Serialized here, before the headers (shared with Celery's message) are put back.
        caught.append((serialize(message), lists))

    headers = getattr(args[1], "headers", None) if len(args) > 1 else None
    saved = dict(headers) if isinstance(headers, dict) else None
    channel._put = catch
    try:
        sender(producer, *args, **options)
    finally:
        if previous is None:
            del channel._put
        else:
            channel._put = previous
        if saved is not None and isinstance(headers, dict):
            headers.clear()
            headers.update(saved)
    if not caught:  # with the default exchange kombu always ends in _put
        raise CeleryShapeError("kombu published without its Redis channel's _put")
    return caught[0]
