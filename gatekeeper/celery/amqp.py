"""RabbitMQ as the broker the replayer, ``status``, the sweep and the dead letter read.

Through kombu (py-amqp), on a connection of its own with publisher confirms:

- ``take``: ``basic_get`` with explicit acks, one message at a time, as many as the queue
  held when the pass began (a passive declare's message count). RabbitMQ gives back every
  message not acked when the connection drops, so a replayer killed mid-batch loses none.
- ``send``: the rewritten message is published to the queue's name on the default exchange
  and confirmed by the broker, and only then is the original acked. A crash between the two
  leaves both: the original comes back (redelivered) and is handed on again with the same
  decision (the gate's record remembers it: :mod:`gatekeeper.redis.handoff`), and a worker
  runs one of the two copies (:mod:`gatekeeper.celery.duplicates`).
- ``hold``: a message not yet due waits in a delay queue ``<defer>.delay.<ms>`` (a queue TTL
  and a dead-letter exchange that send it back to ``defer``), never at the head of defer. One
  TTL per delay queue, so its messages expire in order; the waits are a ladder (the replay
  backoffs, doubling up to ``replay_backoff_max_s``) and a message gets the longest that is
  not past its time (the shortest when its time is nearer), looked at again on its return.
- ``length``: a passive declare's message count (0 for a queue not declared yet).
  ``waiting`` is None: a queue cannot be listed without consuming it, so the sweep's purge
  check stands aside on RabbitMQ (admissions whose message was purged stop counting at the
  horizon, ``max_queue_age_s``, as any stale admission does).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from contextlib import suppress
from typing import Any
from urllib.parse import urlsplit

from amqp.exceptions import NotFound
from kombu.connection import Connection
from kombu.entity import Exchange, Queue
from kombu.messaging import Producer

from gatekeeper.celery.taken import Taken
from gatekeeper.settings import GatekeeperSettings

__all__ = ["DEATH_HEADERS", "AmqpBroker", "delay_ladder"]

DEATH_HEADERS = ("x-death", "x-first-death-", "x-last-death-", "x-delivery-count")
"""What RabbitMQ adds to a message it dead-letters (the delay queues): not the task's, dropped
before the message is handed on."""
COPIED = ("priority", "correlation_id", "reply_to", "delivery_mode", "expiration")


def delay_ladder(backoff_s: float, max_s: float) -> list[int]:
    """The delay queues' waits in milliseconds: the backoffs, doubling, up to the maximum."""
    ladder: list[int] = []
    wait = max(backoff_s, 0.001)
    while wait < max_s and len(ladder) < 32:
        ladder.append(round(wait * 1000))
        wait *= 2
    ladder.append(round(max(max_s, backoff_s) * 1000))
    return sorted(set(ladder))


def _shown(url: str) -> str:
    parts = urlsplit(url)
    vhost = parts.path[1:] or "/"
    return f"amqp {parts.hostname or 'localhost'}:{parts.port or 5672} vhost {vhost}"


def _document(message: Any) -> dict[str, Any]:
    headers = {k: v for k, v in (message.headers or {}).items()
               if not str(k).startswith(DEATH_HEADERS)}  # fmt: skip
    properties = {k: message.properties.get(k) for k in COPIED if k in message.properties}
    delivered = message.delivery_info
    properties["delivery_info"] = {"exchange": delivered.get("exchange", ""),
                                   "routing_key": delivered.get("routing_key")}  # fmt: skip
    return {"body": message.body, "content-type": message.content_type,
            "content-encoding": message.content_encoding, "headers": headers,
            "properties": properties}  # fmt: skip


