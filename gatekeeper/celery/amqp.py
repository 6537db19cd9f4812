"""RabbitMQ as the broker the replayer, ``status``, the sweep and the dead letter read.

Through kombu (py-amqp), on a connection of its own with publisher confirms:

- ``take``: ``basic_get`` with explicit acks, one message at a time, as many as the queue
  held when the pass began (a passive declare's message count). RabbitMQ gives back every
  message not acked when the connection drops, so a replayer killed mid-batch loses none.
- ``send``: the rewritten message is published to the queue's name on the default exchange
  and confirmed by the broker, and only then is the original acked. A crash between the two
  leaves both: the original comes back (redelivered) and is handed on again with the same
  decision (the gate keeps its handoff: :mod:`gatekeeper.redis.handoff`), and a worker
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

from amqp.exceptions import ChannelError, MessageNacked, NotFound
from kombu.connection import Connection
from kombu.entity import Exchange, Queue
from kombu.messaging import Producer

from gatekeeper.celery.taken import Taken
from gatekeeper.settings import GatekeeperSettings

__all__ = ["DEATH_HEADERS", "AmqpBroker", "Unroutable", "delay_ladder"]

DEATH_HEADERS = ("x-death", "x-first-death-", "x-last-death-", "x-delivery-count")
"""What RabbitMQ adds to a message it dead-letters (the delay queues): not the task's, dropped
before the message is handed on."""
COPIED = ("priority", "correlation_id", "reply_to", "delivery_mode")
"""What a rewritten copy keeps of the original's properties. Not ``expiration``: Celery makes
one from ``expires``, and in defer (no dead-letter exchange of its own) it would drop the task
silently; the worker enforces ``expires`` from the headers, and stores the task's state."""


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


def _document(message: Any, strict: bool = True) -> dict[str, Any] | None:
    """kombu's message document of a delivered message; with ``strict``, None for one that is
    not a Celery task message (no ``id`` and ``task`` headers: not even readable as one)."""
    raw = message.headers if isinstance(message.headers, dict) else {}
    if strict and not (raw.get("id") and raw.get("task")):
        return None
    headers = {k: v for k, v in raw.items() if not str(k).startswith(DEATH_HEADERS)}
    properties = {k: message.properties.get(k) for k in COPIED if k in message.properties}
    delivered = message.delivery_info
    properties["delivery_info"] = {"exchange": delivered.get("exchange", ""),
                                   "routing_key": delivered.get("routing_key")}  # fmt: skip
    return {"body": message.body, "content-type": message.content_type,
            "content-encoding": message.content_encoding, "headers": headers,
            "properties": properties}  # fmt: skip


def _as_is(message: Any) -> dict[str, Any]:
    """The document of a message handed on unchanged (one that is not a task: as it came)."""
    document = _document(message, strict=False)
    assert document is not None
    return document


CONFIRM_TIMEOUT_S = 30.0
"""How long a publish waits for RabbitMQ's confirm (a broker under a memory or disk alarm
blocks publishers): past it the publish fails, the connection is dropped and the original,
never acked, goes back to defer."""

SOCKET_TIMEOUT_S = 30.0
"""How long any other wait on RabbitMQ's socket may last (opening a channel, a ``basic_get``, a
passive declare), unless the app's ``broker_transport_options`` set ``read_timeout``: a peer
that takes the bytes and answers nothing (a hung broker, a proxy whose backend is gone) fails
the call then, and the connection is dropped, instead of blocking the replayer for good."""


def _bound(connection: Connection, timeout_s: float | None) -> None:
    """Give the open socket (py-amqp's ``transport.sock``) ``timeout_s`` (None: the app asked
    for none): py-amqp's ``read_timeout`` ends a wait only at a frame's start (mid-frame it
    retries for good), and over TLS the socket keeps its connect timeout instead."""
    if timeout_s is not None:
        with suppress(AttributeError):
            connection.connection.transport.sock.settimeout(float(timeout_s))


class Unroutable(Exception):
    """A publish RabbitMQ confirmed but returned: no queue was bound to take it."""


