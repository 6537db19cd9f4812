"""One message taken from a broker's queue, and what gatekeeper needs of a broker.

The two kinds are :class:`gatekeeper.celery.broker.RedisBroker` (kombu's lists) and
:class:`gatekeeper.celery.amqp.AmqpBroker` (RabbitMQ); :func:`gatekeeper.celery.broker.broker_for`
picks one from the broker's URL.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Broker", "Taken", "copy_message"]


@dataclass(slots=True)
class Taken:
    """One message taken from a queue and not yet handed on."""

    source: str
    """The queue (RabbitMQ) or list (Redis) it came from: where a not-due message goes back."""
    raw: bytes
    """Redis: the message exactly as stored (what ``move.lua`` removes); RabbitMQ: its body."""
    message: dict[str, Any] | None
    """kombu's message document (``headers``, ``properties``, ``body``, ``content-type``,
    ``content-encoding``); None when it cannot be read."""
    at: str = ""
    """Redis: the list the copy is in now (the tenure's processing list, or ``source``)."""
    handle: Any = None
    """RabbitMQ: the kombu message to ack once the rewritten copy is confirmed."""
    done: bool = False
    """Handed on (sent or held): nothing more may be moved for it."""
    batched: bool = False
    """Redis: claimed in a batch (``take_batches``): a send or hold is kept in ``move`` and
    made with the batch's others, in one step (``hand_on``)."""
    move: tuple[str, bytes] | None = None
    """Redis, batched: the list it goes to and the message pushed there, until ``hand_on``."""
    refused: bool = False
    """Redis: its send or hold was not made (``move.lua`` found its tenure over, or its claimed
    copy gone): it was not handed on, and the lock's holder takes it back."""


class Broker(Protocol):
    """What the replayer, ``status``, the sweep and the dead letter need of a broker."""

    shown: str
    """Which server (host, port, vhost or db; never a password), for the lines that say it."""

    def begin(self, ident: str) -> None:
        """A new lock tenure begins (Redis: its processing list)."""

    def end(self) -> None:
        """The tenure ended: nothing more is handed on."""

    def beat(self) -> None:
        """The lock was renewed (Redis: the tenure's heartbeat)."""

    def recover(self) -> int:
        """Put back what dead tenures left claimed; returns how many."""

    def take(self, queue: str, claim: bool = True) -> Iterator[Taken]:
        """Each message in ``queue`` once, oldest first, taken until handed on (``claim``
        False on Redis: read in place, as the dead-letter commands do)."""

    def take_batches(self, queue: str, size: int) -> Iterator[list[Taken]]:
        """``take``'s messages, up to ``size`` at a time (Redis: claimed in one round trip;
        RabbitMQ: one at a time), each batch handed on by ``hand_on``."""

    def hand_on(self, batch: list[Taken]) -> None:
        """Make the sends and holds of ``batch`` (Redis: in one step, none once the tenure is
        over; RabbitMQ: nothing, each was made when asked)."""

    def send(self, taken: Taken, queue: str, message: dict[str, Any] | None) -> bool:
        """Hand ``taken`` on to ``queue``, rewritten as ``message`` (None: as it is). False
        when its copy was gone (Redis: taken back by a successor)."""

    def hold(self, taken: Taken, message: dict[str, Any] | None, wait_s: float) -> bool:
        """Put ``taken`` back in the queue it came from, to be looked at in ``wait_s``."""

    def holds(self, taken: Taken) -> bool:
        """Whether ``taken`` is still this broker's to hand on (RabbitMQ: its channel is
        open; once it closed, the broker gives the message back itself)."""

    def leave(self, taken: Taken) -> None:
        """Hand nothing on: the message stays where it is, for the lock's holder."""

    def length(self, queue: str) -> int:
        """Messages waiting in ``queue`` (every priority)."""

    def claimed(self) -> int | None:
        """Messages replayers hold claimed (None: the broker keeps them itself)."""

    def waiting(self, queue: str) -> set[str] | None:
        """``<job_id>:<attempt>`` of every gated message still to run from ``queue``, or
        None when the broker cannot list a queue without consuming it (RabbitMQ)."""

    def delayed(self, queue: str) -> int | None:
        """Messages of ``queue`` waiting out a backoff elsewhere (RabbitMQ's delay queues);
        None where they wait in the queue itself (Redis)."""

    def abort(self) -> None:
        """After a failed pass: give back whatever is taken and not handed on."""

    def close(self) -> None:
        """Give the connection back."""


def copy_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message to hand on, changed apart from the one taken: when the broker refuses the
    move, :func:`~gatekeeper.celery.deadletter.set_aside` holds the original, which comes back
    as the gate left it (and is handed on again with the same decision), not half rewritten."""
    return {**message, "headers": dict(message["headers"]),
            "properties": dict(message.get("properties") or {})}  # fmt: skip
