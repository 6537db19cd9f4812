"""One scenario on both brokers gatekeeper reads: Redis and a real RabbitMQ the suite starts.

Admit to free, defer then replay then run, reserved, a deadline lost to the dead letter (its
``AsyncResult.get()`` raises), and the replayer SIGKILLed mid-batch at the worst moment
(RabbitMQ: its copy confirmed, the original not acked; Redis: scored, not moved). Every task
runs exactly once, on the queue decided; each attempt gets one ledger row; nothing is left in
defer; ``gatekeeper status`` reads the broker and names it. The app is configured through
``app.conf`` alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from celery import Celery
from click.testing import CliRunner

import gatekeeper
from gatekeeper.celery import amqp
from gatekeeper.celery.amqp import delay_ladder
from gatekeeper.celery.broker import broker_for
from gatekeeper.celery.replay import Replayer
from gatekeeper.defaults import RECORD_RETENTION_S
from gatekeeper.errors import DeadlineAbandoned
from gatekeeper.ops.cli import main
from gatekeeper.redis.keys import Keys
from gatekeeper.settings import GatekeeperSettings
from tests.apps.gated_app import RUNS_KEY, create_app
from tests.conftest import REPO_ROOT, gate_settings, running_worker, wait_until
from tests.moved import BlackHole
from tests.test_replay_strikes import keeps_fail

pytestmark = [pytest.mark.celery, pytest.mark.servers]
SOON = {"gatekeeper_deadline_s": 1.5, "gatekeeper_expected_service_s": 0}
"""Deferred (a service time of 0 cannot be scored), its deadline gone 1.5 s later."""
TIGHT = {"gatekeeper_deadline_s": 0.5}
"""A deadline nearer than the task's own service time: reserved."""
KEYS = Keys()


def _runs(client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange(RUNS_KEY, 0, -1)]


def _rows(client: redis.Redis) -> list[dict[str, Any]]:
    rows = []
    for key in client.scan_iter(KEYS.window_rows(0).replace(":0:", ":*:")):
        rows += [json.loads(raw) for raw in client.lrange(key, 0, -1)]
    return rows


def _ends_abandoned(app: Celery, job_id: str) -> None:
    """``AsyncResult.get()`` raises (its result subscription ends here, while Redis is up)."""
    result = app.AsyncResult(job_id)
    with pytest.raises(DeadlineAbandoned, match="abandoned: its deadline"):
        result.get(timeout=10)


