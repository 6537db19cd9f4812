"""The sweep on RabbitMQ (README, Brokers): a queue cannot be listed there without consuming it,
so the sweep's purge check stands aside (``forgotten=n/a``). Were "cannot list" read as "empty",
every admission still waiting in ``free`` would be forgotten and its reservation given back,
and the budget's ceiling would no longer hold."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from click.testing import CliRunner
from kombu import Connection

from gatekeeper.celery.broker import broker_for
from gatekeeper.celery.replay import Replayer
from gatekeeper.ops.cli import main
from gatekeeper.redis.keys import ATTEMPTS, Keys
from gatekeeper.redis.sweep import PURGE_GRACE_S
from tests.apps.gated_app import create_app
from tests.conftest import gate_settings
from tests.test_worker_ledger import window_totals

pytestmark = [pytest.mark.celery, pytest.mark.servers]
KEYS = Keys()


def in_queue(amqp_url: str, queue: str) -> int:
    """How many messages RabbitMQ holds ready in ``queue`` (a passive declare: none taken)."""
    with Connection(amqp_url) as connection:
        return int(connection.channel().queue_declare(queue, passive=True).message_count)


def three_admitted(redis_url: str, client: redis.Redis, amqp_url: str) -> float:
    """Three gated tasks admitted to ``free`` on RabbitMQ, no worker to take them, older than
    the sweep's grace: the exposure they hold."""
    app = create_app(gate_settings(redis_url), amqp_url)
    jobs = [app.tasks["tests.embed"].delay(n).id for n in range(3)]
    assert [client.hget(KEYS.run(job, 1), "decision") for job in jobs] == [b"admit_free"] * 3
    assert in_queue(amqp_url, "free") == 3
    time.sleep(PURGE_GRACE_S + 0.5)  # a sweep that could list the queue would judge them now
    return window_totals(client, "exposure")


def still_counted(client: redis.Redis, amqp_url: str, exposure: float) -> None:
    """All three still wait and still hold what they reserved."""
    assert exposure > 0 and window_totals(client, "exposure") == exposure
    assert client.hlen(KEYS.inflight) == 3
    assert client.zcount(KEYS.free_waiting, "-inf", ATTEMPTS) == 3
    assert in_queue(amqp_url, "free") == 3  # nothing consumed to find that out


def test_gatekeeper_sweep_on_rabbitmq_says_n_a_and_forgets_no_admission(
    redis_url: str, redis_client: redis.Redis, rabbitmq_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    exposure = three_admitted(redis_url, redis_client, rabbitmq_url)
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    monkeypatch.setenv("GATEKEEPER_BROKER_URL", rabbitmq_url)
    result = CliRunner().invoke(main, ["sweep"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("swept=0 forgotten=n/a (amqp "), result.output
    still_counted(redis_client, rabbitmq_url, exposure)


def test_the_replayers_sweep_on_rabbitmq_forgets_no_admission(
    redis_url: str, redis_client: redis.Redis, rabbitmq_url: str
) -> None:
    exposure = three_admitted(redis_url, redis_client, rabbitmq_url)
    settings = gate_settings(redis_url, broker_url=rabbitmq_url)
    replayer = Replayer(settings, broker_for(settings, None), redis_client)
    counts = replayer.run(threading.Event(), once=True)
    assert counts["pass_failed"] == 0 and counts["lock_held"] == 0, counts
    assert redis_client.get(KEYS.replayer_last_pass) is not None  # a pass, and its sweep, ran
    still_counted(redis_client, rabbitmq_url, exposure)
