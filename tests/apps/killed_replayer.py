"""A replayer that SIGKILLs itself in the middle of its batch, at the worst moment: on its
``GATEKEEPER_TEST_KILL_AT``-th handoff, after the rewritten copy is published (RabbitMQ:
confirmed, before the original is acked) or before the move (Redis: after the gate scored
the message); with ``GATEKEEPER_TEST_KILL_IN=remember``, after the gate scored it and before
its handoff is kept. Settings from the environment, as ``gatekeeper replay`` reads them."""

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


def _die_on_the_nth() -> None:
    global handoffs
    handoffs += 1
    if handoffs == KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)


KILL_IN = os.environ.get("GATEKEEPER_TEST_KILL_IN", "handoff")


class KilledAmqp(AmqpBroker):
    def _ack(self, taken: Taken) -> None:
        if KILL_IN == "handoff":
            _die_on_the_nth()  # the copy is confirmed; the original is not acked
        super()._ack(taken)


class KilledRedis(RedisBroker):
    def _moved(self, taken: Taken, target: str, message: dict[str, Any] | None) -> bool:
        if KILL_IN == "handoff":
            _die_on_the_nth()  # the gate scored it; the claimed copy is not moved
        return super()._moved(taken, target, message)


if os.environ.get("GATEKEEPER_TEST_KILL_IN") == "remember":
    # Killed after the gate scored the message, before its handoff is kept in the record.
    import gatekeeper.celery.replay as replay_module

    def _killed_remember(*_: Any) -> None:
        _die_on_the_nth()

    replay_module.remember = _killed_remember  # type: ignore[assignment]

settings = load_settings()
broker = broker_for(settings)
if isinstance(broker, AmqpBroker):
    broker = KilledAmqp(broker.url, settings)
else:
    broker = KilledRedis(broker.client, settings)
gate = client_for(settings.gate_redis_url(), 5.0)
Replayer(settings, broker, gate).run(threading.Event(), once=True)
raise SystemExit("the replayer was not killed: fewer handoffs than GATEKEEPER_TEST_KILL_AT")
