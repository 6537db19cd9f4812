"""Fast publish: when the broker is the gate's own Redis, one round trip decides and publishes.

A plain publish costs one round trip (kombu's LPUSH); a gated one would cost two (the gate
script, then the LPUSH). When the broker and the gate share a Redis server and database, the
hook instead lets Celery build the message as usual, catches it at kombu's Redis channel just
before the LPUSH, and hands it to ``gate.lua``, which decides and pushes it to the chosen
queue's list in the same atomic step. What the decision decides (the queue in
``delivery_info``, and the ``gatekeeper_decision``, ``_reason``, ``_dwell_s``,
``_free_admitted`` and ``_window`` headers) is left in the message as placeholders that the
script fills in. Each placeholder carries the publish's random nonce
(:mod:`gatekeeper.redis.push`), so nothing a caller writes can be taken for one, and the
pushed message is the one the ordinary path would have published to the chosen queue (a test
compares the two, parsed).

The ``fast_publish`` setting: ``auto`` (the default) takes it only while nothing observes a
publish, ``on`` whenever it can, ``off`` never. What observes a publish: receivers of Celery's
``before_task_publish``, ``after_task_publish`` or ``task_sent`` signals, and ``task-sent``
events. They fire while Celery builds the message, before the script has decided, so under
fast publish they would see the free queue and placeholder decision headers; with ``auto``
such publishes take the ordinary path and see the real decision.

It leans on kombu's virtual Redis channel (:mod:`gatekeeper.celery.private`, with its
checks). It stands aside, and the ordinary path is taken, for: another transport or server
(compared by the server's ``run_id`` and database), a gate Redis that is a Redis Cluster
(kombu has no cluster transport: the broker is never the gate's server), kombu's
``global_keyprefix``, queues with an expiry or a non-direct exchange, queues whose settings
differ (the message would not be the same on each), kombu publish batches, and a job id or
task name that Redis cannot be sent (:func:`sendable`).

When the script fails, or its reply is lost or late (a Redis stall past ``redis_timeout_s``),
the message Celery already built goes to reserved through ``fallback.lua``, not through
Celery's sender again (its signals fired once). Each publish request carries a nonce, and
the attempt's record (``run:<job_id>:<attempt>``) holds the nonce of the request whose
message was pushed: the
fallback pushes only if this request's message is not already there, and a stalled script
that runs after it pushes nothing, so a message is pushed once whichever comes first, and
the fallback can be sent again safely (once more after a timeout, and by the client's
retry policy). The decision line then names whichever push happened. If it
fails, the caller gets kombu's ``OperationalError`` (the broker is that Redis). With
``publish_replies = "later"`` (the default) the reply is read after the publish has returned,
and all this happens then (:mod:`gatekeeper.redis.later`).

Tracers that wrap kombu's ``Producer.publish`` or ``Producer._publish`` instead of connecting
Celery's signals (ddtrace's kombu integration; Sentry's Celery integration, whenever it is on)
count as observers too, as do producer classes that override those methods: they are no
longer kombu's own. A tracer that patches deeper (kombu's channel, the Redis client) is not
detected; ``fast_publish = "off"`` if that matters.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from types import FunctionType
from typing import Any

import redis
from celery import Celery, signals
from kombu.utils.json import dumps

from gatekeeper.celery.address import REPLAYERS
from gatekeeper.celery.private import cached_value, capture_message, channel_fits
from gatekeeper.core.headers import H_DECISION, H_DWELL_S, H_FREE_ADMITTED, H_REASON, H_WINDOW
from gatekeeper.redis.cluster import is_cluster
from gatekeeper.redis.push import Push, placeholders

__all__ = ["FastRender", "one_server", "possible", "publish_observed", "same_server",
           "sendable"]  # fmt: skip

FILLED_HEADERS = {
    H_DECISION: "decision",
    H_REASON: "reason",
    H_DWELL_S: "dwell",
    H_FREE_ADMITTED: "free",
    H_WINDOW: "window",
}
"""Headers whose values ``gate.lua`` writes, and the name of each one's placeholder."""


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
    host names, ports and Sentinel pools cannot fool it. Never when the gate's Redis is a
    Redis Cluster: kombu's channel is one server's client, so the broker is never the
    cluster, even when it is one of its nodes (whose ``run_id`` the cluster's ``INFO`` can
    answer with); ``gate.lua`` would be sent lists of another slot, or of another server.
    """
    if is_cluster(gate):
        return False
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


def sendable(*texts: str) -> bool:
    """Whether Redis can be sent these (redis-py encodes text as UTF-8, which a lone surrogate,
    as in a file name decoded with ``surrogateescape``, is not). A publish whose job id or task
    name cannot be sent takes the ordinary path: the gate's call then fails before Celery has
    built the message, and fails closed through Celery's own sender (whose JSON escapes it),
    where the fallback push could not send it either."""
    try:
        for text in texts:
            text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _queue_settings(queue: Any) -> tuple[Any, ...]:
    """What of a declared queue changes the message Celery builds for it, or how kombu puts it."""
    exchange = getattr(queue, "exchange", None)
    return (
        getattr(exchange, "type", "direct") or "direct",
        getattr(exchange, "delivery_mode", None),
        getattr(queue, "expires", None),
        getattr(queue, "message_ttl", None),
        getattr(queue, "max_priority", None),
    )


def one_server(producer: Any, gate: redis.Redis, known: MutableMapping[Any, bool]) -> bool:
    """Whether a producer's kombu Redis channel talks to the gate's server and database:
    asked once per connection pool (``known``), again next time when a server could not be
    asked."""
    broker = cached_value(getattr(producer, "channel", None), "client")
    pool = getattr(broker, "connection_pool", None)
    if pool is None:
        return False
    same = known.get(pool)
    if same is None:
        same = same_server(broker, gate)
        if same is not None:
            known[pool] = same
    return bool(same)


def possible(app: Celery, producer: Any, queues: tuple[str, str, str]) -> bool:
    """The set-ups fast publish stands aside for (see the module docstring)."""
    return channel_fits(producer, queues) and queues_alike(app, queues)


def queues_alike(app: Celery, queues: tuple[str, str, str]) -> bool:
    """Whether the three queues would get the same message from Celery, on a direct exchange
    and without expiry. Remembered per declared-queues map and the three queues declared in
    it (by identity: replacing the map, or declaring one of them again, asks again; a
    declared ``Queue`` changed in place is not seen)."""
    declared = cached_value(cached_value(app, "amqp"), "queues")
    entries = (declared.get(queues[0]), declared.get(queues[1]), declared.get(queues[2]))
    known = _ALIKE.get(id(app))
    if known is not None and known[0] is declared and known[1] == queues:
        held = known[2]
        if held[0] is entries[0] and held[1] is entries[1] and held[2] is entries[2]:
            return known[3]
    settings = {_queue_settings(entry) for entry in entries}
    kind, _, expires, _, _ = next(iter(settings))
    alike = len(settings) == 1 and kind == "direct" and not expires
    _ALIKE[id(app)] = (declared, queues, entries, alike)
    return alike


_ALIKE: dict[int, tuple[Any, tuple[str, ...], tuple[Any, ...], bool]] = {}
"""Per app: its declared-queues map (held: its id stays its own), the queues asked of, the
three declared there then (held too) and the answer."""


class FastRender:
    """Fast publish for one publish: Celery's sender run with kombu's push caught, cut at its
    placeholders for ``gate.lua``; ``push`` keeps it for the fallback."""

    def __init__(
        self,
        sender: Callable[..., Any],
        producer: Any,
        name: str,
        message: Any,
        options: dict[str, Any],
        queues: tuple[str, str, str],
        fits: Callable[[], bool] = lambda: True,
    ) -> None:
        self.sender, self.producer, self.name, self.message = sender, producer, name, message
        self.options, self.queues, self.fits = options, queues, fits
        self.push: Push | None = None

    def __call__(self, headers: dict[str, Any], nonce: str) -> Push | None:
        """The message Celery would publish with ``headers`` to the free queue, with the
        decided values left as this nonce's placeholders; None when this publish cannot take
        fast publish (``fits``, asked only now: a decision the flags or a guard make never
        pays for the checks) or the message cannot be cut."""
        if not self.fits():
            return None
        marks = placeholders(nonce)
        options = {**self.options, "queue": self.queues[0], "exchange": None, "routing_key": None}
        options.pop("exchange_type", None)
        filled = {header: marks[name] for header, name in FILLED_HEADERS.items()}
        given = self.options.get("headers") or {}  # as address() forwards them: no REPLAYERS
        given = {name: value for name, value in given.items() if name not in REPLAYERS}
        options["headers"] = {**given, **headers, **filled}
        text, lists = capture_message(
            self.sender, self.producer, (self.name, self.message), options, self.queues,
            (H_DECISION, marks["decision"]), marks["queue"], dumps,
        )  # fmt: skip
        self.push = Push.cut(text, nonce, lists, self.queues)  # type: ignore[arg-type]
        return self.push
