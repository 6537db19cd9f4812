"""The broker the replayer, ``status``, the sweep and the dead letter read.

Celery's own monitors do not see ``defer``, so gatekeeper reads the broker itself, in one of
two ways chosen by the broker's URL (:func:`broker_for`):

- Redis (``redis://``, ``rediss://``, ``unix://``, ``sentinel://``): kombu's lists, read
  and moved atomically (:class:`RedisBroker`). Messages are claimed, a batch at a time, into
  the lock tenure's processing list (:class:`gatekeeper.redis.lock.Claims`) and leave it only
  by ``move.lua``, which removes each claimed copy and pushes the rewritten one in one step
  (a batch's moves in one call), and moves nothing once the tenure's heartbeat is gone.
- RabbitMQ (``amqp://``, ``amqps://``, ``pyamqp://``): through kombu, with explicit acks
  and publisher confirms (:class:`gatekeeper.celery.amqp.AmqpBroker`).

Any other transport is refused (:class:`~gatekeeper.errors.ConfigError` naming
``broker_url``): deferred work would have nothing able to read it. So is a Redis broker with
kombu's ``global_keyprefix``: its queues are not where gatekeeper reads them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import redis
from amqp.exceptions import AMQPError
from kombu.exceptions import KombuError

from gatekeeper.celery.lists import Layout, waiting_attempts
from gatekeeper.celery.taken import Broker, Taken
from gatekeeper.errors import ConfigError
from gatekeeper.redis.cluster import is_cluster, shown_nodes
from gatekeeper.redis.connect import client_for
from gatekeeper.redis.lock import Claims
from gatekeeper.redis.scripts import evalsha, load_lua
from gatekeeper.settings import GatekeeperSettings
from gatekeeper.urls import REDIS_URL_SCHEMES

__all__ = ["AMQP_URL_SCHEMES", "BROKER_ERRORS", "Broker", "RedisBroker", "Taken", "broker_for",
           "check_broker", "gone_for_good", "shown_url"]  # fmt: skip

AMQP_URL_SCHEMES = ("amqp://", "amqps://", "pyamqp://")
"""The RabbitMQ URLs gatekeeper reads (kombu's py-amqp transport)."""
BROKER_ERRORS = (redis.RedisError, OSError, KombuError, AMQPError)
"""What a broker that cannot be reached raises, on either kind."""


def check_broker(
    url: str | None, field: str = "broker_url", options: Mapping[str, Any] | None = None
) -> str:
    """``redis`` or ``amqp`` for a broker URL gatekeeper can read (with these kombu transport
    ``options``); ConfigError otherwise."""
    if url and url.startswith(REDIS_URL_SCHEMES):
        prefix = (options or {}).get("global_keyprefix")
        if prefix:  # kombu's lists are then "<prefix><queue>": defer would be read empty
            raise ConfigError(
                f"broker_transport_options: global_keyprefix={prefix!r} is not supported: "
                "gatekeeper reads and moves a Redis broker's queues by their names, and "
                "deferred tasks would have nothing able to read them"
            )
        Layout.of(options)  # its lists' names: read as kombu reads them, or refused here
        return "redis"
    if url and url.startswith(AMQP_URL_SCHEMES):
        return "amqp"
    scheme = (url or "").split("://", 1)[0] or "none"
    raise ConfigError(
        f"{field}: gatekeeper reads its queues on a Redis broker (redis://, rediss://, unix://, "
        f"sentinel://) or RabbitMQ (amqp://, amqps://), got {scheme!r}: deferred tasks would "
        "have nothing able to read them"
    )


def broker_for(
    settings: GatekeeperSettings, app: Any = None, ident: str = "", timeout_s: float = 5.0
) -> Broker:
    """The broker of these settings (``broker_url``, else the app's); ConfigError names the
    field when gatekeeper cannot read it. ``timeout_s``: a Redis broker's socket timeouts
    (the metrics exporter's are short, so that a hung broker cannot hang a scrape)."""
    url = settings.effective_broker_url
    options = settings.broker_transport_options  # a sentinel broker's master, as kombu's
    if check_broker(url, "GATEKEEPER_BROKER_URL", options) == "amqp":
        from gatekeeper.celery.amqp import AmqpBroker

        return AmqpBroker(str(url), settings, app)
    client = client_for(str(url), timeout_s, options, retry_on_timeout=False)
    return RedisBroker(client, settings)


def shown_url(client: redis.Redis) -> str:
    """Which server a client talks to (host, port, db; never a password), for the lines that
    say which broker and gate Redis a command read."""
    if is_cluster(client):
        return shown_nodes(client)
    pool = getattr(client, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", {}) or {}
    master = getattr(pool, "service_name", None)  # behind Sentinel: its name, no lookup
    if master:
        return f"sentinel {master}/{kwargs.get('db', 0)}"
    if "path" in kwargs:
        return f"unix://{kwargs['path']}?db={kwargs.get('db', 0)}"
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}/{kwargs.get('db', 0)}"


def _priority(properties: Mapping[str, Any]) -> int:
    """A message's priority as kombu reads it (``_get_message_priority``: 0 when unreadable)."""
    try:
        return int(properties.get("priority") or 0)
    except (TypeError, ValueError):
        return 0


def _document(raw: bytes | str) -> dict[str, Any] | None:
    try:
        message = json.loads(raw)
    except ValueError:
        return None
    if not (isinstance(message, dict) and isinstance(message.get("headers"), dict)
            and isinstance(message.get("properties"), dict)):  # fmt: skip
        return None
    return message


class RedisBroker:
    """kombu's Redis lists: a queue is one list per priority step (gatekeeper/celery/lists.py)."""

    def __init__(self, client: redis.Redis, settings: GatekeeperSettings) -> None:
        self.client = client
        self.settings = settings
        self.claims: Claims | None = None
        self.layout = Layout.of(settings.broker_transport_options)  # the lists kombu uses
        self._move = client.register_script(load_lua("move.lua"))
        self.shown = shown_url(client)

    def begin(self, ident: str) -> None:
        if self.claims is None or self.claims.ident != ident:
            self.claims = Claims(self.client, self.settings.defer_queue,
                                 self.settings.replay_lock_ttl_s, ident)  # fmt: skip
        self.claims.begin()

    def end(self) -> None:
        if self.claims is not None:
            self.claims.end()

    def beat(self) -> None:
        if self.claims is not None:
            self.claims.beat()

    def recover(self) -> int:
        return self.claims.take_back() if self.claims is not None else 0

    def take(self, queue: str, claim: bool = True) -> Iterator[Taken]:
        for source in self.layout.lists(queue):
            if not claim:
                for raw in reversed(self.client.lrange(source, 0, -1)):
                    data = raw if isinstance(raw, bytes) else raw.encode()
                    yield Taken(source, data, _document(data), at=source)
                continue
            for batch in self._claimed(source, 1, batched=False):  # moved when sent or held
                yield from batch

    def take_batches(self, queue: str, size: int) -> Iterator[list[Taken]]:
        for source in self.layout.lists(queue):
            yield from self._claimed(source, size)

    def _claimed(self, source: str, size: int, batched: bool = True) -> Iterator[list[Taken]]:
        """What ``source`` held when asked, claimed ``size`` at a time (the ones pushed back
        meanwhile are not looked at again)."""
        left = int(self.client.llen(source))
        while left > 0:
            assert self.claims is not None, "begin() a tenure before claiming"
            claimed = self.claims.claim_many(source, min(size, left))
            if not claimed:
                return
            left -= len(claimed)
            at = self.claims.current
            yield [Taken(source, raw, _document(raw), at=at, batched=batched) for raw in claimed]

    def send(self, taken: Taken, queue: str, message: dict[str, Any] | None) -> bool:
        target = self.layout.queue_list(queue, 0)
        if message is not None:
            properties = message["properties"]
            properties["delivery_info"] = {"exchange": "", "routing_key": queue}
            properties["delivery_tag"] = str(uuid.uuid4())
            target = self.layout.queue_list(queue, _priority(properties))
        return self._moved(taken, target, message)

    def hold(self, taken: Taken, message: dict[str, Any] | None, wait_s: float) -> bool:
        return self._moved(taken, taken.source, message)

    def _moved(self, taken: Taken, target: str, message: dict[str, Any] | None) -> bool:
        new = taken.raw if message is None else json.dumps(message).encode()
        taken.done = True  # moved, or its copy was gone (taken back): either way not ours
        if taken.batched:
            taken.move = (target, new)  # made with the batch's others (hand_on)
            return True
        self._move_all([(taken, target, new)])
        return not taken.refused

    def hand_on(self, batch: list[Taken]) -> None:
        moves = [(taken, *taken.move) for taken in batch if taken.move is not None]
        for taken in batch:
            taken.move = None
        self._move_all(moves)

    def _move_all(self, moves: list[tuple[Taken, str, bytes]]) -> None:
        """Move each copy to its target list, one ``move.lua`` call per list they are in (one
        in a pass); a copy not moved is marked ``refused``. A claimed copy moves only while its
        tenure is the current one and alive (its heartbeat); one of a tenure that ended never
        does."""
        for at in dict.fromkeys(taken.at for taken, _, _ in moves):
            mine = [move for move in moves if move[0].at == at]
            if self.claims is not None and at == self.claims.current:
                heartbeat = self.claims.heartbeat_of(self.claims.tenure)
            elif all(taken.at == taken.source for taken, _, _ in mine):
                heartbeat = at  # read in place (the dead-letter commands): no tenure
            else:  # claimed in a tenure that ended: the lock's holder takes it back
                for taken, _, _ in mine:
                    taken.refused = True
                continue
            keys = [at, heartbeat, *(target for _, target, _ in mine)]
            args = [part for taken, _, new in mine for part in (taken.raw, new)]
            answers = evalsha(self.client, self._move, keys, args)
            for (taken, _, _), answer in zip(mine, answers, strict=True):
                taken.refused = not int(answer)

    def holds(self, taken: Taken) -> bool:
        return True  # a claimed copy waits in the tenure's list until moved or taken back

    def leave(self, taken: Taken) -> None:
        """A claimed message stays in the tenure's list; the lock's holder takes it back."""

    def length(self, queue: str) -> int:
        return sum(int(self.client.llen(name)) for name in self.layout.lists(queue))

    def claimed(self) -> int | None:
        return Claims.held(self.client, self.settings.defer_queue)

    def waiting(self, queue: str) -> set[str] | None:
        return waiting_attempts(self.client, queue, self.layout)

    def delayed(self, queue: str) -> int | None:
        return None  # a not-due message waits in the queue's own list

    def abort(self) -> None:
        """Nothing: a claimed message stays in the tenure's list, taken back by the holder."""

    def close(self) -> None:
        self.client.close()


def gone_for_good(batch: list[Taken], labels: list[str]) -> list[dict[str, Any]]:
    """The headers of a replayed batch's messages (with their labels, ``Replayer._handle``'s)
    that left defer for good, handed on or dead-lettered: their deadlines no longer count."""
    gone = ("to_", "dead_lettered", "handed_on")
    pairs = zip(batch, labels, strict=True)
    return [taken.message["headers"] for taken, label in pairs
            if label.startswith(gone) and taken.message]  # fmt: skip
