"""A replayer that SIGKILLs itself in the middle of its work, at the worst moment: on its
``GATEKEEPER_TEST_KILL_AT``-th handoff, after the rewritten copy is published (RabbitMQ:
confirmed, before the original is acked) or before the move (Redis: before the move of the
batch that holds it, every message of that batch scored, its handoff kept); with
``GATEKEEPER_TEST_KILL_IN=remember``, after the gate scored it and before its handoff (its
batch's handoffs) is kept. Settings from the environment, as ``gatekeeper replay`` reads
them (``GATEKEEPER_REPLAY_BATCH_SIZE`` too)."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from gatekeeper.celery.amqp import AmqpBroker
from gatekeeper.celery.broker import RedisBroker, Taken, broker_for
from gatekeeper.celery.replay import Replayer
from gatekeeper.redis.connect import client_for
from gatekeeper.settings import load_settings

KILL_AT = int(os.environ["GATEKEEPER_TEST_KILL_AT"])
handoffs = 0


def _die_on_the_nth(n: int = 1) -> None:
    """Count ``n`` handoffs; die when the ``KILL_AT``-th is among them."""
    global handoffs
    handoffs += n
    if handoffs >= KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)


KILL_IN = os.environ.get("GATEKEEPER_TEST_KILL_IN", "handoff")


class KilledAmqp(AmqpBroker):
    def _ack(self, taken: Taken) -> None:
        if KILL_IN == "handoff":
            _die_on_the_nth()  # the copy is confirmed; the original is not acked
        super()._ack(taken)


class KilledRedis(RedisBroker):
    def hand_on(self, batch: list[Taken]) -> None:
        if KILL_IN == "handoff":  # the gate scored them; no claimed copy is moved
            _die_on_the_nth(sum(taken.move is not None for taken in batch))
        super().hand_on(batch)


if os.environ.get("GATEKEEPER_TEST_KILL_IN") == "remember":
    # Killed after the gate scored the messages, before their handoffs are kept in the record.
    import gatekeeper.celery.batch as batch_module

    def _killed_remember(_: Any, kept: list[Any], *__: Any) -> list[None]:
        _die_on_the_nth(len(kept))
        return [None] * len(kept)  # not the nth: taken as kept (nothing is written)

    batch_module.remember_all = _killed_remember

settings = load_settings()
broker = broker_for(settings)
if isinstance(broker, AmqpBroker):
    broker = KilledAmqp(broker.url, settings)
else:
    broker = KilledRedis(broker.client, settings)
gate = client_for(settings.gate_redis_url(), 5.0)
Replayer(settings, broker, gate).run(threading.Event(), once=True)
raise SystemExit("the replayer was not killed: fewer handoffs than GATEKEEPER_TEST_KILL_AT")