class AmqpBroker:
    """One RabbitMQ connection (publisher confirms on), opened at first use and opened again
    after a fault."""

    def __init__(self, url: str, settings: GatekeeperSettings, app: Any = None) -> None:
        self.url = url
        self.settings = settings
        self.app = app
        self.shown = _shown(url)
        self.ladder = delay_ladder(settings.replay_backoff_s, settings.replay_backoff_max_s)
        self._connection: Connection | None = None
        self._channel: Any = None
        self._declared: set[str] = set()

    # -- the connection -----------------------------------------------------------------

    def _open(self) -> Any:
        if self._channel is None:
            options: dict[str, Any] = {}
            ssl: Any = None
            if self.app is not None:  # the app's own transport options and TLS
                options.update(self.app.conf.broker_transport_options or {})
                ssl = self.app.conf.broker_use_ssl
            options["confirm_publish"] = True
            connection = Connection(self.url, ssl=ssl, transport_options=options,
                                          connect_timeout=5)  # fmt: skip
            try:
                connection.ensure_connection(max_retries=1)
                self._channel = connection.channel()
            except Exception:
                connection.release()
                raise
            self._connection = connection
        return self._channel

    def _faulted(self) -> None:
        """Drop the connection after a fault: RabbitMQ gives back what it had delivered."""
        if self._connection is not None:
            with suppress(Exception):  # already gone
                self._connection.release()
        self._connection, self._channel = None, None
        self._declared.clear()

    def close(self) -> None:
        self._faulted()

    def _count(self, queue: str) -> int | None:
        """The queue's ready messages, None when it is not declared. Asked on a channel of its
        own: a failed passive declare closes its channel, and the main one holds messages
        taken and not yet acked."""
        self._open()
        assert self._connection is not None
        try:
            probe = self._connection.channel()
        except Exception:
            self._faulted()
            raise
        try:
            reply = probe.queue_declare(queue=queue, passive=True)
        except NotFound:
            return None
        except Exception:
            self._faulted()
            raise
        finally:
            with suppress(Exception):  # closed already by the broker after NotFound
                probe.close()
        return int(reply.message_count)

    def _declare(self, queue: str, **arguments: Any) -> None:
        """Declare ``queue`` once: as the app declares it when it knows it, else as Celery
        makes a missing queue (durable, its own direct exchange); a delay queue with its
        arguments. A queue that already exists is left as it is."""
        if queue in self._declared:
            return
        if arguments or self._count(queue) is None:
            known = getattr(getattr(self.app, "amqp", None), "queues", {}) or {}
            if arguments:
                declared = Queue(queue, routing_key=queue, durable=True,
                                       queue_arguments=arguments)  # fmt: skip
            elif queue in known:
                declared = known[queue]
            else:
                declared = Queue(queue, Exchange(queue), routing_key=queue)
            try:
                declared(self._open()).declare()
            except Exception:
                self._faulted()
                raise
        self._declared.add(queue)

    # -- the replayer's steps -----------------------------------------------------------

    def begin(self, ident: str) -> None:
        """Nothing to set up: RabbitMQ holds what a replayer took until it is acked."""

    def end(self) -> None:
        self._faulted()  # anything taken and not acked goes back to its queue

    def beat(self) -> None:
        """Nothing to prove: a dead replayer's connection drops and its messages come back."""

    def recover(self) -> int:
        return 0

    def take(self, queue: str, claim: bool = True) -> Iterator[Taken]:
        count = self._count(queue) or 0
        for _ in range(count):
            try:
                message = Queue(queue, no_declare=True)(self._open()).get(no_ack=False)
            except Exception:
                self._faulted()
                raise
            if message is None:
                break
            yield Taken(queue, message.body, _document(message), handle=message)

    def send(self, taken: Taken, queue: str, message: dict[str, Any] | None) -> bool:
        self._declare(queue)
        self._publish(queue, message or taken.message or {"body": taken.raw, "headers": {}})
        self._ack(taken)
        return True

    def hold(self, taken: Taken, message: dict[str, Any] | None, wait_s: float) -> bool:
        ladder = self.ladder
        wait_ms = ladder[max(0, bisect.bisect_right(ladder, round(wait_s * 1000)) - 1)]
        name = f"{taken.source}.delay.{wait_ms}"
        self._declare(name, **{"x-message-ttl": wait_ms, "x-dead-letter-exchange": "",
                               "x-dead-letter-routing-key": taken.source})  # fmt: skip
        self._publish(name, message or taken.message or {"body": taken.raw, "headers": {}})
        self._ack(taken)
        return True

    def leave(self, taken: Taken) -> None:
        try:
            taken.handle.requeue()
        except Exception:  # the connection is gone: RabbitMQ gives it back anyway
            self._faulted()

    def _publish(self, queue: str, message: dict[str, Any]) -> None:
        """Publish and wait for the broker's confirm (a refusal raises)."""
        properties = message.get("properties") or {}
        options = {k: properties[k] for k in COPIED if properties.get(k) is not None}
        options.setdefault("delivery_mode", 2)
        try:
            Producer(self._open()).publish(
                message["body"], exchange="", routing_key=queue, headers=message["headers"],
                content_type=message.get("content-type") or "application/json",
                content_encoding=message.get("content-encoding") or "utf-8",
                retry=False, **options,
            )  # fmt: skip
        except Exception:
            self._faulted()
            raise

    def _ack(self, taken: Taken) -> None:
        taken.done = True  # the copy is confirmed: whatever the ack does, never publish again
        try:
            taken.handle.ack()
        except Exception:
            self._faulted()
            raise

    # -- what status and the sweep read -------------------------------------------------

    def length(self, queue: str) -> int:
        return self._count(queue) or 0

    def claimed(self) -> int | None:
        return None

    def waiting(self, queue: str) -> set[str] | None:
        return None
