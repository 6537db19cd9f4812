"""Learned service times in a real Redis: the buckets a run adds to, the publisher's cached
read, the drift line once per window, and the decision line that shows both sources."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis

from gatekeeper.celery.replay import Replayer
from gatekeeper.core.service import RELATIVE_ERROR, bucket_of
from gatekeeper.ops.embedded import EmbeddedRedis
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.service_times import LearnedService, ServiceTimes
from tests.apps.gated_app import create_app
from tests.conftest import gate_settings, unused_port


class Lines:
    """A logger that keeps what it is asked to write."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def learned(
    redis_url: str, client: redis.Redis, clock: Clock, wall: Clock | None = None, **settings: Any
) -> tuple[LearnedService, Lines]:
    values = {"service_time": "max", "service_time_min_samples": 5, "flag_cache_s": 1.0,
              **settings}  # fmt: skip
    lines = Lines()
    service = LearnedService(ServiceTimes(client, Keys()), gate_settings(redis_url, **values),
                             lines, clock=clock, wall=wall or Clock())  # fmt: skip
    return service, lines


def test_a_run_adds_one_to_one_bucket_and_names_its_task(redis_client: redis.Redis) -> None:
    times = ServiceTimes(redis_client, Keys())
    times.observe("tasks.embed", 8.0)
    times.observe("tasks.embed", 8.05)
    times.observe("tasks.embed", 30.0, lower_bound=True)
    stored = redis_client.hgetall("gatekeeper:{default}:service:times:tasks.embed")
    assert stored == {f"b{bucket_of(8.0)}".encode(): b"2", f"b{bucket_of(30.0)}".encode(): b"1",
                      b"lower_bounds": b"1"}  # fmt: skip
    assert redis_client.smembers("gatekeeper:{default}:service:names") == {b"tasks.embed"}
    assert redis_client.ttl("gatekeeper:{default}:service:times:tasks.embed") == -1
    histogram = times.read("tasks.embed")
    assert (histogram.samples, histogram.lower_bounds) == (3, 1)
    assert times.names() == ["tasks.embed"]


def test_a_task_never_seen_has_an_empty_histogram(redis_client: redis.Redis) -> None:
    assert ServiceTimes(redis_client, Keys()).read("tasks.none").p95 is None


def test_the_publisher_reads_a_task_at_most_once_per_cache_interval(
    redis_url: str, redis_client: redis.Redis
) -> None:
    clock = Clock()
    service, _ = learned(redis_url, redis_client, clock)
    assert service.choose("tasks.t", 0.8) == (0.8, {
        "service_declared_s": 0.8, "service_learned_p95_s": None, "service_samples": 0,
        "service_source": "declared",
    })  # fmt: skip
    for _ in range(5):
        ServiceTimes(redis_client, Keys()).observe("tasks.t", 3.0)
    clock.now += 0.9
    assert service.choose("tasks.t", 0.8)[1]["service_samples"] == 0  # still the cached read
    clock.now += 0.2
    used, fields = service.choose("tasks.t", 0.8)
    assert fields["service_samples"] == 5 and fields["service_source"] == "learned"
    assert used == pytest.approx(3.0, rel=RELATIVE_ERROR)
    assert fields["service_learned_p95_s"] == pytest.approx(used, abs=1e-6)


def test_before_the_minimum_samples_the_declared_value_is_used(
    redis_url: str, redis_client: redis.Redis
) -> None:
    for _ in range(4):
        ServiceTimes(redis_client, Keys()).observe("tasks.t", 3.0)
    service, lines = learned(redis_url, redis_client, Clock())
    used, fields = service.choose("tasks.t", 0.8)
    assert (used, fields["service_source"], fields["service_samples"]) == (0.8, "declared", 4)
    assert fields["service_learned_p95_s"] == pytest.approx(3.0, rel=RELATIVE_ERROR)
    assert lines.lines == []  # no drift line on four runs either


def test_drift_is_said_once_per_window_across_processes(
    redis_url: str, redis_client: redis.Redis
) -> None:
    for _ in range(5):
        ServiceTimes(redis_client, Keys()).observe("tasks.t", 3.0)
    clock, wall = Clock(), Clock(900 * 2000 + 10)
    one, said_one = learned(redis_url, redis_client, clock, wall, service_time="declared")
    two, said_two = learned(redis_url, redis_client, clock, wall, service_time="declared")
    for _ in range(3):
        one.choose("tasks.t", 0.8)
        two.choose("tasks.t", 0.8)
        clock.now += 2  # every call reads Redis again
    assert [event for event, _ in said_one.lines + said_two.lines] == ["service_time_drift"]
    (_, fields), *_ = said_one.lines + said_two.lines
    assert fields["task"] == "tasks.t" and fields["service_declared_s"] == 0.8
    assert fields["service_learned_p95_s"] == pytest.approx(3.0, rel=RELATIVE_ERROR)
    assert fields["window"] == 2000 and fields["service_samples"] == 5
    assert 0 < redis_client.ttl("gatekeeper:{default}:service:drift:2000:tasks.t") <= 900
    wall.now += 900  # the next window says it again, once
    for _ in range(2):
        one.choose("tasks.t", 0.8)
        two.choose("tasks.t", 0.8)
        clock.now += 2
    assert len(said_one.lines + said_two.lines) == 2


