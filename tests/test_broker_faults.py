"""What a broker can do to the replayer, and a killed replayer to the broker (found in review):
a refused publish, a message that is no task, a replayer killed between scoring and keeping
the handoff, a copy given back after its twin ran, an ``expires`` in defer, the app's own
queue arguments. Real servers: the session's Redis and, where the test says, RabbitMQ."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

import pytest
import redis
from amqp.exceptions import PreconditionFailed
from kombu import Connection, Queue

from gatekeeper.celery.broker import broker_for
from gatekeeper.celery.duplicates import Duplicates
from gatekeeper.celery.replay import Replayer
from gatekeeper.logs import make_logger
from gatekeeper.redis.keys import ATTEMPTS, Keys
from tests.apps.gated_app import create_app
from tests.conftest import REPO_ROOT, gate_settings, wait_until
from tests.test_replay_strikes import keep_fails

pytestmark = [pytest.mark.celery, pytest.mark.servers]
KEYS = Keys()


def _deferred(app: Any, redis_client: redis.Redis, n: int) -> list[str]:
    """``n`` tasks deferred for the free queue's age (a stale admission); then the admission
    is gone, so a replay admits them."""
    redis_client.zadd(KEYS.free_waiting, {"stale:1": (time.time() - 60) * 1000})
    ids = [app.tasks["tests.embed"].delay(i).id for i in range(n)]
    redis_client.zrem(KEYS.free_waiting, "stale:1")
    return ids


def test_a_refused_publish_sets_the_message_aside_and_the_rest_are_replayed(
    rabbitmq_url: str, redis_url: str, redis_client: redis.Redis
) -> None:
    with Connection(rabbitmq_url) as connection:  # free refuses every message (nack)
        channel = connection.channel()
        channel.queue_delete("free")
        Queue("free", routing_key="free", queue_arguments={
            "x-max-length": 0, "x-overflow": "reject-publish"})(channel).declare()  # fmt: skip
    settings = gate_settings(redis_url, broker_url=rabbitmq_url, max_queue_age_s=5)
    app = create_app(settings, rabbitmq_url)
    broker = broker_for(settings, app)
    try:
        ids = _deferred(app, redis_client, 3)
        assert wait_until(lambda: broker.length("defer") == 3, 5)
        counts = Replayer(settings, broker, redis_client, app=app).run(threading.Event(), True)
        # Each refused one is set aside (a copy held with its error count, the original
        # acked); none is copied twice, none stalls the ones behind it.
        assert counts["replay_error"] == 3 and not counts["pass_failed"], counts
        assert broker.length("defer") == 0 and broker.delayed("defer") == 3
        decided = {redis_client.hget(KEYS.run(i, 1), "decision") for i in ids}
        assert decided == {b"admit_free"}  # every one was looked at
    finally:
        broker.close()
        with Connection(rabbitmq_url) as connection:
            connection.channel().queue_delete("free")


def refusing(rabbitmq_url: str, queue: str) -> None:
    """``queue`` declared again to refuse every message (nack), as a length cap does."""
    with Connection(rabbitmq_url) as connection:
        channel = connection.channel()
        channel.queue_delete(queue)
        Queue(queue, routing_key=queue, queue_arguments={
            "x-max-length": 0, "x-overflow": "reject-publish"})(channel).declare()  # fmt: skip


def refused_by(
    rabbitmq_url: str, redis_url: str, queue: str, **overrides: Any
) -> tuple[Any, Any, Any]:
    """Settings with a 1 s backoff, the app and its broker; ``queue`` refuses (:func:`refusing`)."""
    refusing(rabbitmq_url, queue)
    settings = gate_settings(redis_url, broker_url=rabbitmq_url, max_queue_age_s=5,
                             replay_backoff_max_s=1, **overrides)  # fmt: skip
    app = create_app(settings, rabbitmq_url)
    return settings, app, broker_for(settings, app)


@pytest.mark.parametrize("path", ["open", "closed"])
def test_a_refused_move_holds_the_message_as_it_came_and_never_to_free_while_closed(
    rabbitmq_url: str, redis_url: str, redis_client: redis.Redis, path: str
) -> None:
    # An audit: the copy set aside was the one already rewritten for free (its decision,
    # nonce and copy id), so when it came back it matched neither its record nor its
    # handoff, ran on reserved as unverified, and its row said path=free. Held as it came,
    # it is handed on again with its decision; but reviewers saw that decision handed to free
    # after an operator had closed the path, then holds that outlived the sweep's grace for
    # purged admissions (its reservation given back as lost, its expiry charged nothing).
    # While the path is closed it expires at once to reserved, charged the wait so far.
    settings, app, broker = refused_by(rabbitmq_url, redis_url, "free")
    try:
        ids = _deferred(app, redis_client, 3)
        assert wait_until(lambda: broker.length("defer") == 3, 5)
        first = Replayer(settings, broker, redis_client, app=app).run(threading.Event(), True)
        assert first["replay_error"] == 3, first
        with Connection(rabbitmq_url) as connection:  # free takes messages again
            connection.channel().queue_delete("free")
        if path != "open":  # an operator rolls back
            redis_client.hset(KEYS.flags, "free_path_enabled", "false")
        assert wait_until(lambda: broker.length("defer") == 3, 10)  # back from the backoff
        time.sleep(1.2)  # due again
        again = Replayer(settings, broker, redis_client, app=app).run(threading.Event(), True)
        label = {"open": "handed_on_again", "closed": "to_reserved"}[path]
        assert again == {label: 3}, again
        assert broker.length("free") == (3 if path == "open" else 0)
        assert broker.length("reserved") == (3 if label == "to_reserved" else 0)
        records = [redis_client.hmget(KEYS.run(i, 1), "decision", "reason") for i in ids]
        if label == "to_reserved":  # its expired row charged the wait so far; closed
            assert records == [[b"reserved", b"free_wait_expired"]] * 3
            assert redis_client.hlen(KEYS.inflight) == 0
            expired = [row for row in rows_of(redis_client) if row["outcome"] == "expired"]
            assert sorted(row["job_id"] for row in expired) == sorted(ids)
            assert all(0 < row["retry_tax"] <= 10 * 200 for row in expired), expired
        else:
            assert {decision for decision, _ in records} == {b"admit_free"}
    finally:
        broker.close()
        with Connection(rabbitmq_url) as connection:
            channel = connection.channel()
            for queue in ("free", "reserved"):
                channel.queue_delete(queue)


def rows_of(client: redis.Redis) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for key in client.scan_iter(match=KEYS.window_rows(0).replace(":0:", ":*:")):
        found += [json.loads(raw) for raw in client.lrange(key, 0, -1)]
    return found


def test_a_dead_letter_that_refuses_holds_the_message_and_defer_goes_on(
    rabbitmq_url: str, redis_url: str, redis_client: redis.Redis
) -> None:
    # An audit: after five errors the send to a refusing dead letter raised out of the
    # batch, the message went back to the head of defer, and every later pass failed on it:
    # tasks deferred after it were never replayed.
    settings, app, broker = refused_by(rabbitmq_url, redis_url, "dead_letter")
    seen: Counter[str] = Counter()
    try:
        redis_client.zadd(KEYS.free_waiting, {"stale:1": (time.time() - 60) * 1000})
        app.tasks["tests.embed"].apply_async((0,), headers={"gatekeeper_deadline_s": 1})
        time.sleep(1.1)  # its deadline passes in defer: abandoned to a dead letter that refuses
        for _ in range(8):
            assert wait_until(lambda: broker.length("defer") == 1, 10)
            time.sleep(1.1)  # due again
            seen.update(Replayer(settings, broker, redis_client, app=app).run(
                threading.Event(), True))  # fmt: skip
            if seen["dead_letter_refused"]:
                break
        assert seen["dead_letter_refused"] == 1 and not seen["pass_failed"], seen
        later = [app.tasks["tests.embed"].delay(i).id for i in (1, 2)]  # deferred behind it
        redis_client.zrem(KEYS.free_waiting, "stale:1")
        assert wait_until(lambda: broker.length("defer") == 2, 5)
        counts = Replayer(settings, broker, redis_client, app=app).run(threading.Event(), True)
        assert counts["to_free"] == 2 and not counts["pass_failed"], counts
        assert {redis_client.hget(KEYS.run(i, 1), "decision") for i in later} == {b"admit_free"}
    finally:
        broker.close()
        with Connection(rabbitmq_url) as connection:
            connection.channel().queue_delete("dead_letter")


def test_a_message_that_is_no_task_goes_to_the_dead_letter_not_to_a_worker(
    rabbitmq_url: str, redis_url: str, redis_client: redis.Redis
) -> None:
    settings = gate_settings(redis_url, broker_url=rabbitmq_url)
    broker = broker_for(settings)
    with Connection(rabbitmq_url) as connection:
        producer = connection.Producer()
        declared = [Queue("defer", routing_key="defer")]
        producer.publish(b"\x00not json", routing_key="defer", content_type="application/x-x",
                         content_encoding="binary", declare=declared)  # fmt: skip
        producer.publish({"no": "headers"}, routing_key="defer", declare=declared)
    assert wait_until(lambda: broker.length("defer") == 2, 5)
    counts = Replayer(settings, broker, redis_client).run(threading.Event(), once=True)
    assert counts["malformed"] == 2, counts
    assert broker.length("reserved") == 0 and broker.length("dead_letter") == 2
    broker.close()


def test_a_replayer_killed_before_it_kept_the_handoff_leaves_the_message_the_gates(
    broker_url: str, redis_url: str, redis_client: redis.Redis
) -> None:
    settings = gate_settings(redis_url, broker_url=broker_url, max_queue_age_s=5,
                             replay_lock_ttl_s=1)  # fmt: skip
    app = create_app(settings, broker_url)
    (job,) = _deferred(app, redis_client, 1)
    broker = broker_for(settings, app)
    assert wait_until(lambda: broker.length("defer") == 1, 5)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
    env.update(GATEKEEPER_REDIS_URL=redis_url, GATEKEEPER_BROKER_URL=broker_url,
               GATEKEEPER_DWELL_GATE_ENABLED="true", GATEKEEPER_CANARY_PERCENT="100",
               GATEKEEPER_MAX_QUEUE_AGE_S="5", GATEKEEPER_REPLAY_LOCK_TTL_S="1",
               GATEKEEPER_TEST_KILL_AT="1", GATEKEEPER_TEST_KILL_IN="remember",
               PYTHONPATH=str(REPO_ROOT))  # fmt: skip
    killed = subprocess.run([sys.executable, "-m", "tests.apps.killed_replayer"], env=env,
                            capture_output=True, cwd=REPO_ROOT, timeout=60)  # fmt: skip
    assert killed.returncode == -9, killed.stderr.decode()
    assert redis_client.hget(KEYS.run(job, 1), "decision") == b"admit_free"  # scored, then died
    time.sleep(1.2)  # its lock expires
    counts = Replayer(settings, broker_for(settings, app), redis_client, app=app).run(
        threading.Event(), once=True
    )
    # Still the gate's message: scored again as its own (not sent to reserved unverified),
    # and the admission no message carried was given back (no phantom age on free).
    assert counts["to_free"] == 1 and not counts["unverified"], counts
    assert (
        redis_client.zcount(KEYS.free_waiting, "-inf", ATTEMPTS) == 1
    )  # this one, admitted again, once
    assert wait_until(lambda: broker.length("free") == 1, 5)
    broker.close()


def test_a_handoff_the_gates_redis_refused_holds_the_message_in_a_delay_queue(
    rabbitmq_url: str, redis_url: str, redis_client: redis.Redis
) -> None:
    # Before: the copy was handed on all the same, with no handoff kept (a twin, or the
    # original after a lost ack, was then taken as never handed on). Now the original is held
    # (a delay queue, acked once its copy is confirmed) and comes back to be scored again.
    settings = gate_settings(redis_url, broker_url=rabbitmq_url, max_queue_age_s=5,
                             replay_backoff_s=0.3)  # fmt: skip
    app = create_app(settings, rabbitmq_url)
    broker = broker_for(settings, app)
    try:
        (job,) = _deferred(app, redis_client, 1)
        assert wait_until(lambda: broker.length("defer") == 1, 5)
        replayer = Replayer(settings, broker, redis_client, app=app)
        keep_fails(replayer, redis_client)  # out of memory: both writes refused
        assert dict(replayer.run(threading.Event(), True)) == {"handoff_unrecorded": 1}
        assert broker.length("free") == 0 and not redis_client.exists(KEYS.handoff(job, 1))
        assert wait_until(lambda: broker.length("defer") == 1, 10)  # back from its delay
        counts = Replayer(settings, broker, redis_client, app=app).run(threading.Event(), True)
        assert dict(counts) == {"to_free": 1}
        assert wait_until(lambda: broker.length("free") == 1, 5)
        assert list(redis_client.hgetall(KEYS.inflight)) == [f"{job}:1".encode()]
        assert redis_client.zcount(KEYS.free_waiting, "-inf", ATTEMPTS) == 1
    finally:
        broker.close()


def test_a_copy_given_back_after_its_twin_ran_does_not_run(
    redis_url: str, redis_client: redis.Redis
) -> None:
    class Request:  # what the worker's request check reads: a redelivered copy
        def __init__(self) -> None:
            self.delivery_info = {"redelivered": True}
            self.name = "tests.embed"

    redis_client.hset(KEYS.run("job", 1), mapping={"nonce": "n1", "decision": "admit_free"})
    check = Duplicates(redis_client, KEYS, make_logger(gate_settings(redis_url), "worker"))
    copy = {"id": "job", "gatekeeper_attempt": 1, "gatekeeper_nonce": "n1",
            "gatekeeper_decision": "admit_free", "gatekeeper_copy": "a"}  # fmt: skip
    assert check.verdict(Request(), copy) == "run"  # the first copy takes it
    assert check.verdict(Request(), {**copy, "gatekeeper_copy": "b"}) == "skip"  # its twin
    assert check.verdict(Request(), copy) == "run"  # the first one redelivered: the broker's
    forged = {**copy, "gatekeeper_nonce": "other", "gatekeeper_copy": "c"}
    assert check.verdict(Request(), forged) == "run"  # not the gate's: start.lua decides


def test_an_expiring_task_waits_in_defer_and_the_apps_queue_arguments_are_kept(
    rabbitmq_url: str, redis_url: str, redis_client: redis.Redis
) -> None:
    settings = gate_settings(redis_url, broker_url=rabbitmq_url, max_queue_age_s=5)
    app = create_app(settings, rabbitmq_url)
    app.conf.task_queue_max_priority = 10
    with Connection(rabbitmq_url) as connection:
        connection.channel().queue_delete("reserved")
    redis_client.zadd(KEYS.free_waiting, {"stale:1": (time.time() - 60) * 1000})
    job = app.tasks["tests.embed"].apply_async((1,), expires=1.5).id
    broker = broker_for(settings, app)
    assert wait_until(lambda: broker.length("defer") == 1, 5)
    time.sleep(2)  # past its expires: still in defer (Celery's TTL would have dropped it)
    assert broker.length("defer") == 1
    counts = Replayer(settings, broker, redis_client, app=app).run(threading.Event(), once=True)
    assert counts["deferred_again"] == 1, counts  # free still looks old
    redis_client.hset(KEYS.flags, "free_path_enabled", "false")
    time.sleep(1.1)
    counts = Replayer(settings, broker, redis_client, app=app).run(threading.Event(), once=True)
    assert redis_client.hget(KEYS.run(job, 1), "decision") == b"reserved"
    # The replayer made `reserved` as the app makes it (x-max-priority 10): declaring it so
    # again is accepted; a plain declare would have left the app's worker unable to start.
    with Connection(rabbitmq_url) as connection:
        try:
            app.amqp.queues["reserved"](connection.channel()).declare()
        except PreconditionFailed as exc:  # pragma: no cover - the failure this guards
            pytest.fail(f"reserved declared with other arguments than the app's: {exc}")
        finally:  # the session's later tests declare it plain: leave it as they expect
            connection.channel().queue_delete("reserved")
    broker.close()
