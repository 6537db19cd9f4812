"""A batch on the gate's line (gatekeeper/redis/queued.py) stays in step with its replies
whatever the server answers: an error reply leaves the line closed, so the next batch
connects again (after a failover that moved the gate's address, the old primary answers
READONLY, and the replayer follows the new one as its pool does); a NOSCRIPT keeps it; a
command that cannot be packed sends nothing and frees the line; and without hiredis no health
check reads a reply of the batch as its own."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

from gatekeeper.celery.replay import Replayer
from gatekeeper.core.headers import H_REPLAY_AFTER
from gatekeeper.redis import wire
from gatekeeper.redis.breaker import no_retry
from gatekeeper.redis.queued import Queued, send_all
from tests.apps.gated_app import create_app
from tests.conftest import gate_settings, initialised, queue_messages
from tests.moved import Moved, moved_redis


@pytest.fixture(params=["hiredis", "redis-py"])
def raw(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both ways a line packs and reads: hiredis on its socket, redis-py's connection."""
    if request.param == "hiredis" and not wire.RAW:
        pytest.skip("the raw line needs hiredis")
    monkeypatch.setattr(wire, "RAW", request.param == "hiredis")
    return request.param == "hiredis"


def client_id(line: wire.Line, client: redis.Redis) -> int:
    (reply,) = send_all(line, client, [["CLIENT", "ID"]])
    return int(reply)


def test_an_error_reply_leaves_the_line_closed_and_the_next_batch_connects_again(
    redis_client: redis.Redis, raw: bool
) -> None:
    line = wire.Line()
    before = client_id(line, redis_client)
    redis_client.set("plain", "x")
    echo, refused, after_it = send_all(
        line, redis_client, [["ECHO", "a"], ["HGET", "plain", "f"], ["ECHO", "b"]]
    )
    assert (echo, after_it) == (b"a", b"b")  # every reply read, each in its place
    assert isinstance(refused, redis.ResponseError) and "WRONGTYPE" in str(refused)
    assert not line.channel.busy
    assert client_id(line, redis_client) != before


def test_a_noscript_reply_keeps_the_line(redis_client: redis.Redis, raw: bool) -> None:
    line = wire.Line()
    before = client_id(line, redis_client)
    (reply,) = send_all(line, redis_client, [["EVALSHA", "0" * 40, "0"]])
    assert isinstance(reply, redis.exceptions.NoScriptError)
    assert client_id(line, redis_client) == before


def test_a_command_that_cannot_be_packed_sends_nothing_and_frees_the_line(
    redis_client: redis.Redis, raw: bool
) -> None:
    line = wire.Line()
    queued = Queued(line, redis_client)
    for command in (["SET", "sent", "1"], ["SET", "bad", "\ud800"], ["SET", "after", "1"]):
        queued.add(command)  # a lone surrogate: no UTF-8 for it
    replies = list(queued.replies())
    assert len(replies) == 3 and all(isinstance(r, redis.ConnectionError) for r in replies)
    assert not line.channel.busy and redis_client.exists("sent", "bad", "after") == 0
    assert send_all(line, redis_client, [["ECHO", "ok"]]) == [b"ok"]


def test_without_hiredis_no_health_check_reads_a_reply_of_the_batch(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wire, "RAW", False)
    client = redis.Redis.from_url(redis_url, health_check_interval=1, **no_retry())
    queued = Queued(wire.Line(), client)  # eight commands to a write
    for n in range(16):
        queued.add(["ECHO", str(n)])
        if n == 8:
            time.sleep(1.1)  # the next write comes after the health check's interval
    assert list(queued.replies()) == [str(n).encode() for n in range(16)]


@pytest.fixture()
def moved(tmp_path: Path) -> Iterator[Moved]:
    with moved_redis(tmp_path) as pair:
        yield pair


def defer(app: Celery, gate: redis.Redis, count: int) -> list[str]:
    """Gated tasks the age cap defers (a stale entry makes the free queue old)."""
    gate.zadd("gatekeeper:{default}:free:waiting", {"stale:1": (time.time() - 5) * 1000})
    ids = [app.tasks["tests.embed"].delay(n).id for n in range(count)]
    gate.zrem("gatekeeper:{default}:free:waiting", "stale:1")
    return ids


def test_the_replayer_follows_a_failover_that_moved_the_gates_address(moved: Moved) -> None:
    """The gate's address points at A; then B takes A's data, A turns replica (READONLY to
    writes, its connections kept) and the address points at B (a VIP or DNS move). What meets
    A's READONLY is asked again on a new connection, which reaches B, and the replayer's
    lines connect again there."""
    url = moved.url
    app = create_app(gate_settings(url, max_queue_age_s=1.0), f"redis+socket://{moved.address}")
    client = redis.Redis.from_url(url)
    initialised(client)
    gate = redis.Redis.from_url(url, socket_timeout=1, **no_retry())
    replayer = Replayer(gate_settings(url, budget_units=1e9), broker=client, gate=gate)
    assert replayer.acquire()
    defer(app, client, 3)
    assert dict(replayer.pass_once()) == {"to_free": 3}  # its lines are on A now
    parked = defer(app, client, 8)

    moved.fail_over()
    for pool_owner in (client, gate):  # the pools' idle connections too (as Sentinel's would)
        pool_owner.connection_pool.disconnect()
    messages = [json.loads(raw) for raw in moved.b.client.lrange("defer", 0, -1)]
    moved.b.client.delete("defer")
    for message in messages:  # half of them due now, the rest in half a second
        due = 0.5 if message["headers"]["id"] in parked[4:] else -0.1
        message["headers"][H_REPLAY_AFTER] = time.time() + due
        moved.b.client.rpush("defer", json.dumps(message))

    assert dict(replayer.pass_once()) == {"to_free": 4, "not_due": 4}
    time.sleep(0.6)  # the rest due
    assert dict(replayer.pass_once()) == {"to_free": 4}
    free = {m["headers"]["id"] for m in queue_messages(moved.b.client, "free")}
    assert set(parked) <= free
    waiting = moved.b.client.zrange("gatekeeper:{default}:free:waiting", 0, -1)
    assert {f"{job}:1".encode() for job in parked} <= set(waiting)  # decided on B
