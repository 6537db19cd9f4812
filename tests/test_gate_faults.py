"""Faults fail closed: an unreachable gate Redis reserves; concurrent publishers share a budget."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import redis

import gatekeeper
from gatekeeper.core.ledger import window_id
from gatekeeper.ops.embedded import EmbeddedRedis
from gatekeeper.redis.flags import UNREAD_RETRY_S
from gatekeeper.redis.keys import Keys
from tests.apps.gated_app import create_app
from tests.conftest import gate_settings, initialised, queue_messages, unused_port, wait_until


def reasons(client: redis.Redis, queue: str) -> list[str]:
    return [m["headers"]["gatekeeper_reason"] for m in queue_messages(client, queue)]


def test_gate_redis_down_reserves_and_recovers_without_restart(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    with EmbeddedRedis() as gate_server:
        settings = gate_settings(gate_server.url, redis_timeout_s=0.2)
        app = create_app(settings, redis_url)  # the broker stays up on redis_url
        embed = app.tasks["tests.embed"]
        gate = redis.Redis.from_url(gate_server.url)
        initialised(gate)
        embed.delay(1)
        gate_server.kill()
        result = embed.delay(2)  # the caller's publish still succeeds
        assert result.id
        gate_server.start(port=gate_server.port)  # without persistence: it comes back empty
        breaker = gatekeeper.install(app).store.breaker
        assert breaker is not None and breaker.is_open  # opened by the refused connection
        assert wait_until(lambda: not breaker.is_open, timeout_s=5)  # its probe found it back
        embed.delay(3)  # the state is missing: not to free until it is initialised again
        initialised(gate)
        time.sleep(0.3)  # past flag_cache_s: the publisher reads the marker back
        embed.delay(4)
    assert reasons(redis_client, "free") == ["fits", "fits"]
    assert reasons(redis_client, "reserved") == ["gate_unavailable", "state_missing"]
    assert "reason=gate_unavailable" in capsys.readouterr().err


def test_a_gate_redis_down_from_the_start_keeps_gated_tasks_off_free(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # The gate is off in the settings, but a value in Redis could turn it on: until the flags
    # have been read once, a task keeps its own route as the settings say, except free.
    with EmbeddedRedis() as gate_server:
        port, url = gate_server.port, gate_server.url
        gate_server.kill()
        settings = gate_settings(url, redis_timeout_s=0.2, dwell_gate_enabled=False,
                                 flag_cache_s=60)  # fmt: skip
        app = create_app(settings, redis_url)  # the broker stays up on redis_url
        embed = app.tasks["tests.embed"]
        to_free = embed.apply_async((1,), queue="free").id
        own = embed.apply_async((2,)).id  # its own route: the default queue
        gate_server.start(port=port)
        initialised(redis.Redis.from_url(url))
        time.sleep(UNREAD_RETRY_S + 0.2)  # read again well before flag_cache_s
        embed.apply_async((3,), queue="free")  # read: the gate is off, the route untouched
    (reserved,) = queue_messages(redis_client, "reserved")
    assert reserved["headers"]["gatekeeper_reason"] == "gate_unavailable"
    assert reserved["headers"]["gatekeeper_deadline_at"]  # stamped: a retry keeps its deadline
    (own_route,) = queue_messages(redis_client, "celery")
    (untouched,) = queue_messages(redis_client, "free")
    assert "gatekeeper_decision" not in own_route["headers"]
    assert "gatekeeper_decision" not in untouched["headers"]
    lines = capsys.readouterr().err.splitlines()
    (line,) = [line for line in lines if f"job_id={to_free}" in line]  # one line each
    assert "event=gate_decision" in line and "reason=gate_unavailable" in line
    (line,) = [line for line in lines if f"job_id={own}" in line]
    assert "event=gate_skipped" in line and "reason=flags_unread" in line


@pytest.mark.parametrize(
    ("in_settings", "in_redis", "reason"),
    [
        # the gate on in the settings, off in Redis: untouched, on its own route, Redis or not
        (True, "false", None),
        # off in the settings, on in Redis: scored, so reserved while Redis is unreachable
        (False, "true", "gate_unavailable"),
    ],
)
def test_while_the_gate_redis_is_unreachable_the_last_flags_read_stay_in_force(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str],
    in_settings: bool, in_redis: str, reason: str | None,
) -> None:  # fmt: skip
    with EmbeddedRedis() as gate_server:
        gate = redis.Redis.from_url(gate_server.url)
        initialised(gate)
        gate.hset(Keys().flags, "dwell_gate_enabled", in_redis)
        settings = gate_settings(gate_server.url, redis_timeout_s=0.2, flag_cache_s=0.2,
                                 dwell_gate_enabled=in_settings, log_level="debug")  # fmt: skip
        app = create_app(settings, redis_url)  # the broker stays up on redis_url
        embed = app.tasks["tests.embed"]
        read = embed.delay(1).id  # the flags read, Redis's override in force
        gate_server.kill()
        # Past flag_cache_s twice: the first read refused (it opens the breaker), the second
        # made with no socket at all; both keep the flags last read.
        breaker = gatekeeper.install(app).store.breaker
        after: list[str] = []
        for n in (2, 3):
            time.sleep(0.4)
            after.append(embed.delay(n).id)
            assert breaker is not None and breaker.is_open
    err = capsys.readouterr().err
    if reason is None:  # untouched: no gatekeeper header, no decision, skipped as Redis said
        assert [m["headers"]["id"] for m in queue_messages(redis_client, "celery")] == [
            read, *after]  # fmt: skip
        assert not any(
            key.startswith("gatekeeper_")
            for message in queue_messages(redis_client, "celery")
            for key in message["headers"]
        )
        assert "event=gate_decision" not in err
        for job_id in (read, *after):
            (line,) = [ln for ln in err.splitlines() if f"job_id={job_id}" in ln]
            assert "event=gate_skipped" in line and "reason=gate_disabled" in line
    else:
        assert reasons(redis_client, "free") == ["fits"]  # scored while Redis answered
        assert reasons(redis_client, "reserved") == [reason, reason]
        assert redis_client.llen("celery") == 0


def test_with_the_gate_on_in_the_settings_flags_never_read_fail_closed(
    redis_url: str, redis_client: redis.Redis
) -> None:
    app = create_app(gate_settings(f"redis://127.0.0.1:{unused_port()}/0", redis_timeout_s=0.2),
                     redis_url)  # fmt: skip
    app.tasks["tests.embed"].apply_async((1,), queue="free")
    app.tasks["tests.embed"].apply_async((2,))
    assert reasons(redis_client, "reserved") == ["gate_unavailable"] * 2


def _publisher(redis_url: str, count: int, start: multiprocessing.synchronize.Event) -> None:
    settings = gate_settings(redis_url, budget_units=1000, queue_wait_unit_per_second=0)
    app = create_app(settings, redis_url)
    embed = app.tasks["tests.embed"]
    start.wait()
    for n in range(count):
        embed.delay(n)


def test_concurrent_publishers_never_admit_past_the_exposure_budget(
    redis_url: str, redis_client: redis.Redis
) -> None:
    first_window = window_id(time.time(), 900)
    context = multiprocessing.get_context("spawn")
    start = context.Event()
    workers = [context.Process(target=_publisher, args=(redis_url, 25, start)) for _ in range(4)]
    for worker in workers:
        worker.start()
    time.sleep(1.0)  # let every publisher import and connect, then release them together
    start.set()
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0
    windows = range(first_window, window_id(time.time(), 900) + 1)
    exposures = [float(redis_client.hget(Keys().window(w), "exposure") or 0) for w in windows]
    admitted = redis_client.llen("free")
    assert all(exposure <= 1000 for exposure in exposures)
    assert admitted * 100 == sum(exposures)
    assert redis_client.llen("free") + redis_client.llen("reserved") == 100
    if len(exposures) == 1:  # the run did not straddle a window boundary
        assert admitted == 10  # 1000 units / 100 tokens, whoever got there first