def test_no_drift_line_while_the_p95_is_within_the_factor(
    redis_url: str, redis_client: redis.Redis
) -> None:
    for _ in range(5):
        ServiceTimes(redis_client, Keys()).observe("tasks.t", 1.1)
    service, lines = learned(redis_url, redis_client, Clock())
    service.choose("tasks.t", 0.8)
    assert lines.lines == []


def test_an_unreachable_redis_leaves_the_declared_value() -> None:
    client = redis.Redis(port=unused_port(), socket_connect_timeout=0.2)
    service, _ = learned(f"redis://127.0.0.1:{unused_port()}", client, Clock())
    used, fields = service.choose("tasks.t", 0.8)
    assert (used, fields["service_source"], fields["service_samples"]) == (0.8, "declared", 0)


def test_a_histogram_read_once_stays_in_force_while_redis_cannot_be_read() -> None:
    # README: "When Redis cannot be read the last histogram stays in force": a learned p95
    # must not fall back to the declared guess in the middle of an outage.
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url, socket_timeout=0.3, socket_connect_timeout=0.3)
        for _ in range(5):
            ServiceTimes(client, Keys()).observe("tasks.t", 3.0)
        clock = Clock()
        service, _ = learned(server.url, client, clock)
        used, fields = service.choose("tasks.t", 0.8)
        assert (fields["service_source"], fields["service_samples"]) == ("learned", 5)
        server.kill()
        clock.now += 5  # past flag_cache_s: read again, and the read fails
        again, during = service.choose("tasks.t", 0.8)
    assert again == used and (during["service_source"], during["service_samples"]) == (
        "learned", 5)  # fmt: skip


def decision_line(err: str) -> dict[str, str]:
    (line,) = [line for line in err.splitlines() if "event=gate_decision" in line]
    return dict(part.split("=", 1) for part in line.split() if "=" in part)


@pytest.mark.parametrize(("mode", "expected", "source"), [
    ("declared", 0.8, "declared"), ("learned", 3.0, "learned"), ("max", 3.0, "learned"),
])  # fmt: skip
def test_each_decision_line_carries_the_value_used_and_both_sources(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str],
    mode: str, expected: float, source: str,
) -> None:  # fmt: skip
    for _ in range(5):
        ServiceTimes(redis_client, Keys()).observe("tests.long_tail", 3.0)
    settings = gate_settings(redis_url, service_time=mode, service_time_min_samples=5)
    create_app(settings, redis_url).tasks["tests.long_tail"].delay(0)
    line = decision_line(capsys.readouterr().err)
    assert float(line["expected_service_s"]) == pytest.approx(expected, rel=RELATIVE_ERROR)
    assert line["service_declared_s"] == "0.8" and line["service_source"] == source
    assert float(line["service_learned_p95_s"]) == pytest.approx(3.0, rel=RELATIVE_ERROR)
    assert line["service_samples"] == "5"
    dwell = float(line["queue_age_s"]) + float(line["expected_service_s"])
    assert float(line["dwell_s"]) == pytest.approx(dwell, abs=2e-3)  # the gate used it too


@pytest.mark.parametrize(("mode", "to"), [("declared", "to_free"), ("max", "to_reserved")])
def test_the_replayer_decides_with_the_chosen_value_too(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str],
    mode: str, to: str,
) -> None:  # fmt: skip
    """``tests.embed`` is declared at 1 s (one retry left, 60 s of slack); its runs took 50 s:
    with the learned p95 its dwell (50 s + 50 s of retry tax) no longer fits the slack."""
    app = create_app(gate_settings(redis_url, max_queue_age_s=1.0), redis_url)
    redis_client.zadd(Keys().free_waiting, {"stale:1": (time.time() - 5) * 1000})
    app.tasks["tests.embed"].delay(1)  # the age cap defers it
    redis_client.zrem(Keys().free_waiting, "stale:1")
    for _ in range(5):
        ServiceTimes(redis_client, Keys()).observe("tests.embed", 50.0)
    capsys.readouterr()
    settings = gate_settings(redis_url, service_time=mode, service_time_min_samples=5)
    counts = Replayer(settings, broker=redis_client, gate=redis_client).run(
        threading.Event(), once=True
    )
    assert dict(counts) == {to: 1}
    line = decision_line(capsys.readouterr().err)
    assert line["origin"] == "replay" and float(line["service_declared_s"]) == 1
    assert float(line["service_learned_p95_s"]) == pytest.approx(50, rel=RELATIVE_ERROR)
