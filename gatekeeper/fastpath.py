"""Fast publish: when the broker is the gate's own Redis, one round trip decides and publishes.

A plain publish costs one round trip (kombu's LPUSH); a gated one would cost two (the gate
script, then the LPUSH). When the broker and the gate share a Redis server and database, the
hook instead lets Celery build the message as usual, catches it at kombu's Redis channel just
before the LPUSH, and hands it to ``gate.lua``, which decides and pushes it to the chosen
queue's list in the same atomic step. What the decision decides (the queue in
``delivery_info``, and the ``gatekeeper_decision``, ``_reason``, ``_dwell_s``,
``_free_admitted`` and ``_window`` headers) is left in the message as placeholders that the
script fills in.

The ``fast_publish`` setting: ``auto`` (the default) takes it only while nothing observes a
publish, ``on`` whenever it can, ``off`` never. What observes a publish: receivers of Celery's
``before_task_publish``, ``after_task_publish`` or ``task_sent`` signals, and ``task-sent``
events. They fire while Celery builds the message, before the script has decided, so under
fast publish they would see the free queue and placeholder decision headers; with ``auto``
such publishes take the ordinary path and see the real decision.

It leans on kombu's virtual Redis channel (``_put``, ``_q_for_pri``,
``_get_message_priority``): private API, covered by tests that fail if it changes, and
checked on every publish. It stands aside, and the ordinary path is taken, for: another
transport or server (compared by the server's ``run_id`` and database), kombu's
``global_keyprefix``, queues with an expiry or a non-direct exchange, and kombu publish
batches.

When the script fails, or its reply is lost or late (a Redis stall past ``redis_timeout_s``),
the message Celery already built goes to reserved through ``fallback.lua``, not through
Celery's sender again (its signals fired once). Each publish request carries a nonce, and
``fast:<job_id>:<attempt>`` records the nonce of the request whose message was pushed: the
fallback pushes only if this request's message is not already there, and a stalled script
that runs after it pushes nothing, so a message is pushed once whichever comes first, and
the fallback can be sent again safely (once more after a timeout, and by the client's
retry policy). The decision line then names whichever push happened. If it
fails, the caller gets kombu's ``OperationalError`` (the broker is that Redis). A message whose
headers hold a value that looks like a placeholder is published the ordinary way, after
being built once for nothing (with ``on``, its signals fire twice).

Tracers that wrap kombu's ``Producer.publish`` or ``Producer._publish`` instead of connecting
Celery's signals (ddtrace's kombu integration; Sentry's Celery integration, whenever it is on)
count as observers too, as do producer classes that override those methods: they are no
longer kombu's own. A tracer that patches deeper (kombu's channel, the Redis client) is not
detected; ``fast_publish = "off"`` if that matters.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from types import FunctionType
from typing import Any

import redis
from celery import signals
from kombu.utils.json import dumps

from gatekeeper.spec import H_DECISION, H_DWELL_S, H_FREE_ADMITTED, H_REASON, H_WINDOW

__all__ = [
    "PLACEHOLDERS",
    "Push",
    "capture_message",
    "fast_path_possible",
    "new_nonce",
    "publish_observed",
    "same_server",
]

QUEUE_PLACEHOLDER = "__gk_queue__"
PLACEHOLDERS = {
    H_DECISION: "__gk_decision__",
    H_REASON: "__gk_reason__",
    H_DWELL_S: "__gk_dwell__",
    H_FREE_ADMITTED: "__gk_free__",
    H_WINDOW: "__gk_window__",
}
"""Headers whose values ``gate.lua`` writes (placeholders are JSON strings it replaces)."""

_CHANNEL_API = ("_put", "_q_for_pri", "_get_message_priority")
"""What fast publish uses of kombu's virtual Redis channel (private API)."""
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
    nonce: str = field(default_factory=lambda: new_nonce())
    """This publish request's own token (``fast:<job_id>:<attempt>`` holds it once pushed)."""

    @cached_property
    def pieces(self) -> list[str]:
        """The template cut at its placeholders: text, name, text, ..., text (for gate.lua).

        Cut once: the capture checks the names, then the script call sends the pieces.
        """
        return _PLACEHOLDER.split(self.template)

    def filled(self, decision: str, reason: str, queue: str) -> str:
        """The message with a decision made without the script (for ``fallback.lua``).

        Never for ``admit_free``: an admission is only ever pushed by ``gate.lua``, which
        holds its exposure and enters it in the free queue's wait in the same step.
        """
        if decision == "admit_free":
            raise ValueError("decision: admit_free is pushed by gate.lua only")
        values = {
            "decision": json.dumps(decision),
            "reason": json.dumps(reason),
            "dwell": "null",
            "free": "false",
            "window": "null",
            "queue": json.dumps(queue),
        }
        return "".join(
            values[piece] if index % 2 else piece for index, piece in enumerate(self.pieces)
        )