def _env(redis_url: str, broker_url: str, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
    env.update(GATEKEEPER_REDIS_URL=redis_url, GATEKEEPER_BROKER_URL=broker_url,
               GATEKEEPER_DWELL_GATE_ENABLED="true", GATEKEEPER_CANARY_PERCENT="100",
               GATEKEEPER_REPLAY_LOCK_TTL_S="1", PYTHONPATH=str(REPO_ROOT), **more)  # fmt: skip
    return env


def test_the_scenario_on_either_broker(
    broker_url: str, redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    amqp = broker_url.startswith("amqp")
    # Configured through app.conf only (Django's CELERY_GATEKEEPER_* become these keys).
    app = Celery("brokers", broker=broker_url)
    app.conf.update(gatekeeper_redis_url=redis_url, gatekeeper_dwell_gate_enabled=True,
                    gatekeeper_canary_percent=100, gatekeeper_max_queue_age_s=0.5,
                    gatekeeper_replay_lock_ttl_s=1, gatekeeper_replay_poll_s=0.2,
                    result_backend=redis_url)  # fmt: skip
    app.conf.task_default_queue = "celery"
    installed = gatekeeper.install(app)

    @gatekeeper.gated(expected_service_s=1, tokens_in=100, deadline_s=60)
    @app.task(name="tests.embed", shared=False)  # the worker's tests.embed (gated_app)
    def embed(chunk: Any, sleep_s: float = 0.0) -> Any:
        return chunk

    settings = installed.settings
    assert settings.redis_url == redis_url and settings.max_queue_age_s == 0.5

    first = embed.delay(0)  # nothing waits on free: admitted
    tight = embed.apply_async((10,), headers=TIGHT)
    time.sleep(0.6)  # ... and not started: free is older than the cap now
    deferred = [embed.delay(n) for n in range(1, 5)]
    lost = embed.apply_async((9,), headers=SOON)
    decisions = {r.id: redis_client.hget(KEYS.run(r.id, 1), "decision") for r in
                 [first, *deferred, lost, tight]}  # fmt: skip
    assert decisions[first.id] == b"admit_free" and decisions[tight.id] == b"reserved"
    assert {decisions[r.id] for r in [*deferred, lost]} == {b"defer"}
    broker = broker_for(settings, app)
    assert wait_until(lambda: broker.length("defer") == 5 and broker.length("free") == 1, 5)
    broker.close()

    log = tmp_path / "worker.log"
    with running_worker(redis_url, log, queues="free,reserved",
                        GATEKEEPER_BROKER_URL=broker_url):  # fmt: skip
        assert wait_until(lambda: {r["id"] for r in _runs(redis_client)} >= {first.id, tight.id})
        time.sleep(1.6)  # the lost one's deadline passes; the others' do not (60 s)
        # The replayer is SIGKILLed on its 2nd handoff (the 1st went through): one message
        # at a time on either broker (on Redis, batches of one; tests/test_replay_batch.py
        # kills a Redis replayer before a whole batch's move).
        killed = subprocess.run(
            [sys.executable, "-m", "tests.apps.killed_replayer"], capture_output=True,
            env=_env(redis_url, broker_url, GATEKEEPER_TEST_KILL_AT="2",
                     GATEKEEPER_REPLAY_BATCH_SIZE="1"), cwd=REPO_ROOT, timeout=60,
        )  # fmt: skip
        assert killed.returncode == -9, killed.stderr.decode()
        time.sleep(1.2)  # its lock (and, on Redis, its tenure's heartbeat) expires
        # A replayer works defer until every task ran (some wait out a backoff: the killed
        # replayer's admission held free's age over the cap until its message started).
        replayer = Replayer(settings, broker_for(settings, app), redis_client, app=app)
        stop = threading.Event()
        working = threading.Thread(target=replayer.run, args=(stop,))
        working.start()
        everyone = {r.id for r in [first, *deferred, tight]}
        try:
            assert wait_until(lambda: {r["id"] for r in _runs(redis_client)} >= everyone, 60)
        finally:
            stop.set()
            working.join(timeout=20)
        totals = replayer.counts
        assert totals["dead_lettered"] == 1 and not totals["pass_failed"], totals
        assert totals["handed_on_again"] == 1, totals  # the killed handoff, as decided
        time.sleep(1.5)  # a second copy, if one ran, would be recorded by now
    ran = Counter(r["id"] for r in _runs(redis_client))
    assert all(ran[job] == 1 for job in everyone), ran  # exactly once each
    assert lost.id not in ran
    _ends_abandoned(app, lost.id)
    queues = {r["id"]: r["queue"] for r in _runs(redis_client)}
    assert queues[tight.id] == "reserved"
    assert {queues[r.id] for r in [first, *deferred]} == {"free"}
    text = log.read_text()
    if amqp:  # the killed replayer's copy and the one handed on again: one ran
        assert text.count("event=duplicate_skipped") == 1, text
    rows = Counter((r["job_id"], r["attempt"]) for r in _rows(redis_client))
    assert all(n == 1 for n in rows.values()) and len(rows) == 7, rows
    # Each replayed record stays a compact hash, its handoff kept beside it until it expires.
    for job in deferred:
        assert redis_client.object("encoding", KEYS.run(job.id, 1)) in (b"ziplist", b"listpack")
    handoffs = list(redis_client.scan_iter(match=f"{KEYS.base}:handoff:*"))
    assert {KEYS.handoff(job.id, 1).encode() for job in deferred} == set(handoffs), handoffs
    assert all(0 < redis_client.ttl(key) <= RECORD_RETENTION_S for key in handoffs)
    outcomes = Counter(r["outcome"] for r in _rows(redis_client))
    assert outcomes == {"ok": 6, "abandoned": 1}, outcomes

    status = _cli(redis_url, broker_url, "status")
    assert status.exit_code == 0, status.output
    assert "free=0 defer=0 reserved=0 dead_letter=1" in status.output, status.output
    assert ("(broker amqp 127.0.0.1:" if amqp else "(broker 127.0.0.1:") in status.output


def _cli(redis_url: str, broker_url: str, *args: str, **env: str) -> Any:
    env.update(GATEKEEPER_REDIS_URL=redis_url, GATEKEEPER_BROKER_URL=broker_url)
    return CliRunner().invoke(main, list(args), env=env)


def test_not_due_work_waits_off_the_head_of_defer_and_a_dead_letter_is_requeued(
    broker_url: str, redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = gate_settings(redis_url, broker_url=broker_url, max_queue_age_s=0.2,
                             replay_backoff_s=1.0)  # fmt: skip
    app = create_app(settings, broker_url)
    embed = app.tasks["tests.embed"]
    embed.delay(0)
    time.sleep(0.3)  # free is older than the cap, and nothing consumes it
    waiting = embed.delay(1)
    # Due in 3 s: the first pass (a RabbitMQ connection included) must come before it.
    lost = embed.apply_async((2,), headers={**SOON, "gatekeeper_deadline_s": 3.0})
    sent = time.time()  # after the publish that started the deadline's clock
    broker = broker_for(settings, app)
    assert wait_until(lambda: broker.length("defer") == 2, timeout_s=5)  # published (async)
    replayer = Replayer(settings, broker_for(settings, app), redis_client, app=app)
    first = replayer.run(threading.Event(), once=True)
    assert first["deferred_again"] == 2, first
    if broker_url.startswith("amqp"):
        # Not at the head of defer (a replayer would find it there every pass, not due):
        # in the delay queue of its backoff, and back in defer once that TTL ran out.
        assert broker.length("defer") == 0 and broker.length("defer.delay.1000") == 2
        assert wait_until(lambda: broker.length("defer") == 2, timeout_s=5)
        assert broker.length("defer.delay.1000") == 0
    # The lost one's deadline has passed, the other's backoff too.
    time.sleep(max(1.6, sent + 3.3 - time.time()))
    second = Replayer(settings, broker_for(settings, app), redis_client, app=app).run(
        threading.Event(), once=True
    )
    assert second["dead_lettered"] == 1 and second["deferred_again"] == 1, second
    listed = _cli(redis_url, broker_url, "dead-letter", "list")
    assert listed.exit_code == 0, listed.output
    assert f"job_id={lost.id}" in listed.output and "dead_lettered=1" in listed.output
    assert broker.length("dead_letter") == 1  # listing gives the message back
    restore = keeps_fail(monkeypatch, redis_client, "refused")  # no copy leaves unkept
    gated = {"GATEKEEPER_DWELL_GATE_ENABLED": "true", "GATEKEEPER_CANARY_PERCENT": "100"}
    refused = _cli(redis_url, broker_url, "dead-letter", "requeue", lost.id, "--deadline-s", "600",
                   **gated)  # fmt: skip
    assert refused.exit_code == 1 and "refused the handoff of" in refused.output, refused.output
    restore()
    assert wait_until(lambda: broker.length("dead_letter") == 1)  # RabbitMQ: given back
    requeued = _cli(redis_url, broker_url, "dead-letter", "requeue", lost.id,
                    "--deadline-s", "600")  # fmt: skip
    assert requeued.exit_code == 0, requeued.output
    assert f"requeued {lost.id} to " in requeued.output
    assert broker.length("dead_letter") == 0
    delays = [f"defer.delay.{ms}" for ms in delay_ladder(1.0, settings.replay_backoff_max_s)]
    after = sum(broker.length(q) for q in ("free", "defer", "reserved", *delays))
    assert after == 3, after  # the first (never consumed), the waiting one, the requeued one
    assert redis_client.hget(Keys().run(waiting.id, 1), "decision") == b"defer"
    broker.close()


def test_a_rabbitmq_confirm_that_never_comes_fails_the_publish_in_time_and_loses_nothing(
    rabbitmq_url: str, redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # README: a publish waits at most 30 s for its confirm (a broker under an alarm blocks
    # publishers). The replayer's connection goes through a proxy that swallows every byte,
    # both ways, from its second publish on (its publishing channel open): no confirm comes.
    assert amqp.CONFIRM_TIMEOUT_S == 30.0
    monkeypatch.setattr(amqp, "CONFIRM_TIMEOUT_S", 2.0)  # the same wait, shorter
    settings = gate_settings(redis_url, broker_url=rabbitmq_url, max_queue_age_s=0.2)
    app = create_app(settings, rabbitmq_url)
    embed = app.tasks["tests.embed"]
    embed.delay(0)
    time.sleep(0.3)  # free is older than the cap, and nothing consumes it
    jobs = [embed.delay(1).id, embed.delay(2).id]
    broker = broker_for(settings, app)
    assert wait_until(lambda: broker.length("defer") == 2, timeout_s=5)
    hole, held = _through_a_black_hole(settings, rabbitmq_url)
    replayer = Replayer(held, broker_for(held, app), redis_client, app=app)
    publish = amqp.AmqpBroker._publish

    published: list[str] = []

    def swallowed(self: amqp.AmqpBroker, queue: str, message: dict[str, Any]) -> None:
        published.append(queue)
        if len(published) == 2:
            hole.forget()  # the connection open now: taken from, publishing on
        publish(self, queue, message)

    monkeypatch.setattr(amqp.AmqpBroker, "_publish", swallowed)
    started, counts = time.monotonic(), Counter[str]()
    passing = threading.Thread(
        target=lambda: counts.update(replayer.run(threading.Event(), once=True)), daemon=True
    )
    passing.start()
    passing.join(timeout=20)
    assert not passing.is_alive(), "the replayer hung after the confirm did not come"
    took = time.monotonic() - started
    assert 2.0 <= took < 15.0, took  # it waited for the confirm, and no longer
    assert len(published) == 2 and counts["given_back"] == 1, counts  # one was not confirmed
    hole.close()
    # The connection dropped after the fault: RabbitMQ gives that original back to defer; the
    # other's confirmed copy waits in its backoff's delay queue (then in defer). None lost,
    # none doubled: the first task in free and these two, wherever they wait.
    delays = [f"defer.delay.{ms}" for ms in delay_ladder(1.0, settings.replay_backoff_max_s)]
    total = lambda: sum(broker.length(q) for q in ("free", "defer", "reserved", *delays))  # noqa: E731
    assert wait_until(lambda: total() == 3 and broker.length("defer") >= 1, timeout_s=10)
    time.sleep(1.5)
    assert total() == 3
    assert all(redis_client.hget(KEYS.run(job, 1), "decision") == b"defer" for job in jobs)
    broker.close()


def test_a_rabbitmq_flow_that_stops_answering_fails_the_replayers_call_in_time(
    rabbitmq_url: str, redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A peer that takes the bytes and answers nothing (a hung broker, a proxy whose backend is
    # gone): opening a channel, a passive declare, a basic_get wait at most SOCKET_TIMEOUT_S
    # (30 s), a reply that stops in the middle of a frame too; the connection is dropped,
    # RabbitMQ gives back what it had delivered, and the next call opens a new one.
    assert amqp.SOCKET_TIMEOUT_S == 30.0
    monkeypatch.setattr(amqp, "SOCKET_TIMEOUT_S", 2.0)  # the same wait, shorter
    settings = gate_settings(redis_url, broker_url=rabbitmq_url)
    app = create_app(settings, rabbitmq_url)
    app.tasks["tests.embed"].delay("x" * 200_000)  # free declared; a message of frames
    hole, held = _through_a_black_hole(settings, rabbitmq_url)
    broker = broker_for(held, app)
    calls = (
        (lambda: broker.length("free"), None),  # silent from the channel's open on
        (lambda: list(broker.take("free")), None),
        (lambda: list(broker.take("free")), 20_000),  # the message's reply cut mid-frame
    )
    try:
        assert wait_until(lambda: broker.length("free") == 1, timeout_s=5)  # connected
        for call, cut in calls:
            if cut is None:
                hole.forget()  # the connection open now answers nothing from here on
            else:
                hole.forget_after(cut)
            failed: list[BaseException] = []
            thread = threading.Thread(target=_failure_of, args=(call, failed), daemon=True)
            started = time.monotonic()
            thread.start()
            thread.join(timeout=20)
            assert not thread.is_alive(), f"a call on a silent RabbitMQ flow hung (cut={cut})"
            assert 2.0 <= time.monotonic() - started < 15.0 and len(failed) == 1, failed
            assert wait_until(lambda: broker.length("free") == 1, timeout_s=10)  # given back
    finally:
        broker.abort()  # no closing handshake: a silent flow would never answer it
        hole.close()


def _through_a_black_hole(
    settings: GatekeeperSettings, rabbitmq_url: str
) -> tuple[BlackHole, GatekeeperSettings]:
    """A proxy to RabbitMQ (tests.moved.BlackHole) and ``settings`` with the broker behind it."""
    target = urlsplit(rabbitmq_url)
    hole = BlackHole((target.hostname or "127.0.0.1", target.port or 5672))
    through = target._replace(netloc=f"{target.username}:{target.password}@127.0.0.1:{hole.port}")
    return hole, settings.model_copy(update={"broker_url": urlunsplit(through)})


def _failure_of(call: Any, failed: list[BaseException]) -> None:
    try:
        call()
    except Exception as exc:
        failed.append(exc)