class AmqpBroker:
    """One RabbitMQ connection (publisher confirms on), opened at first use and opened again
    after a fault, with a channel for taking and acking, one for publishing, and a fresh one
    for each declare: a refused publish or declare closes only its own channel, never the one
    that holds the messages taken and not yet acked."""

    def __init__(self, url: str, settings: GatekeeperSettings, app: Any = None) -> None:
        self.url = url
        self.settings = settings
        self.app = app
        self.shown = _shown(url)
        self.ladder = delay_ladder(settings.replay_backoff_s, settings.replay_backoff_max_s)
        self._connection: Connection | None = None
        self._taking: Any = None
        self._publishing: Any = None
        self._producer: Any = None
        self._returned: list[str] = []
        self._declared: set[str] = set()

    # -- the connection and its channels ------------------------------------------------

    def _connect(self) -> Connection:
        if self._connection is None:
            options: dict[str, Any] = {}
            ssl: Any = None
            if self.app is not None:  # the app's own transport options and TLS
                options.update(self.app.conf.broker_transport_options or {})
                ssl = self.app.conf.broker_use_ssl
            options["confirm_publish"] = True
            options.setdefault("read_timeout", SOCKET_TIMEOUT_S)
            options.setdefault("write_timeout", SOCKET_TIMEOUT_S)
            connection = Connection(self.url, ssl=ssl, transport_options=options,
                                    connect_timeout=5)  # fmt: skip
            try:
                connection.ensure_connection(max_retries=1)
            except Exception:
                connection.release()
                raise
            _bound(connection, options.get("read_timeout"))
            self._connection = connection
        return self._connection

    def _channel(self) -> Any:
        """The channel messages are taken and acked on."""
        if self._taking is None:
            try:
                self._taking = self._connect().channel()
            except Exception:
                self._faulted()
                raise
        return self._taking

    def _faulted(self, graceful: bool = False) -> None:
        """Drop the connection after a fault: RabbitMQ gives back what it had delivered. Its
        socket is closed without AMQP's closing handshake (``collect``): a broker that stopped
        answering (a memory or disk alarm blocks a publishing connection; a black-holed flow)
        would never answer it, and the replayer would wait for good."""
        if self._connection is not None:
            with suppress(Exception):  # already gone
                if graceful:
                    self._connection.release()
                else:
                    self._connection.collect()
        self._connection, self._taking, self._publishing, self._producer = None, None, None, None
        self._declared.clear()

    def close(self) -> None:
        self._faulted(graceful=True)

    def abort(self) -> None:
        """After a failed pass: drop the connection, so nothing stays taken and unacked."""
        self._faulted()

    def _on_side(self, action: Any) -> Any:
        """Run ``action(channel)`` on a channel of its own, closed after: a channel error
        (NotFound, PreconditionFailed) raises and closes only that channel."""
        try:
            channel = self._connect().channel()
        except Exception:
            self._faulted()
            raise
        try:
            return action(channel)
        except ChannelError:
            raise
        except Exception:
            self._faulted()
            raise
        finally:
            with suppress(Exception):  # closed already by the broker after a channel error
                channel.close()

    def _count(self, queue: str) -> int | None:
        """The queue's ready messages, None when it is not declared."""
        try:
            reply = self._on_side(lambda channel: channel.queue_declare(queue=queue,
                                                                        passive=True))  # fmt: skip
        except NotFound:
            return None
        return int(reply.message_count)

    def _declare(self, queue: str, **arguments: Any) -> None:
        """Declare ``queue`` once per connection: as the app declares it (its priorities and
        queue type: ``app.amqp.queues`` makes a missing one as Celery would) when there is an
        app, else as Celery makes a missing queue by default (durable, its own direct
        exchange); a delay queue with its arguments. One that already exists is left as it is."""
        if queue in self._declared:
            return
        if arguments or self._count(queue) is None:
            if arguments:
                declared = Queue(queue, routing_key=queue, durable=True,
                                 queue_arguments=arguments)  # fmt: skip
            elif self.app is not None:
                declared = self.app.amqp.queues[queue]
            else:
                declared = Queue(queue, Exchange(queue), routing_key=queue)
            self._on_side(lambda channel: declared(channel).declare())
        self._declared.add(queue)

    # -- the replayer's steps -----------------------------------------------------------

    def begin(self, ident: str) -> None:
        """Nothing to set up: RabbitMQ holds what a replayer took until it is acked."""

    def end(self) -> None:
        self._faulted(graceful=True)  # anything taken and not acked goes back to its queue

    def beat(self) -> None:
        """Nothing to prove: a dead replayer's connection drops and its messages come back."""

    def recover(self) -> int:
        return 0

    def take(self, queue: str, claim: bool = True) -> Iterator[Taken]:
        count = self._count(queue) or 0
        for _ in range(count):
            try:
                message = Queue(queue, no_declare=True)(self._channel()).get(no_ack=False)
            except Exception:
                self._faulted()
                raise
            if message is None:
                break
            yield Taken(queue, message.body, _document(message), handle=message)

    def take_batches(self, queue: str, size: int) -> Iterator[list[Taken]]:
        """One message at a time: each is acked once its copy is confirmed, as it is sent."""
        for taken in self.take(queue):
            yield [taken]

    def hand_on(self, batch: list[Taken]) -> None:
        """Nothing: each send and hold was made (published, confirmed, acked) when asked."""

    def send(self, taken: Taken, queue: str, message: dict[str, Any] | None) -> bool:
        self._declare(queue)
        self._publish(queue, message or _as_is(taken.handle))
        self._ack(taken)
        return True

    def hold(self, taken: Taken, message: dict[str, Any] | None, wait_s: float) -> bool:
        ladder = self.ladder
        wait_ms = ladder[max(0, bisect.bisect_right(ladder, round(wait_s * 1000)) - 1)]
        name = f"{taken.source}.delay.{wait_ms}"
        self._declare(taken.source)  # where the delay queue sends it back: never into nothing
        self._declare(name, **{"x-message-ttl": wait_ms, "x-dead-letter-exchange": "",
                               "x-dead-letter-routing-key": taken.source})  # fmt: skip
        self._publish(name, message or _as_is(taken.handle))
        self._ack(taken)
        return True

    def delayed(self, queue: str) -> int | None:
        """Messages of ``queue`` waiting out a backoff in its delay queues."""
        return sum(self._count(f"{queue}.delay.{ms}") or 0 for ms in self.ladder)

    def holds(self, taken: Taken) -> bool:
        channel = getattr(taken.handle, "channel", None)
        return (
            channel is not None
            and channel is self._taking
            and bool(getattr(channel, "is_open", False))
        )

    def leave(self, taken: Taken) -> None:
        try:
            taken.handle.requeue()
        except Exception:  # the connection is gone: RabbitMQ gives it back anyway
            self._faulted()

    def _publish(self, queue: str, message: dict[str, Any]) -> None:
        """Publish (mandatory) and wait for the broker's confirm: a refusal (nack), a return
        (no queue took it) or a closed channel raises, and only the publishing channel is
        dropped, so the original stays taken for the replayer to set aside."""
        properties = message.get("properties") or {}
        options = {k: properties[k] for k in COPIED if properties.get(k) is not None}
        options.setdefault("delivery_mode", 2)
        try:
            if self._publishing is None:
                self._publishing = self._connect().channel()
                self._producer = Producer(self._publishing, on_return=self._on_return)
            self._returned.clear()
            self._producer.publish(
                message["body"], exchange="", routing_key=queue, headers=message["headers"],
                content_type=message.get("content-type") or "application/json",
                content_encoding=message.get("content-encoding") or "utf-8",
                retry=False, mandatory=True, confirm_timeout=CONFIRM_TIMEOUT_S, **options,
            )  # fmt: skip
        except (ChannelError, MessageNacked):
            self._drop_publishing()
            raise
        except Exception:
            self._faulted()
            raise
        if self._returned:
            self._drop_publishing()
            self._declared.discard(queue)
            raise Unroutable(f"RabbitMQ returned the message published to {queue!r}: no queue")

    def _on_return(self, exc: Any, exchange: str, routing_key: str, message: Any) -> None:
        self._returned.append(routing_key)

    def _drop_publishing(self) -> None:
        with suppress(Exception):
            if self._publishing is not None:
                self._publishing.close()
        self._publishing, self._producer = None, None

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