def new_nonce() -> str:
    """A token for one publish request: tells it apart from another publish of the same task
    id and attempt (``random`` is reseeded in a forked child)."""
    return f"{time.time_ns():x}.{random.getrandbits(48):012x}"


def publish_observed(producer_type: type) -> bool:
    """Whether something observes a publish: receivers of Celery's publish signals
    (``before_task_publish``, ``after_task_publish``, the old ``task_sent``), or producer
    publish methods that are not kombu's own (a tracer wrapped them, or a subclass overrides
    them). ``auto`` fast publish stands aside then."""
    if (
        signals.before_task_publish.receivers
        or signals.after_task_publish.receivers
        or signals.task_sent.receivers
    ):
        return True
    return not _kombus_own(_stored(producer_type, "publish"), _stored(producer_type, "_publish"))


def _stored(producer_type: type, name: str) -> Any:
    """A class's attribute as stored (no descriptor run: a wrapt wrapper read off the class
    would be a new bound wrapper each time)."""
    for klass in producer_type.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return None


def _kombus_own(publish: Any, _publish: Any) -> bool:
    """Whether a producer class's publish methods are kombu's ``Producer`` ones, unwrapped:
    a ``functools.wraps`` wrapper and a wrapt proxy both carry ``__wrapped__``.

    Remembered by the methods' identity (wrapt proxies compare equal to what they wrap), so
    a patch made later is seen.
    """
    key = (id(publish), id(_publish))
    seen = _OWN_METHODS.get(key)
    if seen is not None and seen[0] is publish and seen[1] is _publish:
        return seen[2]
    own = all(
        type(method) is FunctionType
        and method.__module__ == "kombu.messaging"
        and method.__qualname__ == f"Producer.{name}"
        and not hasattr(method, "__wrapped__")
        for method, name in ((publish, "publish"), (_publish, "_publish"))
    )
    if len(_OWN_METHODS) >= 32:
        _OWN_METHODS.clear()
    _OWN_METHODS[key] = (publish, _publish, own)  # holds them: their ids stay theirs
    return own


_OWN_METHODS: dict[tuple[int, int], tuple[Any, Any, bool]] = {}


def same_server(broker: Any, gate: redis.Redis) -> bool | None:
    """Whether a kombu channel's Redis client talks to the gate's server and database; None
    when that could not be asked (a server unreachable for now: ask again next time).

    Asked of the servers themselves (``run_id`` and the database number), once per pool:
    host names, ports and Sentinel pools cannot fool it.
    """
    try:
        theirs = broker.connection_pool.connection_kwargs.get("db", 0)
        ours = gate.connection_pool.connection_kwargs.get("db", 0)
        if int(theirs or 0) != int(ours or 0):
            return False
    except Exception:  # a client of a kind this cannot read: the ordinary path
        return False
    try:
        return bool(broker.info("server")["run_id"] == gate.info("server")["run_id"])
    except (redis.ConnectionError, redis.TimeoutError):
        return None
    except Exception:  # INFO refused (ACLs), a cluster's reply: the ordinary path
        return False


def fast_path_possible(app: Any, producer: Any, channel: Any, queues: tuple[str, ...]) -> bool:
    """The set-ups fast publish stands aside for (see the module docstring)."""
    if channel is None or not all(hasattr(channel, name) for name in _CHANNEL_API):
        return False
    if getattr(channel, "global_keyprefix", ""):
        return False
    expires = getattr(channel, "_expires", None) or {}
    if any(queue in expires for queue in queues):
        return False
    batch = getattr(getattr(producer, "_batch_local", None), "current", None)
    if batch is not None:
        return False
    declared = getattr(getattr(app, "amqp", None), "queues", {}) or {}
    for queue in queues:
        known = declared.get(queue) if hasattr(declared, "get") else None
        exchange = getattr(known, "exchange", None)
        if exchange is not None and getattr(exchange, "type", "direct") != "direct":
            return False
        if known is not None and getattr(known, "expires", None):
            return False
    return True


def capture_message(
    sender: Callable[..., Any],
    producer: Any,
    args: tuple[Any, ...],
    options: dict[str, Any],
    queues: tuple[str, str, str],
    job_id: str,
) -> Push | None:
    """Run Celery's sender with kombu's final LPUSH caught; None when a header value looks
    like a placeholder (then the message must take the ordinary path).

    The producer's channel must have passed :func:`fast_path_possible`; ``options`` must
    already carry the placeholders and ``queue=queues[0]``.
    """
    channel = producer.channel
    caught: list[Push] = []
    previous = channel.__dict__.get("_put")
    forward = previous or type(channel)._put.__get__(channel)

    def catch(queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        if caught or str(message.get("headers", {}).get("id")) != job_id:
            # Not ours (another publish on a shared channel): on its way, untouched.
            forward(queue, message, **kwargs)
            return
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
        if previous is None:
            del channel._put
        else:
            channel._put = previous
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
